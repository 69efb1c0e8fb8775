"""Self-verification: every conversion reloads what it wrote and compares logits with its source.

Both sides run in float32 on one fixed batch (2 x 64 random token ids from a seeded generator, no
padding) with the same attention kind: bidirectional for encoder exports, causal for `--causal-lm`
and for decoders imported from Hugging Face, whatever dtype the weights are stored in. The megatron
side is the trainer's EncoderLM built at TP1 in this process, its weights held in the dtype they
are stored in, and loaded from disk with the trainer's own `load_checkpoint` (which also proves
that the checkpoint reshards); its forward casts one layer's weights at a time to float32
(`megatron_logits`). The Hugging Face side is transformers' own model and forward, its weights
read from disk a module at a time (`streamed_hf_logits`), so that a conversion holds one copy of
the model, ours, in its saved dtype. A max |logit difference| above `TOLERANCE` (or a non-finite
logit) fails the conversion.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers.utils import logging as hf_logging

from megatron_mlmclm.convert.common import build_encoder, load_into, stored_dtypes
from megatron_mlmclm.convert.hf_files import HFWeights
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.hf_folder import NO_CODE
from megatron_mlmclm.objectives import document_attention_mask

TOLERANCE = 1e-4
BATCH = 2
SEQ = 64
HEAD_BLOCK = 1 << 25  # bytes of the output layer's weight cast to float32 at a time


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
    """EncoderLM at TP1 loaded from a dist checkpoint through the trainer's load_checkpoint, each
    weight held in the dtype the checkpoint stores it in."""
    model = build_encoder(cfg, vocab_size, stored=stored_dtypes(Path(ckpt)))
    load_into(model, Path(ckpt))
    return model


def megatron_logits(model, tokens: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, s] tokens -> [b, s, padded vocab] float32 logits of our TP1 model on the CPU,
    bidirectional or causal, computed in float32 whatever dtype its weights are held in, with
    one layer's weights at most in float32 beside them (`_float32_layers`). megatron's forward
    runs unchanged up to the final norm; the output layer's product (at TP1 without bias, what
    megatron's ColumnParallelLinear computes) is taken a block of vocabulary rows at a time,
    each block cast to float32."""
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = document_attention_mask(torch.zeros(b, s, dtype=torch.long), causal)
    with torch.no_grad(), _float32_layers(model):
        hidden = model(tokens, positions, mask).transpose(0, 1)  # [s, b, h] -> [b, s, h]
    weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )
    logits = torch.empty(b, s, weight.shape[0], dtype=torch.float32)
    rows = max(1, HEAD_BLOCK // (4 * weight.shape[1]))
    with torch.no_grad():
        for start in range(0, weight.shape[0], rows):
            block = weight[start : start + rows].float()
            logits[..., start : start + block.shape[0]] = F.linear(hidden, block)
    return logits


@contextlib.contextmanager
def _float32_layers(model) -> Iterator[None]:
    """Within: the model's forward computes in float32 and returns the final norm's output, its
    weights kept in the dtype they are held in. Each layer (and the final norm) has its weights
    cast to float32 as it runs, by a forward pre-hook, and given back after, by a forward hook
    (the originals kept: nothing is rounded); the embedding's rows are looked up as held and
    cast (exactly their float32 values: no float32 copy of the embedding); the head is left to
    the caller (`post_process` off: what a pipeline stage without the head returns)."""
    held: dict[torch.nn.Parameter, torch.Tensor] = {}

    def to_float32(unit, args):
        for p in unit.parameters():
            held[p] = p.data
            p.data = p.data.float()

    def give_back(unit, args, output):
        for p in unit.parameters():
            p.data = held.pop(p)

    handles = []
    for _, unit in _units(model):
        if unit is model.embedding.word_embeddings:
            handles.append(unit.register_forward_hook(lambda unit, args, out: out.float()))
        elif unit is not model.output_layer:
            handles.append(unit.register_forward_pre_hook(to_float32))
            handles.append(unit.register_forward_hook(give_back))
    post_process, model.post_process = model.post_process, False
    try:
        yield
    finally:
        model.post_process = post_process
        for handle in handles:
            handle.remove()
        for p, data in held.items():  # a forward that failed inside a layer
            p.data = data
