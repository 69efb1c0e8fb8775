"""The mini-study (`mlmclm study`, docs/mini_study.md): the study's design in miniature on CPU.

design.py (what is trained and fine-tuned), pipeline.py (the stages), runs.py (a pretraining run
on disk: its folder, whether it finished, its losses), compare.py (the study's claims as paired
comparisons with verdicts), report.py (report.md and plots).
"""
