"""The study's grid of run configs, their jobs, and a compute summary (`mlmclm plan`).

    options.py  PlanOptions: what to plan (the flags of commands/plan.py, the study's defaults)
    layout.py   the global batch and each size's parallel layout (docs/parallelism.md)
    grid.py     the runs (single objective, CLM -> MLM, continued pretraining), names, configs,
                and which run branches from which
    compute.py  tokens, model FLOPs and GPU-hours of a run, each size priced from its measured
                step (measured_step_times.yaml, package data) or an assumed throughput
    evaluation.py  the GPU-hours of each model's evaluation array (eval_tasks.yaml: each task's
                sizes and input lengths, with their sources)
    jobs.py     the per-run job script and the SLURM submit script
    summary.py  SUMMARY.md, SUMMARY.csv, manifest.tsv
    write.py    write_plan: everything built and checked in memory, then one folder renamed into
                place
    owned.py    which files of a plan folder a plan wrote (its record): what --force replaces

A plan folder holds OUT/configs/NAME.yaml (each reloaded with load_config before the plan is kept),
OUT/jobs/NAME.sh (pretrain | convert | evaluate), OUT/submit_slurm.sh (every job with its
dependencies), OUT/manifest.tsv, OUT/SUMMARY.csv and OUT/SUMMARY.md (docs/plan.md).
"""
