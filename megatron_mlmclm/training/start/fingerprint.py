"""The data fingerprint: everything that decides which tokens and masks step k of a run trains on,
keyed by config key, stored in every checkpoint.

Sample i of the packed stream is fixed by the data shards, model.seq_length and data.seed (it does
not depend on the run length); its MLM mask by (data.seed, i), the tokenizer's special ids and the
phase that trains on it. A resume (resume.py) and a branch (branch.py) compare the fingerprint of
their checkpoint with the run's, and a run's history (history.py) keeps one per segment. Shards
compare by content (their .idx's size and sha256) and weight, not by path: moved or staged data
resumes.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from megatron_mlmclm.config import PhaseConfig, RunConfig, phase_rotary_base, phase_seq_length
from megatron_mlmclm.data.dataset import parse_prefixes
from megatron_mlmclm.data.sample_index import SAMPLE_ORDER
from megatron_mlmclm.data.tokenizer import TokenSpec
from megatron_mlmclm.errors import UsageError


def shard_list(items: list[str]) -> list[dict[str, Any]]:
    """Each prefix of a data list with its normalised blend weight and its .idx size and sha256."""
    prefixes, weights = parse_prefixes(items)
    total = sum(weights) if weights else 0.0  # unused without weights
    out = []
    for k, prefix in enumerate(prefixes):
        idx = prefix + ".idx"
        if not os.path.isfile(idx):
            raise UsageError(
                f"{idx} does not exist; check the data prefix (give it without "
                f".bin/.idx) or write the shard with `mlmclm preprocess`"
            )
        digest = hashlib.sha256()
        with open(idx, "rb") as f:  # document lengths and offsets: small next to the .bin
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out.append(
            {
                "prefix": prefix,
                "weight": weights[k] / total if weights else None,
                "idx_bytes": os.path.getsize(idx),
                "idx_sha256": digest.hexdigest(),
            }
        )
    return out


def fingerprint(cfg: RunConfig, spec: TokenSpec) -> dict[str, Any]:
    """Everything that decides which tokens and masks step k trains on, keyed by config key."""
    d = cfg.data
    if d.mock:
        kind = "" if d.mock_kind == "uniform" else f"{d.mock_kind} "  # uniform: as before kinds
        lengths = "" if d.mock_doc_length == "short" else f"{d.mock_doc_length}-length "
        train = valid = f"mock {kind}{lengths}(vocab {spec.vocab_size})"
    else:
        train, valid = shard_list(d.train), shard_list(d.valid) if d.valid else []
    phases, start = [], 0
    for ph in cfg.phases:
        if ph.steps:  # a phase of no steps trains nothing
            end = start + ph.steps
            phases.append(phase_description(cfg, ph, start, end))
            start = end
    fp = {
        "data.train": train,
        "data.valid": valid,
        "data.seed": d.seed,
        "data.tokenizer": f"mask {spec.mask_id}, specials {list(spec.special_ids)}",
        "model.seq_length": cfg.model.seq_length,
        "train.global_batch_size": cfg.train.global_batch_size,
        "phases": "[" + ", ".join(phases) + "]",
    }
    if not d.mock:  # synthetic samples are a function of their index, whatever the order rule
        fp[ORDER_KEY] = SAMPLE_ORDER
    return fp


ORDER_KEY = "data.sample_order"


def phase_description(cfg: RunConfig, ph: PhaseConfig, start: int, end: int) -> str:
    """What decides a phase's tokens and masks. Settings a phase inherits unchanged add nothing,
    so a run written before phases could change them keeps its fingerprint."""
    text = f"{ph.objective} steps {start}-{end}"
    if ph.objective == "mlm":
        text += f" (mask_ratio {ph.mask_ratio_text()}, mask_replace {ph.mask_replace})"
    if phase_seq_length(cfg, ph) != cfg.model.seq_length:
        text += f" seq_length {phase_seq_length(cfg, ph)}"
    if phase_rotary_base(cfg, ph) != cfg.model.rotary_base:
        text += f" rotary_base {phase_rotary_base(cfg, ph):g}"
    if ph.data is not None:
        text += (
            f" data temperature {ph.data.temperature:g} over data.train"
            if ph.data.temperature is not None
            else " data " + show_value(shard_list(ph.data.train))
        )
    return text


PHASE_START = re.compile(r", (?=(?:clm|mlm) steps \d+-\d+)")


def first_changed_phase(saved: str, now: str) -> int | None:
    """The index of the first phase whose description differs between two fingerprints."""
    a, b = (PHASE_START.split(x.strip("[]")) for x in (saved, now))
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i] != b[i]:
            return i
    return None


def same_value(a, b) -> bool:
    """Shards compare by content and weight, not by path: moved or staged data resumes."""
    if isinstance(a, list) and isinstance(b, list):
        return [_content(e) for e in a] == [_content(e) for e in b]
    return a == b


def _content(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "prefix"}


def show_value(value) -> str:
    if isinstance(value, list):
        return (
            "["
            + ", ".join(
                f"{e['prefix']} (idx {e['idx_bytes']} B, sha256 {e['idx_sha256'][:12]})"
                for e in value
            )
            + "]"
        )
    return str(value)
