"""What a shard was written with, and whether a run may read it.

`mlmclm preprocess` writes beside each ``PREFIX.bin`` / ``.idx`` its fingerprint,
``PREFIX.fingerprint.json``: the tokenizer's (data/tokenizer.py `tokenizer_fingerprint`: a hash of
its vocabulary, its size, its bos/eos/pad/mask ids) and the document rule it was encoded by
(document.py): EOS appended or not (``append_eod``), documents that start with BOS or not
(``bos``), special-token strings in the text encoded as text (``special_tokens_as_text``).

The fingerprint also holds the shard's largest id, for the file it was written beside (the
.bin's size and modification time, ``bin_bytes`` / ``bin_mtime_ns``): a run refuses ids past its
vocabulary before a model exists; a shard whose .bin is not that file (copied with a new time, or
changed) is scanned instead.

A run (and `pretrain --dry-run`) reads only shards whose tokenizer is its ``data.tokenizer``:
otherwise one line naming both. Shards without a fingerprint (Megatron-LM's, or written before
fingerprints) are scanned once instead, the result cached beside the sample indexes, and must look
written by that tokenizer: every token id below its size, its special ids nowhere inside a
document, and every document ending with its EOS (unless ``data.allow_missing_eod``: shards
written without end-of-document tokens), so that another tokenizer's shards whose ids happen to
fit are refused, not read with its EOS taken for the run's rule. What each scan found is
reported. The run keeps the rule of its training shards in its checkpoints, and `convert to-hf`
copies it into the export's record, so that evaluation encodes fine-tuning inputs as the model
read its pretraining documents.
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
SCAN_VERSION = 2


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
# What a shard holds: its fingerprint's word for this very file, else a scan (cached)


def file_identity(prefix: str | os.PathLike) -> dict[str, int]:
    """What a fingerprint ties itself to: the size and modification time of the shard's .bin
    (any write changes the time; a copy that keeps it, `cp -p` or `rsync -t`, keeps the tie)."""
    st = os.stat(f"{prefix}.bin")
    return {"bin_bytes": st.st_size, "bin_mtime_ns": st.st_mtime_ns}


SPECIAL_KEYS = ("bos_id", "eos_id", "pad_id", "mask_id")


def scan_shard(
    prefix: str, tokenizer: dict[str, Any], cache_dir: str | os.PathLike | None
) -> dict[str, Any]:
    """What a shard's documents hold, read off its tokens and cached (in `cache_dir`, else the
    shard's folder's cache/) under the hash of its index and its .bin's size and modification
    time: {max_id, tokens, documents, ends_eos and starts_bos (documents that end with the
    tokenizer's EOS, start with its BOS), last_id and last_count (the commonest final id and
    how many documents end with it), specials_inside (the tokenizer's bos/eos/pad/mask ids
    anywhere but a BOS at a start and an EOS at an end), append_eod, bos}."""
    digest = hashlib.sha256()
    with open(prefix + ".idx", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    ident = file_identity(prefix)
    if ident["bin_bytes"] == 0:  # numpy maps no empty file
        raise UsageError(
            f"{prefix}.bin is empty (no tokens); preprocess a non-empty corpus or drop the prefix "
            "from the data list"
        )
    ids = [tokenizer.get(k) for k in SPECIAL_KEYS]
    folder = Path(cache_dir) if cache_dir is not None else Path(prefix).parent / "cache"
    key = f"{digest.hexdigest()[:24]}-{ident['bin_bytes']}-{ident['bin_mtime_ns']}"
    key += f"-{'-'.join(map(str, ids))}-v{SCAN_VERSION}"
    cached = folder / f"shard_scan-{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    result = _scan(prefix, *ids)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(result) + "\n")
        os.replace(tmp, cached)
    except OSError:  # a read-only data folder: scanned again next time
        pass
    return result


def _scan(prefix: str, bos: int | None, eos: int | None, pad, mask) -> dict[str, Any]:
    ds = open_indexed_dataset(prefix)
    tokens = np.memmap(prefix + ".bin", dtype=ds.index.dtype, mode="r")
    specials = np.asarray([i for i in (bos, eos, pad, mask) if i is not None], dtype=np.int64)
    top, inside, step = 0, 0, 1 << 26
    for i in range(0, tokens.size, step):
        chunk = tokens[i : i + step]
        top = max(top, int(chunk.max()))
        inside += int(np.isin(chunk, specials).sum())
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    starts = np.asarray(ds.index.sequence_pointers, dtype=np.int64) // tokens.itemsize
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]
    first, last = tokens[starts].astype(np.int64), tokens[starts + lengths - 1].astype(np.int64)
    ends_eos = int((last == eos).sum()) if eos is not None else 0
    starts_bos = int((first == bos).sum()) if bos is not None else 0
    values, counts = np.unique(last, return_counts=True)
    common = int(counts.argmax()) if len(values) else 0
    docs = int(len(lengths))
    return {
        "max_id": top,
        "tokens": int(tokens.size),
        "documents": docs,
        "ends_eos": ends_eos,
        "starts_bos": starts_bos,
        "last_id": int(values[common]) if len(values) else None,
        "last_count": int(counts[common]) if len(values) else 0,
        "specials_inside": inside - ends_eos - starts_bos,
        "append_eod": eos is not None and ends_eos == docs,
        "bos": bos is not None and starts_bos == docs,
    }


def describe_scan(prefix: str, scan: dict[str, Any], tokenizer: dict[str, Any]) -> str:
    """What a scan inferred of a shard without a fingerprint, in one line."""
    docs = scan["documents"]
    return (
        f"shard {prefix} has no fingerprint; scanned: largest id {scan['max_id']} "
        f"({tokenizer['vocab_size']} tokens in data.tokenizer), {scan['ends_eos']} of {docs} "
        f"documents end with its EOS ({tokenizer['eos_id']}), {scan['starts_bos']} start with its "
        f"BOS ({tokenizer['bos_id']}), {scan['specials_inside']} of its special ids inside"
    )


# --------------------------------------------------------------------------------------------------
# A run's shards against its tokenizer


def check_shard(
    prefix: str,
    tokenizer: dict[str, Any],
    tokenizer_path: str,
    cache_dir: str | None,
    allow_missing_eod: bool = False,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """The rule a shard was written by ({append_eod, bos, special_tokens_as_text}: None where
    unknown), once it is known to hold ids of `tokenizer` (the fingerprint of data.tokenizer, at
    `tokenizer_path`); one line otherwise. A shard without a fingerprint is scanned (what the scan
    inferred goes to `notes`) and must look written by this tokenizer: ids below its size, its
    special ids not inside documents, and (unless `allow_missing_eod`, data.allow_missing_eod)
    every document ending with its EOS."""
    fix = f"rewrite it with `mlmclm preprocess --tokenizer {tokenizer_path}`"
    open_indexed_dataset(prefix)  # exists, and its .bin and .idx agree
    fp = read_fingerprint(prefix)
    if fp is not None:
        if not same_tokenizer(fp, tokenizer):
            raise UsageError(
                f"shard {prefix} was written with another tokenizer ({describe_tokenizer(fp)}) "
                f"than data.tokenizer {tokenizer_path} ({describe_tokenizer(tokenizer)}); {fix}"
            )
        top = _fingerprinted_max_id(prefix, fp, tokenizer, cache_dir)
        if top >= tokenizer["vocab_size"]:
            raise UsageError(
                f"shard {prefix} holds token id {top}, outside data.tokenizer {tokenizer_path} "
                f"({tokenizer['vocab_size']} tokens), although its fingerprint names that "
                f"tokenizer: the file changed after it was written; {fix}"
            )
        return {k: fp.get(k) for k in RULE_KEYS}
    scan = scan_shard(prefix, tokenizer, cache_dir)
    if notes is not None:
        notes.append(describe_scan(prefix, scan, tokenizer))
    _check_scan(prefix, scan, tokenizer, tokenizer_path, allow_missing_eod, fix)
    return {"append_eod": scan["append_eod"], "bos": scan["bos"], "special_tokens_as_text": None}


def _fingerprinted_max_id(prefix: str, fp: dict[str, Any], tokenizer, cache_dir) -> int:
    """A fingerprinted shard's largest id: the fingerprint's, where it was written for this very
    file (`file_identity`); else (a shard written before fingerprints held it, copied without its
    time, or changed) a scan's, cached."""
    if fp.get("max_id") is not None and all(
        fp.get(k) == v for k, v in file_identity(prefix).items()
    ):
        return int(fp["max_id"])
    return int(scan_shard(prefix, tokenizer, cache_dir)["max_id"])


def _check_scan(prefix, scan, tokenizer, path: str, allow_missing_eod: bool, fix: str) -> None:
    """One line where a scanned shard does not look written by data.tokenizer."""
    vocab, eos, docs = tokenizer["vocab_size"], tokenizer["eos_id"], scan["documents"]
    other = "it was written with another tokenizer"
    if scan["max_id"] >= vocab:
        raise UsageError(
            f"shard {prefix} holds token id {scan['max_id']}, outside data.tokenizer {path} "
            f"({vocab} tokens): {other}; {fix}"
        )
    if scan["specials_inside"] * 1000 > scan["tokens"]:
        raise UsageError(
            f"shard {prefix} holds data.tokenizer's special ids (bos/eos/pad/mask) "
            f"{scan['specials_inside']} times inside its {docs} documents ({scan['tokens']} "
            f"tokens), where text never puts them: {other}; {fix}"
        )
    if not allow_missing_eod and scan["ends_eos"] < docs:
        if scan["last_count"] == docs and docs > 1:
            why = (
                f"every one of its {docs} documents ends with id {scan['last_id']}, not with "
                f"data.tokenizer's EOS {eos} (another tokenizer's end-of-document?)"
            )
        else:
            why = f"{docs - scan['ends_eos']} of its {docs} documents do not end with EOS {eos}"
        raise UsageError(
            f"shard {prefix} has no fingerprint and {why}: {other}, or without EOS; {fix}, or, "
            "for shards of this tokenizer written without end-of-document tokens (Megatron-LM's "
            "preprocess_data.py without --append-eod), set data.allow_missing_eod=true"
        )


def run_prefixes(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(the prefixes a run trains on, those it validates on): data.train and every phase's own."""
    train = list(parse_prefixes(cfg.data.train)[0]) if cfg.data.train else []
    for ph in cfg.phases:
        if ph.data is not None and ph.data.train:
            train += [p for p in parse_prefixes(ph.data.train)[0] if p not in train]
    valid = list(parse_prefixes(cfg.data.valid)[0]) if cfg.data.valid else []
    return train, valid


def check_run_shards(
    cfg: RunConfig, tokenizer: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """Every shard a run reads checked against data.tokenizer (one line for the first that does
    not fit); -> (the run's shards record (`shards_record`), None for mock data; what the scans
    of shards without a fingerprint inferred, a line each)."""
    if cfg.data.mock or tokenizer is None:
        return None, []
    path, cache, eod = str(cfg.data.tokenizer), cfg.data.cache_dir, cfg.data.allow_missing_eod
    train, valid = run_prefixes(cfg)
    notes: list[str] = []
    rules = {
        p: check_shard(p, tokenizer, path, cache, eod, notes) for p in dict.fromkeys(train + valid)
    }
    return shards_record(train, rules, tokenizer), notes


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
