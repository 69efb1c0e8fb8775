"""`model.rope_scaling` (Llama 3.1-style): the config checks and the frequencies the model builds,
against a pure-Python transcription of the published llama3 rule."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mlmclm.config import load_config
from megatron_mlmclm.errors import UsageError

BASE = [
    "data.mock=true",
    "model.preset=null",
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.kv_channels=16",
    "model.seq_length=32",
    "train.precision=fp32",
]


def llama3_inv_freq(
    base: float, dim: int, factor: float, low: float, high: float, original: int
) -> list[float]:
    """Per frequency: kept above the high-frequency cut, divided by `factor` below the low one,
    and in between a linear blend in original/wavelength."""
    out = []
    for i in range(0, dim, 2):
        f = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


@pytest.mark.parametrize("scaling", [None, (8.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 64)])
def test_model_frequencies_follow_the_llama3_rule(scaling):
    from megatron_mlmclm.model.build import build_model_chunk, transformer_config
    from megatron_mlmclm.runtime.distributed import init_distributed

    over = ["model.rotary_base=10000"]
    if scaling is not None:
        f, lo, hi, orig = scaling
        over.append(
            f"model.rope_scaling={{factor: {f}, low_freq_factor: {lo}, "
            f"high_freq_factor: {hi}, original_max_position_embeddings: {orig}}}"
        )
    cfg = load_config(None, BASE + over)
    init_distributed(1, 1, None, 0)
    model = build_model_chunk(cfg, transformer_config(cfg), 256, True, True)
    got = model.rotary_pos_emb.inv_freq.double()
    expect = (
        llama3_inv_freq(10000.0, 16, *scaling)
        if scaling
        else [1.0 / 10000.0 ** (i / 16) for i in range(0, 16, 2)]
    )
    assert torch.allclose(got, torch.tensor(expect, dtype=torch.float64), rtol=1e-6, atol=0)
    if scaling == (16.0, 2.0, 8.0, 64):  # every regime occurs: kept, blended, divided
        plain = [1.0 / 10000.0 ** (i / 16) for i in range(0, 16, 2)]
        ratios = [p / g for p, g in zip(plain, got.tolist())]
        assert ratios[0] == pytest.approx(1.0) and ratios[-1] == pytest.approx(16.0)
        assert any(1.01 < r < 15.9 for r in ratios)


@pytest.mark.parametrize(
    "value,match",
    [
        ("{type: yarn}", "only llama3"),
        ("{factor: 0.5}", "factor must be >= 1"),
        ("{low_freq_factor: 4, high_freq_factor: 4}", "low_freq_factor < high_freq_factor"),
        ("{original_max_position_embeddings: 0}", "original_max_position_embeddings"),
        ("{scale: 2}", "unknown config key 'model.rope_scaling.scale'"),
    ],
)
def test_invalid_rope_scaling_is_refused(value, match):
    with pytest.raises(UsageError, match=match):
        load_config(None, BASE + [f"model.rope_scaling={value}"])


def test_defaults_are_llama31():
    r = load_config(None, BASE + ["model.rope_scaling={}"]).model.rope_scaling
    assert (
        r.type,
        r.factor,
        r.low_freq_factor,
        r.high_freq_factor,
        r.original_max_position_embeddings,
    ) == ("llama3", 8.0, 1.0, 4.0, 8192)
    assert load_config(None, BASE).model.rope_scaling is None
