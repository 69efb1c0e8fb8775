"""Shared by the engine benchmarks: the model-shape flags and an in-process Trainer on mock data."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time

import torch


def add_shape_arguments(p) -> None:
    p.add_argument(
        "--quick", action="store_true", help="seconds: tiny shapes, few steps (a smoke run)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--mask-ratio", type=float, default=0.4)


QUICK_SHAPES = dict(
    vocab=2048, hidden=64, ffn=192, layers=2, heads=4, kv_heads=2, seq=64, micro_batch=2
)


def apply_quick(args) -> None:
    """--quick: the tiny shapes above in place of the flags' (the step counts are each script's)."""
    if args.quick:
        for k, v in QUICK_SHAPES.items():
            setattr(args, k, v)


def build_trainer(args, extra_overrides: list[str], prefix: str):
    """A set-up Trainer (world of one, fp32) at the shapes in `args`, writing to a temp dir."""
    from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

    defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.training.trainer import Trainer

    out = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    steps = 10 * (args.warmup + args.steps) + 10
    overrides = [
        f"output_dir={out}",
        f"checkpoint.dir={out}/ckpt",
        "checkpoint.resume=false",
        "logging.tensorboard=false",
        "data.mock=true",
        "data.loader=sync",  # the step as it was measured: batches built in it (data_loader.py)
        f"model.vocab_size={args.vocab}",
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        f"model.ffn_hidden_size={args.ffn}",
        f"model.num_attention_heads={args.heads}",
        f"model.num_query_groups={args.kv_heads}",
        f"model.kv_channels={args.hidden // args.heads}",
        f"model.seq_length={args.seq}",
        f"train.steps={steps}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        "train.precision=fp32",
    ] + extra_overrides
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer, cfg


def hf_eurobert(
    *,
    vocab_size: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
    kv_channels: int,
    seq_length: int,
    seed: int = 0,
):
    """The Hugging Face baseline of the step benchmarks: EuroBERT's MLM model of these shapes
    (ours' architecture: SiLU, RMSNorm, no biases, untied), sdpa attention, fp32, ids 0-3 for
    pad, BOS, EOS and mask, initialised from `seed`; on the CPU."""
    from transformers import AutoModelForMaskedLM, EuroBertConfig

    config = EuroBertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_query_groups,
        head_dim=kv_channels,
        max_position_embeddings=max(seq_length, 512),
        hidden_act="silu",
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        mask_token_id=3,
    )
    torch.manual_seed(seed)
    model = AutoModelForMaskedLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_rows(
    loops: dict, warmup: int, steps: int, warm: dict[str, list[float]] | None = None
) -> dict[str, list[float]]:
    """Alternate the loops step by step (rotating order); return timed seconds per loop (each
    loop called with the round number, the device synchronised around it). `warm`, if given,
    receives the warm-up rounds' seconds per loop (where the compiles show)."""
    names = list(loops)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + steps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            sync()
            t0 = time.perf_counter()
            loops[n](r)
            sync()
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
            elif warm is not None:
                warm.setdefault(n, []).append(time.perf_counter() - t0)
    return times


def time_back_to_back(step, warmup: int, steps: int) -> list[float]:
    """Steps 0 .. warmup + steps - 1 of one loop (called with the step number), back to back as
    training runs them: the device is drained before the last warm-up step, whose host work
    starts the clock's lead-in, then each timed step's seconds run from the end of the step
    before it (no drain between steps: a step that reads a device value each step, as a training
    loop reads its loss, waits there for its own work). The device is drained at the end."""
    if warmup < 1:
        raise ValueError("time_back_to_back needs a warm-up step (the lead-in)")
    for r in range(warmup - 1):
        step(r)
    sync()
    step(warmup - 1)  # the lead-in: its device work runs into the first timed step
    times: list[float] = []
    t0 = time.perf_counter()
    for r in range(warmup, warmup + steps):
        step(r)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    sync()
    return times
