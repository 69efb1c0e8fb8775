"""`mlmclm convert from-megatron-lm`: a checkpoint laid out as Megatron-LM writes it, imported
exactly.

The source checkpoint is written here by megatron-core's own GPTModel (local spec, bf16 weights) and
dist_checkpointing, with Megatron-LM's common state (`args` as an argparse.Namespace, `iteration`,
`checkpoint_version`) and folder layout (``iter_0000010/`` + ``latest_checkpointed_iteration.txt``).
The reference for the logits is that writer model itself, in memory; ours is the trainer's model
loaded the trainer's way from the converted output. A copy whose files run a command as they are
read is refused, the command never run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import checkpoint_files as cf
import pytest
import torch
import torch.nn.functional as F
import yaml
from jobs import job_env, word_tokenizer

from megatron_mlmclm.cli import main as cli_main
from megatron_mlmclm.convert.megatron_lm import from_megatron_lm

VOCAB = 300  # tokenizer size; the source's padded vocabulary is larger (Megatron-LM pads for TP)


def megatron_lm_args(**over) -> argparse.Namespace:
    """The architecture part of Megatron-LM's args for a Llama-style GPT (plus run fields)."""
    a = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=160,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=16,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=500000,
        rotary_percent=1.0,
        rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        untie_embeddings_and_output_weights=True,
        padded_vocab_size=512,
        make_vocab_size_divisible_by=128,
        seq_length=64,
        max_position_embeddings=64,
        qk_layernorm=False,
        add_bias_linear=False,
        add_qkv_bias=False,
        num_experts=None,
        multi_latent_attention=False,
        apply_layernorm_1p=False,
        window_size=None,
        init_method_std=0.02,
        ckpt_format="torch_dist",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        bf16=True,
        tokenizer_type="HuggingFaceTokenizer",
        lr=3e-4,
        train_iters=10,
        micro_batch_size=1,
        global_batch_size=8,
    )
    a.update(over)
    return argparse.Namespace(**a)


def write_megatron_lm(save_dir: Path, args: argparse.Namespace, iteration: int = 10, seed: int = 0):
    """Megatron-LM's torch_dist layout; returns the writer model (float32, the saved weights)."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mlmclm.convert.common import init_single_process

    init_single_process(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu,
        add_bias_linear=args.add_bias_linear,
        qk_layernorm=args.qk_layernorm,
        init_method_std=0.2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            normalization=args.normalization, qk_layernorm=args.qk_layernorm
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    ).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # away from 1 so a mapping mistake shows in the logits
                p.uniform_(0.5, 1.5)
            p.copy_(p.bfloat16().float())  # the saved bf16 values, exactly
    sharded = model.sharded_state_dict()
    for sh in sharded.values():
        if hasattr(sh, "data") and torch.is_tensor(sh.data) and sh.data.is_floating_point():
            sh.data = sh.data.bfloat16()  # Megatron-LM saves the bf16 model params
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": sharded,
        "opt_param_scheduler": {"num_steps": iteration * args.global_batch_size},
        "num_floating_point_operations_so_far": 0,
    }
    it = save_dir / f"iter_{iteration:07d}"
    it.mkdir(parents=True)
    dist_checkpointing.save(state, str(it))
    (save_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return model


def causal_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None).float()


def ours_from_run_config(
    run_yaml: Path, tokens: torch.Tensor, causal: bool, overrides=()
) -> torch.Tensor:
    """Logits of the model `mlmclm pretrain run_yaml` starts from (its init_from), loaded the
    trainer's way."""
    from megatron_mlmclm.checkpoint import latest_checkpoint, load_checkpoint
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.model.build import build_model_chunk, transformer_config
    from megatron_mlmclm.objectives import document_attention_mask
    from megatron_mlmclm.runtime.distributed import init_distributed

    cfg = load_config(run_yaml, ["data.mock=true", "train.precision=fp32", *overrides])
    init_distributed(1, 1, None, 0)
    model = build_model_chunk(cfg, transformer_config(cfg), cfg.model.vocab_size, True, True)
    load_checkpoint(latest_checkpoint(cfg.train.init_from), [model.eval()], load_rng=False)
    b, s = tokens.shape
    mask = document_attention_mask(torch.zeros(b, s, dtype=torch.long), causal)
    with torch.no_grad():
        return model(tokens, torch.arange(s).expand(b, s), mask).float()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("mlm_tok"), VOCAB)


@pytest.mark.parametrize("variant", ["gqa_untied", "tied_qknorm_llama3"])
def test_megatron_lm_checkpoint_imports_exactly(tmp_path, tok_dir, variant):
    over = (
        {}
        if variant == "gqa_untied"
        else dict(
            untie_embeddings_and_output_weights=False,
            qk_layernorm=True,
            group_query_attention=False,
            num_query_groups=None,
            use_rope_scaling=True,
            rope_scaling_factor=32.0,
            seq_length=96,
            max_position_embeddings=96,
        )
    )
    args = megatron_lm_args(**over)
    if args.num_query_groups is None:  # Megatron-LM without GQA: one KV head per query head
        args.num_query_groups = args.num_attention_heads
    writer = write_megatron_lm(tmp_path / "mlm", args)

    res = from_megatron_lm(
        tmp_path / "mlm", tmp_path / "out", tokenizer=str(tok_dir), verbose=False
    )
    assert res.verification.max_abs_diff <= 1e-4 and res.vocab_size == VOCAB
    run = yaml.safe_load((res.path / "config.yaml").read_text())
    m = run["model"]
    assert (
        m["num_layers"],
        m["hidden_size"],
        m["ffn_hidden_size"],
        m["num_attention_heads"],
        m["kv_channels"],
        m["seq_length"],
        m["rotary_base"],
    ) == (2, 64, 160, 4, 16, args.seq_length, 500000.0)
    assert m["num_query_groups"] == (2 if variant == "gqa_untied" else 4)
    assert m["tie_embeddings"] == (variant != "gqa_untied")
    assert m["qk_layernorm"] == (variant != "gqa_untied")
    assert m["rope_scaling"] == (
        None
        if variant == "gqa_untied"
        else {
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    assert run["train"]["init_from"] == str(res.path / "checkpoints")
    assert (res.path / "tokenizer" / "tokenizer.json").is_file()
    source = json.loads((res.path / "mlmclm_source.json").read_text())
    assert source["family"] == "megatron-lm" and source["iteration"] == 10

    tokens = torch.randint(
        0, VOCAB, (2, args.seq_length), generator=torch.Generator().manual_seed(11)
    )
    ref = causal_logits(writer, tokens)[..., :VOCAB]
    ours = ours_from_run_config(res.path / "config.yaml", tokens, causal=True)[..., :VOCAB]
    assert (ours - ref).abs().max().item() < 1e-4
    bidir = ours_from_run_config(res.path / "config.yaml", tokens, causal=False)[..., :VOCAB]
    assert (bidir - ref).abs().max().item() > 1e-3  # the comparison can tell attention kinds apart
    if args.use_rope_scaling:  # ... and scaled RoPE from plain RoPE
        plain = ours_from_run_config(
            res.path / "config.yaml", tokens, causal=True, overrides=["model.rope_scaling=null"]
        )[..., :VOCAB]
        assert (plain - ref).abs().max().item() > 1e-3


def run_cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main(["convert", *map(str, args)])
    return rc, capsys.readouterr().err


def test_refusals_are_one_line(tmp_path, tok_dir, capsys):
    out = tmp_path / "out"
    good = tmp_path / "good"
    write_megatron_lm(good, megatron_lm_args())
    cases = {
        "layernorm": (dict(normalization="LayerNorm"), "LayerNorm"),
        "bias": (dict(add_bias_linear=True), "biases"),
        "learned": (dict(position_embedding_type="learned_absolute"), "learned_absolute"),
        "moe": (dict(num_experts=8), "mixture of experts"),
        "gelu": (dict(swiglu=False), "SwiGLU"),
        "vocab": (dict(padded_vocab_size=256), "padded vocabulary is 256"),
    }
    for name, (over, match) in cases.items():
        # The checks read the saved args: the good checkpoint with edited args.
        bad = tmp_path / name
        shutil.copytree(good, bad)
        common_pt = bad / "iter_0000010" / "common.pt"
        state = torch.load(common_pt, weights_only=False)
        state["args"] = megatron_lm_args(**over)
        torch.save(state, common_pt)
        rc, err = run_cli(capsys, "from-megatron-lm", bad, out, "--tokenizer", tok_dir)
        assert rc == 2 and err.strip().count("\n") == 0 and match in err, (name, err)
    for args, match in (
        ((good, out), "--tokenizer"),
        ((tmp_path / "missing", out, "--tokenizer", tok_dir), "does not exist"),
        ((tok_dir, out, "--tokenizer", tok_dir), "torch_dist"),
        ((good, out, "--tokenizer", good), "tokenizer"),
    ):
        rc, err = run_cli(capsys, "from-megatron-lm", *args)
        assert rc == 2 and err.strip().count("\n") == 0 and match in err, err
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    # The Megatron-style script runs the same code.
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parent.parent / "tools" / "convert_checkpoint.py"),
            "--loader",
            "megatron-lm",
            "--saver",
            "megatron",
            "--load-dir",
            str(good),
            "--save-dir",
            str(out),
        ],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--tokenizer" in proc.stderr and not out.exists()


@pytest.fixture(scope="module")
def megatron_lm_source(tmp_path_factory):
    """A Megatron-LM save dir (torch_dist), written once for the poisoned copies below."""
    save_dir = tmp_path_factory.mktemp("megatron_lm") / "mlm"
    write_megatron_lm(save_dir, megatron_lm_args())
    return save_dir


def poison_legacy(save_dir: Path, marker: Path) -> None:
    """The legacy (torch) layout in place of torch_dist: iter_0000010/mp_rank_00/
    model_optim_rng.pt, a pickle that runs a command and returns the state it stands for."""
    it = save_dir / "iter_0000010"
    shutil.rmtree(it)
    (it / "mp_rank_00").mkdir(parents=True)
    state = {"args": megatron_lm_args(), "iteration": 10, "checkpoint_version": 3.0}
    torch.save(cf.Payload(marker, state), it / "mp_rank_00" / "model_optim_rng.pt")


@pytest.mark.parametrize("poison", [".metadata", "common.pt", "legacy model_optim_rng.pt"])
def test_a_checkpoint_that_runs_a_command_when_read_is_refused(
    megatron_lm_source, tmp_path, tok_dir, capsys, monkeypatch, poison
):
    """A Megatron-LM checkpoint (from someone else: no manifest) whose `.metadata`, `common.pt`
    or legacy `model_optim_rng.pt` is a pickle that runs a command (creating a marker file) and
    returns the real contents: refused in one line, exit status 2, the command never run,
    nothing written. TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turns torch.load's default weights_only
    off: megatron-core's own common-state reader then runs the payload, ours does not."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    save_dir = tmp_path / "mlm"
    shutil.copytree(megatron_lm_source, save_dir)
    it = save_dir / "iter_0000010"
    marker = tmp_path / "payload-ran"
    if poison == ".metadata":
        cf.poison_metadata(it, marker)
    elif poison == "common.pt":
        cf.poison_common(it, marker)
        from megatron.core import dist_checkpointing

        dist_checkpointing.load_common_state_dict(str(it))  # megatron-core's reader: it runs
        assert marker.exists()
        marker.unlink()
    else:
        poison_legacy(save_dir, marker)
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "from-megatron-lm", save_dir, out, "--tokenizer", tok_dir)
    assert rc == 2 and err.strip().count("\n") == 0, err
    expected = {
        ".metadata": f"checkpoint {it} is refused: its .metadata names _operator.getitem",
        "common.pt": f"checkpoint {it} is refused: its common.pt holds what a weights-only load",
        "legacy model_optim_rng.pt": "is a legacy (torch) Megatron-LM checkpoint",
    }[poison]
    assert expected in err, err
    assert not marker.exists() and not out.exists() and not list(tmp_path.glob("out.tmp-*"))
