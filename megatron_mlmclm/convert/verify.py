"""Self-verification: every conversion reloads what it wrote and compares logits with its source.

Both sides run in float32 on one fixed batch (2 x 64 random token ids from a seeded generator, no
padding) with the same attention kind: bidirectional for encoder exports, causal for `--causal-lm`
and for decoders imported from Hugging Face. The megatron side is the trainer's EncoderLM built at
TP1 in this process and loaded from disk with the trainer's own `load_checkpoint` (which also
proves that the checkpoint reshards). The Hugging Face side is transformers' own model and forward,
its weights read from disk a module at a time (`streamed_hf_logits`), so that a conversion holds
one copy of the model, ours. A max |logit difference| above `TOLERANCE` (or a non-finite logit)
fails the conversion.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers.utils import logging as hf_logging

from megatron_mlmclm.convert.common import build_encoder, load_into
from megatron_mlmclm.convert.hf_files import HFWeights
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


def quiet_transformers() -> None:
    """No progress bars or info chatter from transformers during a conversion."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def streamed_hf_logits(
    folder: Path,
    auto_class: str,
    tokens: torch.Tensor,
    weights: HFWeights | None = None,
    stats: dict[str, int] | None = None,
) -> tuple[torch.Tensor, str]:
    """(logits, class name) of a local HF model run by plain transformers in float32 with SDPA,
    whose weights are read from disk as each of its modules runs and released after it: the
    embedding, each layer, the final norm and the head in turn, never the whole model at once.

    The model is built on the meta device (no memory), its rotary embeddings computed on the CPU;
    each module with weights (a layer, or one of the others) loads them in a forward pre-hook and
    puts meta tensors back in a forward hook. transformers' own forward runs unchanged. `stats`
    gets the most weight bytes held at once (`peak`) and those read in all (`loaded`)."""
    cls = getattr(transformers, auto_class)
    quiet_transformers()
    weights = weights if weights is not None else HFWeights(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.from_pretrained(
            str(folder), local_files_only=True, **NO_CODE
        )
        with torch.device("meta"):
            model = cls.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    _buffers_on_cpu(model)
    loader = _StreamedWeights(weights, bool(getattr(config, "tie_word_embeddings", False)))
    for prefix, unit in _units(model):
        unit.register_forward_pre_hook(loader.loader(prefix))
        unit.register_forward_hook(loader.releaser(prefix))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = model.eval()(input_ids=tokens).logits.float()
    if stats is not None:
        stats.update(peak=loader.peak, loaded=loader.loaded)
    return logits, type(model).__name__


def _units(model) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose weights are loaded together: each element of a ModuleList (a layer),
    and every other module that holds weights itself (embedding, norm, head), outermost first."""
    units: list[tuple[str, torch.nn.Module]] = []
    taken: list[str] = []
    for name, mod in model.named_modules():
        if any(name.startswith(t) for t in taken):
            continue
        if isinstance(mod, torch.nn.ModuleList):
            units += [(f"{name}.{i}", child) for i, child in enumerate(mod)]
            taken.append(f"{name}.")
        elif next(mod.parameters(recurse=False), None) is not None:
            units.append((name, mod))
            taken.append(f"{name}.")
    return units


def _buffers_on_cpu(model) -> None:
    """Modules built on the meta device whose buffers are computed, not loaded (the rotary
    embeddings' inverse frequencies): built again on the CPU."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if next(mod.parameters(recurse=False), None) is not None or not hasattr(mod, "config"):
                raise VerificationError(f"cannot rebuild {name} ({type(mod).__name__}) off meta")
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, type(mod)(config=mod.config))


class _StreamedWeights:
    """Puts a module's weights in before it runs and takes them out after; counts the bytes held
    (`peak`, `loaded`: what tests of the streaming read)."""

    def __init__(self, weights: HFWeights, tied: bool):
        self.weights, self.tied = weights, tied
        self.held = self.peak = self.loaded = 0

    def _key(self, name: str) -> str:
        if name not in self.weights and name == "lm_head.weight" and self.tied:
            return "model.embed_tokens.weight"
        if name not in self.weights:
            raise VerificationError(f"verification failed: the weights have no {name}")
        return name

    @staticmethod
    def _slots(unit: torch.nn.Module):
        for pname, p in list(unit.named_parameters()):
            owner, _, leaf = pname.rpartition(".")
            yield pname, (unit.get_submodule(owner) if owner else unit), leaf, p

    def loader(self, prefix: str):
        def load(unit, args):
            for pname, owner, leaf, p in self._slots(unit):
                t = self.weights.get(self._key(f"{prefix}.{pname}")).float()
                if tuple(t.shape) != tuple(p.shape):
                    raise VerificationError(
                        f"verification failed: {prefix}.{pname} has shape {tuple(t.shape)}, "
                        f"the model {tuple(p.shape)}"
                    )
                setattr(owner, leaf, torch.nn.Parameter(t, requires_grad=False))
                self.held += t.nbytes
                self.loaded += t.nbytes
            self.peak = max(self.peak, self.held)

        return load

    def releaser(self, prefix: str):
        def release(unit, args, output):
            for _, owner, leaf, p in self._slots(unit):
                self.held -= p.nbytes
                meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                setattr(owner, leaf, torch.nn.Parameter(meta, requires_grad=False))

        return release


def megatron_from_checkpoint(ckpt: Path, cfg, vocab_size: int):
    """EncoderLM at TP1 loaded from a dist checkpoint through the trainer's load_checkpoint."""
    model = build_encoder(cfg, vocab_size)
    load_into(model, Path(ckpt))
    return model
