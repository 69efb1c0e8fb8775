"""The transformer layer as a few lines of plain torch, which torch.compile fuses.

`PlainTransformerLayer` is megatron-core's TransformerLayer (same submodules, so the same
parameter names, checkpoints, initialisation and sharded state) whose forward, where a layer runs
whole on one rank (tensor and context parallel size 1) and trains without dropout, is written out
below instead of going through megatron's general one: RMSNorm, the QKV projection split per KV
group as megatron splits it, RoPE, the core attention module of the layer spec (SDPA, Flex or
varlen; called between the two compiled halves, since each brings its own kernel), the output
projection and residual, RMSNorm, SwiGLU and the second residual. Eager, it computes what
megatron computes; compiled (`LayerKernels(compiled=True)`, the kernel plan's choice on CUDA),
each half is a handful of fused kernels around the GEMMs, where megatron's layer launches dozens
of small ones (and does not compile: its linear layers warn on every call, a graph break inside
a context manager).

`PlainTransformerBlock` goes one step further where the kernel plan allows it (`plain_stack`: no
per-layer recompute, and a core attention that is a pure function: SDPA or varlen): the whole
layer stack, attention included, plus the final norm, is one function of the hidden states and
every layer's weights, so compiled it is one graph forward and one backward, where per-layer
halves cost four compiled calls per layer and step, each with its host-side overhead. Where a
gradient reduce overlaps the backward (data parallelism), the stack runs as a few consecutive
chunks of layers (`stack_chunks`), one graph each: a chunk's backward yields its layers'
gradients together, so their buckets are reduced while the earlier chunks' backward runs
(`gradient_groups` tells the data-parallel wrapper which parameters arrive together). Before a
chunk runs, the forward pre-hooks of the modules it stands for run, as their own forwards would
have run them: megatron's DDP waits there for the overlapped parameter all-gather.

Anything else (TP or CP > 1, packed THD batches for Transformer Engine or its stand-in, dropout,
selective recompute, inference) runs megatron's own forward, unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor


def _rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's unfused RoPE (_apply_rotary_pos_emb_bshd, not interleaved): the first
    freqs.shape[-1] channels rotated, the rest passed through."""
    rot = freqs.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    first, second = torch.chunk(t, 2, dim=-1)
    t = (t * cos) + (torch.cat((-second, first), dim=-1) * sin)
    return torch.cat((t, rest), dim=-1)


def _before_attention(
    hidden, norm, eps, qkv, groups, per_group, head_dim, q_norm, k_norm, qk_eps, q_freqs, k_freqs
):
    """RMSNorm, QKV projection, the split into [s, b, heads, d] query and [s, b, groups, d]
    key/value (per KV group: its query heads, then its key, then its value), q/k norms, RoPE.
    Weights come as tensors (not the layer) so that one compiled graph serves every layer."""
    mixed = F.linear(F.rms_norm(hidden, norm.shape, norm, eps), qkv)
    mixed = mixed.view(*mixed.shape[:-1], groups, (per_group + 2) * head_dim)
    query, key, value = torch.split(mixed, [per_group * head_dim, head_dim, head_dim], dim=3)
    query = query.reshape(query.size(0), query.size(1), -1, head_dim)
    if q_norm is not None:
        query = F.rms_norm(query, q_norm.shape, q_norm, qk_eps)
        key = F.rms_norm(key, k_norm.shape, k_norm, qk_eps)
    if q_freqs is not None:
        query, key = _rope(query, q_freqs), _rope(key, k_freqs)
    return query, key, value


def _after_attention(residual, context, proj, norm, eps, fc1, fc2):
    """Output projection and residual, RMSNorm, SwiGLU MLP and residual."""
    hidden = residual + F.linear(context, proj)
    gate, up = torch.chunk(F.linear(F.rms_norm(hidden, norm.shape, norm, eps), fc1), 2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, fc2)


class LayerWeights(NamedTuple):
    """One plain layer's weights and shape constants, as the functions above take them."""

    norm: torch.Tensor
    eps: float
    qkv: torch.Tensor
    groups: int
    per_group: int
    head_dim: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float | None
    proj: torch.Tensor
    post_norm: torch.Tensor
    post_eps: float
    fc1: torch.Tensor
    fc2: torch.Tensor


def _stack(hidden, layers, final_norm, final_eps, q_freqs, k_freqs, attend, attend_args):
    """Every layer (LayerWeights each) in turn, then the final RMSNorm (if this stage has it):
    the layer forward below, with the core attention `attend(query, key, value, *attend_args)`
    (model/attention.py's as_function) inside."""
    for w in layers:
        query, key, value = _before_attention(
            hidden, w.norm, w.eps, w.qkv, w.groups, w.per_group, w.head_dim,
            w.q_norm, w.k_norm, w.qk_eps, q_freqs, k_freqs,
        )  # fmt: skip
        context = attend(query, key, value, *attend_args)
        hidden = _after_attention(
            hidden, context, w.proj, w.post_norm, w.post_eps, w.fc1, w.fc2
        )  # fmt: skip
    if final_norm is not None:
        hidden = F.rms_norm(hidden, final_norm.shape, final_norm, final_eps)
    return hidden


class LayerKernels:
    """The two halves of a plain layer and the whole stack, eager or compiled; shared by all
    layers of a model (one compiled graph serves them all: their weights are inputs)."""

    def __init__(self, compiled: bool = False, stack: bool = False, stack_chunks: int = 1):
        self.compiled = compiled
        self.stack_on = stack  # the kernel plan's plain_stack: PlainTransformerBlock may stack
        self.stack_chunks = stack_chunks  # the kernel plan's: consecutive chunks of layers
        wrap = torch.compile if compiled else (lambda f: f)
        self.before_attention = wrap(_before_attention)
        self.after_attention = wrap(_after_attention)
        self.stack = wrap(_stack)


EAGER = LayerKernels(compiled=False)


class PlainTransformerLayer(TransformerLayer):
    """TransformerLayer with the plain forward above where it applies (`plain`)."""

    def __init__(self, *args, kernels: LayerKernels | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernels = kernels or EAGER
        c, attention = self.config, self.self_attention
        self.head_dim = c.kv_channels
        q_norm, k_norm = self.qk_norms
        norms = [self.input_layernorm, self.pre_mlp_layernorm]
        if q_norm is not None:
            norms += [q_norm, k_norm]
        linears = [attention.linear_qkv, attention.linear_proj, self.mlp.linear_fc1]
        linears.append(self.mlp.linear_fc2)
        self.plain = (
            c.tensor_model_parallel_size == 1
            and c.context_parallel_size == 1
            and not c.sequence_parallel
            and c.hidden_dropout == 0.0
            and c.attention_dropout == 0.0
            and c.gated_linear_unit
            and c.activation_func is F.silu
            and c.recompute_granularity != "selective"
            and not c.attention_output_gate
            and not c.rotary_interleaved
            and not c.apply_residual_connection_post_layernorm
            and all(isinstance(n, torch.nn.RMSNorm) for n in norms)
            and all(getattr(m, "bias", None) is None for m in linears)
        )

    @property
    def qk_norms(self) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
        """The attention's q/k norms (Qwen3), or None where the spec has none (megatron's
        IdentityOp). Read through the attention module, never registered twice."""
        attention = self.self_attention
        return tuple(  # type: ignore[return-value]
            None if isinstance(n, IdentityOp) else n
            for n in (attention.q_layernorm, attention.k_layernorm)
        )

    def forward(self, *args, **kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        packed = kwargs.get("packed_seq_params")
        if (
            not self.plain
            or len(args) > 1
            or kwargs.get("context") is not None
            or kwargs.get("inference_context") is not None
            or kwargs.get("attention_bias") is not None
            or kwargs.get("rotary_pos_cos") is not None
            or (packed is not None and packed.qkv_format == "thd")
        ):
            return super().forward(*args, **kwargs)
        freqs = kwargs.get("rotary_pos_emb")
        q_freqs, k_freqs = freqs if isinstance(freqs, tuple) else (freqs, freqs)
        w = self.weights()
        query, key, value = self.kernels.before_attention(
            hidden, w.norm, w.eps, w.qkv, w.groups, w.per_group, w.head_dim,
            w.q_norm, w.k_norm, w.qk_eps, q_freqs, k_freqs,
        )  # fmt: skip
        attention = self.self_attention
        context = attention.core_attention(
            query,
            key,
            value,
            kwargs.get("attention_mask"),
            attn_mask_type=attention.attn_mask_type,
            attention_bias=None,
            packed_seq_params=packed,
        )
        out = self.kernels.after_attention(
            hidden, context, w.proj, w.post_norm, w.post_eps, w.fc1, w.fc2
        )
        return out, kwargs.get("context")

    def weights(self) -> LayerWeights:
        """The layer's weights as the plain functions take them. Built once and kept: gathering
        them goes through a dozen module attribute look-ups, host time at the start of every
        forward (0.35 ms for 12 layers on a slow host core). Rebuilt where a weight was replaced
        (a parameter registered anew, as load_state_dict(assign=True) does)."""
        cached = self.__dict__.get("_weights")
        if cached is not None and all(slots[name] is w for slots, name, w in cached[1]):
            return cached[0]
        weights = self._gather_weights()
        held = {id(w) for w in weights if isinstance(w, torch.Tensor)}
        slots = [
            (module._parameters, name, w)
            for module in self.modules()
            for name, w in module._parameters.items()
            if id(w) in held
        ]
        self.__dict__["_weights"] = (weights, slots)
        return weights

    def _gather_weights(self) -> LayerWeights:
        attention, mlp = self.self_attention, self.mlp
        norm, post, (q_norm, k_norm) = self.input_layernorm, self.pre_mlp_layernorm, self.qk_norms
        groups = attention.num_query_groups_per_partition
        return LayerWeights(
            norm=norm.weight,
            eps=norm.eps,
            qkv=attention.linear_qkv.weight,
            groups=groups,
            per_group=attention.num_attention_heads_per_partition // groups,
            head_dim=self.head_dim,
            q_norm=None if q_norm is None else q_norm.weight,
            k_norm=None if k_norm is None else k_norm.weight,
            qk_eps=None if q_norm is None else q_norm.eps,
            proj=attention.linear_proj.weight,
            post_norm=post.weight,
            post_eps=post.eps,
            fc1=mlp.linear_fc1.weight,
            fc2=mlp.linear_fc2.weight,
        )


class PlainTransformerBlock(TransformerBlock):
    """megatron's TransformerBlock whose plain layers run as one stack, or a few chunks of it (see
    above), where the kernel plan says so (`LayerKernels.stack_on`, `stack_chunks`) and the call
    allows it; anything else runs megatron's block forward, layer by layer. No state of its own:
    EncoderLM builds it where the kernel plan's block spec names it (model/build.py,
    decoder_spec), as GPTModel builds megatron's block."""

    def chunks(self) -> list[list[torch.nn.Module]]:
        """The layers in consecutive chunks of equal size (the last one shorter), the final norm
        with the last: one compiled graph per chunk size."""
        layers = list(self.layers)
        kernels = layers[0].kernels if layers else None
        wanted = kernels.stack_chunks if kernels is not None and kernels.stack_on else 1
        size = max(1, -(-len(layers) // max(1, wanted)))
        out = [layers[i : i + size] for i in range(0, len(layers), size)] or [[]]
        if self.final_layernorm is not None:
            out[-1] = [*out[-1], self.final_layernorm]
        return out

    def gradient_groups(self) -> list[list[torch.nn.Parameter]]:
        """The parameters whose gradients the stack's backward yields together, chunk by chunk
        (the data-parallel wrapper moves and reduces each group as it completes)."""
        return [[p for m in chunk for p in m.parameters()] for chunk in self.chunks()]

    def forward(self, *args, **kwargs):
        layers = self.layers
        packed = kwargs.get("packed_seq_params")
        kernels = layers[0].kernels if len(layers) else None
        if (
            kernels is None
            or not kernels.stack_on
            or args
            or not all(isinstance(layer, PlainTransformerLayer) and layer.plain for layer in layers)
            or (self.config.recompute_granularity == "full" and self.training)
            or self.config.fp8
            or self.config.fp4
            or self.config.cpu_offloading
            or any(
                kwargs.get(name) is not None
                for name in (
                    "context",
                    "inference_context",
                    "inference_params",
                    "attention_bias",
                    "rotary_pos_cos",
                )
            )
            or (packed is not None and packed.qkv_format == "thd")
        ):
            return super().forward(*args, **kwargs)
        first = layers[0].self_attention
        attend = first.core_attention.as_function(
            kwargs.get("attention_mask"), first.attn_mask_type, packed
        )
        if attend is None:  # a core with state between layers (Flex): layer by layer
            return super().forward(*args, **kwargs)
        hidden = kwargs["hidden_states"] if self.pre_process else self.input_tensor
        hidden = make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True)
        if kernels.compiled:
            function, arguments = attend
            for i in getattr(function, "varying_length_args", ()):
                torch._dynamo.maybe_mark_dynamic(arguments[i], 0)
        freqs = kwargs.get("rotary_pos_emb")
        q_freqs, k_freqs = freqs if isinstance(freqs, tuple) else (freqs, freqs)
        final = self.final_layernorm
        for chunk in self.chunks():
            _run_forward_pre_hooks(chunk)
            last = chunk[-1] is final
            hidden = kernels.stack(
                hidden,
                [layer.weights() for layer in (chunk[:-1] if last else chunk)],
                final.weight if last else None,
                final.eps if last else None,
                q_freqs,
                k_freqs,
                *attend,
            )
        return make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True)


def _run_forward_pre_hooks(modules: list[torch.nn.Module]) -> None:
    """The forward pre-hooks of every module in `modules` (and below), in forward order, as the
    modules' own forwards would run them: the stack calls their weights directly. megatron's
    DDP registers its wait for the overlapped parameter all-gather there; without that hook
    nothing is registered and this is a loop over empty dicts."""
    for top in modules:
        for module in top.modules():
            for hook in list(module._forward_pre_hooks.values()):
                hook(module, ())
