"""MLM vs CLM optimizer-step time through the real Trainer, same model and batch shapes, on CPU.

One Trainer (megatron-core GPTModel subclass EncoderLM, megatron DDP + optimizer, WSD schedule)
runs `Trainer.train_step(phase)` with a CLM phase and an MLM phase (40% masking) in turn, so both
objectives use the same weights, micro-batch, sequence length and vocabulary. The timed step is the
whole optimizer step as training runs it: building the micro-batch from packed mock samples
(masking + document attention mask), megatron's forward/backward schedule, grad clipping and Adam.

EncoderLM computes output logits only where the loss mask is set, so an MLM step at 40% masking pays
~40% of the output-layer matmul that a CLM step pays (CLM: every position but document ends).
Shapes default to a small trunk with a 32k vocabulary, where the output layer is a large share of
the step, as it is for the paper's models (vocab 128k).

    PYTHONPATH=. python benchmarks/mlm_vs_clm_step.py [--threads 1]
    PYTHONPATH=. python benchmarks/mlm_vs_clm_step.py --quick   # seconds: tiny shapes, 2 steps

Measurements alternate CLM/MLM steps (ABBA order per round) so machine noise hits both alike.
Last line: RESULT mlm_vs_clm_step ratio=<mlm_s/clm_s> ours_s=<mlm_s> baseline_s=<clm_s>
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _engine import add_shape_arguments, apply_quick, build_trainer

warnings.filterwarnings("ignore", category=UserWarning)  # megatron's no-Apex/TE notices


def build(args):
    return build_trainer(
        args,
        [
            "train.warmup_steps=1",
            "train.decay_steps=1",
            "phases.0.objective=clm",
            "phases.0.share=0.5",
            "phases.1.objective=mlm",
            "phases.1.share=0.5",
            f"phases.1.mask_ratio={args.mask_ratio}",
        ],
        prefix="bench_mlm_vs_clm_",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds per objective")
    p.add_argument("--steps", type=int, default=16, help="timed steps per objective")
    p.add_argument(
        "--forward-reps", type=int, default=6, help="timed forward-only passes (0: skip)"
    )
    args = p.parse_args()
    if args.quick:
        args.warmup, args.steps, args.forward_reps = 1, 2, 1
    apply_quick(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    trainer, cfg = build(args)
    clm, mlm = cfg.phases[0], cfg.phases[1]
    n_params = sum(p.numel() for c in trainer.model_chunks for p in c.parameters())
    print(
        f"torch {torch.__version__}, torch threads = {torch.get_num_threads()} (set explicitly), "
        f"device cpu, fp32"
    )
    print(
        f"shapes: vocab {args.vocab}, hidden {args.hidden}, ffn {args.ffn}, layers {args.layers}, "
        f"heads {args.heads}, kv heads {args.kv_heads}, seq {args.seq}, micro-batch "
        f"{args.micro_batch} (one micro-batch per step), {n_params / 1e6:.1f}M parameters "
        f"(output layer {args.vocab * args.hidden / 1e6:.1f}M)"
    )
    print(
        f"MLM mask ratio {args.mask_ratio}; {args.warmup} warmup + {args.steps} timed steps per "
        f"objective, interleaved ABBA"
    )

    times = {"clm": [], "mlm": []}
    tokens = {"clm": [], "mlm": []}

    def one(phase, record):
        t0 = time.perf_counter()
        stats = trainer.train_step(phase)
        dt = time.perf_counter() - t0
        trainer.step += 1
        if record:
            times[phase.objective].append(dt)
            tokens[phase.objective].append(stats["tokens"])

    for r in range(args.warmup + args.steps):
        order = (clm, mlm) if r % 2 == 0 else (mlm, clm)
        for ph in order:
            one(ph, r >= args.warmup)

    clm_s, mlm_s = statistics.median(times["clm"]), statistics.median(times["mlm"])
    for name in ("clm", "mlm"):
        ts = times[name]
        print(
            f"{name}: median {statistics.median(ts):.4f} s/step, min {min(ts):.4f}, max "
            f"{max(ts):.4f}, loss positions per step {statistics.mean(tokens[name]):.0f} of "
            f"{args.micro_batch * args.seq}"
        )

    paired = [m / c for m, c in zip(times["mlm"], times["clm"])]
    print(
        f"noise check: median of per-round mlm/clm ratios {statistics.median(paired):.3f}, "
        f"ratio of min times {min(times['mlm']) / min(times['clm']):.3f}"
    )

    if args.forward_reps > 0:
        fwd = {"clm": [], "mlm": []}
        stream = trainer.train_ds[0]  # the run's one sample stream
        batches = {ph.objective: trainer.microbatches(stream, 0, ph) for ph in (clm, mlm)}
        with torch.no_grad():
            for r in range(args.forward_reps + 1):
                order = ("clm", "mlm") if r % 2 == 0 else ("mlm", "clm")
                for name in order:
                    t0 = time.perf_counter()
                    trainer.run_schedule(batches[name], forward_only=True)
                    if r > 0:  # the first round is warmup
                        fwd[name].append(time.perf_counter() - t0)
        fc, fm = statistics.median(fwd["clm"]), statistics.median(fwd["mlm"])
        print(
            f"forward only (no_grad, batch prebuilt): clm {fc:.4f} s, mlm {fm:.4f} s, "
            f"ratio mlm/clm = {fm / fc:.3f}"
        )

    print(
        f"RESULT mlm_vs_clm_step ratio={mlm_s / clm_s:.3f} ours_s={mlm_s:.4f} "
        f"baseline_s={clm_s:.4f}"
    )


if __name__ == "__main__":
    main()
