"""Where a run starts and what that takes. decide.py decides it, in one place and in this order
(resume -> branch -> train.init_from -> fresh), returning what was decided and checked; the rest
are its checks: the data fingerprint a resume or branch must match (fingerprint.py), what a
checkpoint must agree with to be resumed (resume.py), a run's history in its checkpoints
(history.py), what a branch may change (branch.py), what train.init_from gives a run and must agree
with (continued.py)."""
