"""Training throughput (tokens/s/GPU) and MFU of our engine vs HF EuroBERT and a plain-PyTorch
reference of the same shape, fed the same batches.

For each preset x sequence length x tokens per step x objective x precision (a row), in one
process:
- ours: `Trainer.train_step(phase)` (megatron-core EncoderLM, megatron DDP + optimizer, packed mock
  samples with per-document attention), data.loader=sync: each step builds, lays out and sends
  the next step's batches while it waits for its own figures (Trainer.prefetch_next). Attention
  core (`model.attention`, --attention): `auto` by default, what a run gets (torch's varlen kernel
  on CUDA, else FlexAttention on CUDA, else SDPA with a dense mask: the kernel plan's rule, with
  Transformer Engine installed or not: --set model.kernels=te takes TE's packed THD path), or
  `varlen`, `flex` (CUDA only: torch has no FlexAttention backward on CPU), `sdpa` (dense
  [b,1,s,s] document mask). FP8 rows (where TE imports) run model.kernels=te.
- hf (MLM rows): EuroBertForMaskedLM(attn_implementation="sdpa") under torch.compile (eager with
  --no-compile or --quick), fused AdamW, bf16 autocast on GPU, the same masked inputs
  (megatron_mlmclm.objectives.mlm_mask on the same samples), cross-entropy over full logits,
  padding-free batch with attention_mask all ones (HF's SDPA then runs unmasked: cheaper than
  document masking, and blind to document boundaries), its batch built in its step and its loss
  read at the step's end, as a plain HF loop does. EuroBERT is an encoder: there is no HF
  baseline for CLM rows.
- ref (MLM and CLM rows): benchmarks/reference_encoder.py, the same shape written plainly in PyTorch
  (RMSNorm, RoPE, SwiGLU, GQA and any head dim, untied embeddings, sparse head at the labelled
  positions, fused AdamW, clipping), the whole model under torch.compile on CUDA (eager on CPU or
  with --no-compile), bf16 autocast on GPU. Attention per document (causal inside each document for
  CLM): varlen_attn with cu_seqlens from the samples' document ids on CUDA (FlexAttention with a
  document block mask where torch has no varlen_attn; --ref-attention chooses), SDPA with a dense
  document mask on CPU. Fed the same samples (`trainer.train_ds[0]`), MLM masks (mlm_mask) and
  document ids as ours; CLM labels at every next token inside its document, as ours. Its loop is
  ours' (reference_encoder.ReferenceLoop): step k's work queued, then step k + 1's batch built,
  pinned and copied non-blocking while the device runs it, then step k's loss read, its one wait a
  step (the loss copied to the host before the update is queued, so the read does not wait for the
  update: ours' queued update). Its model keeps the design of the independent plain model in the GPU
  measuring tools (../shared/gpu/ref_encoder.py, not part of the project: one torch.compile over the
  whole model, fused QKV and gate-up projections, bf16 autocast, fused AdamW, logits at the labelled
  positions), and takes varlen attention where that one takes FlexAttention, and ours' loop where
  that one builds its batch inside the step. Each row prints the parameter counts of ours and the
  reference, which must be equal. What plain PyTorch reaches on the same work: the ceiling our
  engine is measured against.
- distopt (--distopt): ours with the distributed optimizer (parallel.use_distributed_optimizer=
  true) in this one process, DP = 1: nothing to shard, and the kernel plan runs no gradient reduce
  and no parameter gather (a group of one rank), so nothing is overlapped. What the optimizer's
  layout alone costs on one GPU; not the reduce-scatter and gather of DP > 1. Same samples; its
  first loss equals ours'.
Timing: by default the contenders alternate step by step (rotating order), each step timed
between two drains of the device, and each row reports the median s/step. With --sequential
they run one at a time, each built, warmed up, timed back to back as training runs its steps
(the median of the timed steps, each from the end of the one before; a step ends when its loss
is read) and freed before the next is built, so a row needs the memory of one model, not of all
of them (1b at 24,576 tokens a step: its states alone are 25 GB at 18 bytes a parameter, and
activations take about as much again); each row then prints each contender's peak GPU memory,
and a contender that fails (out of memory or otherwise) is reported with its error while the
row's others are still measured.
The loss of each contender's first step is printed as a sanity check (same init scale: all near
ln(vocab) at step 0), not a test of equality.

--size 210m|610m|1b: one model size with all its rows in one process: seq 2048, MLM, 16,384
tokens a step and 24,576 (the study's 12 sequences of 2,048 per GPU), ours, the reference and
distopt, --sequential, no HF, no FP8. --quick --size: the same rows on the tiny preset at 256 and
384 tokens a step.

Documents (--documents, data.mock_doc_length): the mock samples' documents are `web` by default,
log-normal lengths of mean 700 tokens with a long tail (about 6% over 2,048 tokens), each sample a
window of a packed stream of them (data/mock.py); `medium` are uniform from 64 to 1,023 tokens,
each row starting a document, the documents the plain model of the GPU measuring tools draws
(run both on them to compare the two references); `short` is the mock's default elsewhere
(geometric, mean 96 tokens). The benchmark reads no shards; it prints which documents it ran, and
for each row the documents of its timed steps: their mean length in the rows (a document cut by
a row's edge counts as its pieces), the longest, and attention over documents as a share of
attention over whole rows.

MFU = model FLOPs (megatron_mlmclm.flops.mfu_step_flops: attention counted over whole rows, half
for causal, the published convention; output head at labelled positions) / step time / dense
bf16 peak of the device (megatron_mlmclm.runtime.distributed.device_peak_flops). Beside it, "MFU,
documents" counts attention over each document instead (flops.document_step_flops: the sum over
documents of len^2, not seq^2 per row; half for causal), the work the document-masked kernels
execute; on web-like documents in 2,048-token rows that is about half the row count. The same
FLOP counts are used for every contender, so MFU ratios equal throughput ratios. On CPU the peak
is unknown and MFU prints n/a.

--profile: no timing table; N (--profile-steps) steps of ours, after the warm-up steps, for the
first preset, the longest sequence, the first tokens per step and MLM (else the first objective):
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
    the same batches, profiled as ours (skipped with --no-ref): unprofiled back to back as ours'
    (the ratio of the two is what training gets, where the table's rows time each step between
    two drains), under the profiler, started drained (its device work per step against ours: the
    GPU's work, whatever the host does; its top kernels), its host time by caller and its
    synchronisations as in (b);
(b) on CUDA, torch's own count of synchronising calls per step (cuda_sync_debug_count, sync
    debug mode), then under megatron_mlmclm.training.host_syncs.HostSyncCounter the operations per
    step that make the host wait for the device, by operation and line (counted on CPU too: what
    would wait on a GPU). The counter is a dispatch mode, under which torch.compile does not
    trace and FlexAttention's higher-order operator does not run: on the flex path it prints
    n/a (--attention sdpa counts the step's other waits).

    PYTHONPATH=. python benchmarks/train_throughput.py          # GPU: presets, bf16 (+FP8 w/ TE)
    PYTHONPATH=. python benchmarks/train_throughput.py --size 610m   # GPU: one size, all rows
    PYTHONPATH=. python benchmarks/train_throughput.py --quick  # CPU, seconds: tiny, seq 128, fp32
    PYTHONPATH=. python benchmarks/train_throughput.py --quick --size 1b
    PYTHONPATH=. python benchmarks/train_throughput.py --quick --profile
    # CPU, host-bound shapes, ours compiled as on a GPU (--set: config overrides for ours):
    PYTHONPATH=. python benchmarks/train_throughput.py --presets tiny --seqs 64 --vocab 512 \
        --tokens-per-step 64 --objectives mlm --no-hf --threads 1 --warmup 5 --steps 40 \
        --set model.compile=on --set model.num_layers=12 --set model.hidden_size=64 \
        --set model.ffn_hidden_size=128 --set model.num_attention_heads=2 \
        --set model.num_query_groups=2

RESULT lines. For each row with the reference: RESULT train_throughput_vs_reference_<row>
ratio=<ours_s/ref_s> ours_s=.. baseline_s=.. ours_mfu=.. ours_mfu_documents=.. ref_mfu=..
params_equal=<yes|no>; for each row with distopt: RESULT train_throughput_distopt_<row>
ratio=<distopt_s/ours_s> ours_s=<distopt's> baseline_s=<ours'>; <row> is <preset>_<tokens per
step, 16k or 24k>, with _s<seq> where seq is not 2048 and _clm for CLM rows (both lines end with
timing=back_to_back under --sequential). Last: RESULT train_throughput_vs_reference
ratio=<ours_s/ref_s> ours_s=.. baseline_s=.., then RESULT train_throughput ratio=<ours_s/hf_s>
ours_s=.. baseline_s=.., for the headline row (210m, seq 2048, MLM 40%, bf16, the first tokens per
step; with --quick the first quick MLM row). With --profile the last line is RESULT
train_throughput_profile host_syncs_per_step=<n or n/a> gpu_busy=<fraction or n/a>
gpu_busy_unprofiled=<fraction or n/a> (and cuda_syncs_per_step=<n> on CUDA) device_ms=<ours'
device work per step, ms, or n/a> ref_device_ms=<the reference's, or n/a>
back_to_back_vs_reference=<ours / the reference, each timed unprofiled back to back, or n/a>
ref_host_syncs_per_step=<n or n/a> (and ref_cuda_syncs_per_step=<n> on CUDA).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import itertools
import math
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from _engine import sync, time_back_to_back, time_rows
from reference_encoder import (
    ReferenceEncoder,
    ReferenceLoop,
    ReferenceStep,
    default_attention,
    make_batch,
)

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

warnings.filterwarnings("ignore", category=UserWarning)  # megatron's no-Apex/TE notices

LR, BETAS, EPS, WD, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
# --size: 16k tokens a step, and the study's tokens per GPU (12 sequences of 2,048)
SIZE_TOKENS = "16384,24576"
GIB = 2**30


def on_gpu() -> bool:
    return torch.cuda.is_available()


def distopt_overrides() -> list[str]:
    """Ours with the distributed optimizer's layout, in this one process (DP = 1): nothing to
    shard, and the kernel plan runs no gradient reduce and no parameter gather, on CUDA as on
    CPU."""
    return ["parallel.use_distributed_optimizer=true"]


def build_ours(
    args,
    preset: str,
    seq: int,
    tokens: int,
    objective: str,
    precision: str,
    fp8,
    attention: str,
    extra: list[str] | None = None,
):
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.training.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench_train_throughput_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    mb = args.micro_batch or max(1, tokens // seq)
    overrides = [
        f"output_dir={out}",
        f"checkpoint.dir={out}/ckpt",
        "checkpoint.resume=false",
        "logging.tensorboard=false",
        "data.mock=true",
        f"data.mock_doc_length={args.documents}",
        f"model.preset={preset}",
        # batches built in this process, as for hf and ref (benchmarks/data_loader.py); the
        # trainer builds the next step's while it waits for this step's figures
        "data.loader=sync",
        f"model.vocab_size={args.vocab}",
        f"model.seq_length={seq}",
        # room for every step a row or the profile runs, and the reference's fetch ahead
        f"train.steps={args.warmup + args.steps + 4 * args.profile_steps + 10}",
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
    if fp8:  # inside Transformer Engine's layers only
        overrides += [f"train.fp8={fp8}", "model.kernels=te"]
    cfg = load_config(None, overrides + [f"model.attention={attention}", *(extra or []), *args.set])
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


def tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU check in seconds: tiny preset, seq 128, fp32, eager, 1 + 2 steps",
    )
    p.add_argument(
        "--size",
        choices=["210m", "610m", "1b"],
        default=None,
        help="one model size with all its rows: seq 2048, MLM, at 16k and 24,576 tokens a step "
        "(the study's 12 sequences per GPU), ours, the reference and ours with the distributed "
        "optimizer's layout (--distopt), one at a time (--sequential); no HF, no FP8. With "
        "--quick: the tiny preset at 256 and 384 tokens a step",
    )
    p.add_argument("--presets", default="210m,610m,1b")
    p.add_argument("--seqs", default="512,1024,2048")
    p.add_argument("--objectives", default="clm,mlm")
    p.add_argument("--mask-ratio", type=float, default=0.4)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument(
        "--tokens-per-step",
        default=None,
        help="comma-separated, a row for each: micro-batch = tokens-per-step // seq (one "
        f"micro-batch per step); default 16384, {SIZE_TOKENS} with --size",
    )
    p.add_argument("--micro-batch", type=int, default=None, help="fixed micro-batch instead")
    p.add_argument(
        "--documents",
        choices=["web", "medium", "short"],
        default="web",
        help="the mock samples' document lengths (data.mock_doc_length): web (log-normal, mean "
        "700 tokens, a long tail), medium (uniform 64-1,023 tokens) or short (geometric, mean 96)",
    )
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
        "--distopt",
        action="store_true",
        help="add ours with parallel.use_distributed_optimizer=true (DP = 1) to each row",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="the contenders one at a time (built, warmed up, timed back to back, freed), so that "
        "a row needs the memory of one model at a time, instead of alternating step by step",
    )
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
        help="profile ours and the reference instead of timing the rows: GPU-busy fraction, host "
        "time by caller, host syncs, top ops",
    )
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--trace", default=None, help="with --profile: write the Chrome trace here")
    args = p.parse_args()
    if args.size:
        args.presets, args.seqs, args.objectives, args.fp8 = args.size, "2048", "mlm", ""
        args.tokens_per_step = args.tokens_per_step or SIZE_TOKENS
        args.no_hf = args.distopt = args.sequential = True
    args.tokens_per_step = args.tokens_per_step or "16384"
    if args.quick:
        args.presets, args.seqs, args.vocab = "tiny", "128", 1024
        args.tokens_per_step = "256,384" if args.size else "256"
        args.warmup, args.steps = 1, 2
        args.no_compile, args.profile_steps = True, 2
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sequential and args.warmup < 1:
        raise SystemExit("--sequential needs --warmup 1 or more (the timed steps' lead-in)")

    from megatron_mlmclm.data.mock import MEDIUM_RANGE, SHORT_MEAN, WEB_MEAN
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
    shapes = {
        "web": f"log-normal lengths, mean {WEB_MEAN:.0f} tokens, a long tail",
        "medium": f"uniform lengths from {MEDIUM_RANGE[0]} to {MEDIUM_RANGE[1] - 1} tokens, each "
        "row starting a document",
        "short": f"geometric lengths, mean {SHORT_MEAN} tokens",
    }
    print(
        f"documents: mock samples (no shards), data.mock_doc_length={args.documents}: "
        f"{shapes[args.documents]}, packed into rows; the same samples and masks for every "
        "contender"
    )
    if args.profile:
        profile_ours(args, attention, ref_attention, precisions[0][0])
        return
    timing = (
        "one at a time, each timed back to back as training runs steps (median of the steps)"
        if args.sequential
        else "the contenders alternating, each step between two drains (median s/step)"
    )
    print(
        f"vocab {args.vocab}; tokens per step {args.tokens_per_step.replace(',', ', ')} (a row "
        f"each; one micro-batch a step); {args.warmup} warmup + {args.steps} timed steps, {timing}"
    )
    print(
        "MFU: model FLOPs (attention over whole rows, half for causal: the published convention) "
        "/ step time / peak; 'documents': the same with attention over each document, as the "
        "document-masked kernels execute it"
    )

    rows, headline = [], None
    grid = itertools.product(
        args.presets.split(","),
        [int(x) for x in args.seqs.split(",")],
        [int(x) for x in args.tokens_per_step.split(",")],
        args.objectives.split(","),
        precisions,
    )
    for preset, seq, tokens, objective, (precision, fp8) in grid:
        mlm = f" {args.mask_ratio:.0%}" if objective == "mlm" else ""
        label = (
            f"{preset} s{seq} {tokens_label(tokens)} {objective}{mlm} "
            f"{precision}{'+fp8-' + fp8 if fp8 else ''}"
        )
        key = (
            f"{preset}_{tokens_label(tokens)}"
            + ("" if seq == 2048 else f"_s{seq}")
            + ("" if objective == "mlm" else f"_{objective}")
        )
        try:
            row = run_row(
                args, preset, seq, tokens, objective, precision, fp8, attention, ref_attention, peak
            )
        except torch.OutOfMemoryError as e:
            row = {"oom": True}
            print(f"{label}: {out_of_memory(e)}")
            print("".join(traceback.format_exc().splitlines(True)[-14:-1]))
        row.update(label=label, key=key, fp8=fp8)
        rows.append(row)
        print_row(row)
        if (
            headline is None
            and objective == "mlm"
            and fp8 is None
            and "ours_s" in row
            and ((preset == "210m" and seq == 2048) or args.quick)
        ):
            headline = row
        free_memory(reset_compiled=True)

    print_table(rows)
    print(
        f"\nloss at step 0 (a sanity check, same init scale; ln(vocab) = "
        f"{math.log(args.vocab):.3f}):"
    )
    for r in rows:
        if not r.get("oom"):
            losses = ", ".join(f"{k} {v:.3f}" for k, v in r["step0_loss"].items())
            print(f"  {r['label']}: {losses}")
    mode = " timing=back_to_back" if args.sequential else ""
    for r in rows:
        if r.get("oom") or r["fp8"]:
            continue
        failed = ", ".join(f"{k} {v}" for k, v in r["failed"].items())
        if r.get("ref_s") and r.get("ours_s"):
            print(
                f"RESULT train_throughput_vs_reference_{r['key']} ratio={ratio(r, 'ref_s'):.3f} "
                f"ours_s={r['ours_s']:.4f} baseline_s={r['ref_s']:.4f} "
                f"ours_mfu={fmt(r['ours_mfu'], '.3f')} "
                f"ours_mfu_documents={fmt(r['ours_mfu_documents'], '.3f')} "
                f"ref_mfu={fmt(r['ref_mfu'], '.3f')} "
                f"params_equal={params_equal(r)}{mode}"
            )
        elif "ref" in r["params"] or "ref" in r["failed"]:
            print(f"RESULT train_throughput_vs_reference_{r['key']} ratio=n/a ({failed})")
        if r.get("distopt_s") and r.get("ours_s"):
            print(
                f"RESULT train_throughput_distopt_{r['key']} "
                f"ratio={r['distopt_s'] / r['ours_s']:.3f} ours_s={r['distopt_s']:.4f} "
                f"baseline_s={r['ours_s']:.4f}{mode}"
            )
        elif "distopt" in r["params"] or "distopt" in r["failed"]:
            print(f"RESULT train_throughput_distopt_{r['key']} ratio=n/a ({failed})")
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
                f"ours_s={headline['ours_s']:.4f} baseline_s={headline[key]:.4f}{mode}"
            )
        else:
            print(f"RESULT {name} ratio=n/a ({key[:-2]} not run)")


def ratio(row: dict, key: str) -> float | None:
    return row["ours_s"] / row[key] if row.get(key) and row.get("ours_s") else None


def params_equal(row: dict) -> str:
    counts = set(row["params"].values())
    return "yes" if len(counts) == 1 else "no"


def out_of_memory(e: BaseException) -> str:
    gpu = on_gpu()
    return (
        f"{str(e).splitlines()[0][:240]} (peak allocated "
        f"{torch.cuda.max_memory_allocated() / GIB if gpu else 0:.1f} GiB, reserved "
        f"{torch.cuda.memory_reserved() / GIB if gpu else 0:.1f} GiB)"
    )


def free_memory(reset_compiled: bool = False) -> None:
    """What the contenders left: collected, the CUDA cache emptied; `reset_compiled`: torch's
    compiled-code caches cleared too, so the next row compiles as a fresh process would (its
    own static shapes) and no cache keeps a model alive."""
    if reset_compiled:
        torch.compiler.reset()
    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()


def parameters(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


class Samples:
    """The run's one sample stream as ours reads it, step by step: (inputs, labels, document ids),
    numpy [mb, seq], labels IGNORE where no loss (CLM: the next token of another document), the
    MLM masks ours draws (objectives.mlm_mask)."""

    def __init__(self, trainer, phase, mb: int):
        from megatron_mlmclm.objectives import IGNORE, mlm_mask

        self.ds, self.spec, self.seed = trainer.train_ds[0], trainer.spec, trainer.cfg.data.seed
        self.phase, self.mb, self.mlm_mask, self.ignore = phase, mb, mlm_mask, IGNORE

    def rows(self, r: int) -> list[int]:
        if (r + 1) * self.mb > len(self.ds):
            raise IndexError(f"step {r} is past the benchmark's {len(self.ds)} samples")
        return list(range(r * self.mb, (r + 1) * self.mb))

    def document_ids(self, r: int) -> np.ndarray:
        """[mb, seq]: the document ids of step r's input positions."""
        return np.stack([self.ds[i]["document_ids"][:-1] for i in self.rows(r)])

    def batch(self, r: int):
        idx = self.rows(r)
        samples = [self.ds[i] for i in idx]
        tokens = np.stack([s["tokens"] for s in samples]).astype(np.int64)
        docs = np.stack([s["document_ids"] for s in samples])
        if self.phase.objective == "clm":
            labels = tokens[:, 1:].copy()
            labels[docs[:, :-1] != docs[:, 1:]] = self.ignore
            return tokens[:, :-1], labels, docs[:, :-1]
        ph = self.phase
        pairs = [
            self.mlm_mask(t[:-1], i, self.seed, ph.mask_ratio, self.spec, ph.mask_replace)
            for t, i in zip(tokens, idx)
        ]
        return np.stack([q[0] for q in pairs]), np.stack([q[1] for q in pairs]), docs[:, :-1]

    def labelled(self, r: int) -> int:
        return int((self.batch(r)[1] != self.ignore).sum())


def document_lengths(docs: np.ndarray) -> list[int]:
    """The lengths of the documents as rows [mb, seq] of document ids hold them (ids rise by one
    at each document start; a row's edge cuts a document)."""
    out = []
    for row in docs:
        starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        out += np.diff(np.r_[starts, len(row)]).tolist()
    return out


def document_figures(source: Samples, steps: range) -> dict:
    """The documents of the given steps' samples: count, mean and longest piece, and the share of
    whole-row attention that attention over each document is (sum of len^2 / seq^2 per row)."""
    per_step = [document_lengths(source.document_ids(r)) for r in steps]
    every = [n for lengths in per_step for n in lengths]
    rows = len(steps) * source.mb
    seq = sum(per_step[0]) // source.mb
    return {
        "per_step": per_step,
        "mean": statistics.fmean(every),
        "per_row": len(every) / rows,
        "longest": max(every),
        "attention_share": sum(n * n for n in every) / (rows * seq * seq),
    }


def describe_documents(d: dict, seq: int) -> str:
    return (
        f"documents in the timed steps' samples: mean {d['mean']:.0f} tokens ({d['per_row']:.1f} "
        f"per {seq}-token row: a document cut by a row's edge counts as its pieces), longest "
        f"{d['longest']}; attention over documents is {d['attention_share']:.1%} of attention "
        "over whole rows"
    )


class Contender:
    """One contender of a row: `step(r)` runs step r (its loss read at its end), `close()` lets
    its memory go, `params` counts its model's parameters."""

    def __init__(self, step: Callable[[int], None], params: int, close=None):
        self.step, self.params, self._close = step, params, close

    def close(self) -> None:
        if self._close is not None:
            self._close()
        self.step = self._close = None


def ours_contender(trainer, name: str, row: dict, labelled: list[int] | None) -> Contender:
    def step(r: int) -> None:
        trainer.step = r
        stats = trainer.train_step(trainer.phase_at_step(r))
        if labelled is not None:
            labelled.append(int(stats["tokens"]))
        if r == 0:
            row["step0_loss"][name] = stats["loss"]

    return Contender(step, parameters(trainer.model), trainer.close)


def hf_contender(cfg, source: Samples, bf16: bool, compile_model: bool, row: dict) -> Contender:
    model, fwd, opt = build_hf(cfg, bf16, compile_model)
    dev = torch.device("cuda" if on_gpu() else "cpu")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)

    def step(r: int) -> None:
        inputs, labels, _ = source.batch(r)
        inputs = torch.from_numpy(inputs).to(dev, non_blocking=True)
        labels = torch.from_numpy(labels).to(dev, non_blocking=True)
        with amp:
            logits = fwd(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)).float(),
                labels.view(-1),
                ignore_index=source.ignore,
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # read each step, as a training loop logs it
        if r == 0:
            row["step0_loss"]["hf"] = value

    return Contender(step, parameters([model]))


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


def reference_loop(args, cfg, source: Samples, ref_attention: str, bf16: bool) -> ReferenceLoop:
    """The reference fed ours' samples: step r's batch built, pinned and sent while step r - 1
    runs (reference_encoder.ReferenceLoop)."""
    dev = torch.device("cuda" if on_gpu() else "cpu")
    compile_model = on_gpu() and not args.no_compile
    causal = source.phase.objective == "clm"
    ref = build_ref(cfg, source.spec.vocab_size, causal, ref_attention, bf16, compile_model)
    return ReferenceLoop(ref, lambda r: make_batch(*source.batch(r), source.ignore, dev))


def ref_contender(args, cfg, source: Samples, ref_attention: str, bf16: bool, row: dict):
    loop = reference_loop(args, cfg, source, ref_attention, bf16)

    def step(r: int) -> None:
        loss = loop(r)
        if r == 0:
            row["step0_loss"]["ref"] = loss

    return Contender(step, parameters([loop.step.model]))


def run_row(
    args, preset, seq, tokens, objective, precision, fp8, attention, ref_attention, peak
) -> dict:
    """One row: its contenders built and timed (alternating, or one at a time with
    --sequential), its figures."""
    from megatron_mlmclm.flops import document_step_flops, mfu_step_flops

    gpu = on_gpu()
    bf16 = precision == "bf16" and gpu
    compile_hf = not args.no_compile
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer, cfg, mb = build_ours(args, preset, seq, tokens, objective, precision, fp8, attention)
    phase = cfg.phases[0]
    source = Samples(trainer, phase, mb)
    row: dict = {"mb": mb, "seq": seq, "step0_loss": {}, "params": {}, "peak_gib": {}}
    row["failed"] = {}  # --sequential: contender -> what stopped it (the others still run)
    labelled: list[int] = []
    first = [trainer]  # handed to its contender, so that nothing here keeps it alive after
    del trainer
    builders: dict[str, Callable[[], Contender]] = {
        "ours": lambda: ours_contender(first.pop(), "ours", row, labelled)
    }
    if objective == "mlm" and not args.no_hf:
        builders["hf"] = lambda: hf_contender(cfg, source, bf16, compile_hf, row)
    if not args.no_ref and fp8 is None:
        builders["ref"] = lambda: ref_contender(args, cfg, source, ref_attention, bf16, row)
    if args.distopt and fp8 is None:

        def distopt() -> Contender:
            t = build_ours(
                args, preset, seq, tokens, objective, precision, fp8, attention, distopt_overrides()
            )[0]
            return ours_contender(t, "distopt", row, None)

        builders["distopt"] = distopt

    t0 = time.perf_counter()
    if args.sequential:
        times = {}
        for name, build in builders.items():
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            contender = None
            try:
                contender = build()
                row["params"][name] = contender.params
                times[name] = time_back_to_back(contender.step, args.warmup, args.steps)
                if gpu:
                    row["peak_gib"][name] = torch.cuda.max_memory_allocated() / GIB
            except Exception as e:  # one contender's failure leaves the row's others measured
                if isinstance(e, torch.OutOfMemoryError):
                    print(f"  {name}: {out_of_memory(e)}")
                    row["failed"][name] = "out of memory"
                else:
                    print(f"  {name} failed:")
                    print("".join(traceback.format_exc().splitlines(True)[-14:]))
                    row["failed"][name] = f"failed ({type(e).__name__})"
            finally:
                try:
                    if contender is not None:
                        contender.close()
                except Exception as e:
                    print(f"  {name}: closing it failed: {type(e).__name__}: {e}")
                contender = None
                free_memory()
                left = torch.cuda.memory_allocated() / GIB if gpu else 0.0
                if left > 0.25:  # held by a cache of compiled code: cleared, at a recompile's cost
                    print(
                        f"  {name} left {left:.1f} GiB allocated: clearing torch.compile's caches"
                    )
                    free_memory(reset_compiled=True)
    else:
        contenders = {}
        for name, build in builders.items():
            contenders[name] = build()
            row["params"][name] = contenders[name].params
        times = time_rows({n: c.step for n, c in contenders.items()}, args.warmup, args.steps)
        if gpu:
            row["peak_gib"]["all"] = torch.cuda.max_memory_allocated() / GIB
        for c in contenders.values():
            c.close()
        contenders.clear()
    row["wall_s"] = time.perf_counter() - t0

    timed = range(args.warmup, args.warmup + args.steps)
    docs = document_figures(source, timed)
    row["documents"] = docs
    labels = int(
        statistics.median(labelled)
        if labelled
        else statistics.median(source.labelled(r) for r in timed)
    )
    shape, vocab = cfg.model.shape(), source.spec.vocab_size
    causal = objective == "clm"
    flops = mfu_step_flops(shape, vocab, seq, mb, labels, causal=causal)
    executed = statistics.fmean(
        document_step_flops(shape, vocab, seq, mb, labels, causal, lengths)
        for lengths in docs["per_step"]
    )
    for name, t_all in times.items():
        t = statistics.median(t_all)
        row.update(
            {
                f"{name}_s": t,
                f"{name}_mean_s": statistics.fmean(t_all),
                f"{name}_tok": mb * seq / t,
                f"{name}_mfu": flops / t / peak if peak else None,
                f"{name}_mfu_documents": executed / t / peak if peak else None,
            }
        )
    return row  # what is left of the models goes with this frame; the caller frees it


def print_row(row) -> None:
    if row.get("oom"):
        print(f"{row['label']}: out of memory")
        return

    def other(name):
        if not row.get(f"{name}_s"):
            return f"{name} {row['failed'].get(name, 'n/a')}"
        mfu, documents = row[f"{name}_mfu"], row[f"{name}_mfu_documents"]
        return (
            f"{name} {row[f'{name}_s']:.4f} s ({row[f'{name}_tok']:.0f} tok/s, MFU "
            f"{fmt(mfu, '.1%')}, documents {fmt(documents, '.1%')})"
        )

    print(f"{row['label']}: mb {row['mb']}, {other('ours')}; {other('hf')}; {other('ref')}", end="")
    if "distopt" in row["params"] or "distopt" in row["failed"]:
        d = ratio_of(row, "distopt_s", "ours_s")
        print(f"; {other('distopt')}, distopt / ours {fmt(d, '.3f')}", end="")
    print(f"; wall {row['wall_s']:.0f} s", flush=True)
    print(f"  {describe_documents(row['documents'], row['seq'])}")
    counts = ", ".join(f"{k} {v:,}" for k, v in row["params"].items())
    print(f"  parameters: {counts} ({'equal' if params_equal(row) == 'yes' else 'NOT EQUAL'})")
    if row["peak_gib"]:
        peaks = ", ".join(f"{k} {v:.1f}" for k, v in row["peak_gib"].items())
        print(f"  peak GPU memory allocated (GiB): {peaks}")


def ratio_of(row: dict, a: str, b: str) -> float | None:
    return row[a] / row[b] if row.get(a) and row.get(b) else None


def print_table(rows: list[dict]) -> None:
    print(
        "\n| config | mb | ours tok/s/GPU | ours MFU | ours MFU, documents | hf tok/s | hf MFU "
        "| ref tok/s | ref MFU | ours/hf s | ours/ref s | distopt/ours s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("oom"):
            print(f"| {r['label']} | OOM | | | | | | | | | | |")
            continue
        print(
            f"| {r['label']} | {r['mb']} | {fmt(r.get('ours_tok'), '.0f')} | "
            f"{fmt(r.get('ours_mfu'), '.1%')} | {fmt(r.get('ours_mfu_documents'), '.1%')} | "
            f"{fmt(r.get('hf_tok'), '.0f')} | {fmt(r.get('hf_mfu'), '.1%')} | "
            f"{fmt(r.get('ref_tok'), '.0f')} | {fmt(r.get('ref_mfu'), '.1%')} | "
            f"{fmt(ratio(r, 'hf_s'), '.3f')} | {fmt(ratio(r, 'ref_s'), '.3f')} | "
            f"{fmt(ratio_of(r, 'distopt_s', 'ours_s'), '.3f')} |"
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


def count_syncs(run: Callable[[int], None], n: int, who: str) -> tuple[float | None, float | None]:
    """(CUDA's count of synchronising calls per step or None off CUDA, HostSyncCounter's or None
    where it cannot count) over n steps of `run(n)`, printed with their commonest sites."""
    from megatron_mlmclm.training.host_syncs import HostSyncCounter, cuda_sync_debug_count

    cuda_syncs = None
    if on_gpu():
        count, messages = cuda_sync_debug_count(lambda: run(n))
        cuda_syncs = count / n
        print(f"{who}: CUDA sync debug mode: {cuda_syncs:g} synchronising calls per step")
        for m in messages[:8]:
            print(f"  {m.splitlines()[0][:140]}")
    # Last: the counter is a dispatch mode, under which torch.compile does not trace and torch
    # runs no higher-order operator without a rule for it (FlexAttention): on the flex path it
    # stops the step, and --attention sdpa counts the rest. A diagnostic: whatever stops the
    # counted steps is printed, and the profile goes on.
    syncs = None
    try:
        with HostSyncCounter() as counter:
            run(n)
        syncs = counter.total / n
        print(f"{who}: host synchronisations over {n} steps ({syncs:g} per step), commonest sites:")
        print("\n".join(counter.report().splitlines()[:20]))
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:200]
        print(f"{who}: HostSyncCounter cannot count this step: {type(e).__name__}: {first}")
    return cuda_syncs, syncs


def profile_reference(args, cfg, source: Samples, ref_attention: str, n: int) -> dict:
    """The reference's steps on ours' batches, profiled as ours' are: unprofiled back to back (after
    a lead-in step, the clock stopped by a drain), then under the profiler from a drain (its
    device work per step: the kernels' time summed, None on CPU; its top kernels), its host time
    by caller (a pass with stacks), its synchronisations (CUDA's count and HostSyncCounter's).
    Step numbers run on from pass to pass, so that each step finds the batch fetched ahead."""
    from torch.profiler import ProfilerActivity, profile

    gpu = on_gpu()
    bf16 = gpu and cfg.train.precision == "bf16"
    loop = reference_loop(args, cfg, source, ref_attention, bf16)
    step = iter(range(10**9))

    def run(steps: int, then_sync: bool = True) -> None:
        for _ in range(steps):
            loop(next(step))
        if then_sync:
            sync()

    run(args.warmup)
    run(1, then_sync=False)
    t0 = time.perf_counter()
    run(n)
    plain = (time.perf_counter() - t0) / n
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run(n)
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
    with profile(activities=activities, with_stack=True) as prof:
        run(min(n, 2))
    print("reference:", end=" ")
    print_host_callers(prof, min(n, 2))
    cuda_syncs, syncs = count_syncs(run, n, "reference")
    return {"plain": plain, "work": work, "cuda_syncs": cuda_syncs, "syncs": syncs}


def profile_ours(args, attention: str, ref_attention: str, precision: str) -> None:
    """Where a step of ours spends its time: see the module docstring (--profile)."""
    from torch.profiler import ProfilerActivity, profile

    preset = args.presets.split(",")[0]
    seq = max(int(s) for s in args.seqs.split(","))
    tokens = int(args.tokens_per_step.split(",")[0])
    objectives = args.objectives.split(",")
    objective = "mlm" if "mlm" in objectives else objectives[0]
    trainer, cfg, mb = build_ours(args, preset, seq, tokens, objective, precision, None, attention)
    phase, n, gpu = cfg.phases[0], args.profile_steps, on_gpu()
    source = Samples(trainer, phase, mb)
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
    print("ours:", end=" ")
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
    print(describe_documents(document_figures(source, range(args.warmup, args.warmup + n)), seq))
    ref = {}
    back_to_back = None
    if not args.no_ref:
        ref = profile_reference(args, cfg, source, ref_attention, n)
        back_to_back = plain / ref["plain"]
        print(
            f"back to back, unprofiled (as training runs steps): ours {plain:.4f} s/step, "
            f"reference {ref['plain']:.4f} s/step, ours / reference {back_to_back:.3f}"
        )
    cuda_syncs, syncs = count_syncs(run, n, "ours")
    trainer.close()
    print(
        f"RESULT train_throughput_profile host_syncs_per_step={fmt(syncs, 'g')} "
        f"gpu_busy={fmt(busy, '.3f')} gpu_busy_unprofiled={fmt(busy_plain, '.3f')}"
        + (f" cuda_syncs_per_step={cuda_syncs:g}" if gpu else "")
        + f" device_ms={fmt(work, '.2f')} ref_device_ms={fmt(ref.get('work'), '.2f')}"
        + f" back_to_back_vs_reference={fmt(back_to_back, '.3f')}"
        + f" ref_host_syncs_per_step={fmt(ref.get('syncs'), 'g')}"
        + (f" ref_cuda_syncs_per_step={fmt(ref.get('cuda_syncs'), 'g')}" if gpu else "")
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
