"""The pretraining loop, grouped by concern (docs/architecture.md), bottom to top:

- faults/: what goes wrong in a run and how it is survived: the fault monitor (non-finite steps,
  spikes, stragglers), its hang watchdog, stop signals (preemption) and the fault-injection hook;
- logs/: what a run reports: the log lines, metrics.jsonl, the progress bar, TensorBoard and W&B;
- batches/: which samples make each step's micro-batches, and who builds them;
- step/: one optimizer step on megatron-core: the engine (model, data parallelism, optimizer,
  update), the micro-batch on the device, the host synchronisations of a step;
- start/: where a run starts (resume, branch, train.init_from, fresh) and every check that takes;
- on top, the run: trainer.py (the Trainer), checkpointer.py (the start loaded, checkpoints
  saved), validator.py, pretrain.py (a run and its exit statuses), dry_run.py and preflight.py
  (`pretrain --dry-run`).
"""
