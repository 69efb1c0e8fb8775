"""Preprocess throughput vs the bare tokenizer on the same documents and worker count.

ours:     `preprocess()` end to end (read jsonl, tokenize, write .bin/.idx shards)
baseline: the `tokenizers.Tokenizer` behind the fast tokenizer, `encode_batch(texts)` on the same
          documents already in memory (no reading, no writing), with the same number of threads
          (RAYON_NUM_THREADS = --workers, set before the first encode of the process).

Documents: the first --books Gutenberg train books split into paragraphs (blank-line separated).
The tokenizer is a byte-level BPE trained here (--vocab-size) on the first book, unless
--tokenizer names a folder. Prints the ratio ours/baseline; last line:
RESULT preprocess ratio=<ours_tput/baseline_tput> ours_s=<..> baseline_s=<..>

    python benchmarks/preprocess.py --workers 2
    python benchmarks/preprocess.py --quick      # seconds: 2 books, a 1k BPE, one run each
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--books", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--tokenizer", help="tokenizer folder (default: train one here)")
    ap.add_argument("--backend", choices=("threads", "processes"), default="threads")
    ap.add_argument("--repeats", type=int, default=2, help="best of N for each side")
    ap.add_argument("--quick", action="store_true", help="2 books, vocabulary 1024, one run each")
    ap.add_argument(
        "--compare-processes",
        action="store_true",
        help="also time --backend processes (information only)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.books, args.vocab_size, args.repeats = 2, 1024, 1
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # before tokenizers' pool starts
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    from megatron_mlmclm.data.preprocess import preprocess
    from megatron_mlmclm.data.tokenizer import load_tokenizer, train_tokenizer
    from megatron_mlmclm.paths import data_dir

    src = data_dir(required=True) / "gutenberg_en" / "train.jsonl.gz"
    texts = []
    with gzip.open(src, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= args.books:
                break
            texts += [p for p in json.loads(line)["text"].split("\n\n") if p.strip()]
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        tok_dir = args.tokenizer
        if tok_dir is None:
            (tmp / "first.txt").write_text("\n\n".join(texts[: len(texts) // args.books]))
            tok_dir = train_tokenizer(
                [str(tmp / "first.txt")], tmp / "tok", args.vocab_size, progress=False
            )
        backend_tok = load_tokenizer(tok_dir).backend_tokenizer
        n_chars = sum(map(len, texts))
        print(
            f"documents={len(texts)} chars={n_chars:,} workers={args.workers} "
            f"backend={args.backend}"
        )

        def baseline(fn):
            best, n = float("inf"), 0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                enc = fn(texts, add_special_tokens=False)
                best = min(best, time.perf_counter() - t0)
                n = sum(len(e.ids) for e in enc)
                del enc
            return best, n

        def ours(backend):
            best, s = float("inf"), None
            for _ in range(args.repeats):
                s = preprocess(
                    [str(corpus)],
                    tmp / f"out_{backend}",
                    tok_dir,
                    workers=args.workers,
                    backend=backend,
                    force=True,
                    progress=False,
                )
                best = min(best, s["seconds"])
            return best, s

        base_s, base_tokens = baseline(backend_tok.encode_batch)
        ours_s, s = ours(args.backend)
        ours_tokens = s["tokens"] - s["documents"]  # without the appended eos
        assert ours_tokens == base_tokens, (ours_tokens, base_tokens)
        base_tput, ours_tput = base_tokens / base_s, ours_tokens / ours_s
        print(f"baseline encode_batch:  {base_s:7.2f} s  {base_tput:12,.0f} tokens/s")
        print(
            f"ours ({args.backend}):  {ours_s:7.2f} s  {ours_tput:12,.0f} tokens/s  "
            f"(end to end: read jsonl + tokenize + write shards)"
        )
        fast_s, _ = baseline(backend_tok.encode_batch_fast)
        print(f"info: encode_batch_fast: {fast_s:7.2f} s  {base_tokens / fast_s:12,.0f} tokens/s")
        if args.compare_processes:
            other = "processes" if args.backend == "threads" else "threads"
            o_s, _ = ours(other)
            print(f"info: ours ({other}): {o_s:7.2f} s  {base_tokens / o_s:12,.0f} tokens/s")
        ratio = ours_tput / base_tput
        print(f"ratio ours/baseline = {ratio:.3f} (target >= 0.8)")
        print(f"RESULT preprocess ratio={ratio:.3f} ours_s={ours_s:.3f} baseline_s={base_s:.3f}")
    return 0


if __name__ == "__main__":
    defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does
    sys.exit(main())
