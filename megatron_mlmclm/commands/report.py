"""`mlmclm report RESULTS_DIR --out DIR`: the study's tables and plots from the result JSONs, with
the paper's own runs beside them from an EncodEval results tree (`--encodeval`) (eval/report/)."""

from __future__ import annotations

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.report import make_report


def add_arguments(p) -> None:
    p.add_argument(
        "results",
        nargs="?",
        default=None,
        help="folder of result JSONs written by `mlmclm evaluate`",
    )
    p.add_argument("--out", default=None, help="report folder (default RESULTS/report)")
    p.add_argument(
        "--protocol",
        nargs="+",
        default=None,
        metavar="ID",
        help="report only results whose protocol id or run id starts with one of these "
        "(needed when the folder holds more than one protocol)",
    )
    p.add_argument(
        "--encodeval",
        default=None,
        metavar="DIR",
        help="an EncodEval results tree (<model>/<SC|TC|QA|IR>/<dataset>/lr.._sd../"
        "results.json): the paper's runs, reported beside yours",
    )
    p.add_argument(
        "--encodeval-models",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="only these model folders of the EncodEval tree (shell patterns, e.g. '610m-*')",
    )
    p.add_argument(
        "--task-file",
        action="append",
        default=[],
        help="extra task YAML (maps EncodEval dataset names to tasks; repeatable)",
    )
    p.add_argument("--no-plots", action="store_true")


def run(args) -> int:
    if args.results is None and args.encodeval is None:
        raise UsageError("give a results folder, or --encodeval DIR (or both)")
    out = make_report(
        args.results,
        args.out,
        plots=not args.no_plots,
        protocol=args.protocol,
        encodeval=args.encodeval,
        encodeval_models=args.encodeval_models,
        task_files=args.task_file,
    )
    print(f"report: {out / 'report.md'}")
    return 0
