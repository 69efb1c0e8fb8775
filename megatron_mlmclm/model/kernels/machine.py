"""The machine a run is planned for: what imports there (Transformer Engine and its version, Apex's
CUDA extensions, torch's varlen kernel), the device a run targets, and what the process must set
before CUDA starts."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

import torch

from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.config.attention import torch_has_varlen
from megatron_mlmclm.errors import UsageError


@dataclass(frozen=True)
class Kernels:
    """What imports on this machine (probed once by `probe_kernels`; tests pass their own)."""

    te_version: tuple[int, ...] | None = None  # Transformer Engine
    apex_adam: bool = False  # megatron's optimizer uses TE's or Apex's FusedAdam when present
    torch_varlen: bool = False  # torch.nn.attention.varlen (torch >= 2.10)
    apex_grad_accum: bool = False  # fused_weight_gradient_mlp_cuda (Apex --cuda_ext)
    apex_masked_softmax: bool = False  # scaled_masked_softmax_cuda (Apex)
    apex_persist_layer_norm: bool = False  # apex.contrib.layer_norm (FastLayerNormFN)


def probe_kernels() -> Kernels:
    te = None
    if _importable("transformer_engine"):
        te = _version("transformer_engine") or _version("transformer-engine") or (0,)
    return Kernels(
        te_version=te,
        apex_adam=te is not None or _importable("apex.optimizers"),
        torch_varlen=torch_has_varlen(),
        apex_grad_accum=_importable("fused_weight_gradient_mlp_cuda"),
        apex_masked_softmax=_importable("scaled_masked_softmax_cuda"),
        apex_persist_layer_norm=_importable("apex.contrib.layer_norm"),
    )


def _version(dist: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


def resolve_device(cfg: RunConfig, planning: bool = False) -> str:
    """`runtime.device` -> cuda | cpu. A run may only target the device it has; planning
    (--dry-run) may target either."""
    wanted, has_cuda = cfg.runtime.device, torch.cuda.is_available()
    if wanted == "auto":
        return "cuda" if has_cuda else "cpu"
    if not planning and (wanted == "cuda") != has_cuda:
        have = "CUDA" if has_cuda else "no CUDA device"
        raise UsageError(
            f"runtime.device={wanted} but this machine has {have}; set "
            "runtime.device=auto to train here, or add --dry-run to plan a run "
            f"for {wanted}"
        )
    return wanted


def max_connections(cfg: RunConfig, device: str) -> tuple[str | None, str]:
    p = cfg.parallel
    if device != "cuda":
        return None, "CPU"
    if p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1:
        exported = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        if exported is not None and exported != "1":  # the run keeps it: say what it runs with
            return exported, (
                "exported, kept over the plan's 1 for TP/CP (more queues may reorder the "
                "communication kernels and overlap compute less; Megatron-LM requires 1 before "
                "Blackwell)"
            )
        return "1", (
            "TP/CP: one hardware queue keeps communication kernels in issue order so "
            "they overlap compute (Megatron-LM requires it before Blackwell; export "
            "another value to override)"
        )
    return None, "TP = CP = 1: nothing needs it"


def tf32(cfg: RunConfig, device: str) -> tuple[bool | None, str]:
    if device != "cuda":
        return None, "CPU"
    if cfg.train.precision == "fp32":
        return False, "train.precision=fp32: fp32 matmuls stay fp32 (a true fp32 reference)"
    return None, "bf16 model: torch's default for the few fp32 matmuls outside it"


INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
# The TORCHINDUCTOR_CACHE_DIR a run last set (`use_compile_cache`), in the environment so that the
# processes a run starts know it too: a value set by a run is not the user's.
RUN_SET_CACHE = "MLMCLM_RUN_INDUCTOR_CACHE_DIR"


def users_compile_cache() -> str | None:
    """A TORCHINDUCTOR_CACHE_DIR the user chose: set, and neither the one a run set (in this
    process or the one that started it) nor Inductor's default, which Inductor sets itself in
    a process that compiled without one."""
    value = os.environ.get(INDUCTOR_CACHE)
    if not value or value == os.environ.get(RUN_SET_CACHE):
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return None if os.path.abspath(value) == os.path.abspath(default_cache_dir()) else value


def compile_cache_dir(output_dir: str) -> str:
    """Where torch.compile's caches go: the user's TORCHINDUCTOR_CACHE_DIR, else
    $MLMCLM_CACHE_DIR/inductor (shared by runs: the same shapes compile once), else the run's
    output_dir/compile_cache."""
    shared = os.environ.get("MLMCLM_CACHE_DIR")
    folder = (
        os.path.join(shared, "inductor") if shared else os.path.join(output_dir, "compile_cache")
    )
    return os.path.abspath(users_compile_cache() or folder)


def use_compile_cache(folder: str) -> None:
    """Inductor's caches in `folder` (compile_cache_dir) for this run, and Triton's under it: set
    for every run, since a process may run several (tests, the study, a notebook), unless the user
    chose a folder (then torch puts Triton's under it, as it does for its default)."""
    if users_compile_cache() is None:
        os.environ[INDUCTOR_CACHE] = os.environ[RUN_SET_CACHE] = folder
        if users_triton_cache() is None:
            triton = triton_cache_dir(folder)
            os.environ[TRITON_CACHE] = os.environ[RUN_SET_TRITON] = triton


# Triton's kernel cache. Inductor sets TRITON_CACHE_DIR itself, once per process, where it is unset
# when it first compiles a Triton kernel (torch/_inductor/runtime/triton_heuristics.py, torch
# 2.13: `<TORCHINDUCTOR_CACHE_DIR>/triton/<device>`), and keeps it: a process's later runs would
# write their Triton kernels into its first run's folder. So a run sets it, as Inductor would name
# it under the run's own folder, unless the user chose one; RUN_SET_TRITON records that a run did.
TRITON_CACHE = "TRITON_CACHE_DIR"
RUN_SET_TRITON = "MLMCLM_RUN_TRITON_CACHE_DIR"


def triton_cache_dir(inductor_folder: str) -> str:
    """Triton's folder under an Inductor cache folder, as torch names it for this process's GPU
    (its local rank's, the device a run's rank takes)."""
    return os.path.join(inductor_folder, "triton", os.environ.get("LOCAL_RANK", "0"))


def users_triton_cache() -> str | None:
    """A TRITON_CACHE_DIR the user chose: set, and neither the one a run set nor the one Inductor
    derived from its default folder in a process that compiled before any run set one."""
    value = os.environ.get(TRITON_CACHE)
    if not value or value == os.environ.get(RUN_SET_TRITON):
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductors = os.path.dirname(os.path.dirname(os.path.abspath(value)))
    return None if inductors == os.path.abspath(default_cache_dir()) else value


def compile_cache_line() -> str:
    """What this process has compiled so far, and how much of it came from the compile cache."""
    from torch._dynamo.utils import counters  # imported by the compiles this line reports

    stats = counters["inductor"]
    return (
        f"torch.compile: {stats['fxgraph_cache_miss']} graph(s) compiled, "
        f"{stats['fxgraph_cache_hit']} loaded from the compile cache "
        f"{os.environ.get(INDUCTOR_CACHE)}"
    )
