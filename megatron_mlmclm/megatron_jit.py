"""megatron-core's fused kernels compiled at their first call, not when megatron is imported.

megatron-core decorates about 40 kernels with `torch.compile` as its modules are imported
(`jit_fuser` in megatron/core/jit.py). Decorating imports TorchDynamo and Inductor, about 1.5 s
of the start of every process that imports megatron-core (each rank, each converter), also where
none of those kernels ever runs (on CPU the kernel plan turns megatron's fusions off).
`install()`, called by the package's __init__ before anything here imports megatron, replaces
`jit_fuser` right after megatron/core/jit.py has run (before any module decorates with it) by a
decorator that calls `torch.compile` at the kernel's first call, which is when torch.compile
compiles anyway. Inside a torch.compile trace the kernel's Python function is called as it is:
TorchDynamo traces it as it traces a nested compiled function.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

JIT_MODULE = "megatron.core.jit"


def compile_on_first_call(compile_fn):
    """A decorator doing what `compile_fn` (torch.compile) does, compiling at the first call."""
    import torch  # megatron.core.jit has imported it already

    def decorator(fn):
        compiled = None

        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            nonlocal compiled
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            if compiled is None:
                compiled = compile_fn(fn)
            return compiled(*args, **kwargs)

        kernel.deferred_compile = True
        return kernel

    return decorator


def defer(jit_module) -> None:
    """Swap megatron.core.jit's `jit_fuser`, when it is torch.compile, for the deferred one."""
    import torch

    if getattr(jit_module, "jit_fuser", None) is torch.compile:
        jit_module.jit_fuser = compile_on_first_call(torch.compile)


class _JitModuleFinder(importlib.abc.MetaPathFinder):
    """Finds megatron/core/jit.py as Python's path finder does and runs `defer` after it."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            defer(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if JIT_MODULE in sys.modules:  # imported before us: only modules imported from now on gain
        defer(sys.modules[JIT_MODULE])
    elif not any(isinstance(f, _JitModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitModuleFinder())
