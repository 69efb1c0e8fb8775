"""Phase recipes: budgets in steps, tokens or FLOPs (checked against hand-computed FLOPs), mask
schedules, per-phase data / seq_length / RoPE, the phase plan's streams, the recipes of
examples/configs/recipes (at full size with --dry-run, at the tiny preset on CPU), and exact
resume after kill -9 across each kind of phase change."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import yaml
from jobs import (
    REPO,
    kill_after_checkpoint,
    random_shard,
    read_metrics,
    run_pretrain,
    word_tokenizer,
)
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_mlmclm.cli import main
from megatron_mlmclm.config import (
    MaskSchedule,
    PhasePlan,
    budget_report,
    causal_attention_halved,
    dump_yaml,
    load_config,
    resolved_phases,
)
from megatron_mlmclm.data.dataset import temperature_blend
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.kernels import Kernels, plan_kernels

RECIPES = REPO / "examples" / "configs" / "recipes"


def cfg(overrides, path=None):
    return load_config(path, ["data.mock=true", "logging.eval_interval=0"] + overrides)


# --------------------------------------------------------------------------------------------------
# Budgets


def test_flops_budgets_match_hand_computed_flops_for_two_presets():
    """Per-step FLOPs by hand (2 FLOPs a multiply-add, backward = 2x forward) for tiny and 210m,
    CLM with and without halved causal attention and MLM 40% with the sparse head; the steps a
    budget buys are budget / per-step FLOPs, rounded."""
    # tiny: h 128, 4 layers, 4 heads of 32, 2 KV groups, FFN 384, seq 128, vocab 1000, GBS 8.
    # per token per layer: QKV 2*128*(128 + 2*64) = 65,536; out 2*128*128 = 32,768;
    # SwiGLU 2*3*128*384 = 294,912 -> 393,216; attention 2*2*128*128 = 65,536 (32,768 causal-half)
    tiny_clm_full = 3 * 8 * 128 * (4 * (393_216 + 65_536) + 2 * 128 * 1000)
    tiny_clm_half = 3 * 8 * 128 * (4 * (393_216 + 32_768) + 2 * 128 * 1000)
    tiny_mlm = 3 * 8 * 128 * (4 * (393_216 + 65_536) + 0.4 * 2 * 128 * 1000)
    # 210m: h 768, 12 layers, 12 heads of 64 (no GQA), FFN 3072, seq 2048, vocab 128,256, GBS 16.
    # per token per layer: 2*768*2304 + 2*768*768 + 6*768*3072 = 18,874,368;
    # attention 4*2048*768 = 6,291,456 (3,145,728 causal-half); head 2*768*128,256 = 197,001,216
    big_clm_half = 3 * 16 * 2048 * (12 * (18_874_368 + 3_145_728) + 197_001_216)
    big_mlm = 3 * 16 * 2048 * (12 * (18_874_368 + 6_291_456) + 0.4 * 197_001_216)
    cases = [
        ("tiny", 1000, 8, "clm", "full", tiny_clm_full),
        ("tiny", 1000, 8, "clm", "causal-half", tiny_clm_half),
        ("tiny", 1000, 8, "mlm", "full", tiny_mlm),
        ("210m", 128256, 16, "clm", "causal-half", big_clm_half),
        ("210m", 128256, 16, "mlm", "causal-half", big_mlm),
    ]
    for preset, vocab, gbs, objective, attention, per_step in cases:
        budget = 1000.4 * per_step  # 1000 steps and a bit: rounds to 1000
        c = cfg(
            [
                f"model.preset={preset}",
                f"model.vocab_size={vocab}",
                f"train.global_batch_size={gbs}",
                "train.micro_batch_size=1",
                f"train.flops={budget}",
                f"train.flops_attention={attention}",
                f"phases=[{{objective: {objective}, mask_ratio: 0.4}}]",
            ]
        )
        assert c.train.steps == 1000 and c.phases[0].steps == 1000, (preset, objective)
        report = budget_report(c)[0]
        assert f"{1000 * per_step:.4g} FLOPs" in report, (report, per_step)


def test_equal_flops_gives_mlm_more_steps_and_a_tokens_budget_follows_seq_length():
    flops = 1e15
    steps = {}
    for objective in ("clm", "mlm"):
        c = cfg(
            [
                "model.vocab_size=1000",
                f"train.flops={flops}",
                "train.flops_attention=full",
                f"phases=[{{objective: {objective}, mask_ratio: 0.4}}]",
            ]
        )
        steps[objective] = c.train.steps
    assert steps["mlm"] > steps["clm"]
    # 2 phases by share of 1.6M tokens, GBS 8: 1024-token samples then 2048-token ones.
    c = cfg(
        [
            "model.seq_length=1024",
            "train.tokens=1.6e6",
            "train.warmup_steps=1",
            "phases=[{objective: mlm, share: 0.5}, {objective: mlm, share: 0.5, seq_length: 2048}]",
        ]
    )
    assert [p.steps for p in c.phases] == [98, 49]  # 8e5 / 8192 = 97.7, 8e5 / 16384 = 48.8
    assert c.train.steps == 147


def test_budget_rules_round_trip_and_refusals(tmp_path):
    c = cfg(
        [
            "model.vocab_size=1000",
            "train.flops=1e15",
            "train.warmup_steps=1",
            "phases=[{objective: clm, share: 0.25}, {objective: mlm, share: 0.75, decay: true}]",
        ]
    )
    assert c.train.decay_steps == c.phases[1].steps and c.train.flops_attention == "full"
    dump_yaml(c, tmp_path / "run.yaml")  # the resolved config loads back to the same steps
    again = load_config(tmp_path / "run.yaml")
    assert [p.steps for p in again.phases] == [p.steps for p in c.phases]
    assert again.train.steps == c.train.steps
    refusals = [
        (["train.flops=1e15", "train.tokens=1e9"], "exactly one of train.steps"),
        (["model.vocab_size=1000", "train.flops=1e15", "train.steps=7"], "train.steps=null"),
        (["train.flops=1e15"], "needs model.vocab_size"),
        (["phases=[{objective: mlm, share: 0.5, tokens: 1e6}]"], "gives share and tokens"),
        (
            ["phases=[{objective: mlm, share: 0.5, decay: true}, {objective: mlm, share: 0.5}]"],
            "the decay phases are the run's last",
        ),
        (
            [
                "train.decay_steps=3",
                "phases=[{objective: mlm, share: 0.5}, {objective: mlm, share: 0.5, decay: true}]",
            ],
            "disagrees with the decay phases",
        ),
        (["phases=[{objective: mlm, mask_ratio: {from: 0.3, to: 1.5}}]"], "must be in (0, 1)"),
        (
            ["phases=[{objective: mlm, mask_ratio: {from: 0.3, to: 0.1, shape: zigzag}}]"],
            "linear, cosine, step",
        ),
        (["phases=[{objective: mlm, data: {temperature: 0.5}}]"], "contradicts phases.0.data"),
    ]
    for overrides, message in refusals:
        with pytest.raises(UsageError) as e:
            cfg(overrides)
        assert message in str(e.value), (overrides, str(e.value))


def test_mask_schedules_and_the_phase_plan_streams():
    s = MaskSchedule(0.3, 0.1, "linear")
    assert [round(s.at(p), 6) for p in (0, 0.5, 1)] == [0.3, 0.2, 0.1]
    c = MaskSchedule(0.3, 0.1, "cosine")
    assert [round(c.at(p), 6) for p in (0, 0.5, 1)] == [0.3, 0.2, 0.1]
    assert round(c.at(0.25), 6) == round(0.1 + 0.2 * (1 + math.cos(math.pi / 4)) / 2, 6)
    st = MaskSchedule(0.3, 0.1, "step")
    assert (st.at(0.49), st.at(0.5)) == (0.3, 0.1)
    # clm 4 steps, mlm 4 (same stream: continues), mlm at seq 64 (new stream from 0), mlm back at
    # the run's length (continues the first stream after its 8 x 4 samples).
    run = cfg(
        [
            "model.seq_length=32",
            "train.steps=16",
            "train.warmup_steps=1",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "phases=[{objective: clm, steps: 4}, {objective: mlm, steps: 4, mask_ratio: "
            "{from: 0.4, to: 0.1}}, {objective: mlm, steps: 4, seq_length: 64}, "
            "{objective: mlm, steps: 4, seq_length: 32}]",
        ]
    )
    plan = PhasePlan(resolved_phases(run), 4)
    assert [plan.stream(k) for k in (0, 4, 8, 12)] == [0, 0, 1, 0]
    assert [plan.position(k) for k in (0, 3, 4, 7, 8, 11, 12, 15)] == [0, 12, 16, 28, 0, 12, 32, 44]
    assert [s.samples for s in plan.streams] == [48, 16]
    assert [round(plan.phase(k).mask_ratio, 6) for k in (4, 5, 7)] == [0.4, 0.3, 0.1]
    assert plan.phase(0) is plan.phases[0]  # constant phases are passed through as they are


def test_budget_attention_count_follows_the_kernel_plan():
    """causal_attention_halved (config, no torch needed) agrees with model/kernels/'s attention
    path: halved exactly where the plan picks a kernel that skips masked blocks."""
    for device, attention, te, precision, which in itertools.product(
        ("cpu", "cuda"),
        ("auto", "sdpa", "flex", "thd"),
        (None, (2, 8)),
        ("bf16", "fp32"),
        ("torch", "te"),
    ):
        if which == "te" and (
            attention in ("sdpa", "flex") or precision == "fp32" or (device, te) == ("cuda", None)
        ):
            continue  # refused (tests/test_kernels.py)
        c = cfg(
            [
                f"runtime.device={device}",
                f"model.attention={attention}",
                f"train.precision={precision}",
                f"model.kernels={which}",
            ]
        )
        c.train.flops_attention = "auto"
        kernels = Kernels(te_version=te)
        import importlib.util

        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a, te=te, real=real: (
            object()
            if name == "transformer_engine" and te
            else (None if name == "transformer_engine" else real(name, *a))
        )
        try:
            halved = causal_attention_halved(c)
        finally:
            importlib.util.find_spec = real
        plan = plan_kernels(c, device, kernels)
        assert halved == (plan.attention in ("te-thd", "flex")), (device, attention, te, which)


def test_temperature_weights_by_hand(tmp_path):
    prefixes = []
    for name, n_tokens in (("small", 100), ("large", 900)):
        builder = IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=np.int32)
        builder.add_item(torch.arange(n_tokens, dtype=torch.int32))
        builder.end_document()
        builder.finalize(str(tmp_path / f"{name}.idx"))
        prefixes.append(str(tmp_path / name))
    items = temperature_blend(prefixes, 0.5)
    w = [float(x) for x in items[0::2]]
    expected = [
        math.sqrt(0.1) / (math.sqrt(0.1) + math.sqrt(0.9)),
        math.sqrt(0.9) / (math.sqrt(0.1) + math.sqrt(0.9)),
    ]
    assert items[1::2] == prefixes and w == pytest.approx(expected, rel=1e-12)


def test_a_phase_rope_base_is_megatrons_own_frequencies_for_that_base():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_mlmclm.mcore_patches.apply import apply_patches
    from megatron_mlmclm.model.build import set_rotary_base

    apply_patches()  # megatron's RoPE asks for a CUDA device; this machine has none

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary_pos_emb = RotaryEmbedding(
                32, 1.0, rotary_base=10000, use_cpu_initialization=True
            )

    chunk = Chunk()
    before = chunk.rotary_pos_emb(16).clone()
    set_rotary_base([chunk], cfg([]).model, 160000)
    reference = RotaryEmbedding(32, 1.0, rotary_base=160000, use_cpu_initialization=True)
    assert torch.equal(chunk.rotary_pos_emb.inv_freq, reference.inv_freq)
    assert torch.equal(chunk.rotary_pos_emb(16), reference(16))  # no stale cached embedding
    assert not torch.equal(before, reference(16))


# --------------------------------------------------------------------------------------------------
# Recipes


def tiny_shards(root, names, tok):
    """A word-corpus shard per name (different seeds): data/shards/<name>_text_document."""
    return {
        f"data/shards/{name}_text_document": random_shard(
            root / f"{name}_text_document", tok, seed=k, docs=300, low=5
        )
        for k, name in enumerate(sorted(names))
    }


def tiny_recipe(recipe: dict, shards: dict, tok, out) -> dict:
    """The recipe at the tiny preset: 8 steps of 4 samples, sequence lengths / 64, its shards."""
    r = yaml.safe_load(yaml.safe_dump(recipe))
    r["output_dir"] = str(out)
    r["model"] = {
        "preset": "tiny",
        "seq_length": max(8, r["model"].get("seq_length", 128) // 64),
        "rotary_base": r["model"].get("rotary_base", 10000.0),
    }
    r["train"] = {
        "steps": 8,
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "warmup_steps": 1,
        "lr": 1e-3,
    }
    if not any(ph.get("decay") for ph in r["phases"]):
        r["train"]["decay_steps"] = 1
    swap = lambda items: [shards.get(x, x) if isinstance(x, str) else x for x in items]  # noqa
    r["data"] = {
        "train": swap(r["data"]["train"]),
        "valid": swap(r["data"]["valid"]),
        "tokenizer": str(tok),
    }
    for ph in r["phases"]:
        if "seq_length" in ph:
            ph["seq_length"] //= 64
        if ph.get("data", {}).get("train"):
            ph["data"]["train"] = swap(ph["data"]["train"])
    r["checkpoint"] = {"save_interval": 0}
    r["logging"] = {"tensorboard": False, "eval_interval": 0, "eval_iters": 1}
    return r


@pytest.fixture(scope="module")
def recipe_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    tok = word_tokenizer(root, 300)
    names = set()
    for path in RECIPES.glob("*.yaml"):
        text = path.read_text()
        names |= {
            w.split("/")[-1][: -len("_text_document")]
            for w in text.replace(",", " ").replace("[", " ").replace("]", " ").split()
            if w.startswith("data/shards/")
        }
    return root, tok, tiny_shards(root, names, tok)


RECIPE_NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml"))


def test_there_are_the_recipes_the_docs_promise():
    assert RECIPE_NAMES == [
        "equal-flops-clm",
        "equal-flops-mlm",
        "ettin-decoder",
        "ettin-encoder",
        "mmbert",
        "modernbert",
        "study-clm-mlm",
    ]


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_recipe_dry_runs_at_full_size(name, placeholder_dry_run):
    out = placeholder_dry_run(str(RECIPES / f"{name}.yaml"))
    recipe = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    for i in range(len(recipe["phases"])):
        assert f"# phases.{i}: " in out and " tokens, " in out
    assert "# total: " in out and "FLOPs" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_recipe_runs_at_the_tiny_preset(name, recipe_data, tmp_path):
    root, tok, shards = recipe_data
    recipe = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(recipe, shards, tok, tmp_path / "run")))
    run_pretrain(path, [])
    records = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert [m["step"] for m in records] == list(range(1, 9))
    assert all(math.isfinite(m["loss"]) for m in records)
    phases = load_config(path).phases
    assert sorted({m["phase"] for m in records}) == [i for i, ph in enumerate(phases) if ph.steps]


def test_paired_recipes_read_the_same_samples_whatever_the_objective():
    plans = {}
    for name in ("ettin-encoder", "ettin-decoder"):
        c = load_config(RECIPES / f"{name}.yaml")
        plans[name] = PhasePlan(resolved_phases(c), c.train.global_batch_size)
        objectives = {ph.objective for ph in c.phases}
        assert objectives == ({"mlm"} if name == "ettin-encoder" else {"clm"})
    enc, dec = plans.values()
    assert enc.streams == dec.streams and enc.starts == dec.starts
    for step in (0, 1, enc.starts[1], enc.starts[2], enc.total - 1):
        assert (enc.stream(step), enc.position(step)) == (dec.stream(step), dec.position(step))


# --------------------------------------------------------------------------------------------------
# Exact resume across phase boundaries, and the guard that names the phase


CHANGES = {
    "rope": {"rotary_base": 160000},
    # One boundary that changes everything a phase may: a new stream (length and data) and RoPE.
    "seq_length+data+rope": {"seq_length": 32, "rotary_base": 160000},
}


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("phase_resume")
    tok = word_tokenizer(root, 300)
    return root, tok, tiny_shards(root, {"a", "b"}, tok)


def boundary_config(two_shards, change: str, out):
    root, tok, shards = two_shards
    second = {"objective": "mlm", "share": 0.5, **CHANGES[change]}
    if "data" in change:
        second["data"] = {"train": [shards["data/shards/b_text_document"]]}
    cfg_ = {
        "output_dir": str(out),
        "model": {"preset": "tiny", "seq_length": 16},
        "data": {"train": [shards["data/shards/a_text_document"]], "tokenizer": str(tok)},
        "phases": [{"objective": "clm", "share": 0.5}, second],
        "train": {
            "steps": 8,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "warmup_steps": 1,
            "decay_steps": 2,
        },
        "checkpoint": {"save_interval": 2, "keep_last": 2},
        "logging": {"tensorboard": False},
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg_))
    return path


@pytest.mark.slow
def test_kill_9_before_a_phase_change_resumes_bitwise(two_shards, tmp_path):
    """Killed before a boundary where the sequence length, the data and the RoPE base all change:
    the resumed run's losses equal an uninterrupted run's, bitwise."""
    change = "seq_length+data+rope"
    ref = boundary_config(two_shards, change, tmp_path / "ref")
    cut = boundary_config(two_shards, change, tmp_path / "cut")
    run_pretrain(ref, [])
    kill_after_checkpoint(["pretrain", str(cut)], 1, tmp_path / "cut", "iter_0000002")
    resumed = run_pretrain(cut, [])
    assert "at step 2" in resumed.stderr or "at step 4" in resumed.stderr, resumed.stderr[-2000:]
    curve = lambda d: {m["step"]: m["loss"] for m in read_metrics(d) if "loss" in m}  # noqa
    assert sorted(curve(tmp_path / "cut")) == list(range(1, 9))
    assert curve(tmp_path / "cut") == curve(tmp_path / "ref")  # bitwise, across the boundary


def test_resume_guard_names_the_phase_whose_definition_changed(two_shards, tmp_path, capsys):
    path = boundary_config(two_shards, "rope", tmp_path / "run")
    run_pretrain(path, ["train.steps=4", "train.decay_steps=1"])
    assert (
        main(
            [
                "pretrain",
                str(path),
                "train.steps=4",
                "train.decay_steps=1",
                "phases.1.rotary_base=500000",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "(phases.1 is the first that changed)" in err and "rotary_base 500000" in err, err


def test_the_interface_of_the_issue_reads_as_written(tmp_path):
    """The phase interface as proposed, verbatim, plus the vocabulary a FLOPs budget needs."""
    path = tmp_path / "run.yaml"
    path.write_text("""
model: {preset: 210m, vocab_size: 128256}
data: {train: [0.5, web, 0.5, books]}
train: {flops: 1.0e+21}          # or tokens: 1.0e+11, or steps: 42000 (exactly one)
phases:
  - {objective: mlm, share: 0.8, seq_length: 1024, mask_ratio: {from: 0.3, to: 0.15, shape: linear}}
  - {objective: mlm, share: 0.1, seq_length: 8192, rotary_base: 160000, mask_ratio: 0.15}
  - {objective: mlm, share: 0.1, mask_ratio: 0.05, data: {train: [0.5, web, 0.5, books]}}
""")
    c = load_config(path)
    assert c.phases[0].mask_ratio == MaskSchedule(0.3, 0.15, "linear")
    assert [p.seq_length for p in resolved_phases(c)] == [1024, 8192, 2048]
    assert c.train.steps == sum(p.steps for p in c.phases) > 0
    # A preset's steps cleared from the command line, a token budget instead:
    c = load_config(path, ["train.flops=null", "train.tokens=1e11"])
    assert c.train.tokens == 1e11 and c.train.flops is None
