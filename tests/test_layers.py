"""The plain-torch transformer layer (model/layers.py) against megatron-core's own forward of the
same layer (same module, same weights): forward and every gradient, fp32 and bf16, dense mask and
document ids, with q/k norms; compiled within rounding; and where the plan keeps megatron's."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from tolerance import assert_close, reordered

from megatron_mlmclm.config import load_config
from megatron_mlmclm.model.build import build_model, transformer_config
from megatron_mlmclm.model.kernels import plan_kernels
from megatron_mlmclm.model.layers import LayerKernels, PlainTransformerLayer
from megatron_mlmclm.model.packed import document_seq_params
from megatron_mlmclm.objectives import document_attention_mask

BASE = [
    "data.mock=true",
    "model.vocab_size=256",
    "model.seq_length=48",
    "model.num_layers=2",
    "model.num_query_groups=2",  # GQA: 4 query heads share 2 KV groups in the tiny preset
]


@pytest.fixture(scope="module", autouse=True)
def one_process():
    from megatron_mlmclm.runtime.distributed import init_distributed

    init_distributed(1, 1, None, seed=0)


def layer_and_inputs(precision: str, *overrides: str):
    cfg = load_config(None, BASE + [f"train.precision={precision}", *overrides])
    (model,) = build_model(cfg, transformer_config(cfg), 256)
    if precision == "bf16":  # as Float16Module leaves it for training
        model = model.bfloat16()
    layer = model.decoder.layers[1]
    assert isinstance(layer, PlainTransformerLayer) and layer.plain
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(1)
    s, b = 48, 2
    hidden = torch.randn(s, b, layer.config.hidden_size, generator=g).to(dtype)
    docs = torch.tensor([[0] * 20 + [1] * 28, [0] * 7 + [1] * 30 + [2] * 11])
    return model, layer, hidden, docs, model.rotary_pos_emb(s)


def run(forward, layer, hidden, **kwargs):
    x = hidden.clone().requires_grad_()
    out, _ = forward(layer, hidden_states=x, **kwargs)
    gen = torch.Generator().manual_seed(2)
    out.backward(torch.randn(out.shape, generator=gen).to(out.dtype))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def assert_same(a, b, exact: bool):
    (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = a, b
    if exact:
        assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
        for name in grads_b:
            assert torch.equal(grads_a[name], grads_b[name]), name
        return
    # The same sums in another order (a matmul in megatron's autograd function, F.linear here),
    # over outputs and gradients below 8 (4.2, 4.0 and 5.8 at most). In bf16 the GEMMs accumulate
    # in fp32 and round once: the fp32 bounds hold there too.
    tol = reordered(magnitude=8)
    assert_close(out_a, out_b, **tol, what="output")
    assert_close(dx_a, dx_b, **tol, what="input gradient")
    for name in grads_b:
        assert_close(grads_a[name], grads_b[name], **tol, what=name)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_plain_forward_is_megatrons_forward(precision, causal, qk_norm):
    """Bit for bit where the layer's arithmetic is the same op for op; the projections are
    F.linear here and a matmul inside megatron's linear autograd function, which may round a
    weight gradient differently in the last bit: within 1e-4 then, in fp32 and bf16."""
    overrides = ["model.qk_layernorm=true"] if qk_norm else []
    model, layer, hidden, docs, rope = layer_and_inputs(precision, *overrides)
    mask = document_attention_mask(docs, causal)
    kwargs = dict(attention_mask=mask, rotary_pos_emb=rope)
    plain = run(PlainTransformerLayer.forward, layer, hidden, **kwargs)
    theirs = run(TransformerLayer.forward, layer, hidden, **kwargs)
    assert_same(plain, theirs, exact=False)
    torch.testing.assert_close(plain[0], theirs[0], rtol=0, atol=0)  # the forward: exact


def test_document_ids_reach_the_core_attention_unchanged():
    """The flex path's packed_seq_params pass through the plain forward to the core attention:
    with SDPA's core swapped for one that builds the dense mask from the ids, the output is the
    dense-mask output."""
    model, layer, hidden, docs, rope = layer_and_inputs("fp32")
    core = layer.self_attention.core_attention
    seen = []

    class FromIds(torch.nn.Module):
        def forward(
            self, q, k, v, mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            seen.append(packed_seq_params)
            ids = packed_seq_params.document_ids
            return core(q, k, v, document_attention_mask(ids, packed_seq_params.causal))

    params = document_seq_params(docs, causal=True)
    layer.self_attention.core_attention = FromIds()
    try:
        out, _ = layer(hidden_states=hidden, rotary_pos_emb=rope, packed_seq_params=params)
    finally:
        layer.self_attention.core_attention = core
    want, _ = TransformerLayer.forward(
        layer,
        hidden_states=hidden,
        attention_mask=document_attention_mask(docs, True),
        rotary_pos_emb=rope,
    )
    assert seen == [params]
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides,why",
    [
        (["parallel.tensor_model_parallel_size=2"], "TP or CP > 1"),
        (["model.attention=thd"], "packed THD batches"),
        (["train.recompute=selective"], "selective"),
    ],
)
def test_the_plan_keeps_megatrons_layer_where_the_plain_one_does_not_apply(overrides, why):
    plan = plan_kernels(load_config(None, BASE + overrides), "cpu")
    assert plan.plain_layers.on is False and why in plan.plain_layers.why
    assert plan_kernels(load_config(None, BASE), "cpu").plain_layers.on is True


@pytest.mark.slow
def test_compiled_halves_match_eager_within_rounding():
    """torch.compile of the two halves (CPU inductor here; the kernel plan compiles on CUDA):
    forward and gradients within fp32 rounding of the eager plain layer, on both layers of the
    model (one compiled graph serves them: their weights are inputs)."""
    model, layer, hidden, docs, rope = layer_and_inputs("fp32")
    kwargs = dict(attention_mask=document_attention_mask(docs, True), rotary_pos_emb=rope)
    compiled = LayerKernels(compiled=True)
    for layer in model.decoder.layers:
        eager = run(PlainTransformerLayer.forward, layer, hidden, **kwargs)
        layer.kernels = compiled
        try:
            fused = run(PlainTransformerLayer.forward, layer, hidden, **kwargs)
        finally:
            layer.kernels = LayerKernels(compiled=False)
        assert_same(fused, eager, exact=False)


def test_each_half_is_one_graph_without_breaks():
    """What torch.compile fuses: each half traces whole (megatron's own layer breaks its graph
    8 times: its linears warn on every call, inside a context manager)."""
    from megatron_mlmclm.model.layers import _after_attention, _before_attention

    model, layer, hidden, docs, rope = layer_and_inputs("fp32")
    a = layer.self_attention
    args = (hidden, layer.input_layernorm.weight, 1e-5, a.linear_qkv.weight, 2, 2, 32)
    before = torch._dynamo.explain(_before_attention)(*args, None, None, None, rope, rope)
    q, k, v = _before_attention(*args, None, None, None, rope, rope)
    context = q.flatten(2)
    mlp = layer.mlp
    after = torch._dynamo.explain(_after_attention)(
        hidden,
        context,
        a.linear_proj.weight,
        layer.pre_mlp_layernorm.weight,
        1e-5,
        mlp.linear_fc1.weight,
        mlp.linear_fc2.weight,
    )
    assert (before.graph_count, before.graph_break_count) == (1, 0)
    assert (after.graph_count, after.graph_break_count) == (1, 0)


def test_the_plain_layer_keeps_megatrons_parameter_names():
    """Checkpoints, conversion and layouts read the names: the same as megatron's own layer's
    (built where the plan keeps it: selective recompute), q/k norms included."""
    names = {}
    for extra in ([], ["train.recompute=selective"]):
        cfg = load_config(None, BASE + ["model.qk_layernorm=true", *extra])
        (model,) = build_model(cfg, transformer_config(cfg), 256)
        kind = {type(layer) for layer in model.decoder.layers}
        names[kind.pop().__name__] = list(model.state_dict())
    assert set(names) == {"PlainTransformerLayer", "TransformerLayer"}
    assert names["PlainTransformerLayer"] == names["TransformerLayer"]
    assert any("q_layernorm" in n for n in names["TransformerLayer"])


def test_the_kept_weights_follow_a_replaced_parameter():
    """The weights a plain layer hands its functions are kept between forwards; a parameter
    registered anew (load_state_dict(assign=True)) is picked up, an in-place load needs nothing."""
    _, layer, hidden, _, freqs = layer_and_inputs("fp32", "model.qk_layernorm=true")
    first = layer.weights()
    assert layer.weights() is first  # kept
    fresh = {
        k: v.clone() + 1 if isinstance(v, torch.Tensor) else v
        for k, v in layer.state_dict().items()
    }
    layer.load_state_dict(fresh)  # in place: the same parameters, new values
    assert layer.weights() is first
    assert torch.equal(first.qkv, fresh["self_attention.linear_qkv.weight"])
    doubled = {k: v * 2 if isinstance(v, torch.Tensor) else v for k, v in fresh.items()}
    layer.load_state_dict(doubled, assign=True)
    now = layer.weights()
    assert now is not first
    assert now.fc2 is layer.mlp.linear_fc2.weight and now.q_norm is layer.qk_norms[0].weight
    out, _ = layer(hidden_states=hidden, rotary_pos_emb=freqs, attention_mask=None)
    layer.__dict__.pop("_weights")  # built afresh from the modules: the same output
    again, _ = layer(hidden_states=hidden, rotary_pos_emb=freqs, attention_mask=None)
    assert torch.equal(out, again)


# ------------------------------------------------------------------------------ the stack
DOCS = torch.tensor([[0] * 20 + [1] * 28, [0] * 7 + [1] * 30 + [2] * 11])


def model_step(model, precision: str, varlen: bool, causal: bool, docs=DOCS):
    """Loss over labelled positions and every gradient, through the whole model: the dense mask
    (SDPA) or one row of packed sequences (varlen's CPU stand-in, per-token RoPE)."""
    from megatron_mlmclm.model.build import labelled_positions
    from megatron_mlmclm.model.packed import flatten_for_varlen

    g = torch.Generator().manual_seed(3)
    b, s = 2, 48
    tokens = torch.randint(4, 256, (b, s), generator=g)
    labels = torch.randint(4, 256, (b, s), generator=g)
    loss_mask = (torch.rand(b, s, generator=g) < 0.4).float()
    positions = torch.arange(s).expand(b, s)
    batch = dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=positions)
    if varlen:
        batch = flatten_for_varlen(batch, docs, causal)
        mask, params = None, batch["packed_seq_params"]
    else:
        mask, params = document_attention_mask(docs, causal), None
    index, targets = labelled_positions(batch["loss_mask"], batch["labels"])
    loss, _ = model(
        batch["tokens"],
        batch["position_ids"],
        mask,
        labels=targets,
        label_index=index,
        packed_seq_params=params,
    )
    loss.float().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("fusions", ["auto", "off"])
def test_the_decoder_is_built_once_as_the_plans_block(monkeypatch, fusions):
    """The model's decoder is the block class the kernel plan's spec names, built once (two
    layers, two layer constructions), with the parameters, in the same order and shapes, that
    megatron's own GPTModel builds from the same layers."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_mlmclm.model.build import decoder_spec
    from megatron_mlmclm.model.layers import PlainTransformerBlock

    built = []
    init = TransformerLayer.__init__

    def counted(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(TransformerLayer, "__init__", counted)
    cfg = load_config(None, BASE + [f"model.fusions={fusions}"])
    tconfig = transformer_config(cfg)
    (model,) = build_model(cfg, tconfig, 256)
    layer = "PlainTransformerLayer" if fusions == "auto" else "TransformerLayer"
    assert built == [layer, layer]
    assert type(model.decoder) is (PlainTransformerBlock if fusions == "auto" else TransformerBlock)
    megatrons = GPTModel(
        config=tconfig,
        transformer_layer_spec=decoder_spec(tconfig, plan_kernels(cfg, "cpu")).submodules,
        vocab_size=256,
        max_sequence_length=48,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=cfg.model.tie_embeddings,
    )
    assert type(megatrons.decoder) is TransformerBlock
    ours = [(name, p.shape) for name, p in model.named_parameters()]
    assert ours == [(name, p.shape) for name, p in megatrons.named_parameters()]


def stack_model(precision: str, varlen: bool, *overrides: str):
    from megatron_mlmclm.model.layers import PlainTransformerBlock

    attention = "varlen" if varlen else "sdpa"
    cfg = load_config(
        None, BASE + [f"train.precision={precision}", f"model.attention={attention}", *overrides]
    )
    (model,) = build_model(cfg, transformer_config(cfg), 256)
    assert isinstance(model.decoder, PlainTransformerBlock)
    return model.bfloat16() if precision == "bf16" else model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["sdpa", "varlen"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_stack_computes_what_the_layers_compute_one_by_one(precision, varlen, causal):
    """Eager, the stack (one function over all layers, attention and final norm) is the same
    arithmetic as the layers called one by one: loss and every gradient bit for bit; and against
    megatron's own layers (the plain forward switched off) the loss is exact and gradients within
    the weight-GEMM rounding of test_plain_forward_is_megatrons_forward."""
    model = stack_model(precision, varlen, "model.qk_layernorm=true")
    kernels = model.decoder.layers[0].kernels
    calls, stack = [], kernels.stack
    kernels.stack = lambda *args: calls.append(1) or stack(*args)
    stacked = model_step(model, precision, varlen, causal)
    assert calls == [1]  # the stack ran (and nothing layer by layer)
    kernels.stack_on = False
    try:
        one_by_one = model_step(model, precision, varlen, causal)
        for layer in model.decoder.layers:
            layer.plain = False
        megatron = model_step(model, precision, varlen, causal)
    finally:
        kernels.stack_on = True
        for layer in model.decoder.layers:
            layer.plain = True
    assert torch.equal(stacked[0], one_by_one[0])
    for name, grad in one_by_one[1].items():
        assert torch.equal(stacked[1][name], grad), name
    torch.testing.assert_close(stacked[0], megatron[0], rtol=0, atol=0)
    for name, grad in megatron[1].items():  # as in assert_same: gradients below 8
        assert_close(stacked[1][name], grad, **reordered(magnitude=8), what=name)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_stack_in_chunks_is_the_one_stack_and_runs_the_modules_pre_hooks(precision):
    """Three layers in two chunks (two layers, then one with the final norm): loss and every
    gradient bit for bit the stack as one function. Before each chunk the forward pre-hooks of
    the modules it stands for run, every one, in forward order (megatron's DDP waits there for
    the overlapped parameter all-gather), and the chunks' gradient groups hold every decoder
    parameter once."""
    model = stack_model(precision, True, "model.num_layers=3", "model.stack_chunks=2")
    decoder, kernels = model.decoder, model.decoder.layers[0].kernels
    assert kernels.stack_chunks == 2
    groups = decoder.gradient_groups()
    assert [len(g) for g in groups] == [2 * 6, 6 + 1]  # 6 weights a layer, the final norm
    assert sorted(id(p) for g in groups for p in g) == sorted(id(p) for p in decoder.parameters())
    events: list[str] = []
    names = {id(m): n for n, m in decoder.named_modules()}
    handles = [
        m.register_forward_pre_hook(lambda m, args: events.append(names[id(m)]))
        for m in decoder.modules()
        if m is not decoder
    ]
    stack = kernels.stack
    kernels.stack = lambda *args: events.append(f"stack of {len(args[1])}") or stack(*args)
    try:
        chunked = model_step(model, precision, True, False)
        kernels.stack_chunks = 1
        events_one = len(events)
        whole = model_step(model, precision, True, False)
    finally:
        kernels.stack_chunks = 2
        kernels.stack = stack
        for handle in handles:
            handle.remove()
    # every module the stack stands for (a ModuleList is a container: it has no forward)
    modules = [
        n
        for n, m in decoder.named_modules()
        if m is not decoder and not isinstance(m, torch.nn.ModuleList)
    ]
    first = [n for n in modules if n.startswith(("layers.0", "layers.1"))]
    assert events[:events_one] == [
        *first,
        "stack of 2",
        *[n for n in modules if n not in first],
        "stack of 1",
    ]
    assert events[events_one:] == [*modules, "stack of 3"]
    assert torch.equal(chunked[0], whole[0])
    for name, grad in whole[1].items():
        assert torch.equal(chunked[1][name], grad), name


@pytest.mark.parametrize("varlen", [False, True], ids=["sdpa", "varlen"])
def test_the_stack_is_one_graph_without_breaks(varlen):
    """What torch.compile sees of the stack: one graph, attention included, for the dense mask
    and for varlen (its CPU stand-in, and torch's kernel call through a stand-in kernel with the
    signature of torch 2.11: the signature is read outside the trace)."""
    from megatron_mlmclm.model import attention as attn
    from megatron_mlmclm.model.layers import _stack

    model = stack_model("fp32", varlen)
    seen = []
    captured = {}

    def capture(hidden, layers, final, eps, q_freqs, k_freqs, attend, *args):
        captured.update(args=(hidden, layers, final, eps, q_freqs, k_freqs, attend, *args))
        return _stack(hidden, layers, final, eps, q_freqs, k_freqs, attend, *args)

    kernels = model.decoder.layers[0].kernels
    kernels.stack = capture
    model_step(model, "fp32", varlen, causal=True)
    explained = torch._dynamo.explain(_stack)(*captured["args"])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    if varlen:

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            seen.append(max_q)
            causal = window_size == (-1, 0)
            return attn.varlen_reference(q, k, v, cu_q, causal, scale, False)

        call = attn.VarlenKernel(kernel)
        q, k, v, cu, longest = (torch.randn(12, 4, 8), torch.randn(12, 2, 8),
                                torch.randn(12, 2, 8), torch.tensor([0, 5, 12]), 7)  # fmt: skip
        explained = torch._dynamo.explain(call)(q, k, v, cu, longest, True, 0.3, True)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0) and seen


@pytest.mark.slow
def test_the_compiled_stack_matches_eager_within_rounding():
    """torch.compile of the whole stack on the varlen path, what a GPU run without TE takes (CPU
    inductor here, with the stand-in attention): loss and gradients within fp32 rounding of the
    eager stack, over micro-batches whose sequence counts and longest sequences differ, from one
    compilation: a batch that recompiled the stack would stall the run for a second compile."""
    from torch._dynamo.utils import counters

    layouts = [
        DOCS,
        torch.tensor([[0] * 5 + [1] * 9 + [2] * 34, [0] * 48]),  # 4 sequences, the longest 48
        torch.tensor([[0] * 8 + [1] * 40, [0] * 4 + [1] * 4 + [2] * 10 + [3] * 30]),  # 6, 40
    ]
    model = stack_model("fp32", True)
    eager = [model_step(model, "fp32", True, False, docs) for docs in layouts]
    for layer in model.decoder.layers:
        layer.kernels = LayerKernels(compiled=True, stack=True)
    graphs = []
    for docs, want in zip(layouts, eager, strict=True):
        fused = model_step(model, "fp32", True, False, docs)
        graphs.append(counters["stats"]["unique_graphs"])
        torch.testing.assert_close(fused[0], want[0], rtol=1e-5, atol=1e-5)
        for name, grad in want[1].items():  # fp32 in Inductor's order; gradients below 8
            assert_close(fused[1][name], grad, **reordered(magnitude=8), what=name)
    assert graphs[0] == graphs[1] == graphs[2], graphs  # compiled once, at the first batch
