"""Self-verification: every conversion reloads what it wrote and compares logits with its source.

Both sides run in float32 on one fixed batch (2 x 64 random token ids from a seeded generator, no
padding) with the same attention kind: bidirectional for encoder exports, causal for `--causal-lm`
and for decoders imported from Hugging Face. The megatron side is the trainer's EncoderLM built at
TP1 in this process and loaded from disk with the trainer's own `load_checkpoint` (which also
proves that the checkpoint reshards). A max |logit difference| above `TOLERANCE` (or a non-finite
logit) fails the conversion.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers.utils import logging as hf_logging

from megatron_mlmclm.checkpoint import load_checkpoint
from megatron_mlmclm.convert.common import build_encoder, megatron_logits
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.hf_folder import NO_CODE

TOLERANCE = 1e-4
BATCH = 2
SEQ = 64


class VerificationError(UsageError):
    """The written model does not reproduce its source: the output is removed, exit 2."""


@dataclass
class Verification:
    max_abs_diff: float
    batch: int
    seq: int
    attention: str  # "bidirectional" | "causal"
    against: str

    def line(self) -> str:
        return (
            f"verified: max |logit diff| = {self.max_abs_diff:.1e} on {self.batch}x{self.seq} "
            f"tokens ({self.attention}, megatron TP1 vs {self.against}, float32)"
        )


def verification_tokens(
    vocab_size: int, seq: int = SEQ, batch: int = BATCH, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def compare(
    reference: torch.Tensor, result: torch.Tensor, against: str, causal: bool
) -> Verification:
    if reference.shape != result.shape:
        raise VerificationError(
            f"verification failed: logits have shape {tuple(result.shape)}, "
            f"expected {tuple(reference.shape)}"
        )
    if not torch.isfinite(result).all() or not torch.isfinite(reference).all():
        raise VerificationError("verification failed: non-finite logits; output removed")
    diff = (reference.double() - result.double()).abs().max().item()
    v = Verification(
        diff,
        reference.shape[0],
        reference.shape[1],
        "causal" if causal else "bidirectional",
        against,
    )
    if diff > TOLERANCE:
        raise VerificationError(
            f"verification failed: max |logit diff| = {diff:.3e} > "
            f"{TOLERANCE:g} on {v.batch}x{v.seq} tokens; output removed"
        )
    return v


def load_hf(path: Path, auto_class: str):
    """A local HF model in float32 with SDPA attention (no remote code)."""
    cls = getattr(transformers, auto_class)
    quiet_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls.from_pretrained(
            str(path),
            dtype=torch.float32,
            attn_implementation="sdpa",
            local_files_only=True,
            **NO_CODE,
        )
    return model.eval()


def quiet_transformers() -> None:
    """No progress bars or info chatter from transformers during a conversion."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_from_checkpoint(ckpt: Path, cfg, vocab_size: int):
    """EncoderLM at TP1 loaded from a dist checkpoint through the trainer's load_checkpoint."""
    model = build_encoder(cfg, vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(Path(ckpt), [model], optimizer=None, scheduler=None, load_rng=False)
    return model


def verify_pair(
    megatron_model, hf_model, vocab_size: int, causal: bool, seq: int, against: str
) -> Verification:
    """Logits of both models on the fixed batch, compared over the first `vocab_size` ids."""
    tokens = verification_tokens(vocab_size, seq=seq)
    ref = megatron_logits(megatron_model, tokens, causal)[..., :vocab_size]
    got = hf_logits(hf_model, tokens)[..., :vocab_size]
    return compare(ref, got, against, causal)
