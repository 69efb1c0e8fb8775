"""megatron-core's torch.compile'd kernels compile at their first call (megatron_jit.py): importing
megatron through our package no longer imports Inductor, and a kernel still computes what its
Python function computes, compiled at its first call, and traces inside an outer torch.compile."""

from __future__ import annotations

import inspect
import subprocess
import sys

import torch
from jobs import job_env

from megatron_mlmclm.megatron_jit import compile_on_first_call

IMPORTS = (
    "import sys; import megatron_mlmclm.training.trainer, megatron_mlmclm.convert.hf_import; "
    "import megatron.core.jit as j; from megatron.core.fusions import fused_bias_swiglu as f; "
    "print(getattr(j.jit_fuser, '__module__', ''), hasattr(f.bias_swiglu, 'deferred_compile'), "
    "'torch._inductor.compile_fx' in sys.modules)"
)


def test_importing_megatron_through_the_package_does_not_import_inductor():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", IMPORTS],
        env=job_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["megatron_mlmclm.megatron_jit", "True", "False"]
    # The check can fail: with megatron imported before our package, Inductor is imported.
    eager = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", "import megatron.core; " + IMPORTS],
        env=job_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
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
