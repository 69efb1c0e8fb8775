"""Shared fixtures: a tiny random-init EuroBert folder with a word-level tokenizer trained on the
real data, and the data folder (tests skip when it is absent)."""

from __future__ import annotations

import pytest
import torch

from megatron_mlmclm.paths import data_dir


@pytest.fixture(scope="session")
def data():
    d = data_dir()
    if d is None or not (d / "sst2").is_dir():
        pytest.skip("no shared data folder (set MLMCLM_DATA_DIR)")
    return d


@pytest.fixture(scope="session")
def tiny_model(data, tmp_path_factory):
    from megatron_mlmclm.eval.tiny import build_tiny_model, sample_texts

    torch.set_num_threads(1)  # 2 shared cores: more threads only spin
    out = tmp_path_factory.mktemp("models") / "tiny-eurobert"
    return str(
        build_tiny_model(
            out,
            sample_texts(data, max_lines=20000),
            vocab_size=8000,
            hidden_size=64,
            max_positions=256,
        )
    )
