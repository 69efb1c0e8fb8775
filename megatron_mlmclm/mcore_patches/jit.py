"""megatron-core's fused kernels compiled at their first call, not when megatron is imported.

megatron-core decorates about 40 kernels with `torch.compile` as its modules are imported
(`jit_fuser` in megatron/core/jit.py). Decorating imports TorchDynamo and Inductor, about 1.5 s
of the start of every process that imports megatron-core (each rank, each converter), also where
none of those kernels ever runs (on CPU the kernel plan turns megatron's fusions off).
`defer_kernel_compilation()` replaces `jit_fuser`, right after megatron/core/jit.py has run and
before any module decorates with it, by a decorator that calls `torch.compile` at the kernel's
first call, which is when torch.compile compiles anyway. Inside a torch.compile trace the
kernel's Python function is called as it is: TorchDynamo traces it as it traces a nested compiled
function.

Who calls it: the `mlmclm` entry point, as cli.py is imported (so every rank and converter, and
the workers a command spawns, which import the entry point first), and the scripts and the test
suite (tests/conftest.py) that import megatron-core themselves. Importing megatron_mlmclm changes
nothing. A process that imports megatron-core without calling it keeps megatron's own
`torch.compile` at import: the same kernels, 1.5 s later.
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
    """Finds megatron/core/jit.py as Python's path finder does, runs `defer` right after it, and
    leaves sys.meta_path.

    An import hook because no other moment exists: importing `megatron.core.jit` first runs
    megatron/core/__init__.py, which imports (through tensor_parallel and the fusions) the
    modules that decorate with `jit_fuser`, so by the time any import of ours returns, the
    kernels are decorated. The hook is the one point between jit.py defining `jit_fuser` and
    its first use."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        _remove_finder()
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        then_run(spec, defer)
        return spec


def then_run(spec, after) -> None:
    """Make the module that `spec` (a finder's answer) loads call `after(module)` as soon as its
    own code has run."""
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return
    run = spec.loader.exec_module

    def exec_module(module):
        run(module)
        after(module)

    spec.loader.exec_module = exec_module


def _remove_finder() -> None:
    # A new list: the import under way iterates over the old one.
    sys.meta_path = [f for f in sys.meta_path if not isinstance(f, _JitModuleFinder)]


def defer_kernel_compilation() -> None:
    """Make megatron-core's `jit_fuser` kernels compile at their first call (see above). Call it
    before anything imports megatron-core; once megatron is imported, only the modules it imports
    from then on gain."""
    if JIT_MODULE in sys.modules:
        defer(sys.modules[JIT_MODULE])
    elif not any(isinstance(f, _JitModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitModuleFinder())
