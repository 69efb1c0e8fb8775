#!/usr/bin/env python
"""Measure what `mlmclm plan` prices an evaluation task by (megatron_mlmclm/plan/eval_tasks.yaml):
examples per split and the mean length of an input in tokens, text + EOS as `mlmclm evaluate`
encodes it, cut at the maximum length. Reads the tasks' local data ($MLMCLM_DATA_DIR).

    python tools/eval_task_figures.py --tokenizer TOKENIZER_DIR sst2 mnli conll2003 squad scifact

prints one YAML entry per task (paste it into eval_tasks.yaml with its `source`). The inputs: SC the
entry's template, TC the words joined by spaces, QA `Question: ...\\nContext: ...` (the entry's
template), IR the query and document templates; documents and queries measured apart.

Training batches are drawn at random, so a batch is padded to its longest input: `padded_tokens`
is the mean of that longest length over one seeded epoch of batches of 32 (IR: of the training
pairs' queries and documents apart, `padded_query_tokens` / `padded_document_tokens`).
Evaluation batches are sorted by length (eval/families/base.py, ir.py), so they are priced at the
mean. `judged_documents` (IR): the documents judged in the validation or test qrels, the corpus
`--protocol encodeval` ranks.
"""

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenizers import Tokenizer  # noqa: E402

from megatron_mlmclm.eval.families import load_split  # noqa: E402
from megatron_mlmclm.eval.families.ir import (  # noqa: E402
    document_text,
    query_text,
    training_pairs,
)
from megatron_mlmclm.eval.families.qa import TEMPLATE  # noqa: E402
from megatron_mlmclm.eval.families.sc import text_of  # noqa: E402
from megatron_mlmclm.eval.tasks import load_registry  # noqa: E402


def text(task, record) -> str:
    if task.family == "sc":
        return text_of(task, record)
    if task.family == "tc":
        return " ".join(record["tokens"])
    return (task.template or TEMPLATE).format(**record)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="folder with tokenizer.json (Llama-3's)")
    p.add_argument("--max-length", type=int, default=2027, help="0.99 x 2048 positions")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size")
    p.add_argument("tasks", nargs="+")
    args = p.parse_args()
    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))

    def lengths(texts) -> list[int]:
        # add_special_tokens=False + 1: the text's tokens and EOS (document.py's rule)
        return [
            min(len(e.ids) + 1, args.max_length)
            for e in tok.encode_batch(list(texts), add_special_tokens=False)
        ]

    def mean_tokens(texts) -> float:
        return round(statistics.fmean(lengths(texts)), 1)

    def padded_tokens(texts) -> float:
        """The mean longest length of a batch, over one seeded epoch of batches."""
        n = lengths(texts)
        order = list(range(len(n)))
        random.Random(0).shuffle(order)
        batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
        return round(statistics.fmean(max(n[i] for i in b) for b in batches), 1)

    registry = load_registry()
    for name in args.tasks:
        task = registry[name]
        print(f"{name}:\n  family: {task.family}")
        if task.family == "ir":
            test = load_split(task, "test")
            print(f"  corpus_documents: {len(test.corpus)}")
            documents = [document_text(task, d) for d in test.corpus.values()]
            print(f"  document_tokens: {mean_tokens(documents)}")
            for split in ("train", "validation", "test"):
                if split in task.splits:
                    got = load_split(task, split)
                    print(f"  {split}_queries: {len(got.qrels)}")
            print(
                f"  query_tokens: {mean_tokens(query_text(task, q) for q in test.queries.values())}"
            )
            judged = {
                d
                for split in ("validation", "test")
                for q in load_split(task, split).qrels.values()
                for d in q
                if d in test.corpus
            }
            print(f"  judged_documents: {len(judged)}")
            train = training_pairs(task, None)
            print(f"  padded_query_tokens: {padded_tokens(q for q, _ in train)}")
            print(f"  padded_document_tokens: {padded_tokens(d for _, d in train)}")
            continue
        for split in ("train", "validation", "test"):
            print(f"  {split}_examples: {len(load_split(task, split))}")
        train = [text(task, r) for r in load_split(task, "train")]
        print(f"  input_tokens: {mean_tokens(train)}")
        print(f"  padded_tokens: {padded_tokens(train)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
