"""`mlmclm study`: the study's design in miniature on CPU, with verdicts (study/; `make study`)."""

from __future__ import annotations

from megatron_mlmclm.study.design import LR_LADDER, TASKS, StudyDesign

_D = StudyDesign()


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="out/study", help="output folder (default %(default)s)")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder with gutenberg_en/ and the tasks' folders (default: "
        "$MLMCLM_DATA_DIR, else ../shared/data)",
    )
    _pretraining_flags(
        parser.add_argument_group(
            "pretraining (defaults: the 60-minute design, docs/mini_study.md)"
        )
    )
    _finetuning_flags(parser.add_argument_group("fine-tuning"))
    _curve_flags(parser.add_argument_group("learning curve"))
    parser.add_argument(
        "--workers",
        type=int,
        default=_D.workers,
        help="runs side by side, one thread each (default %(default)s)",
    )


def _pretraining_flags(g) -> None:
    """The recipes' pretraining runs."""
    g.add_argument("--preset", default=_D.preset, help="model preset (default %(default)s)")
    g.add_argument(
        "--steps", type=int, default=_D.steps, help="steps per recipe (default %(default)s)"
    )
    g.add_argument(
        "--cpt-steps",
        type=int,
        default=_D.cpt_steps,
        help="MLM steps added to the CLM model (default %(default)s)",
    )
    g.add_argument("--pretrain-seeds", nargs="+", type=int, default=_D.pretrain_seeds)
    g.add_argument("--lr", type=float, default=_D.lr, help="peak pretraining LR")
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=_D.micro_batch_size,
        help="sequences per pretraining step (default %(default)s)",
    )
    g.add_argument(
        "--eval-iters",
        type=int,
        default=_D.eval_iters,
        help="validation batches of --micro-batch-size sequences per evaluation "
        "(default %(default)s)",
    )
    g.add_argument("--vocab-size", type=int, default=_D.vocab_size)
    g.add_argument(
        "--train-documents",
        type=int,
        default=_D.train_documents,
        help="tokenize only the first N documents (books) of the corpus's train split "
        "(default: all)",
    )


def _finetuning_flags(g) -> None:
    """The fine-tuning grid each model is evaluated on."""
    g.add_argument("--tasks", nargs="+", default=list(TASKS))
    g.add_argument(
        "--lrs",
        nargs="+",
        type=float,
        default=_D.lrs,
        help=f"initial LR grid, on the ladder {list(LR_LADDER)}",
    )
    g.add_argument("--seeds", dest="finetune_seeds", nargs="+", type=int, default=_D.finetune_seeds)
    g.add_argument("--finetune-steps", type=int, default=_D.finetune_steps)
    g.add_argument("--batch-size", type=int, default=_D.batch_size)
    g.add_argument("--max-length", type=int, default=_D.max_length)
    g.add_argument("--max-train-examples", type=int, default=_D.max_train_examples)
    g.add_argument("--max-eval-examples", type=int, default=_D.max_eval_examples)
    g.add_argument(
        "--max-widen",
        type=int,
        default=_D.max_widen,
        help="times a task's LR grid may be widened (default %(default)s)",
    )


def _curve_flags(g) -> None:
    """The learning curve: smaller budgets branched from the full runs."""
    g.add_argument(
        "--curve-shares",
        nargs="*",
        type=float,
        default=_D.curve_shares,
        help="smaller budgets of CLM and MLM 40%%, as shares of --steps, trained as decay "
        "branches of the full runs (default %(default)s; none: no learning curve)",
    )
    g.add_argument(
        "--curve-tasks",
        nargs="+",
        default=_D.curve_tasks,
        help="tasks the learning-curve models are fine-tuned on, among --tasks "
        "(default %(default)s)",
    )


def run(args) -> int:
    fields = {k: v for k, v in vars(args).items() if k in StudyDesign.__dataclass_fields__}
    design = StudyDesign(**fields).check()
    design.check_folder(args.out)
    # Imported here: megatron-core and transformers would slow `mlmclm study --help`.
    from megatron_mlmclm.study.pipeline import run_study

    run_study(args.out, design, data_folder=args.data_dir)
    return 0
