"""What a run reports: the `[mlmclm]` lines, metrics.jsonl, the progress bar and each step's
figures (metrics.py), TensorBoard and Weights & Biases (sinks.py)."""
