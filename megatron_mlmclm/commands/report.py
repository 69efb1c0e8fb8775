"""`mlmclm report RESULTS_DIR --out DIR`: the study's tables and plots from the result JSONs
(eval/report.py)."""

from __future__ import annotations

from megatron_mlmclm.eval.report import make_report


def add_arguments(p) -> None:
    p.add_argument("results", help="folder of result JSONs written by `mlmclm evaluate`")
    p.add_argument("--out", default=None, help="report folder (default RESULTS/report)")
    p.add_argument("--protocol", nargs="+", default=None, metavar="ID",
                   help="report only results whose protocol id or run id starts with one of these "
                        "(needed when the folder holds more than one protocol)")
    p.add_argument("--no-plots", action="store_true")


def run(args) -> int:
    out = make_report(args.results, args.out, plots=not args.no_plots, protocol=args.protocol)
    print(f"report: {out / 'report.md'}")
    return 0
