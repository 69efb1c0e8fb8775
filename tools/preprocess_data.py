#!/usr/bin/env python
"""Megatron-LM style entry point: the same as `mlmclm preprocess` (same flags, same code).

    python tools/preprocess_data.py --input data.jsonl --output-prefix out/corpus \
        --tokenizer tok_dir --json-keys text --workers 8

writes out/corpus_text_document.bin/.idx. Bad input: one line on stderr, exit status 2.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mlmclm.commands import preprocess  # noqa: E402
from megatron_mlmclm.errors import EXIT_USAGE, UsageError  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py", description="raw text -> Megatron .bin/.idx shards"
    )
    preprocess.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return int(preprocess.run(args) or 0)
    except UsageError as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # spawn workers (--backend processes) re-import this file
    sys.exit(main())
