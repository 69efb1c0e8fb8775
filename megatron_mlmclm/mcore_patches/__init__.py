"""megatron-core's changes, in one place: every function, method or attribute of megatron-core
(and of torch, where megatron-core calls it) that this project replaces, and why.

- registry.yaml: the list. One row per replaced or overridden thing: what, by which code of
  ours, when, why, the megatron-core version it was checked against and the pins (source hashes)
  that tests/test_mcore_patches.py checks against the installed packages; registry.py reads it
  and computes the pins.
- jit.py: megatron's torch.compile'd kernels compiled at their first call
  (`defer_kernel_compilation`, asked for by the `mlmclm` entry point before megatron is
  imported).
- cpu.py: megatron-core on machines without CUDA.
- optimizer.py: megatron's optimizer without Apex or Transformer Engine, torch's fused AdamW
  behind it, the device-side skip of a non-finite step, the main parameters read back.
- safe_load.py: torch's and megatron-core's checkpoint readers with nothing a file names ever
  called (`.metadata` through an allow-list, byte objects and common state weights_only):
  subclasses that checkpoint/ hands to their loads; nothing is replaced.
- apply.py: `apply_patches()`, what a training or converting process installs, after checking
  the registry's pins against the installed source (registry.verify_installed).

This package imports nothing of megatron_mlmclm, and importing it (or jit.py, registry.py)
imports neither torch nor megatron-core: the entry point can use it before either.
"""
