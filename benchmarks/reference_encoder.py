"""A plain-PyTorch encoder of our model's shape: what torch alone reaches on the same work.

The contender "ref" of benchmarks/train_throughput.py. Same shape as the run's model config
(hidden, layers, heads, KV heads, head dim, FFN, vocabulary, untied input and output embeddings),
RMSNorm, RoPE, SwiGLU, attention that never crosses a document (causal inside each document for
CLM), logits only at the labelled positions (given as an index into the flattened batch),
cross-entropy, gradient clipping and torch's fused AdamW. No megatron, no parallelism.

Attention, by `attention`:
- `varlen`: torch.nn.attention.varlen.varlen_attn on the packed [tokens, heads, dim] layout with
  cu_seqlens at every document and row start (CUDA; its causal switch is `is_causal=` in some
  torch versions and `window_size=(-1, 0)` in others, found with inspect);
- `flex`: FlexAttention with a document block mask built on the device each step (CUDA);
- `sdpa`: scaled_dot_product_attention with a dense [b, 1, s, s] document mask (CPU: torch has no
  varlen kernel and no FlexAttention backward there).
RoPE positions run along the row (0..s-1): attention never crosses a document, so only positions
relative to each other inside a document matter, and these are the same as per-document ones.

`ReferenceLoop` runs the steps as a training loop that overlaps its input with the device: step
k's work is queued (forward, backward, clipping, update; nothing in them waits for the device;
the loss is copied to the host before the update is queued), then step k + 1's batch is built
on the host, pinned and copied non-blocking, then step k's loss is read, the step's one wait,
which the update does not prolong. Our trainer does the same (Trainer.prefetch_next, its
queued update). The plain model
in the measuring tools beside the project (a whole-model torch.compile, fused AdamW, bf16
autocast, fused QKV and gate-up projections, logits at the labelled positions) builds its batch
inside the step and never reads its loss; this reference keeps those design choices and takes
our loop's: its batch ahead, its loss read every step.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # torch >= 2.10, CUDA kernels only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch version
    varlen_attn = None

VARLEN_ARGS = set(inspect.signature(varlen_attn).parameters) if varlen_attn else set()


def default_attention(device: torch.device) -> str:
    if device.type != "cuda":
        return "sdpa"
    return "varlen" if varlen_attn is not None else "flex"


@dataclass
class Batch:
    """One micro-batch on the device. `label_index` indexes the flattened [b * s] positions."""

    tokens: torch.Tensor  # [b, s] int64
    document_ids: torch.Tensor  # [b, s] int32
    cu_seqlens: torch.Tensor  # [documents + 1] int32, over the flattened batch
    label_index: torch.Tensor  # [n] int64
    targets: torch.Tensor  # [n] int64


def make_batch(inputs, labels, document_ids, ignore: int, device: torch.device) -> Batch:
    """Host numpy arrays [b, s] (labels `ignore` where no loss) -> a Batch on `device`. Every
    index is computed on the host, so the step itself never waits for the device."""
    b, s = inputs.shape
    flat_docs = document_ids.reshape(-1)
    starts = np.flatnonzero(
        np.r_[True, flat_docs[1:] != flat_docs[:-1]] | (np.arange(b * s) % s == 0)
    )
    cu = np.r_[starts, b * s].astype(np.int32)
    label_index = np.flatnonzero(labels.reshape(-1) != ignore)
    host = {
        "tokens": np.ascontiguousarray(inputs, dtype=np.int64),
        "document_ids": np.ascontiguousarray(document_ids, dtype=np.int32),
        "cu_seqlens": cu,
        "label_index": label_index.astype(np.int64),
        "targets": labels.reshape(-1)[label_index].astype(np.int64),
    }
    pin = device.type == "cuda"  # a pageable copy would wait for the stream
    return Batch(
        **{
            k: (torch.from_numpy(v).pin_memory() if pin else torch.from_numpy(v)).to(
                device, non_blocking=True
            )
            for k, v in host.items()
        }
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, dim]; cos, sin [s, dim] (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None].to(x.dtype) + rotated * sin[:, None].to(x.dtype)


class Block(nn.Module):
    def __init__(self, h, heads, groups, head_dim, ffn, eps, attention, causal):
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, head_dim
        self.attention, self.causal = attention, causal
        self.norm1, self.norm2 = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.qkv = nn.Linear(h, (heads + 2 * groups) * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def attend(self, q, k, v, mask, batch: Batch):
        b, s = q.shape[:2]
        rep = self.heads // self.groups
        if self.attention == "varlen":
            if rep > 1 and "enable_gqa" not in VARLEN_ARGS:
                k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            extra = {"enable_gqa": True} if rep > 1 and "enable_gqa" in VARLEN_ARGS else {}
            if self.causal:
                extra.update(
                    {"window_size": (-1, 0)}
                    if "window_size" in VARLEN_ARGS
                    else {"is_causal": True}
                )
            cu = batch.cu_seqlens  # max length: s bounds every document (a constant: no recompile)
            flat = [t.reshape(b * s, t.shape[2], self.d).contiguous() for t in (q, k, v)]
            return varlen_attn(*flat, cu, cu, s, s, **extra).view(b, s, -1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        if self.attention == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=rep > 1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=rep > 1)
        return out.transpose(1, 2).reshape(b, s, -1)

    def forward(self, x, cos, sin, mask, batch: Batch):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, self.heads + 2 * self.groups, self.d)
        q, k, v = qkv.split([self.heads, self.groups, self.groups], dim=2)
        x = x + self.proj(self.attend(rope(q, cos, sin), rope(k, cos, sin), v, mask, batch))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ReferenceEncoder(nn.Module):
    """`shape`: megatron_mlmclm.flops.TransformerShape (or anything with its fields)."""

    def __init__(self, shape, vocab, seq, rotary_base, eps, std, attention, causal):
        super().__init__()
        h, d = shape.hidden_size, shape.kv_channels
        self.attention, self.causal, self.hidden = attention, causal, h
        self.embedding = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(
            Block(h, shape.num_attention_heads, shape.num_query_groups, d,
                  shape.ffn_hidden_size, eps, attention, causal)
            for _ in range(shape.num_layers)
        )  # fmt: skip
        self.final_norm = nn.RMSNorm(h, eps=eps)
        self.head = nn.Linear(h, vocab, bias=False)  # untied from the embedding
        angles = torch.outer(
            torch.arange(seq, dtype=torch.float32),
            1.0 / rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d),
        )
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)
        # megatron's init: normal(std); the projections back into the residual stream at
        # std / sqrt(2 * layers); norms at one.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                out = name.endswith(("proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * shape.num_layers) if out else std)

    def document_mask(self, document_ids: torch.Tensor):
        """The mask `attend` takes: None (varlen), a BlockMask (flex) or a dense bool mask."""
        if self.attention == "varlen":
            return None
        b, s = document_ids.shape
        causal = self.causal
        if self.attention == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            def same_document(b_, h_, q, kv):
                same = document_ids[b_, q] == document_ids[b_, kv]
                return same & (q >= kv) if causal else same

            return create_block_mask(
                same_document, b, None, s, s, device=document_ids.device, _compile=True
            )
        allowed = document_ids[:, :, None] == document_ids[:, None, :]
        if causal:
            allowed &= torch.ones(s, s, dtype=torch.bool, device=allowed.device).tril_()
        return allowed[:, None]  # True: may attend

    def forward(self, batch: Batch, mask) -> torch.Tensor:
        s = batch.tokens.shape[1]
        x = self.embedding(batch.tokens)
        cos, sin = self.cos[:s], self.sin[:s]
        for block in self.blocks:
            x = block(x, cos, sin, mask, batch)
        x = self.final_norm(x).view(-1, self.hidden).index_select(0, batch.label_index)
        return F.cross_entropy(self.head(x).float(), batch.targets)


class LossReading:
    """A loss on its way to the host: copied to pinned memory behind the work queued so far, with
    an event after the copy (CUDA), so that `value()` waits for that work alone and not for what
    is queued after it; on CPU, the value itself."""

    def __init__(self, loss: torch.Tensor):
        self._done = None
        if loss.is_cuda:
            self._host = torch.empty(loss.shape, dtype=loss.dtype, pin_memory=True)
            self._host.copy_(loss, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = loss.detach().clone()

    def value(self) -> float:
        if self._done is not None:
            self._done.synchronize()
        return float(self._host.tolist())


class ReferenceStep:
    """One optimizer step: forward (under torch.compile when `compile_model`, bf16 autocast when
    `bf16`), backward, clip_grad_norm_, fused AdamW, all queued; nothing waits for the device.
    Returns the loss as a LossReading taken before the update is queued, so that reading it
    waits for the forward, backward and clipping, while the device runs the update (as our
    trainer reads its step's figures)."""

    def __init__(self, model, lr, betas, eps, weight_decay, clip, compile_model, bf16):
        self.model, self.clip = model, clip
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True
        )
        self.compiled = compile_model
        self.forward = torch.compile(model) if compile_model else model
        device = next(model.parameters()).device
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def __call__(self, batch: Batch) -> LossReading:
        if self.compiled:  # document and label counts change every step: one graph for all
            for t in (batch.cu_seqlens, batch.label_index, batch.targets):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        mask = self.model.document_mask(batch.document_ids)
        with self.autocast:
            loss = self.forward(batch, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        reading = LossReading(loss.detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return reading


class ReferenceLoop:
    """Step r of a training loop over `step` (a ReferenceStep), its batches from `fetch(r)`: the
    batch fetched during the previous step where that was step r - 1 (else fetched now), step r
    queued, step r + 1's batch fetched while the device runs it, then step r's loss read (the
    host's one wait a step), and returned as a float. A fetch ahead that fails (`IndexError`:
    past the data) is left to the step that needs it."""

    def __init__(self, step: ReferenceStep, fetch: Callable[[int], Batch]):
        self.step, self.fetch = step, fetch
        self.ready: tuple[int, Batch] | None = None

    def __call__(self, r: int) -> float:
        ready, self.ready = self.ready, None
        batch = ready[1] if ready is not None and ready[0] == r else self.fetch(r)
        loss = self.step(batch)
        try:
            self.ready = (r + 1, self.fetch(r + 1))
        except IndexError:
            self.ready = None
        return loss.value()
