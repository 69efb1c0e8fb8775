"""One optimizer step on megatron-core: the engine (engine.py: model, data parallelism, optimizer
and schedule, the update), megatron's DDP (data_parallel.py), the optimizer (optimizer.py), the
step's figures and update (update.py), a micro-batch on the device with the forward step
(microbatch.py), a phase's entry into the model (phase_entry.py) and the host synchronisations of a
step, counted (host_syncs.py)."""
