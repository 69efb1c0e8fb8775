"""`mlmclm convert`: megatron <-> Hugging Face checkpoints, each conversion verified before it is
kept (convert/).

    mlmclm convert to-hf CKPT OUT [--arch eurobert|llama|qwen3] [--causal-lm] [--tokenizer DIR]
                                  [--clf-pooling late|mean|bos] [--dtype fp32|bf16|fp16]
                                  [--force] [--all | --steps N ...]
    mlmclm convert from-hf HF_DIR OUT [--force] [--seed N]
    mlmclm convert from-megatron-lm CKPT OUT --tokenizer DIR [--force] [--seed N]

CKPT is a run's checkpoints folder (its latest complete checkpoint) or one iter_NNNNNNN folder,
saved at any TP/PP layout. With --all (every complete checkpoint of the folder) or --steps, OUT is
a folder of exports named OUT/step<N>-tokens<T> (a run's kept checkpoints: learning curves). Bad
input exits with status 2 and one line; nothing partial is left.
"""

from __future__ import annotations

import warnings

from megatron_mlmclm.errors import UsageError


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="{to-hf,from-hf,from-megatron-lm}")
    sub.required = True
    _to_hf_arguments(sub)
    _from_hf_arguments(sub)
    _from_megatron_lm_arguments(sub)


def _to_hf_arguments(sub) -> None:
    p = sub.add_parser(
        "to-hf",
        help="megatron checkpoint -> Hugging Face folder",
        description="Export a megatron checkpoint (any TP/PP layout) to a Hugging "
        "Face folder that loads without remote code; verified.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="a run's checkpoints folder (latest complete checkpoint) or an iter_ folder",
    )
    p.add_argument("out", metavar="OUT", help="output folder (must not exist unless --force)")
    p.add_argument(
        "--arch",
        choices=("eurobert", "llama", "qwen3"),
        help="HF architecture (default: the source family recorded at import, else "
        "eurobert; qwen3 for qk-norm models)",
    )
    p.add_argument(
        "--causal-lm",
        action="store_true",
        help="export a causal LlamaForCausalLM (Qwen3ForCausalLM with qk-norm) for "
        "generation, e.g. from a CLM checkpoint",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer folder (default: data.tokenizer of the checkpoint's run)",
    )
    p.add_argument(
        "--clf-pooling",
        default="late",
        choices=("late", "mean", "bos"),
        help="EuroBERT classifier_pooling for sequence classification (default: late)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        help="dtype of the exported weights (default: the one the checkpoint stores them in)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (atomically)")
    many = p.add_mutually_exclusive_group()
    many.add_argument(
        "--all",
        action="store_true",
        help="export every complete checkpoint of the CKPT folder into OUT/step<N>-tokens<T>/",
    )
    many.add_argument(
        "--steps",
        nargs="+",
        type=int,
        metavar="N",
        help="export these steps' checkpoints of the CKPT folder into OUT/step<N>-tokens<T>/",
    )


def _from_hf_arguments(sub) -> None:
    p = sub.add_parser(
        "from-hf",
        help="Hugging Face decoder -> megatron checkpoint for MLM",
        description="Import a local Llama-family / Qwen3 / EuroBERT folder as a "
        "megatron checkpoint plus a run config for continued MLM "
        "pretraining; verified.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="local Hugging Face model folder")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (atomically)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the run config (default 1234)")


def _from_megatron_lm_arguments(sub) -> None:
    p = sub.add_parser(
        "from-megatron-lm",
        help="Megatron-LM GPT checkpoint -> ours for MLM",
        description="Import a Megatron-LM GPT checkpoint (torch_dist format; "
        "RMSNorm, SwiGLU, RoPE, no biases) as a megatron checkpoint "
        "plus a run config for continued MLM pretraining; verified.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="Megatron-LM save dir (with "
        "latest_checkpointed_iteration.txt) or one iter_NNNNNNN folder",
    )
    p.add_argument("out", metavar="OUT", help="output folder (must not exist unless --force)")
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="required: the tokenizer the model was "
        "trained with, as a folder written by `mlmclm tokenize` (with a mask token)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (atomically)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the run config (default 1234)")


def run(args) -> int:
    warnings.filterwarnings("ignore")
    from megatron_mlmclm.convert.common import map_large_allocations

    map_large_allocations()  # a tensor freed goes back to the system at once (docs/convert.md)
    # Imported here, one direction at a time: megatron-core and transformers would slow `--help`.
    if args.direction == "to-hf":
        from megatron_mlmclm.convert.hf_export import to_hf, to_hf_many

        options = dict(
            arch=args.arch,
            causal_lm=args.causal_lm,
            tokenizer=args.tokenizer,
            force=args.force,
            clf_pooling=args.clf_pooling,
            dtype=args.dtype,
        )
        if args.all or args.steps:
            to_hf_many(args.checkpoint, args.out, steps=args.steps, **options)
        else:
            to_hf(args.checkpoint, args.out, **options)
    elif args.direction == "from-hf":
        from megatron_mlmclm.convert.hf_import import from_hf

        from_hf(args.hf_dir, args.out, force=args.force, seed=args.seed)
    elif args.direction == "from-megatron-lm":
        from megatron_mlmclm.convert.megatron_lm import from_megatron_lm

        from_megatron_lm(
            args.checkpoint, args.out, tokenizer=args.tokenizer, force=args.force, seed=args.seed
        )
    else:  # pragma: no cover - argparse enforces the choice
        raise UsageError("choose to-hf, from-hf or from-megatron-lm")
    return 0
