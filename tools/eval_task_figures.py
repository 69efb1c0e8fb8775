#!/usr/bin/env python
"""Measure what `mlmclm plan` prices an evaluation task by (megatron_mlmclm/plan/eval_tasks.yaml):
examples per split and the mean length of an input in tokens, text + EOS as `mlmclm evaluate`
encodes it, cut at the maximum length. Reads the tasks' local data ($MLMCLM_DATA_DIR).

    python tools/eval_task_figures.py --tokenizer TOKENIZER_DIR sst2 mnli conll2003 squad scifact

prints one YAML entry per task (paste it into eval_tasks.yaml with its `source`). The inputs: SC the
entry's template, TC the words joined by spaces, QA `Question: ...\\nContext: ...` (the entry's
template), IR the query and document templates; documents and queries measured apart.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenizers import Tokenizer  # noqa: E402

from megatron_mlmclm.eval.families import load_split  # noqa: E402
from megatron_mlmclm.eval.families.ir import document_text, query_text  # noqa: E402
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
    p.add_argument("tasks", nargs="+")
    args = p.parse_args()
    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))

    def mean_tokens(texts) -> float:
        # add_special_tokens=False + 1: the text's tokens and EOS (document.py's rule)
        lengths = [
            min(len(e.ids) + 1, args.max_length)
            for e in tok.encode_batch(list(texts), add_special_tokens=False)
        ]
        return round(statistics.fmean(lengths), 1)

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
            continue
        for split in ("train", "validation", "test"):
            print(f"  {split}_examples: {len(load_split(task, split))}")
        print(f"  input_tokens: {mean_tokens(text(task, r) for r in load_split(task, 'train'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
