"""The study's grid of run configs, their jobs, and a compute summary (`mlmclm plan`).

    options.py  PlanOptions: what to plan (the flags of commands/plan.py, the study's defaults)
    layout.py   the global batch and each size's parallel layout (docs/parallelism.md)
    grid.py     the runs (single objective, CLM -> MLM, continued pretraining), names, configs,
                and which run branches from which
    compute.py  tokens, model FLOPs and GPU-hours of a run, each size priced from its measured
                step (measured_step_times.yaml, package data) or an assumed throughput
    evaluation.py  the GPU-hours of each model's evaluation array (eval_tasks.yaml: each task's
                sizes and input lengths, with their sources)
    jobs.py     the per-run job script, the job table (jobs.json: every SLURM job with its options,
                dependencies and done rule; evaluation arrays sized to finish) and submit_slurm.sh
    submit.py   `mlmclm submit`: the job table submitted with sbatch, what is neither done nor
                queued (the standard library only: it runs on a login node)
    status.py   `mlmclm status`: where the study stands (jobs, runs, evaluation, GPU-hours spent
                against the price, what is left), from the table, the jobs' files
                (progress.py) and squeue / sacct (scheduler.py); status_page.py writes it as
                STATUS.md and status.html (plots: svg.py); standard library only, as submit.py
    summary.py  SUMMARY.md, SUMMARY.csv, manifest.tsv
    write.py    write_plan: everything built and checked in memory, then one folder renamed into
                place
    owned.py    which files of a plan folder a plan wrote (its record): what --force replaces

A plan folder holds OUT/configs/NAME.yaml (each reloaded with load_config before the plan is kept),
OUT/jobs/NAME.sh (pretrain | convert | evaluate), OUT/jobs.json (every job with its dependencies)
and OUT/submit_slurm.sh (`mlmclm submit OUT`), OUT/manifest.tsv, OUT/SUMMARY.csv and
OUT/SUMMARY.md (docs/plan.md); `mlmclm status OUT` adds OUT/STATUS.md and OUT/status.html.
"""
