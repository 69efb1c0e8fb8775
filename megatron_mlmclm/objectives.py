"""CLM and MLM batches from packed samples: inputs, labels, loss mask, attention mask.

Both objectives read the same packed sample (seq_length + 1 tokens with per-token document ids):
- CLM: inputs tokens[:-1], labels tokens[1:], causal attention inside each document; a label that
  belongs to the next document (the token after an eos) carries no loss.
- MLM: inputs tokens[:-1] with a fraction of the non-special tokens replaced, labels at those
  positions only, bidirectional attention inside each document.

MLM masks are a pure function of (seed, global sample index): identical after a resume and under
any parallel layout, since no RNG state is involved. BERT's random replacement draws uniformly from
the non-special ids: a mask, pad or bos token never appears as a "random word".
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_mlmclm.config import PhaseConfig
from megatron_mlmclm.data.tokenizer import TokenSpec

IGNORE = -100


def document_attention_mask(document_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, s] per-token document ids -> [b, 1, s, s] bool mask, True where attention is blocked
    (megatron's convention), causal or not, never across documents."""
    same_doc = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
    if causal:
        s = document_ids.size(1)
        same_doc &= torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril_()
    return (~same_doc).unsqueeze(1)


def mlm_mask(
    tokens: np.ndarray,
    sample_index: int,
    seed: int,
    ratio: float,
    spec: TokenSpec,
    replace: str = "mask",
) -> tuple[np.ndarray, np.ndarray]:
    """Mask round(ratio * #eligible) positions of one sample. Returns (inputs, labels)."""
    rng = np.random.default_rng([seed, sample_index, 0x4D4C4D])  # MLM stream of this sample
    eligible = np.flatnonzero(~np.isin(tokens, spec.special_ids))
    n = int(round(ratio * eligible.size))
    chosen = np.sort(rng.choice(eligible, size=n, replace=False)) if n else eligible[:0]
    inputs = tokens.copy()
    labels = np.full_like(tokens, IGNORE)
    labels[chosen] = tokens[chosen]
    if replace == "mask":
        inputs[chosen] = spec.mask_id
    else:  # BERT's 80% mask / 10% random token / 10% unchanged
        u = rng.random(n)
        inputs[chosen[u < 0.8]] = spec.mask_id
        rand = chosen[(u >= 0.8) & (u < 0.9)]
        specials = np.unique([i for i in spec.special_ids if 0 <= i < spec.vocab_size])
        r = rng.integers(0, spec.vocab_size - specials.size, size=rand.size)
        inputs[rand] = regular_ids(r, specials)
    return inputs, labels


def regular_ids(r: np.ndarray, specials: np.ndarray) -> np.ndarray:
    """The r-th non-special id (0-based) of the vocabulary; `specials` sorted and unique.

    That id is r plus the number of specials below it; the j-th special s_j has s_j - j regular ids
    below it, so the count is #{j : s_j - j <= r}.
    """
    specials = np.asarray(specials, dtype=np.int64)
    return r + np.searchsorted(specials - np.arange(specials.size), r, side="right")


def batch_arrays(
    samples: list[dict], sample_indices: list[int], phase: PhaseConfig, spec: TokenSpec, seed: int
) -> dict[str, np.ndarray]:
    """The host side of a micro-batch for `phase.objective`: numpy arrays, no attention mask.

    Every row depends only on its own sample and stream position, so building a batch row by row
    (training/batches/loader.py's DALI source does) gives the same bits as building it at once.
    """
    tokens = np.stack([s["tokens"] for s in samples]).astype(np.int64)
    docs = np.stack([s["document_ids"] for s in samples])
    positions = np.stack([s["position_ids"] for s in samples]).astype(np.int64)[:, :-1]
    if phase.objective == "clm":
        inputs, labels = tokens[:, :-1], tokens[:, 1:].copy()
        loss_mask = docs[:, :-1] == docs[:, 1:]
        labels[~loss_mask] = IGNORE
    else:
        pairs = [
            mlm_mask(t[:-1], i, seed, phase.mask_ratio, spec, phase.mask_replace)
            for t, i in zip(tokens, sample_indices)
        ]
        inputs = np.stack([p[0] for p in pairs])
        labels = np.stack([p[1] for p in pairs])
        loss_mask = labels != IGNORE
    return {
        "tokens": np.ascontiguousarray(inputs),
        "labels": np.ascontiguousarray(labels),
        "loss_mask": loss_mask.astype(np.float32),
        "position_ids": np.ascontiguousarray(positions),
        "document_ids": np.ascontiguousarray(docs[:, :-1]),
    }


def make_batch(
    samples: list[dict],
    sample_indices: list[int],
    phase: PhaseConfig,
    spec: TokenSpec,
    seed: int,
    device=None,
    dense_mask: bool = True,
) -> dict[str, torch.Tensor]:
    """Stack packed samples into one micro-batch for `phase.objective`."""
    arrays = batch_arrays(samples, sample_indices, phase, spec, seed)
    return to_device({k: torch.from_numpy(v) for k, v in arrays.items()}, phase, device, dense_mask)


def to_device(
    batch: dict[str, torch.Tensor], phase: PhaseConfig, device=None, dense_mask: bool = True
) -> dict[str, torch.Tensor]:
    """A host micro-batch moved where it is used (non-blocking: loaders hand over pinned memory),
    with the dense [b, 1, s, s] document mask built there: s bytes a token against 32 for the rest
    of the batch, so it is never built on the host or copied (the packed THD path needs none)."""
    if device is not None:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if dense_mask:
        batch["attention_mask"] = document_attention_mask(
            batch["document_ids"], causal=phase.objective == "clm"
        )
    return batch
