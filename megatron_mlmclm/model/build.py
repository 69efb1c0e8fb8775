"""The encoder as a megatron-core GPTModel: config, the decoder's spec (the kernel plan's layer
and block classes, built by construction), and a head that pays only for labels.

Architecture (docs/study.md): RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings. The same
trunk is trained causally (CLM) or bidirectionally (MLM); the attention kind is a property of the
batch (the mask), not of the model, so one model switches objective between phases.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.quantization.utils import get_quant_config_or_none
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mlmclm.config import ModelConfig, RunConfig, final_model
from megatron_mlmclm.model.attention import (
    DocumentMasks,
    FlexDocumentAttention,
    SDPAttention,
    THDReferenceAttention,
    VarlenAttention,
)
from megatron_mlmclm.model.init import initialize_by_global_parameter
from megatron_mlmclm.model.kernels import KernelPlan, plan_kernels, resolve_device
from megatron_mlmclm.model.layers import (
    LayerKernels,
    PlainTransformerBlock,
    PlainTransformerLayer,
)
from megatron_mlmclm.model.loss import EAGER as EAGER_LOSS
from megatron_mlmclm.model.loss import LossKernels, sparse_cross_entropy


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Pad to a multiple of 128 (divisible by every power-of-two TP, so checkpoints reshard)."""
    multiple = 128 if 128 % tp == 0 else 128 * tp
    return -(-vocab_size // multiple) * multiple


def use_bf16(cfg: RunConfig) -> bool:
    if cfg.train.precision == "auto":
        return torch.cuda.is_available()
    return cfg.train.precision == "bf16"


def transformer_config(cfg: RunConfig, plan: KernelPlan | None = None) -> TransformerConfig:
    """megatron-core's TransformerConfig for the run; fusions, overlap-related and init fields
    come from the kernel plan (model/kernels/; by default planned for this machine)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    plan = plan if plan is not None else plan_kernels(cfg, resolve_device(cfg))
    bf16 = use_bf16(cfg)
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # The loss is a mean over all label-carrying tokens of the global batch (megatron's
        # per-token convention): the schedule divides by the token count summed over micro-batches
        # and DP ranks, so every parallel layout computes the same loss.
        calculate_per_token_loss=True,
        # No CUDA graphs are captured (cuda_graph_impl stays "none"); the empty scope is the
        # whole layer, what megatron's default "full" means, without its deprecation warning.
        cuda_graph_scope=[],
        # Fusions, batched P2P, sequence parallelism and CPU initialisation: the kernel plan.
        **plan.transformer_kwargs(),
    )
    if t.recompute == "full":
        kwargs.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    elif t.recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    if t.fp8 is not None:  # the kernel plan has refused FP8 without TE's layers
        kwargs.update(
            fp8="hybrid",
            fp8_recipe={"delayed": "delayed", "current": "tensorwise", "mxfp8": "mxfp8"}[t.fp8],
        )
    return TransformerConfig(**kwargs)


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with megatron's norm signature, usable under sequence parallelism (megatron's
    torch-norm wrapper refuses it): with SP each TP rank normalises its s/TP tokens, so the weight's
    gradient is partial and finalize_model_grads all-reduces it over TP (the `sequence_parallel`
    mark). Same parameter name and initial value as the wrapper's, so checkpoints are unchanged."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def decoder_spec(config: TransformerConfig, plan: KernelPlan, vp_stage: int | None = None):
    """The kernel plan's decoder block as a spec EncoderLM builds:
    - te-thd: Transformer Engine's layer spec, built by megatron's TransformerBlock;
    - otherwise a block spec (a ModuleSpec of the block class with its TransformerBlockSubmodules):
      megatron's local layer with our core attention (SDPA, Flex, varlen or the THD stand-in) and
      our RMSNorm (the final norm too); where the plan says so the plain layer forward
      (model/layers.py, compiled or not), and `PlainTransformerBlock`, which runs the plain
      layers as one stack (plain_stack), else megatron's `TransformerBlock`.
    Parameter names are megatron's either way."""
    if plan.attention == "te-thd":
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.arbitrary}
        _mlp_width_from(config, spec)
        return spec
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    core = {
        "sdpa": SDPAttention,
        "varlen": VarlenAttention,
        "thd-reference": THDReferenceAttention,
    }.get(plan.attention)
    if plan.attention == "flex":  # one DocumentMasks for all layers: one block mask per micro-batch
        core = functools.partial(FlexDocumentAttention, masks=DocumentMasks())
    spec.submodules.self_attention.submodules.core_attention = core
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.arbitrary}
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    _mlp_width_from(config, spec)
    if plan.plain_layers.on:  # one LayerKernels for all layers: one compiled graph per half
        spec.module = PlainTransformerLayer
        kernels = LayerKernels(plan.compile.on, plan.plain_stack.on, plan.stack_chunks)
        spec.params = {**spec.params, "kernels": kernels}
    return ModuleSpec(
        module=PlainTransformerBlock if plan.plain_stack.on else TransformerBlock,
        submodules=TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
            layer_norm=RMSNorm,
        ),
    )


def _mlp_width_from(config: TransformerConfig, layer: ModuleSpec) -> None:
    """The MLP's width from the config, given as megatron-core asks (it warns when it takes it
    from the config itself)."""
    mlp = layer.submodules.mlp
    mlp.params = {**mlp.params, "ffn_hidden_size": config.ffn_hidden_size}


# GPTModel builds megatron's TransformerBlock itself from the spec it is given (megatron-core 0.16
# has no way to name another block class). EncoderLM hands it this one, with no layers and no
# final norm, so it builds and initialises nothing, and builds its own block in that place.
_NO_LAYERS = TransformerBlockSubmodules(layer_specs=[], layer_norm=None)


def _block_of(spec) -> tuple[type[TransformerBlock], object]:
    """(block class, the spec it takes): a block spec's own class and submodules; any other spec
    megatron's TransformerBlock of it, as GPTModel builds it."""
    module = spec.module if isinstance(spec, ModuleSpec) else None
    if isinstance(module, type) and issubclass(module, TransformerBlock):
        return module, spec.submodules
    return TransformerBlock, spec


class EncoderLM(GPTModel):
    """GPTModel whose loss path computes output logits only where a label exists.

    With labels, the last stage returns `(per_token_loss [n], correct [n])` over the n labelled
    positions. The trainer names them as `label_index` (positions in the flattened [s, b] hidden
    states, built on the host with the batch, so picking them never waits for the device) with
    `labels` the n targets; a direct caller may instead pass [b, s] labels and a loss mask, whose
    positions are then found on the device. MLM at 40% therefore pays 40% of the output-layer
    matmul (the largest one at vocab 128k); CLM pays for all positions. The loss is
    model/loss.py's sparse cross-entropy, compiled where the kernel plan says so (`loss_kernels`).
    Without labels it returns logits [b, s, vocab/tp] as GPTModel does.

    Packed layouts whose rows hold many sequences (the varlen path) pass per-token RoPE positions
    in their packed_seq_params (`rope_positions`): each token is rotated by its position inside
    its own sequence, as Transformer Engine's THD kernels do.
    """

    loss_kernels: LossKernels = EAGER_LOSS
    _label_index: torch.Tensor | None = None

    def __init__(self, config: TransformerConfig, transformer_layer_spec, **kwargs):
        """GPTModel's arguments. `transformer_layer_spec` takes what GPTModel takes (a layer's
        ModuleSpec, TransformerBlockSubmodules) and also a block spec: a ModuleSpec whose module
        is a TransformerBlock subclass, built with its submodules (GPTModel would build
        megatron's TransformerBlock of them)."""
        super().__init__(config, _NO_LAYERS, **kwargs)
        self.transformer_layer_spec = transformer_layer_spec
        block, spec = _block_of(transformer_layer_spec)
        # The decoder slot GPTModel registered, filled in place: parameter names and order as
        # GPTModel's own block would have them.
        self.decoder = block(
            config=self.config,
            spec=spec,
            pre_process=self.pre_process,
            post_process=self.post_process,
            pg_collection=self.pg_collection,
            vp_stage=self.vp_stage,
        )
        # What GPTModel's __init__ ends with, for the modules of the block built here.
        for name, module in self.decoder.named_modules(prefix="decoder"):
            if hasattr(module, "finish_init"):
                module.finish_init(get_quant_config_or_none(name, self.config.quant_recipe))

    def forward(self, *args, label_index: torch.Tensor | None = None, **kwargs):
        self._label_index = label_index
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._label_index = None

    def _preprocess(self, *args, packed_seq_params=None, **kwargs):
        out = super()._preprocess(*args, packed_seq_params=packed_seq_params, **kwargs)
        positions = getattr(packed_seq_params, "rope_positions", None)
        if positions is None or out[1] is None:
            return out
        # megatron's table covers 0 .. max_seqlen - 1 (get_rotary_seq_len): one row per token.
        return (out[0], out[1].index_select(0, positions), *out[2:])

    def _postprocess(
        self,
        hidden_states,
        input_ids,
        position_ids,
        labels,
        *args,
        loss_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        if not self.post_process or labels is None:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, *args, loss_mask=loss_mask, **kwargs
            )
        index, targets = self._label_index, labels
        if index is None:  # [b, s] labels: their positions, found on the device
            keep = loss_mask if loss_mask is not None else labels >= 0
            index, targets = labelled_positions(keep, labels)
        sequence_parallel = self.output_layer.sequence_parallel
        if sequence_parallel:
            # Each TP rank holds s/TP positions: gather the whole sequence before picking the
            # labelled positions, then run the output layer on those without its own SP gather
            # (as GPTModel does for last-token logits). Its backward already all-reduces the
            # input gradient over TP, so the gather's backward only keeps this rank's slice.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        hidden = hidden_states.reshape(-1, hidden_states.size(-1)).index_select(0, index)
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else None
        )
        self.output_layer.sequence_parallel = False
        try:
            logits, _ = self.output_layer(hidden.unsqueeze(1), weight=weight)  # [n, 1, V/tp]
        finally:
            self.output_layer.sequence_parallel = sequence_parallel
        tp = parallel_state.get_tensor_model_parallel_world_size()
        return sparse_cross_entropy(
            logits.squeeze(1),
            targets,
            vocab_start=parallel_state.get_tensor_model_parallel_rank() * logits.size(-1),
            group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
            kernels=self.loss_kernels,
        )


def labelled_positions(
    loss_mask: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, s] loss mask and labels -> (positions in the flattened [s, b] order the head reads
    hidden states in, the labels there). On host tensors this is how a batch is prepared; on
    device tensors it waits for the device (nonzero)."""
    keep = loss_mask.transpose(0, 1).reshape(-1) != 0
    index = keep.nonzero().squeeze(1)
    return index, labels.transpose(0, 1).reshape(-1).index_select(0, index)


def build_model_chunk(
    cfg: RunConfig,
    config: TransformerConfig,
    vocab_size: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    plan: KernelPlan | None = None,
    initialize: bool = True,
):
    """One model chunk with its initial weights (model/init.py: the same model for every parallel
    layout; without `initialize`, whatever memory held: for a caller that loads every weight, and
    pass a config with `perform_initialization` off); its attention path is the kernel plan's (by
    default planned for this machine)."""
    # The model as the run leaves it: the last phase's RoPE base (the trainer switches the base
    # per phase, set_rotary_base) and room for the longest phase.
    m: ModelConfig = final_model(cfg)
    plan = plan if plan is not None else plan_kernels(cfg, resolve_device(cfg))
    model = EncoderLM(
        config=config,
        transformer_layer_spec=decoder_spec(config, plan, vp_stage),
        vocab_size=padded_vocab_size(vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=m.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(m.rotary_base),
        vp_stage=vp_stage,
    )
    if m.rope_scaling is not None:
        apply_rope_scaling(model, m)
    model.loss_kernels = LossKernels(compiled=plan.compile.on)
    if initialize:
        initialize_by_global_parameter([model], config, cfg.train.seed)
    return model


def apply_rope_scaling(model: GPTModel, m: ModelConfig) -> None:
    """Llama 3.1 frequency scaling with all four parameters. GPTModel's own `rope_scaling` passes
    only the factor (low/high_freq_factor and original_max_position_embeddings are fixed at 1, 4
    and 8192 there), so the unscaled frequencies it built are rescaled here with the configured
    values by megatron's own `_apply_scaling`."""
    r, rotary = m.rope_scaling, model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq,
        factor=r.factor,
        low_freq_factor=r.low_freq_factor,
        high_freq_factor=r.high_freq_factor,
        original_max_position_embeddings=r.original_max_position_embeddings,
    )
    model.rotary_scaling = True


def set_rotary_base(chunks: list[torch.nn.Module], m: ModelConfig, base: float) -> None:
    """Rebuild every chunk's RoPE frequencies for `base` (a phase's rotary_base), as megatron's
    RotaryEmbedding computes them (int base; the run's llama3 scaling applied on top), and drop its
    cached embeddings."""
    for chunk in chunks:
        rotary = getattr(chunk, "rotary_pos_emb", None)
        if rotary is None:
            continue
        dim = 2 * rotary.inv_freq.numel()
        rotary.inv_freq = 1.0 / (
            int(base)
            ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rotary.inv_freq.device) / dim)
        )
        if m.rope_scaling is not None:
            r = m.rope_scaling
            rotary.inv_freq = rotary._apply_scaling(
                rotary.inv_freq,
                factor=r.factor,
                low_freq_factor=r.low_freq_factor,
                high_freq_factor=r.high_freq_factor,
                original_max_position_embeddings=r.original_max_position_embeddings,
            )
        type(rotary).forward.cache_clear()


def build_model(
    cfg: RunConfig, config: TransformerConfig, vocab_size: int, plan: KernelPlan | None = None
) -> list[torch.nn.Module]:
    """Model chunks for this rank (one, or several with virtual pipeline parallelism)."""
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunk = build_model_chunk(cfg, config, vocab_size, pre, post, vp_stage, plan)
        chunk.model_type = ModelType.encoder_or_decoder
        chunks.append(chunk)
    return chunks
