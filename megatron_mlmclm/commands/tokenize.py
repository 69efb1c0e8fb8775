"""`mlmclm tokenize`: load a local Hugging Face tokenizer and complete it, or train a byte-level BPE
(data/tokenizer.py)."""

from __future__ import annotations

from megatron_mlmclm.errors import UsageError


def add_arguments(parser) -> None:
    g = parser.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--from",
        dest="source",
        metavar="HF_FOLDER",
        help="local Hugging Face tokenizer folder to complete with bos/eos/pad/mask",
    )
    g.add_argument(
        "--train",
        nargs="+",
        metavar="INPUT",
        help="train a byte-level BPE on these inputs (jsonl[.gz], json, txt, parquet, folder)",
    )
    parser.add_argument("--out", required=True, help="output folder (save_pretrained format)")
    parser.add_argument(
        "--vocab-size", type=int, help="BPE vocab size, specials included (--train)"
    )
    parser.add_argument(
        "--json-key",
        "--json-keys",
        dest="json_key",
        default="text",
        help="text field of json/jsonl/parquet records (default: text)",
    )
    parser.add_argument("--min-frequency", type=int, default=2, help="BPE min pair frequency")
    parser.add_argument("--max-documents", type=int, help="train on at most this many documents")
    parser.add_argument(
        "--txt-split-lines",
        action="store_true",
        help="each non-empty line of a .txt input is a document (default: the "
        "whole file is one document)",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")


def run(args) -> int:
    # Imported here: transformers and tokenizers would slow `mlmclm tokenize --help`.
    from megatron_mlmclm.data.tokenizer import prepare_tokenizer, read_metadata, train_tokenizer

    if args.train:
        if not args.vocab_size:
            raise UsageError("--train needs --vocab-size N (e.g. 32768)")
        out = train_tokenizer(
            args.train,
            args.out,
            args.vocab_size,
            text_key=args.json_key,
            min_frequency=args.min_frequency,
            max_documents=args.max_documents,
            txt_split_lines=args.txt_split_lines,
            force=args.force,
        )
    else:
        out = prepare_tokenizer(args.source, args.out, force=args.force)
    meta = read_metadata(out)
    print(
        f"tokenizer saved to {out}: vocab_size={meta['vocab_size']} bos={meta['bos_id']} "
        f"eos={meta['eos_id']} pad={meta['pad_id']} mask={meta['mask_id']}"
    )
    return 0
