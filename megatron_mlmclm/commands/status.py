"""`mlmclm status PLAN`: where a plan's study stands (plan/status.py): each run's steps, tokens,
loss and last checkpoint, each job's state, every failure with its log's error line and what
waits on it, each model's export and evaluation runs, GPU-hours spent against the plan's price,
what is left and a finish estimate. Read from the plan's files and, where SLURM answers, squeue
and sacct; it changes nothing but the two pages it writes into the plan folder, STATUS.md and
status.html (a static page: tables and plots, no server). Needs the standard library only (a
login node's python3), like `mlmclm submit`, which refreshes the pages after each submission.

    mlmclm status plans/study
    mlmclm status plans/study --no-slurm --logs /scratch/me/logs
"""

from __future__ import annotations

import os

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.plan.status import read_status
from megatron_mlmclm.plan.status_page import markdown, write_pages


def add_arguments(p) -> None:
    p.add_argument("plan", metavar="PLAN", help="the folder `mlmclm plan --out` wrote")
    p.add_argument(
        "--logs",
        default="logs",
        metavar="DIR",
        help="the jobs' logs where sacct does not name their folder (default: ./logs, where "
        "`mlmclm submit` ran)",
    )
    p.add_argument(
        "--no-slurm", action="store_true", help="files only: ask neither squeue nor sacct"
    )
    p.add_argument("--quiet", action="store_true", help="print only where the pages were written")


def run(args) -> int:
    status = read_status(args.plan, dict(os.environ), logs=args.logs, ask=not args.no_slurm)
    try:
        pages = write_pages(status)
    except OSError as e:
        raise UsageError(f"cannot write the status pages into {status.plan}: {e}") from None
    if not args.quiet:
        print(markdown(status))
    print("written: " + ", ".join(map(str, pages)))
    return 0
