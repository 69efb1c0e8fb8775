"""Our MLM training step vs a plain Hugging Face EuroBertForMaskedLM + torch.optim.AdamW loop, CPU.

Same shapes on both sides: hidden, layers, heads, KV heads, head dim, FFN, vocabulary, sequence
length, micro-batch; fp32; MLM with 40% masking (the same masks: both use
megatron_mlmclm.objectives.mlm_mask on the same mock samples); AdamW with the same lr, betas, eps
and weight decay; gradient clipping at 1.0; one micro-batch per optimizer step.

- ours: `Trainer.train_step(mlm_phase)` (megatron-core EncoderLM + megatron DDP + megatron
  optimizer + WSD schedule). Logits only at the masked positions. Attention is bidirectional
  *inside each packed document*: an explicit [b, 1, s, s] bool mask goes to SDPA.
- hf (the plain loop users would write): EuroBertForMaskedLM(attn_implementation="sdpa"),
  logits at all b*s positions, cross-entropy over the masked positions (ignore_index=-100),
  clip_grad_norm_(1.0), AdamW. The batch is padding-free with attention_mask all ones, so HF's
  SDPA runs without a mask (cheaper than ours, and it does not respect document boundaries).
- hf-gather (like-for-like head): the same HF model, but the final hidden states are gathered at
  the masked positions before lm_head, as our head does.

Each timed step includes building the batch from packed samples (masking; ours also builds the
document mask), forward, backward, clipping and the optimizer step. Steps alternate between the
three loops (rotating order each round); the headline is the median s/step.

    PYTHONPATH=. python benchmarks/train_step.py [--threads 1]
    PYTHONPATH=. python benchmarks/train_step.py --quick   # seconds: tiny shapes, 2 steps

Last line (the headline is like for like): RESULT train_step ratio=<ours_s/hf_gather_s> ours_s=<..>
baseline_s=<hf_gather_s>; the ratio against the plain loop is printed above it, for information.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from _engine import add_shape_arguments, apply_quick, build_trainer, hf_eurobert

warnings.filterwarnings("ignore", category=UserWarning)  # megatron's no-Apex/TE notices

LR, BETAS, EPS, WD, CLIP = 5e-4, (0.9, 0.95), 1e-5, 0.1, 1.0


def build_ours(args):
    return build_trainer(
        args,
        [
            "train.warmup_steps=0",
            "train.decay_steps=0",
            f"train.lr={LR}",
            f"train.adam_beta1={BETAS[0]}",
            f"train.adam_beta2={BETAS[1]}",
            f"train.adam_eps={EPS}",
            f"train.weight_decay={WD}",
            f"train.clip_grad={CLIP}",
            "phases.0.objective=mlm",
            f"phases.0.mask_ratio={args.mask_ratio}",
        ],
        prefix="bench_train_step_",
    )


def build_hf(args, seed: int):
    model = hf_eurobert(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        kv_channels=args.hidden // args.heads,
        seq_length=args.seq,
        seed=seed,
    )
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return model, opt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    p.add_argument("--steps", type=int, default=12, help="timed steps per loop")
    args = p.parse_args()
    if args.quick:
        args.warmup, args.steps = 1, 2
    apply_quick(args)
    torch.set_num_threads(args.threads)

    from megatron_mlmclm.objectives import IGNORE, mlm_mask

    trainer, cfg = build_ours(args)
    phase, spec, seed = cfg.phases[0], trainer.spec, cfg.data.seed
    hf_full, opt_full = build_hf(args, seed=0)
    hf_gather, opt_gather = build_hf(args, seed=0)
    n_ours = sum(p.numel() for c in trainer.model_chunks for p in c.parameters())
    n_hf = sum(p.numel() for p in hf_full.parameters())

    print(
        f"torch {torch.__version__}, torch threads = {torch.get_num_threads()} (set explicitly), "
        f"device cpu, fp32"
    )
    print(
        f"shapes: vocab {args.vocab}, hidden {args.hidden}, ffn {args.ffn}, layers {args.layers}, "
        f"heads {args.heads}, kv heads {args.kv_heads}, head dim {args.hidden // args.heads}, seq "
        f"{args.seq}, micro-batch {args.micro_batch} (one micro-batch per step); parameters: ours "
        f"{n_ours / 1e6:.3f}M, hf {n_hf / 1e6:.3f}M"
    )
    print(
        f"MLM mask ratio {args.mask_ratio}; AdamW lr {LR} betas {BETAS} eps {EPS} wd {WD}, clip "
        f"{CLIP}; {args.warmup} warmup rounds + {args.steps} timed steps per loop, rotating order"
    )
    print(
        "attention: ours = document-masked bidirectional (explicit [b,1,s,s] bool mask from "
        "packed samples -> SDPA); hf = padding-free batch, attention_mask all ones, which HF turns "
        "into no mask at all (SDPA unmasked: cheaper, and blind to document boundaries)"
    )
    print(
        "note: megatron's optimizer skips weight decay on norms (and biases; there are none); "
        "the plain AdamW loop decays every parameter"
    )

    def hf_batch(step: int):
        """The same samples and masks as our step `step` (what a data collator would produce)."""
        first = step * args.micro_batch
        idx = list(range(first, first + args.micro_batch))
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
        inputs = torch.from_numpy(np.stack([q[0] for q in pairs]))
        labels = torch.from_numpy(np.stack([q[1] for q in pairs]))
        return inputs, labels, torch.ones_like(inputs)

    def step_hf_full(step: int):
        inputs, labels, attn = hf_batch(step)
        logits = hf_full(input_ids=inputs, attention_mask=attn).logits  # [b, s, V]
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=IGNORE
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_full.parameters(), CLIP)
        opt_full.step()
        opt_full.zero_grad(set_to_none=True)
        return loss.item()

    def step_hf_gather(step: int):
        inputs, labels, attn = hf_batch(step)
        hidden = hf_gather.model(input_ids=inputs, attention_mask=attn).last_hidden_state
        keep = labels != IGNORE
        logits = hf_gather.lm_head(hidden[keep])  # [n_masked, V]
        loss = F.cross_entropy(logits, labels[keep])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_gather.parameters(), CLIP)
        opt_gather.step()
        opt_gather.zero_grad(set_to_none=True)
        return loss.item()

    def step_ours(step: int):
        trainer.step = step
        return trainer.train_step(phase)["loss"]

    loops = {"ours": step_ours, "hf": step_hf_full, "hf-gather": step_hf_gather}
    names = list(loops)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    for r in range(args.warmup + args.steps):
        order = names[r % 3 :] + names[: r % 3]
        for n in order:
            t0 = time.perf_counter()
            loss = loops[n](r)
            dt = time.perf_counter() - t0
            if r >= args.warmup:
                times[n].append(dt)
                losses[n].append(loss)

    med = {n: statistics.median(times[n]) for n in names}
    for n in names:
        ts = times[n]
        print(
            f"{n:>9}: median {med[n]:.4f} s/step, min {min(ts):.4f}, max {max(ts):.4f}, "
            f"last loss {losses[n][-1]:.3f}"
        )
    tokens = args.micro_batch * args.seq
    print(
        f"throughput: ours {tokens / med['ours']:.0f} tok/s, hf {tokens / med['hf']:.0f} tok/s, "
        f"hf-gather {tokens / med['hf-gather']:.0f} tok/s"
    )
    print(
        f"info, against the plain loop (HF logits at every position): ratio ours/hf = "
        f"{med['ours'] / med['hf']:.3f} ours_s={med['ours']:.4f} hf_s={med['hf']:.4f}"
    )
    paired = [a / b for a, b in zip(times["ours"], times["hf"])]
    paired_g = [a / b for a, b in zip(times["ours"], times["hf-gather"])]
    print(
        f"noise check: median of per-round ratios (same round, adjacent steps): ours/hf "
        f"{statistics.median(paired):.3f}, ours/hf-gather {statistics.median(paired_g):.3f}; "
        f"ratio of min times: ours/hf {min(times['ours']) / min(times['hf']):.3f}, ours/hf-gather "
        f"{min(times['ours']) / min(times['hf-gather']):.3f}"
    )
    print(
        f"RESULT train_step ratio={med['ours'] / med['hf-gather']:.3f} ours_s={med['ours']:.4f} "
        f"baseline_s={med['hf-gather']:.4f}"
    )


if __name__ == "__main__":
    main()
