"""A checkpoint written with the local (CPU) layer spec loads into Transformer Engine's spec, and
back.

TE's modules keep FP8 metadata as `_extra_state`, which megatron saves as a ShardedObject per
module: megatron's local linears write an empty one, the local core attention none at all. TE's
spec also fuses each pre-norm into the next linear (`linear_qkv.layer_norm_weight`), a name the
local spec maps its norms to in checkpoints. No TE here, so the TE side is the same model made
TE-shaped: norms fused into the linears, and the projections and attention cores carrying extra
state as TE's do (get_extra_state returns a serialized uint8 tensor).
"""

from __future__ import annotations

import pytest
import torch

from megatron_mlmclm.checkpoint import load_checkpoint, save_checkpoint
from megatron_mlmclm.config import load_config
from megatron_mlmclm.convert.common import init_single_process
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.build import build_model_chunk, transformer_config

TE_MODULES = ("linear_qkv", "linear_proj", "core_attention", "linear_fc1", "linear_fc2")


def te_shaped(chunk: torch.nn.Module) -> torch.nn.Module:
    """Fuse the pre-norms into the linears after them and give every module TE would replace a
    TE-style `_extra_state` (recording what it loads)."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in chunk.decoder.layers:
        for norm, linear in (
            ("input_layernorm", layer.self_attention.linear_qkv),
            ("pre_mlp_layernorm", layer.mlp.linear_fc1),
        ):
            linear.register_parameter("layer_norm_weight", getattr(layer, norm).weight)
            setattr(layer, norm, IdentityOp())
    for name, mod in list(chunk.named_modules()):
        if name.rsplit(".", 1)[-1] in TE_MODULES:
            base = type(mod)
            mod.__class__ = type(
                "TE" + base.__name__,
                (base,),
                {
                    "get_extra_state": lambda self: torch.frombuffer(
                        bytearray(b"fp8-meta"), dtype=torch.uint8
                    ),
                    "set_extra_state": lambda self, state: setattr(self, "loaded_extra", state),
                },
            )
    return chunk


def build(seed: int, te: bool):
    cfg = load_config(None, ["data.mock=true", "model.vocab_size=500", f"train.seed={seed}"])
    init_single_process(seed)
    chunk = build_model_chunk(cfg, transformer_config(cfg), 500, True, True)
    return te_shaped(chunk) if te else chunk


def save(chunk, path):
    save_checkpoint(path, 1, [chunk], None, None, {"trainer": {"step": 1}}, keep_last=1)
    return path / "iter_0000001"


def weights(chunk) -> dict[str, torch.Tensor]:
    """Every weight by its checkpoint key (the names both specs share)."""
    return {
        v.key + str(getattr(v, "global_offset", ())): v.data.detach().clone()
        for v in chunk.sharded_state_dict().values()
        if hasattr(v, "data") and not v.key.endswith("_extra_state")
    }


def checkpoint_keys(chunk) -> set[str]:
    return {v.key for v in chunk.sharded_state_dict().values()}


def test_the_te_shape_asks_for_keys_a_cpu_checkpoint_lacks():
    """What the test is about: the TE side asks for core-attention extra state the CPU spec never
    writes, and both name the fused norms alike."""
    te, cpu = checkpoint_keys(build(1, te=True)), checkpoint_keys(build(1, te=False))
    assert te - cpu == {"decoder.layers.self_attention.core_attention._extra_state"}
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in te & cpu


@pytest.mark.parametrize(
    "saved_te,loaded_te",
    [(False, True), (True, False)],
    ids=["cpu_spec_into_te", "te_into_cpu_spec"],
)
def test_checkpoint_loads_across_the_specs(tmp_path, saved_te, loaded_te):
    source = build(1, saved_te)
    ckpt = save(source, tmp_path)
    target = build(2, loaded_te)
    assert weights(target).keys() == weights(source).keys()
    assert any(not torch.equal(weights(target)[k], v) for k, v in weights(source).items())
    load_checkpoint(ckpt, [target], load_rng=False)
    for k, v in weights(source).items():
        assert torch.equal(weights(target)[k], v), k
    if saved_te:  # TE's metadata written by TE is read back by TE, not dropped
        te_again = build(3, te=True)
        load_checkpoint(ckpt, [te_again], load_rng=False)
        core = te_again.decoder.layers[0].self_attention.core_attention
        assert bytes(core.loaded_extra.numpy()) == b"fp8-meta"


def test_a_missing_weight_is_still_an_error(tmp_path):
    ckpt = save(build(1, te=False), tmp_path)
    target = build(2, te=True)
    fc1 = target.decoder.layers[0].mlp.linear_fc1
    fc1.register_parameter("scale", torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(UsageError, match="scale"):
        load_checkpoint(ckpt, [target], load_rng=False)
