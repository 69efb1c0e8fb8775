"""`mlmclm submit PLAN`: submit a plan's jobs to SLURM from its job table (plan/submit.py), what is
neither done nor queued, each after the jobs it waits on. Safe to run again at any time; the
plan's submit_slurm.sh runs it. Each run refreshes the plan's status pages (`mlmclm status`).
Needs the standard library only (a login node's python3).

    mlmclm submit plans/study
    SBATCH_EXTRA="--account X --partition Y" mlmclm submit plans/study
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from megatron_mlmclm.plan.status_page import refresh
from megatron_mlmclm.plan.submit import PLANNED, VARIABLES, submit


def add_arguments(p) -> None:
    p.add_argument("plan", metavar="PLAN", help="the folder `mlmclm plan --out` wrote")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    rows = []
    for name, what in VARIABLES.items():
        first, *rest = textwrap.wrap(what, 60, break_on_hyphens=False)
        rows += [f"  {name:<18}{first}", *(" " * 20 + line for line in rest)]
    refused = ", ".join(f"{name} ({flag})" for name, flag in PLANNED.items())
    p.epilog = (
        "environment variables (all optional; docs/cluster.md#5-submit):\n"
        + "\n".join(rows)
        + f"\nset by the plan, refused here: {refused}"
    )


def run(args) -> int:
    submit(args.plan)
    # the plan's STATUS.md and status.html (`mlmclm status`): a failure there is one warning line
    refresh(args.plan, dict(os.environ), say=lambda line: print(line, file=sys.stderr))
    return 0
