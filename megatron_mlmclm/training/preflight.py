"""What `mlmclm pretrain --dry-run` opens besides the config: what the run would open, checked as
the run checks it, every problem found (not only the first), one line each.

The tokenizer loads and fits model.vocab_size; every data prefix exists, is a readable shard and
holds ids of that tokenizer (data/shards.py); train.init_from exists, verifies against its
manifest, and is the model and tokenizer of the run (training/start/continued.py), unless it is gone
and the run resumes from its own checkpoint (which is all the run then reads); a run with
checkpoint.resume=false finds no earlier run's checkpoints in its folder (training/checkpointer.py).
"""

from __future__ import annotations

from pathlib import Path

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import RunConfig, own_checkpoints, to_dict
from megatron_mlmclm.data.dataset import open_indexed_dataset
from megatron_mlmclm.data.shards import check_shard, run_prefixes, shards_record
from megatron_mlmclm.data.tokenizer import token_spec_and_vocab
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.training.checkpointer import earlier_run
from megatron_mlmclm.training.start.continued import (
    check_init_from,
    init_from_checkpoint,
    init_from_tokenizer,
)


def preflight(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(one line per problem with what the run would open, empty when everything fits; what the
    run will report: what the scans of shards without a fingerprint found, train.init_from's
    settings a recipe changed on purpose)."""
    problems: list[str] = []
    notes: list[str] = []

    def check(fn, *args):
        try:
            return fn(*args)
        except UsageError as e:
            problems.append(str(e))
            return None

    spec = check(token_spec_and_vocab, cfg, init_from_tokenizer(cfg))
    tokenizer = spec.tokenizer if spec is not None else None
    if not cfg.data.mock:
        train, valid = run_prefixes(cfg)
        rules = {}
        for prefix in dict.fromkeys(train + valid):
            if tokenizer is None:
                check(open_indexed_dataset, prefix)
            else:
                path, cache = str(cfg.data.tokenizer), cfg.data.cache_dir
                args = (prefix, tokenizer, path, cache, cfg.data.require_eod, notes)
                rules[prefix] = check(check_shard, *args)
        if tokenizer is not None and not problems:
            check(shards_record, train, rules, tokenizer)  # the training shards share one rule
    init_from = cfg.train.init_from
    own = own_checkpoints(to_dict(cfg)) if init_from and not Path(init_from).exists() else None
    if own is not None:
        # the run resumes from its own checkpoint, which holds the model; init_from is not read
        notes.append(
            f"train.init_from {init_from} does not exist; the run resumes from its own "
            f"checkpoint {ckpt.latest_checkpoint(own)}"
        )
    elif init_from:
        found = check(init_from_checkpoint, init_from)
        if found is not None and spec is not None:
            notes += check(check_init_from, found, cfg, spec) or []
    moved = check(earlier_run, cfg, False)  # checkpoint.resume=false over earlier checkpoints
    if moved:
        notes.append(moved)
    return problems, notes
