"""A run's samples as step batches: which samples make each step's micro-batches, from the step
number alone (batch_plan.py), the datasets of each sample stream (datasets.py), and who builds the
coming steps' micro-batches (loader.py: data.loader)."""
