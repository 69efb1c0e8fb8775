"""The mini-study (`mlmclm study`, docs/mini_study.md): the study's design in miniature on CPU.

design.py (what is trained and fine-tuned), pipeline.py (the stages), compare.py (the study's
claims as paired comparisons with verdicts), report.py (report.md and plots).
"""
