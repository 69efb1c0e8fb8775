"""What a process that trains or converts installs: `apply_patches()`, called by
runtime/distributed.py before it creates megatron's process groups.

Every run gets the optimizer's replacements (optimizer.py); a machine without CUDA also gets
the CPU path (cpu.py). The jit deferral is not here: it must come before megatron-core is
imported at all (jit.py, called by the entry point).
"""

from __future__ import annotations

import torch

from megatron_mlmclm.mcore_patches import cpu, optimizer
from megatron_mlmclm.mcore_patches.registry import verify_installed

_applied = False


def apply_patches() -> None:
    """Install the run-time replacements of registry.yaml for this machine, once per process,
    after checking the registry's pins: raises SourceChanged, naming them, where the installed
    megatron-core (or torch) changed a pinned target (registry.verify_installed)."""
    global _applied
    if _applied:
        return
    verify_installed()
    optimizer.apply_everywhere()
    if not torch.cuda.is_available():
        cpu.apply_without_cuda()
    _applied = True
