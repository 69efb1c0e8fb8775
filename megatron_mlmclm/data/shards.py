"""What a shard was written with, and whether a run may read it.

`mlmclm preprocess` writes beside each ``PREFIX.bin`` / ``.idx`` its fingerprint,
``PREFIX.fingerprint.json``: the tokenizer's (data/tokenizer.py `tokenizer_fingerprint`: a hash of
its vocabulary, its size, its bos/eos/pad/mask ids) and the document rule it was encoded by
(document.py): EOS appended or not (``append_eod``), documents that start with BOS or not
(``bos``), special-token strings in the text encoded as text (``special_tokens_as_text``).

A run (and `pretrain --dry-run`) reads only shards whose tokenizer is its ``data.tokenizer``:
otherwise one line naming both. Shards without a fingerprint (Megatron-LM's, or written before
fingerprints) are scanned once instead, the result cached beside the sample indexes: every token id
must be below the tokenizer's size, and whether every document ends with EOS and starts with BOS is
read off the documents. The run keeps the rule of its training shards in its checkpoints, and
`convert to-hf` copies it into the export's record, so that evaluation encodes fine-tuning inputs
as the model read its pretraining documents.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.data.dataset import open_indexed_dataset, parse_prefixes
from megatron_mlmclm.data.tokenizer import describe_tokenizer, same_tokenizer
from megatron_mlmclm.errors import UsageError

SUFFIX = ".fingerprint.json"
RULE_KEYS = ("append_eod", "bos", "special_tokens_as_text")
SCAN_VERSION = 1


def shard_fingerprint(tokenizer: dict[str, Any], append_eod: bool) -> dict[str, Any]:
    """The fingerprint of shards `mlmclm preprocess` writes with a tokenizer of this fingerprint:
    documents without BOS, special-token strings encoded as text (document.py)."""
    rule = {"append_eod": bool(append_eod), "bos": False, "special_tokens_as_text": True}
    return {**tokenizer, **rule}


def fingerprint_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}{SUFFIX}")


def write_fingerprint(prefix: str | os.PathLike, fingerprint: dict[str, Any]) -> Path:
    """Write PREFIX.fingerprint.json beside a shard (under a temporary name, then renamed)."""
    path = fingerprint_path(prefix)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(fingerprint, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_fingerprint(prefix: str | os.PathLike) -> dict[str, Any] | None:
    path = fingerprint_path(prefix)
    if not path.is_file():
        return None
    fix = "rewrite the shard with `mlmclm preprocess`"
    try:
        fp = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is not readable JSON ({e}); {fix}") from None
    if not isinstance(fp, dict):
        raise UsageError(f"{path} holds a {type(fp).__name__}, not a shard's fingerprint; {fix}")
    return fp


# --------------------------------------------------------------------------------------------------
# Shards without a fingerprint: scanned once


def scan_shard(
    prefix: str, bos_id: int | None, eos_id: int | None, cache_dir: str | os.PathLike | None
) -> dict[str, Any]:
    """{max_id, append_eod, bos} of a shard's documents, cached (in `cache_dir`, else the shard's
    folder's cache/) under the hash of its index and the size of its tokens."""
    digest = hashlib.sha256()
    with open(prefix + ".idx", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    size = os.path.getsize(prefix + ".bin")
    if size == 0:  # numpy maps no empty file
        raise UsageError(
            f"{prefix}.bin is empty (no tokens); preprocess a non-empty corpus or drop the prefix "
            "from the data list"
        )
    folder = Path(cache_dir) if cache_dir is not None else Path(prefix).parent / "cache"
    key = f"{digest.hexdigest()[:24]}-{size}-{bos_id}-{eos_id}-v{SCAN_VERSION}"
    cached = folder / f"shard_scan-{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    ds = open_indexed_dataset(prefix)
    tokens = np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r")
    step = 1 << 26
    top = max(int(tokens[i : i + step].max()) for i in range(0, tokens.size, step))
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    starts = np.asarray(ds.index.sequence_pointers, dtype=np.int64) // tokens.itemsize
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]
    result = {
        "max_id": top,
        "append_eod": eos_id is not None and bool(np.all(tokens[starts + lengths - 1] == eos_id)),
        "bos": bos_id is not None and bool(np.all(tokens[starts] == bos_id)),
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(result) + "\n")
        os.replace(tmp, cached)
    except OSError:  # a read-only data folder: scanned again next time
        pass
    return result


# --------------------------------------------------------------------------------------------------
# A run's shards against its tokenizer


def check_shard(
    prefix: str, tokenizer: dict[str, Any], tokenizer_path: str, cache_dir: str | None
) -> dict[str, Any]:
    """The rule a shard was written by ({append_eod, bos, special_tokens_as_text}: None where
    unknown), once it is known to hold ids of `tokenizer` (the fingerprint of data.tokenizer, at
    `tokenizer_path`); one line otherwise."""
    fix = f"rewrite it with `mlmclm preprocess --tokenizer {tokenizer_path}`"
    open_indexed_dataset(prefix)  # exists, and its .bin and .idx agree
    fp = read_fingerprint(prefix)
    if fp is not None:
        if not same_tokenizer(fp, tokenizer):
            raise UsageError(
                f"shard {prefix} was written with another tokenizer ({describe_tokenizer(fp)}) "
                f"than data.tokenizer {tokenizer_path} ({describe_tokenizer(tokenizer)}); {fix}"
            )
        return {k: fp.get(k) for k in RULE_KEYS}
    scan = scan_shard(prefix, tokenizer["bos_id"], tokenizer["eos_id"], cache_dir)
    if scan["max_id"] >= tokenizer["vocab_size"]:
        raise UsageError(
            f"shard {prefix} holds token id {scan['max_id']}, outside data.tokenizer "
            f"{tokenizer_path} ({tokenizer['vocab_size']} tokens): it was written with another "
            f"tokenizer; {fix}"
        )
    return {"append_eod": scan["append_eod"], "bos": scan["bos"], "special_tokens_as_text": None}


def run_prefixes(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(the prefixes a run trains on, those it validates on): data.train and every phase's own."""
    train = list(parse_prefixes(cfg.data.train)[0]) if cfg.data.train else []
    for ph in cfg.phases:
        if ph.data is not None and ph.data.train:
            train += [p for p in parse_prefixes(ph.data.train)[0] if p not in train]
    valid = list(parse_prefixes(cfg.data.valid)[0]) if cfg.data.valid else []
    return train, valid


def check_run_shards(cfg: RunConfig, tokenizer: dict[str, Any] | None) -> dict[str, Any] | None:
    """Every shard a run reads checked against data.tokenizer (one line for the first that does
    not fit); -> the run's shards record (`shards_record`). None for mock data."""
    if cfg.data.mock or tokenizer is None:
        return None
    path, cache = str(cfg.data.tokenizer), cfg.data.cache_dir
    train, valid = run_prefixes(cfg)
    rules = {p: check_shard(p, tokenizer, path, cache) for p in dict.fromkeys(train + valid)}
    return shards_record(train, rules, tokenizer)


def shards_record(
    train: list[str], rules: dict[str, dict[str, Any]], tokenizer: dict[str, Any]
) -> dict[str, Any]:
    """The record of a run's shards: the tokenizer's fingerprint and the rule its training shards
    (`train`, each with its rule in `rules`, from `check_shard`) were written by, which they must
    share (evaluation follows one rule); one line otherwise."""
    for key in ("append_eod", "bos"):
        seen = {rules[p][key] for p in train}
        if len(seen) > 1:
            a, b = (next(p for p in train if rules[p][key] == v) for v in sorted(seen))
            raise UsageError(
                f"the training shards disagree on {key}: {a} has {key}={rules[a][key]}, {b} "
                f"{key}={rules[b][key]}; a model is fine-tuned by one rule: preprocess them alike"
            )
    as_text = {rules[p]["special_tokens_as_text"] for p in train}
    return {**tokenizer, **rules[train[0]], "special_tokens_as_text": as_text == {True}}
