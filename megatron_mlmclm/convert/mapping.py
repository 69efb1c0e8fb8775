"""Declarative megatron <-> Hugging Face mappings, one table per model family, used both ways.

A table is a tuple of `Rule`s. Each rule names one megatron dist-checkpoint key (global tensor;
keys under ``decoder.layers.`` are stacked over layers on dim 0), the Hugging Face key(s) it
corresponds to (``{i}`` = layer index) and the transform between them:

  copy     the same tensor
  qkv      megatron's fused ``linear_qkv`` holds, per KV group, that group's query heads, then its
           key head, then its value head  <->  q_proj, k_proj, v_proj
  gate_up  megatron's ``linear_fc1`` = [gate; up] (SwiGLU)  <->  gate_proj, up_proj
  vocab    megatron pads the vocabulary to a multiple of 128: trimmed on export, zero-padded on
           import

`when` makes a rule conditional: ``untied`` (output layer only with untied embeddings), ``qk_norm``.
RoPE needs no permutation (megatron and HF both rotate halves). A config table maps HF config fields
to ModelConfig fields in the same way (`CONFIG_FIELDS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_mlmclm.errors import UsageError


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    op: str = "copy"  # copy | qkv | gate_up | vocab
    when: str | None = None  # None | "untied" | "qk_norm"

    @property
    def per_layer(self) -> bool:
        return self.megatron.startswith("decoder.layers.")


@dataclass(frozen=True)
class Dims:
    """What the transforms need: heads, KV groups, head dim, vocab (real and padded)."""

    num_layers: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int  # real (unpadded) rows
    padded_vocab_size: int
    tied: bool
    qk_norm: bool


L = "model.layers.{i}."

# The decoder trunk shared by all three families (they use the same HF module names).
_EMBED = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
_ATTN = (
    Rule(
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        (L + "input_layernorm.weight",),
    ),
    Rule(
        "decoder.layers.self_attention.linear_qkv.weight",
        (
            L + "self_attn.q_proj.weight",
            L + "self_attn.k_proj.weight",
            L + "self_attn.v_proj.weight",
        ),
        "qkv",
    ),
    Rule("decoder.layers.self_attention.linear_proj.weight", (L + "self_attn.o_proj.weight",)),
)
_QK_NORM = (
    Rule(
        "decoder.layers.self_attention.q_layernorm.weight",
        (L + "self_attn.q_norm.weight",),
        when="qk_norm",
    ),
    Rule(
        "decoder.layers.self_attention.k_layernorm.weight",
        (L + "self_attn.k_norm.weight",),
        when="qk_norm",
    ),
)
_MLP = (
    Rule(
        "decoder.layers.mlp.linear_fc1.layer_norm_weight", (L + "post_attention_layernorm.weight",)
    ),
    Rule(
        "decoder.layers.mlp.linear_fc1.weight",
        (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"),
        "gate_up",
    ),
    Rule("decoder.layers.mlp.linear_fc2.weight", (L + "mlp.down_proj.weight",)),
)
_HEAD = (
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", when="untied"),
)

# One table per family.
EUROBERT = (_EMBED, *_ATTN, *_MLP, *_HEAD)
LLAMA = (_EMBED, *_ATTN, *_MLP, *_HEAD)
MISTRAL = LLAMA  # Mistral without sliding window is Llama
QWEN3 = (_EMBED, *_ATTN, *_QK_NORM, *_MLP, *_HEAD)

TABLES: dict[str, tuple[Rule, ...]] = {
    "eurobert": EUROBERT,
    "llama": LLAMA,
    "mistral": MISTRAL,
    "qwen3": QWEN3,
}

# HF config field <-> ModelConfig field (all families; rope theta and vocab are handled apart).
CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("hidden_size", "hidden_size"),
    ("intermediate_size", "ffn_hidden_size"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_query_groups"),
    ("head_dim", "kv_channels"),
    ("rms_norm_eps", "norm_epsilon"),
    ("initializer_range", "init_method_std"),
    ("tie_word_embeddings", "tie_embeddings"),
)


def active_rules(family: str, dims: Dims) -> list[Rule]:
    if family not in TABLES:
        raise UsageError(f"no mapping for model family '{family}'; supported: {', '.join(TABLES)}")
    rules = []
    for r in TABLES[family]:
        if r.when == "untied" and dims.tied:
            continue
        if r.when == "qk_norm" and not dims.qk_norm:
            continue
        rules.append(r)
    return rules


# --------------------------------------------------------------------------------------------------
# Transforms (each has an inverse)


def _split(op: str, t: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    """megatron tensor (one layer) -> HF tensors."""
    if op == "copy":
        return [t]
    if op == "vocab":
        return [t[: d.vocab_size]]
    if op == "gate_up":
        gate, up = t.chunk(2, dim=0)
        return [gate, up]
    if op == "qkv":
        per = d.num_heads // d.num_groups
        hidden = t.shape[-1]
        g = t.reshape(d.num_groups, per + 2, d.head_dim, hidden)
        q = g[:, :per].reshape(d.num_heads * d.head_dim, hidden)
        k = g[:, per].reshape(d.num_groups * d.head_dim, hidden)
        v = g[:, per + 1].reshape(d.num_groups * d.head_dim, hidden)
        return [q, k, v]
    raise ValueError(op)


def _join(op: str, ts: list[torch.Tensor], d: Dims) -> torch.Tensor:
    """HF tensors -> megatron tensor (one layer)."""
    if op == "copy":
        return ts[0]
    if op == "vocab":
        t = ts[0]
        if t.shape[0] > d.padded_vocab_size:
            raise UsageError(
                f"vocabulary of {t.shape[0]} rows exceeds the padded size {d.padded_vocab_size}"
            )
        pad = t.new_zeros(d.padded_vocab_size - t.shape[0], *t.shape[1:])
        return torch.cat([t, pad], dim=0)
    if op == "gate_up":
        return torch.cat(ts, dim=0)
    if op == "qkv":
        q, k, v = ts
        per = d.num_heads // d.num_groups
        hidden = q.shape[-1]
        q = q.reshape(d.num_groups, per, d.head_dim, hidden)
        k = k.reshape(d.num_groups, 1, d.head_dim, hidden)
        v = v.reshape(d.num_groups, 1, d.head_dim, hidden)
        return torch.cat([q, k, v], dim=1).reshape(-1, hidden)
    raise ValueError(op)


def _layers(r: Rule, d: Dims) -> list[int | None]:
    return list(range(d.num_layers)) if r.per_layer else [None]


def iter_megatron_to_hf(
    get: Callable[[str, int | None], torch.Tensor], family: str, d: Dims
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) one at a time from megatron tensors, `get(key, layer)` giving one layer
    of a global tensor (layer None: a tensor outside the layers). The tensors are contiguous copies
    where the transform cuts (qkv, gate_up, vocab), else `get`'s own."""
    for r in active_rules(family, d):
        for i in _layers(r, d):
            for name, t in zip(r.hf, _split(r.op, get(r.megatron, i), d)):
                yield name.format(i=i), t.contiguous()


def missing_hf_keys(keys, family: str, d: Dims) -> list[str]:
    """The HF tensors the family's rules need that `keys` lacks."""
    have = set(keys)
    return [
        n.format(i=i)
        for r in active_rules(family, d)
        for i in _layers(r, d)
        for n in r.hf
        if n.format(i=i) not in have
    ]


def iter_hf_to_megatron(
    get: Callable[[str], torch.Tensor], family: str, d: Dims, pad_vocab: bool = True
) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """(megatron key, layer or None, tensor) one layer at a time, from HF tensors read by `get`
    as each is needed (check `missing_hf_keys` first). Without `pad_vocab`, a vocabulary tensor
    comes with its own rows (its receiver pads it: no padded copy is made)."""
    for r in active_rules(family, d):
        for i in _layers(r, d):
            ts = [get(n.format(i=i)) for n in r.hf]
            if r.op == "vocab" and not pad_vocab:
                if ts[0].shape[0] > d.padded_vocab_size:
                    raise UsageError(
                        f"vocabulary of {ts[0].shape[0]} rows exceeds the padded size "
                        f"{d.padded_vocab_size}"
                    )
                yield r.megatron, i, ts[0]
            else:
                yield r.megatron, i, _join(r.op, ts, d)


def vocab_keys(family: str, d: Dims) -> frozenset[str]:
    """The megatron keys whose rows are the vocabulary (padded by megatron)."""
    return frozenset(r.megatron for r in active_rules(family, d) if r.op == "vocab")


def unused_hf_keys(state: Iterable[str], family: str, d: Dims) -> list[str]:
    """HF tensors no rule consumes (rotary buffers excluded): a sign of an unsupported feature."""
    used = set()
    for r in active_rules(family, d):
        layers = range(d.num_layers) if r.per_layer else [None]
        used |= {n.format(i=i) for n in r.hf for i in layers}
    if d.tied:
        used.add("lm_head.weight")
    return sorted(k for k in state if k not in used and not k.endswith("rotary_emb.inv_freq"))
