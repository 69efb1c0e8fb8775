"""A short fine-tune of a tiny model beats the trivial baselines on the real data."""

from __future__ import annotations

from megatron_mlmclm.eval.finetune import FinetuneConfig, run_finetune


def test_sst2_beats_majority_class(tiny_model):
    r = run_finetune(
        FinetuneConfig(
            model=tiny_model,
            task="sst2",
            lr=1e-3,
            seed=0,
            max_steps=125,
            eval_every=125,
            max_train_examples=4000,
            threads=1,
            progress=False,
        )
    )
    majority = 444 / 872  # dev: 444 positive / 428 negative
    acc = r["metrics"]["test"]["accuracy"]
    assert acc > majority + 0.08, acc


def test_conll_beats_all_o_baseline(tiny_model):
    # The untrained / all-"O" tagger scores entity F1 = 0 (see test_metrics).
    r = run_finetune(
        FinetuneConfig(
            model=tiny_model,
            task="conll2003",
            lr=2e-3,
            seed=0,
            max_steps=250,
            eval_every=250,
            max_train_examples=8000,
            max_eval_examples=300,
            threads=1,
            progress=False,
        )
    )
    assert r["metrics"]["test"]["f1"] > 0.10, r["metrics"]
