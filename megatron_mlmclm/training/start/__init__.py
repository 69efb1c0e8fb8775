"""Where a run starts and what that takes: what a checkpoint must agree with to be resumed
(resume.py), a run's history in its checkpoints (history.py), what a branch may change (branch.py),
what train.init_from gives a run and must agree with (continued.py)."""
