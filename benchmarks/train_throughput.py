"""Training throughput (tokens/s/GPU) and MFU of our engine vs plain HF EuroBERT, same shapes.

For each preset x sequence length x objective x precision, in one process:
- ours: `Trainer.train_step(phase)` (megatron-core EncoderLM, megatron DDP + optimizer, packed mock
  samples with per-document attention). Attention core (`model.attention`): Transformer Engine's
  packed THD path when TE imports (bf16, and FP8 rows), else --attention: `sdpa` (SDPAttention,
  dense [b,1,s,s] document mask) or `flex` (FlexDocumentAttention: block-sparse document masking;
  CUDA only, torch has no FlexAttention backward on CPU). Default: flex on CUDA, sdpa on CPU.
- hf (MLM rows): EuroBertForMaskedLM(attn_implementation="sdpa") under torch.compile, fused AdamW,
  bf16 autocast on GPU, the same masked inputs (megatron_mlmclm.objectives.mlm_mask on the same
  samples), cross-entropy over full logits, padding-free batch with attention_mask all ones (HF's
  SDPA then runs unmasked: cheaper than document masking, and blind to document boundaries).
  EuroBERT is an encoder: there is no HF baseline for CLM rows.

MFU = model FLOPs (megatron_mlmclm.flops.mfu_step_flops: attention counted in full, half
for causal; output head at labelled positions) / step time / dense bf16 peak of the device
(megatron_mlmclm.runtime.distributed.device_peak_flops). The same FLOP count is used for hf, so MFU
ratios equal throughput ratios.
On CPU the peak is unknown and MFU prints n/a.

    PYTHONPATH=. python benchmarks/train_throughput.py          # GPU: presets, bf16 (+FP8 w/ TE)
    PYTHONPATH=. python benchmarks/train_throughput.py --quick  # CPU: tiny, seq 64/128, fp32

Last line: RESULT train_throughput ratio=<ours_s/hf_s> ours_s=.. baseline_s=.. for the headline
row (210m, seq 2048, MLM 40%, bf16; with --quick the largest quick MLM row).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import shutil
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", category=UserWarning)  # megatron's no-Apex/TE notices

LR, BETAS, EPS, WD, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def on_gpu() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def build_ours(args, preset: str, seq: int, objective: str, precision: str, fp8, attention: str):
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.training.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench_train_throughput_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    mb = args.micro_batch or max(1, args.tokens_per_step // seq)
    overrides = [
        f"output_dir={out}",
        f"checkpoint.dir={out}/ckpt",
        "checkpoint.resume=false",
        "logging.tensorboard=false",
        "data.mock=true",
        f"model.preset={preset}",
        "data.loader=sync",  # batches built in the step, as for hf (benchmarks/data_loader.py)
        f"model.vocab_size={args.vocab}",
        f"model.seq_length={seq}",
        f"train.steps={args.warmup + args.steps + 10}",
        "train.warmup_steps=0",
        "train.decay_steps=0",
        f"train.lr={LR}",
        f"train.adam_beta1={BETAS[0]}",
        f"train.adam_beta2={BETAS[1]}",
        f"train.adam_eps={EPS}",
        f"train.weight_decay={WD}",
        f"train.clip_grad={CLIP}",
        f"train.micro_batch_size={mb}",
        f"train.global_batch_size={mb}",
        f"train.precision={precision}",
        f"phases.0.objective={objective}",
    ]
    if objective == "mlm":
        overrides.append(f"phases.0.mask_ratio={args.mask_ratio}")
    if fp8:
        overrides.append(f"train.fp8={fp8}")
    cfg = load_config(None, overrides + [f"model.attention={attention}"])
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer, cfg, mb


def build_hf(cfg, bf16: bool, compile_model: bool):
    from transformers import AutoModelForMaskedLM, EuroBertConfig

    m = cfg.model
    config = EuroBertConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        head_dim=m.kv_channels,
        max_position_embeddings=max(m.seq_length, 512),
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
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    device = "cuda" if on_gpu() else "cpu"
    model.to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=on_gpu()
    )
    fwd = torch.compile(model) if compile_model else model
    return model, fwd, opt


def time_rows(loops: dict, warmup: int, steps: int) -> dict[str, list[float]]:
    """Alternate the loops step by step (rotating order); return timed seconds per loop."""
    names = list(loops)
    times = {n: [] for n in names}
    for r in range(warmup + steps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            sync()
            t0 = time.perf_counter()
            loops[n](r)
            sync()
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
    return times


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="CPU check: tiny preset, seq 64/128, fp32, few steps"
    )
    p.add_argument("--presets", default="210m,610m,1b")
    p.add_argument("--seqs", default="512,1024,2048")
    p.add_argument("--objectives", default="clm,mlm")
    p.add_argument("--mask-ratio", type=float, default=0.4)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument(
        "--tokens-per-step",
        type=int,
        default=16384,
        help="micro-batch = tokens-per-step // seq (one micro-batch per step)",
    )
    p.add_argument("--micro-batch", type=int, default=None, help="fixed micro-batch instead")
    p.add_argument(
        "--fp8",
        default="delayed,current",
        help="FP8 recipes to add as rows where Transformer Engine exists",
    )
    p.add_argument(
        "--attention",
        choices=["sdpa", "flex"],
        default=None,
        help="core attention without TE (default: flex on CUDA, sdpa on CPU)",
    )
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="HF baseline in eager mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.quick:
        args.presets, args.seqs, args.vocab = "tiny", "64,128", 1024
        args.tokens_per_step, args.warmup, args.steps = 256, 2, 3
    if args.threads:
        torch.set_num_threads(args.threads)

    from megatron_mlmclm.flops import mfu_step_flops
    from megatron_mlmclm.model.build import have_transformer_engine
    from megatron_mlmclm.objectives import IGNORE, mlm_mask
    from megatron_mlmclm.runtime.distributed import device_peak_flops

    gpu = on_gpu()
    te = have_transformer_engine() and gpu
    precisions = [("bf16", None)] if gpu else [("fp32", None)]
    if te:
        precisions += [("bf16", r) for r in args.fp8.split(",") if r]
    attention = "te" if te else (args.attention or ("flex" if gpu else "sdpa"))
    if attention == "flex" and not gpu:
        raise SystemExit("--attention flex needs CUDA (torch has no FlexAttention backward on CPU)")
    peak = device_peak_flops()
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"Transformer Engine {'yes' if te else 'no'}, attention core {attention}, "
        f"peak bf16 {fmt(peak and peak / 1e12, '.0f')} TFLOP/s"
    )
    print(
        f"vocab {args.vocab}; one micro-batch of ~{args.tokens_per_step} tokens per step; "
        f"{args.warmup} warmup + {args.steps} timed steps, ours and hf alternating; "
        "median s/step"
    )

    rows, headline = [], None
    for preset in args.presets.split(","):
        for seq in [int(s) for s in args.seqs.split(",")]:
            for objective in args.objectives.split(","):
                for precision, fp8 in precisions:
                    label = (
                        f"{preset} s{seq} {objective}{' 40%' if objective == 'mlm' else ''} "
                        f"{precision}{'+fp8-' + fp8 if fp8 else ''}"
                    )
                    try:
                        row = run_row(
                            args,
                            preset,
                            seq,
                            objective,
                            precision,
                            fp8,
                            attention,
                            peak,
                            mfu_step_flops,
                            mlm_mask,
                            IGNORE,
                        )
                    except torch.OutOfMemoryError:
                        row = {"oom": True}
                    row["label"] = label
                    rows.append(row)
                    print_row(row)
                    if (
                        objective == "mlm"
                        and fp8 is None
                        and "ours_s" in row
                        and ((preset == "210m" and seq == 2048) or args.quick)
                    ):
                        headline = row
                    gc.collect()
                    if gpu:
                        torch.cuda.empty_cache()

    print("\n| config | mb | ours tok/s/GPU | ours MFU | hf tok/s | hf MFU | ours/hf s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("oom"):
            print(f"| {r['label']} | OOM | | | | | |")
            continue
        ratio = r["ours_s"] / r["hf_s"] if r.get("hf_s") else None
        print(
            f"| {r['label']} | {r['mb']} | {r['ours_tok']:.0f} | {fmt(r['ours_mfu'], '.1%')} | "
            f"{fmt(r.get('hf_tok'), '.0f')} | {fmt(r.get('hf_mfu'), '.1%')} | "
            f"{fmt(ratio, '.3f')} |"
        )
    if headline is None or not headline.get("hf_s"):
        print("RESULT train_throughput ratio=n/a (headline row 210m s2048 mlm not run)")
        return
    print(f"headline: {headline['label']}")
    print(
        f"RESULT train_throughput ratio={headline['ours_s'] / headline['hf_s']:.3f} "
        f"ours_s={headline['ours_s']:.4f} baseline_s={headline['hf_s']:.4f}"
    )


def run_row(
    args,
    preset,
    seq,
    objective,
    precision,
    fp8,
    attention,
    peak,
    mfu_step_flops,
    mlm_mask,
    IGNORE,
) -> dict:
    trainer, cfg, mb = build_ours(
        args, preset, seq, objective, precision, fp8, {"te": "auto"}.get(attention, attention)
    )
    phase, spec, seed = cfg.phases[0], trainer.spec, cfg.data.seed
    labelled = []

    def step_ours(r):
        trainer.step = r
        labelled.append(int(trainer.train_step(phase)["tokens"]))

    loops = {"ours": step_ours}
    if objective == "mlm" and not args.no_hf:
        model, fwd, opt = build_hf(cfg, precision == "bf16", not args.no_compile)
        dev = "cuda" if on_gpu() else "cpu"
        amp = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if precision == "bf16" and on_gpu()
            else torch.autocast("cpu", enabled=False)
        )

        def step_hf(r):
            idx = list(range(r * mb, (r + 1) * mb))
            samples = [trainer.train_ds[0][i] for i in idx]  # the run's one sample stream
            pairs = [
                mlm_mask(
                    s["tokens"][:-1].astype(np.int64),
                    i,
                    seed,
                    phase.mask_ratio,
                    spec,
                    phase.mask_replace,
                )
                for s, i in zip(samples, idx)
            ]
            inputs = torch.from_numpy(np.stack([q[0] for q in pairs])).to(dev, non_blocking=True)
            labels = torch.from_numpy(np.stack([q[1] for q in pairs])).to(dev, non_blocking=True)
            with amp:
                logits = fwd(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits
                loss = F.cross_entropy(
                    logits.view(-1, logits.size(-1)).float(), labels.view(-1), ignore_index=IGNORE
                )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)

        loops["hf"] = step_hf
    t0 = time.perf_counter()
    times = time_rows(loops, args.warmup, args.steps)
    wall = time.perf_counter() - t0
    tokens = mb * seq
    ours_s = statistics.median(times["ours"])
    flops = mfu_step_flops(
        cfg.model.shape(),
        spec.vocab_size,
        seq,
        mb,
        int(statistics.median(labelled)),
        causal=objective == "clm",
    )
    row = {
        "mb": mb,
        "ours_s": ours_s,
        "ours_tok": tokens / ours_s,
        "ours_mfu": flops / ours_s / peak if peak else None,
        "wall_s": wall,
    }
    if "hf" in times:
        hf_s = statistics.median(times["hf"])
        row.update(hf_s=hf_s, hf_tok=tokens / hf_s, hf_mfu=flops / hf_s / peak if peak else None)
    trainer.close()
    return row  # both models go with this frame; the caller's gc.collect() frees them


def print_row(row) -> None:
    if row.get("oom"):
        print(f"{row['label']}: out of memory")
        return
    hf = (
        f"hf {row['hf_s']:.4f} s ({row['hf_tok']:.0f} tok/s, MFU {fmt(row['hf_mfu'], '.1%')})"
        if row.get("hf_s")
        else "hf n/a"
    )
    print(
        f"{row['label']}: mb {row['mb']}, ours {row['ours_s']:.4f} s ({row['ours_tok']:.0f} "
        f"tok/s/GPU, MFU {fmt(row['ours_mfu'], '.1%')}); {hf}; wall {row['wall_s']:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
