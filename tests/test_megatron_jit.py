"""megatron-core's torch.compile'd kernels compile at their first call (mcore_patches/jit.py): in a
process of the `mlmclm` entry point importing megatron through our package no longer imports
Inductor (importing the package alone changes nothing), and a kernel still computes what its Python
function computes, compiled at its first call, and traces inside an outer torch.compile."""

from __future__ import annotations

import inspect
import subprocess
import sys

import torch
from jobs import job_env

from megatron_mlmclm.mcore_patches.jit import compile_on_first_call

# The entry point as a command's process imports it; first, whether importing the package alone
# installed an import hook.
ENTRY = (
    "import sys, megatron_mlmclm; "
    "print(any('megatron_mlmclm' in type(f).__module__ for f in sys.meta_path)); "
    "import megatron_mlmclm.cli; "
)
IMPORTS = (
    "import sys; import megatron_mlmclm.training.trainer, megatron_mlmclm.convert.hf_import; "
    "import megatron.core.jit as j; from megatron.core.fusions import fused_bias_swiglu as f; "
    "print(getattr(j.jit_fuser, '__module__', ''), hasattr(f.bias_swiglu, 'deferred_compile'), "
    "'torch._inductor.compile_fx' in sys.modules)"
)


def run_python(code: str) -> list[str]:
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        env=job_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def test_importing_megatron_through_the_package_does_not_import_inductor():
    """Through the `mlmclm` entry point, which asks for the deferral; the package alone installs
    no import hook."""
    out = run_python(ENTRY + IMPORTS)
    assert out == ["False", "megatron_mlmclm.mcore_patches.jit", "True", "False"]
    # The check can fail: with megatron imported before our package, Inductor is imported.
    eager = run_python("import megatron.core; " + ENTRY + IMPORTS)
    assert eager[-2:] == ["False", "True"]


def test_a_megatron_kernel_compiles_at_its_first_call_and_matches_its_python_function():
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
    from torch._dynamo.utils import counters

    python_fn = inspect.unwrap(bias_swiglu)  # megatron's function, whichever way it was decorated
    kernel = compile_on_first_call(torch.compile)(python_fn)
    y, bias = torch.randn(4, 16), torch.randn(16)
    before = counters["stats"]["unique_graphs"]
    got = kernel(y, bias)
    assert counters["stats"]["unique_graphs"] == before + 1  # compiled here, at the first call
    torch.testing.assert_close(got, python_fn(y, bias))
    # Inside a torch.compile trace it is traced as part of the outer graph, without a break.
    outer = torch.compile(lambda a, b: kernel(a * 2, b), backend="eager", fullgraph=True)
    torch.testing.assert_close(outer(y, bias), python_fn(y * 2, bias))
