"""Training throughput (tokens/s/GPU) and MFU of our engine vs HF EuroBERT and a plain-PyTorch
reference of the same shape, fed the same batches.

For each preset x sequence length x objective x precision, in one process:
- ours: `Trainer.train_step(phase)` (megatron-core EncoderLM, megatron DDP + optimizer, packed mock
  samples with per-document attention), data.loader=sync: each step builds, lays out and sends
  the next step's batches while it waits for its own figures (Trainer.prefetch_next), where hf
  and ref build theirs at the start of the step, as plain loops do. Attention core
  (`model.attention`, --attention): `auto` by default, what a run gets (Transformer Engine's
  packed THD path when TE imports, else torch's varlen kernel on CUDA, else FlexAttention on
  CUDA, else SDPA with a dense mask: the kernel plan's rule), or `varlen`, `flex` (CUDA only:
  torch has no FlexAttention backward on CPU), `sdpa` (dense [b,1,s,s] document mask).
- hf (MLM rows): EuroBertForMaskedLM(attn_implementation="sdpa") under torch.compile (eager with
  --no-compile or --quick), fused AdamW, bf16 autocast on GPU, the same masked inputs
  (megatron_mlmclm.objectives.mlm_mask on the same samples), cross-entropy over full logits,
  padding-free batch with attention_mask all ones (HF's SDPA then runs unmasked: cheaper than
  document masking, and blind to document boundaries). EuroBERT is an encoder: there is no HF
  baseline for CLM rows.
- ref (MLM and CLM rows): benchmarks/reference_encoder.py, the same shape written plainly in
  PyTorch (RMSNorm, RoPE, SwiGLU, sparse head at the labelled positions, fused AdamW, clipping),
  the whole model under torch.compile on CUDA (eager on CPU or with --no-compile), bf16 autocast on
  GPU. Attention per document (causal inside each document for CLM): varlen_attn with cu_seqlens
  from the samples' document ids on CUDA (FlexAttention with a document block mask where torch has
  no varlen_attn; --ref-attention chooses), SDPA with a dense document mask on CPU. Fed the same
  samples (`trainer.train_ds[0][i]`), MLM masks (mlm_mask) and document ids as ours; CLM labels at
  every next token inside its document, as ours. What plain PyTorch reaches on the same work: the
  ceiling our engine is measured against.
The contenders alternate step by step (rotating order); each row reports the median s/step.
The loss of each contender's first step is printed as a sanity check (same init scale: all near
ln(vocab) at step 0), not a test of equality.

MFU = model FLOPs (megatron_mlmclm.flops.mfu_step_flops: attention counted in full, half
for causal; output head at labelled positions) / step time / dense bf16 peak of the device
(megatron_mlmclm.runtime.distributed.device_peak_flops). The same FLOP count is used for hf and
ref, so MFU ratios equal throughput ratios. On CPU the peak is unknown and MFU prints n/a.

--profile: no timing table; N (--profile-steps) steps of ours, after the warm-up steps, for the
first preset, the longest sequence and MLM (else the first objective):
(a) under torch.profiler: the GPU-busy fraction of the wall time (the device time of the
    kernels, copies and fills inside the window, summed, over its wall time; n/a on CPU) and the
    top kernels and CPU ops. The steps run back to back as in training: the clock (and the
    profile's record) starts after a lead-in step's host work, while the device still runs that
    step, so no drain before the first timed step counts as idle (the lead-in's last kernels,
    run inside the window, count in it). --trace FILE writes that pass's Chrome trace
    (chrome://tracing, Perfetto). Then the host's time by Python caller (a second pass of 2
    steps with stacks, started drained: its device time is a step's device work, printed and in
    the RESULT line, and over the unprofiled step's time it is the busy fraction of a step as it
    trains, since the profiler slows the host and not the kernels), and the reference's steps on
    the same batches: unprofiled back to back as ours' (the ratio of the two is what training
    gets, where the table's rows time each step between two drains), then under the profiler,
    started drained: its device work per step against ours (the GPU's work, whatever the host
    does) and its top kernels (skipped with --no-ref);
(b) on CUDA, torch's own count of synchronising calls per step (cuda_sync_debug_count, sync
    debug mode), then under megatron_mlmclm.training.host_syncs.HostSyncCounter the operations per
    step that make the host wait for the device, by operation and line (counted on CPU too: what
    would wait on a GPU). The counter is a dispatch mode, under which torch.compile does not
    trace and FlexAttention's higher-order operator does not run: on the flex path it prints
    n/a (--attention sdpa counts the step's other waits).

    PYTHONPATH=. python benchmarks/train_throughput.py          # GPU: presets, bf16 (+FP8 w/ TE)
    PYTHONPATH=. python benchmarks/train_throughput.py --quick  # CPU, seconds: tiny, seq 128, fp32
    PYTHONPATH=. python benchmarks/train_throughput.py --quick --profile
    # CPU, host-bound shapes, ours compiled as on a GPU (--set: config overrides for ours):
    PYTHONPATH=. python benchmarks/train_throughput.py --presets tiny --seqs 64 --vocab 512 \
        --tokens-per-step 64 --objectives mlm --no-hf --threads 1 --warmup 5 --steps 40 \
        --set model.compile=on --set model.num_layers=12 --set model.hidden_size=64 \
        --set model.ffn_hidden_size=128 --set model.num_attention_heads=2 \
        --set model.num_query_groups=2

Last lines: RESULT train_throughput_vs_reference ratio=<ours_s/ref_s> ours_s=.. baseline_s=..,
then RESULT train_throughput ratio=<ours_s/hf_s> ours_s=.. baseline_s=.., for the headline row
(210m, seq 2048, MLM 40%, bf16; with --quick the quick MLM row). With --profile the last line is
RESULT train_throughput_profile host_syncs_per_step=<n or n/a> gpu_busy=<fraction or n/a>
gpu_busy_unprofiled=<fraction or n/a> (and cuda_syncs_per_step=<n> on CUDA)
device_ms=<ours' device work per step, ms, or n/a> ref_device_ms=<the reference's, or n/a>
back_to_back_vs_reference=<ours / the reference, each timed unprofiled back to back, or n/a>.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import math
import shutil
import statistics
import tempfile
import time
import traceback
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from _engine import sync, time_rows
from reference_encoder import ReferenceEncoder, ReferenceStep, default_attention, make_batch

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

warnings.filterwarnings("ignore", category=UserWarning)  # megatron's no-Apex/TE notices

LR, BETAS, EPS, WD, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def on_gpu() -> bool:
    return torch.cuda.is_available()


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
        # batches built in this process, as for hf and ref (benchmarks/data_loader.py); the
        # trainer builds the next step's while it waits for this step's figures
        "data.loader=sync",
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
    cfg = load_config(None, overrides + [f"model.attention={attention}", *args.set])
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


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU check in seconds: tiny preset, seq 128, fp32, eager, 1 + 2 steps",
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
        choices=["auto", "varlen", "flex", "sdpa"],
        default="auto",
        help="model.attention of ours (default auto: what a run on this machine gets)",
    )
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-ref", action="store_true", help="leave out the plain-PyTorch reference")
    p.add_argument(
        "--ref-attention",
        choices=["varlen", "flex", "sdpa"],
        default=None,
        help="the reference's attention (default: varlen on CUDA where torch has it, else flex; "
        "sdpa on CPU)",
    )
    p.add_argument(
        "--no-compile", action="store_true", help="HF baseline and reference in eager mode"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for ours after the preset's (repeatable), e.g. model.num_layers=12 "
        "or model.compile=on; the reference and HF take their shape from ours",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile ours instead of timing the rows: GPU-busy fraction, host syncs, top ops",
    )
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--trace", default=None, help="with --profile: write the Chrome trace here")
    args = p.parse_args()
    if args.quick:
        args.presets, args.seqs, args.vocab = "tiny", "128", 1024
        args.tokens_per_step, args.warmup, args.steps = 256, 1, 2
        args.no_compile, args.profile_steps = True, 2
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)

    from megatron_mlmclm.flops import mfu_step_flops
    from megatron_mlmclm.model.build import have_transformer_engine
    from megatron_mlmclm.runtime.distributed import device_peak_flops

    gpu = on_gpu()
    te = have_transformer_engine() and gpu
    precisions = [("bf16", None)] if gpu else [("fp32", None)]
    if te:
        precisions += [("bf16", r) for r in args.fp8.split(",") if r]
    attention = args.attention
    if attention == "flex" and not gpu:
        raise SystemExit("--attention flex needs CUDA (torch has no FlexAttention backward on CPU)")
    device = torch.device("cuda" if gpu else "cpu")
    ref_attention = args.ref_attention or default_attention(device)
    if ref_attention != "sdpa" and not gpu:
        raise SystemExit(f"--ref-attention {ref_attention} needs CUDA (no backward on CPU)")
    peak = device_peak_flops()
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(
        f"torch {torch.__version__}, device {name}, threads {torch.get_num_threads()}, "
        f"Transformer Engine {'yes' if te else 'no'}, attention core {attention}, "
        f"reference attention {ref_attention}, peak bf16 {fmt(peak and peak / 1e12, '.0f')} "
        "TFLOP/s"
    )
    if args.profile:
        profile_ours(args, attention, ref_attention, precisions[0][0])
        return
    print(
        f"vocab {args.vocab}; one micro-batch of ~{args.tokens_per_step} tokens per step; "
        f"{args.warmup} warmup + {args.steps} timed steps, the contenders alternating; "
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
                            ref_attention,
                            peak,
                            mfu_step_flops,
                        )
                    except torch.OutOfMemoryError as e:
                        row = {"oom": True}
                        gib = 2**30
                        print(
                            f"{label}: {str(e).splitlines()[0][:240]} (peak allocated "
                            f"{torch.cuda.max_memory_allocated() / gib:.1f} GiB, reserved "
                            f"{torch.cuda.memory_reserved() / gib:.1f} GiB)"
                        )
                        print("".join(traceback.format_exc().splitlines(True)[-14:-1]))
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

    print(
        "\n| config | mb | ours tok/s/GPU | ours MFU | hf tok/s | hf MFU | ref tok/s | ref MFU "
        "| ours/hf s | ours/ref s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("oom"):
            print(f"| {r['label']} | OOM | | | | | | | | |")
            continue
        print(
            f"| {r['label']} | {r['mb']} | {r['ours_tok']:.0f} | {fmt(r['ours_mfu'], '.1%')} | "
            f"{fmt(r.get('hf_tok'), '.0f')} | {fmt(r.get('hf_mfu'), '.1%')} | "
            f"{fmt(r.get('ref_tok'), '.0f')} | {fmt(r.get('ref_mfu'), '.1%')} | "
            f"{fmt(ratio(r, 'hf_s'), '.3f')} | {fmt(ratio(r, 'ref_s'), '.3f')} |"
        )
    print(
        f"\nloss at step 0 (a sanity check, same init scale; ln(vocab) = "
        f"{math.log(args.vocab):.3f}):"
    )
    for r in rows:
        if not r.get("oom"):
            losses = ", ".join(f"{k} {v:.3f}" for k, v in r["step0_loss"].items())
            print(f"  {r['label']}: {losses}")
    if headline is None:
        print(
            "RESULT train_throughput_vs_reference ratio=n/a (headline row 210m s2048 mlm not run)"
        )
        print("RESULT train_throughput ratio=n/a (headline row 210m s2048 mlm not run)")
        return
    print(f"headline: {headline['label']}")
    for key, name in (("ref_s", "train_throughput_vs_reference"), ("hf_s", "train_throughput")):
        if headline.get(key):
            print(
                f"RESULT {name} ratio={ratio(headline, key):.3f} "
                f"ours_s={headline['ours_s']:.4f} baseline_s={headline[key]:.4f}"
            )
        else:
            print(f"RESULT {name} ratio=n/a ({key[:-2]} not run)")


def ratio(row: dict, key: str) -> float | None:
    return row["ours_s"] / row[key] if row.get(key) else None


def sample_batch(trainer, seed: int, phase, r: int, mb: int, mlm_mask, IGNORE):
    """Step r's samples of the run's one stream, as ours reads them: (inputs, labels, document
    ids), numpy [mb, seq]; labels IGNORE where no loss (CLM: the next token of another document)."""
    idx = list(range(r * mb, (r + 1) * mb))
    samples = [trainer.train_ds[0][i] for i in idx]
    tokens = np.stack([s["tokens"] for s in samples]).astype(np.int64)
    docs = np.stack([s["document_ids"] for s in samples])
    if phase.objective == "clm":
        labels = tokens[:, 1:].copy()
        labels[docs[:, :-1] != docs[:, 1:]] = IGNORE
        return tokens[:, :-1], labels, docs[:, :-1]
    spec = trainer.spec
    pairs = [
        mlm_mask(t[:-1], i, seed, phase.mask_ratio, spec, phase.mask_replace)
        for t, i in zip(tokens, idx)
    ]
    return np.stack([q[0] for q in pairs]), np.stack([q[1] for q in pairs]), docs[:, :-1]


def build_ref(cfg, vocab: int, causal: bool, ref_attention: str, bf16: bool, compile_model: bool):
    m = cfg.model
    torch.manual_seed(0)
    model = ReferenceEncoder(
        m.shape(),
        vocab,
        m.seq_length,
        m.rotary_base,
        m.norm_epsilon,
        m.init_method_std,
        ref_attention,
        causal,
    ).to("cuda" if on_gpu() else "cpu")
    return ReferenceStep(model, LR, BETAS, EPS, WD, CLIP, compile_model, bf16)


def reference_steps(args, trainer, cfg, phase, mb: int, ref_attention: str, bf16: bool):
    """The reference fed ours' samples: a function of the step index r that runs step r and
    returns its loss tensor."""
    from megatron_mlmclm.objectives import IGNORE, mlm_mask

    dev = torch.device("cuda" if on_gpu() else "cpu")
    compile_model = on_gpu() and not args.no_compile
    ref = build_ref(
        cfg, trainer.spec.vocab_size, phase.objective == "clm", ref_attention, bf16, compile_model
    )

    def step(r: int) -> torch.Tensor:
        inputs, labels, docs = sample_batch(trainer, cfg.data.seed, phase, r, mb, mlm_mask, IGNORE)
        return ref(make_batch(inputs, labels, docs, IGNORE, dev))

    return step


def run_row(
    args, preset, seq, objective, precision, fp8, attention, ref_attention, peak, mfu_step_flops
) -> dict:
    from megatron_mlmclm.objectives import IGNORE, mlm_mask

    trainer, cfg, mb = build_ours(args, preset, seq, objective, precision, fp8, attention)
    phase, spec = cfg.phases[0], trainer.spec
    dev = torch.device("cuda" if on_gpu() else "cpu")
    bf16 = precision == "bf16" and on_gpu()
    labelled, step0 = [], {}

    def step_ours(r):
        trainer.step = r
        stats = trainer.train_step(trainer.phase_at_step(r))
        labelled.append(int(stats["tokens"]))
        if r == 0:
            step0["ours"] = stats["loss"]

    loops = {"ours": step_ours}
    if objective == "mlm" and not args.no_hf:
        model, fwd, opt = build_hf(cfg, bf16, not args.no_compile)
        amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)

        def step_hf(r):
            inputs, labels, _ = sample_batch(trainer, cfg.data.seed, phase, r, mb, mlm_mask, IGNORE)
            inputs = torch.from_numpy(inputs).to(dev, non_blocking=True)
            labels = torch.from_numpy(labels).to(dev, non_blocking=True)
            with amp:
                logits = fwd(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits
                loss = F.cross_entropy(
                    logits.view(-1, logits.size(-1)).float(), labels.view(-1), ignore_index=IGNORE
                )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r == 0:
                step0["hf"] = loss.detach()

        loops["hf"] = step_hf
    if not args.no_ref and fp8 is None:
        ref_step = reference_steps(args, trainer, cfg, phase, mb, ref_attention, bf16)

        def step_ref(r):
            loss = ref_step(r)
            if r == 0:
                step0["ref"] = loss

        loops["ref"] = step_ref
    t0 = time.perf_counter()
    times = time_rows(loops, args.warmup, args.steps)
    wall = time.perf_counter() - t0
    tokens = mb * seq
    flops = mfu_step_flops(
        cfg.model.shape(),
        spec.vocab_size,
        seq,
        mb,
        int(statistics.median(labelled)),
        causal=objective == "clm",
    )
    row = {"mb": mb, "wall_s": wall, "step0_loss": {k: float(v) for k, v in step0.items()}}
    for name in loops:
        t = statistics.median(times[name])
        row.update(
            {
                f"{name}_s": t,
                f"{name}_tok": tokens / t,
                f"{name}_mfu": flops / t / peak if peak else None,
            }
        )
    trainer.close()
    return row  # the models go with this frame; the caller's gc.collect() frees them


def print_row(row) -> None:
    if row.get("oom"):
        print(f"{row['label']}: out of memory")
        return

    def other(name):
        if not row.get(f"{name}_s"):
            return f"{name} n/a"
        return (
            f"{name} {row[f'{name}_s']:.4f} s ({row[f'{name}_tok']:.0f} tok/s, MFU "
            f"{fmt(row[f'{name}_mfu'], '.1%')})"
        )

    print(
        f"{row['label']}: mb {row['mb']}, ours {row['ours_s']:.4f} s ({row['ours_tok']:.0f} "
        f"tok/s/GPU, MFU {fmt(row['ours_mfu'], '.1%')}); {other('hf')}; {other('ref')}; "
        f"wall {row['wall_s']:.0f} s",
        flush=True,
    )


def device_ms(prof) -> float:
    """The device time of the profiled kernels, copies and fills, summed, in ms. Not the ranges
    torch marks on the device around work already counted (`Optimizer.step#AdamW.step` spans
    the fused AdamW's kernels: counted, the optimizer's time would be added twice), as torch's
    own "Self CUDA time total" leaves them out."""
    from torch.autograd import DeviceType

    return (
        sum(
            getattr(e, "device_time", None) or e.cuda_time
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        )
        / 1e3
    )


def profile_reference(args, trainer, cfg, phase, mb: int, ref_attention: str, n: int):
    """The reference's steps on ours' batches: unprofiled back to back as ours' (after a lead-in
    step, the clock stopped by a drain), then under the profiler from a drain: (its unprofiled
    s/step, its device work per step: the kernels' time summed, None on CPU), set against ours',
    and its top kernels."""
    from torch.profiler import ProfilerActivity, profile

    gpu = on_gpu()
    bf16 = gpu and cfg.train.precision == "bf16"
    step = reference_steps(args, trainer, cfg, phase, mb, ref_attention, bf16)

    def run(first: int, steps: int, then_sync: bool = True) -> None:
        for r in range(first, first + steps):
            step(r)
        if then_sync:
            sync()

    run(0, args.warmup)
    run(args.warmup, 1, then_sync=False)
    t0 = time.perf_counter()
    run(args.warmup + 1, n)
    plain = (time.perf_counter() - t0) / n
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run(args.warmup, n)
        wall = (time.perf_counter() - t0) / n
    work = device_ms(prof) / n if gpu else None
    print(
        f"reference, same batches: unprofiled {plain:.4f} s/step, profiled {wall:.4f} s/step; "
        f"device work {fmt(work, '.1f')} ms/step"
    )
    if gpu:
        table = prof.key_averages().table(
            sort_by="self_device_time_total", row_limit=12, max_name_column_width=60
        )
        print(table)
    return plain, work


def profile_ours(args, attention: str, ref_attention: str, precision: str) -> None:
    """Where a step of ours spends its time: see the module docstring (--profile)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_mlmclm.training.host_syncs import HostSyncCounter, cuda_sync_debug_count

    preset = args.presets.split(",")[0]
    seq = max(int(s) for s in args.seqs.split(","))
    objectives = args.objectives.split(",")
    objective = "mlm" if "mlm" in objectives else objectives[0]
    trainer, cfg, mb = build_ours(args, preset, seq, objective, precision, None, attention)
    phase, n, gpu = cfg.phases[0], args.profile_steps, on_gpu()
    step = iter(range(10**9))

    def run(steps: int, then_sync: bool = True) -> None:
        for _ in range(steps):
            trainer.step = next(step)
            trainer.train_step(trainer.phase_at_step(trainer.step))
        if then_sync:
            sync()

    # Steps as training runs them, back to back: the clock starts after one step's host work,
    # while the device still runs that step, not after a drain that training never has.
    run(args.warmup)
    run(1, then_sync=False)
    t0 = time.perf_counter()
    run(n)
    plain = (time.perf_counter() - t0) / n

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    # The lead-in step is traced, not recorded; the n steps after it are recorded as one.
    lead_in = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with profile(activities=activities, schedule=lead_in) as prof:
        run(1, then_sync=False)
        prof.step()
        t0 = time.perf_counter()
        run(n)
        wall = time.perf_counter() - t0
    if args.trace:
        prof.export_chrome_trace(args.trace)
    table = prof.key_averages()
    if gpu:
        print(table.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    # The busy fraction is the device's time inside the timed window over the window; that time
    # includes the lead-in step's last kernels, which run inside it. The device work of a step is
    # taken from the next pass, which starts drained: its kernels are its own steps' alone.
    window_work = device_ms(prof) if gpu else None
    # Where the host's time goes, by Python caller: a second, shorter pass with stacks (they
    # slow the host, so the timed pass above runs without them).
    with profile(activities=activities, with_stack=True) as prof:
        run(min(n, 2))
    print_host_callers(prof, min(n, 2))
    busy = busy_plain = work = None
    if gpu and window_work is not None:
        busy = window_work / 1e3 / wall
        work = device_ms(prof) / min(n, 2)
        # The profiler slows the host (each launch is recorded), not the kernels: a step's
        # device work over the unprofiled step is the busy fraction of a step as it trains.
        busy_plain = work / 1e3 / plain
    print(
        f"profile: {preset} s{seq} {objective} {precision}, mb {mb}, attention {attention}; "
        f"{args.warmup} warm-up steps, then {n} steps each: unprofiled {plain:.4f} s/step, "
        f"profiled {wall / n:.4f} s/step; GPU busy {fmt(busy, '.1%')} of the profiled wall "
        f"time ({fmt(busy_plain, '.1%')} of the unprofiled step's), device work "
        f"{fmt(work, '.1f')} ms/step"
    )
    ref_plain = ref_work = back_to_back = None
    if not args.no_ref:
        ref_plain, ref_work = profile_reference(args, trainer, cfg, phase, mb, ref_attention, n)
        back_to_back = plain / ref_plain
        print(
            f"back to back, unprofiled (as training runs steps): ours {plain:.4f} s/step, "
            f"reference {ref_plain:.4f} s/step, ours / reference {back_to_back:.3f}"
        )
    cuda_syncs = None
    if gpu:
        count, messages = cuda_sync_debug_count(lambda: run(n))
        cuda_syncs = count / n
        print(f"CUDA sync debug mode: {cuda_syncs:g} synchronising calls per step")
        for m in messages[:8]:
            print(f"  {m.splitlines()[0][:140]}")
    # Last: the counter is a dispatch mode, under which torch.compile does not trace and torch
    # runs no higher-order operator without a rule for it (FlexAttention): on the flex path it
    # stops the step, and --attention sdpa counts the rest.
    syncs = None
    try:
        with HostSyncCounter() as counter:
            run(n)
        syncs = counter.total / n
        print(f"host synchronisations over {n} steps ({syncs:g} per step), commonest sites:")
        print("\n".join(counter.report().splitlines()[:20]))
    except (NotImplementedError, RuntimeError) as e:
        print(f"HostSyncCounter cannot count this step: {str(e).splitlines()[0][:200]}")
    trainer.close()
    print(
        f"RESULT train_throughput_profile host_syncs_per_step={fmt(syncs, 'g')} "
        f"gpu_busy={fmt(busy, '.3f')} gpu_busy_unprofiled={fmt(busy_plain, '.3f')}"
        + (f" cuda_syncs_per_step={cuda_syncs:g}" if gpu else "")
        + f" device_ms={fmt(work, '.2f')} ref_device_ms={fmt(ref_work, '.2f')}"
        + f" back_to_back_vs_reference={fmt(back_to_back, '.3f')}"
    )


def print_host_callers(prof, steps: int, top: int = 14, frames: int = 4) -> None:
    """The host's self time of torch's operators, summed by operator and its innermost Python
    frames (the profiler's Python events are the operators' ancestors)."""
    totals: dict[tuple, list] = {}
    for e in prof.events():
        if ".py(" in e.name or e.name.startswith("<built-in") or e.self_cpu_time_total <= 0:
            continue
        where, parent = [], e.cpu_parent
        while parent is not None and len(where) < frames:
            if ".py(" in parent.name and "/torch/" not in parent.name:
                where.append(parent.name.split("/")[-1])
            parent = parent.cpu_parent
        entry = totals.setdefault((e.name, " < ".join(where) or "?"), [0.0, 0])
        entry[0] += e.self_cpu_time_total
        entry[1] += 1
    print(f"host time by caller (self CPU per step over {steps} steps, innermost frame first):")
    for (name, where), (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / 1e3 / steps:7.2f} ms {count / steps:6.0f}x {name[:40]:40s} {where[:220]}")


if __name__ == "__main__":
    defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does
    main()
