"""Initial weights by global parameter: every parallel layout starts from the same model.

megatron-core draws a layer's weights from the process RNG in the order the rank builds its
layers, so a pipeline stage that builds layers 3-4 first draws what a single process draws for
layers 1-2: PP and VPP layouts start from other models than the single-process run, and
`use_cpu_initialization` only makes tensor-parallel slices agree. Here each parameter is drawn
whole, from a generator seeded by (train.seed, its dist-checkpoint key, its global layer), with
megatron's own init method for it, and each rank keeps its slice: the slice a checkpoint of that
layout would hold. So any TP x PP x VPP (x DP, CP) layout, on CPU or GPU, starts from the single-
process model, bit for bit (tests/test_init.py).

Which init method a parameter gets is megatron-core's (transformer/attention.py, mlp.py,
language_model_embedding.py): the projections back into the residual stream (linear_proj,
linear_fc2) use `output_layer_init_method` (std / sqrt(2 x layers)), the embedding
`embedding_init_method`, every other weight `init_method`, norm weights are ones. A test checks
that table against megatron's own build.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.transformer_config import TransformerConfig

OUTPUT_LAYER_INIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
EMBEDDING_INIT = ("embedding.word_embeddings.weight",)
ONES = ("layer_norm_weight", "layernorm.weight", "final_layernorm.weight")


def init_method_for(key: str, config: TransformerConfig) -> Callable[[torch.Tensor], None]:
    """The init megatron-core gives the parameter stored under dist-checkpoint key `key`."""
    if key.endswith(ONES):
        return torch.nn.init.ones_
    if key.endswith(OUTPUT_LAYER_INIT):
        return config.output_layer_init_method
    if key.endswith(EMBEDDING_INIT):
        return config.embedding_init_method
    if key.endswith(".weight"):
        return config.init_method
    raise ValueError(f"no initialisation rule for parameter {key}")


def _seed(seed: int, key: str, index: tuple[int, ...]) -> int:
    text = f"{seed}:{key}:{','.join(map(str, index))}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def _sharded_tensors(entry) -> Iterator[ShardedTensor]:
    if isinstance(entry, ShardedTensor):
        yield entry
    elif isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        for part in built if isinstance(built, list) else [built]:
            yield from _sharded_tensors(part)
    elif isinstance(entry, dict):
        for value in entry.values():
            yield from _sharded_tensors(value)
    elif isinstance(entry, list):
        for value in entry:
            yield from _sharded_tensors(value)


@torch.no_grad()
def initialize_by_global_parameter(
    chunks: list[torch.nn.Module], config: TransformerConfig, seed: int
) -> None:
    """Overwrite every parameter of this rank's model chunks with its slice of the global
    parameter drawn for (seed, key, layer). Raises when a parameter is left out."""
    done: set[int] = set()
    for chunk in chunks:
        for sharded in _sharded_tensors(chunk.sharded_state_dict()):
            local = sharded.data
            prepend = sharded.prepend_axis_num
            index = tuple(sharded.global_offset[:prepend])  # the global layer, for stacked keys
            whole = torch.empty(sharded.global_shape[prepend:], dtype=torch.float32)
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(_seed(seed, sharded.key, index))
                init_method_for(sharded.key, config)(whole)
            part = whole[
                tuple(slice(o, o + n) for o, n in zip(sharded.global_offset[prepend:], local.shape))
            ]
            local.copy_(part.to(dtype=local.dtype, device=local.device))
            done.add(local.untyped_storage().data_ptr())
    missing = [
        name
        for chunk in chunks
        for name, p in chunk.named_parameters()
        if p.untyped_storage().data_ptr() not in done
    ]
    if missing:
        raise RuntimeError(f"initialisation by global parameter left out {missing[:3]}")
