"""What `mlmclm pretrain --dry-run` opens besides the config: what the run would open, checked as
the run checks it, every problem found (not only the first), one line each.

The tokenizer loads and fits model.vocab_size; every data prefix exists, is a readable shard and
holds ids of that tokenizer (data/shards.py); then where the run would start, decided and checked
as the run decides it (training/start/decide.py: an earlier run's checkpoints under
checkpoint.resume=false; the run's own checkpoint, verified and checked against the run; else
train.branch_from's; else train.init_from's, its model and tokenizer those of the run), moving
nothing aside. A checkpoint is verified in full, as the run verifies it.
"""

from __future__ import annotations

from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.data.dataset import open_indexed_dataset
from megatron_mlmclm.data.shards import check_shard, run_prefixes, shards_record
from megatron_mlmclm.data.tokenizer import token_spec_and_vocab
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.training.start.continued import init_from_tokenizer
from megatron_mlmclm.training.start.decide import Start, decide_start
from megatron_mlmclm.training.start.fingerprint import fingerprint


def preflight(cfg: RunConfig) -> tuple[list[str], list[str], Start | None]:
    """(one line per problem with what the run would open, empty when everything fits; what the
    run will report: what the scans of shards without a fingerprint found, what its start says;
    where it would start, None where that was refused)."""
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
                args = (prefix, tokenizer, path, cache, cfg.data.allow_missing_eod, notes)
                rules[prefix] = check(check_shard, *args)
        if tokenizer is not None and not problems:
            check(shards_record, train, rules, tokenizer)  # the training shards share one rule
    # the data fingerprint a resume or branch is checked against, where the data could be read
    data = check(fingerprint, cfg, spec) if spec is not None and not problems else None
    start = check(decide_start, cfg, spec, data, True)
    if start is not None:
        notes += start.notes
    return problems, notes, start
