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
    debug mode), then under megatron_mlmclm.training.step.host_syncs.HostSyncCounter the operations
    per step that make the host wait for the device, by operation and line (counted on CPU too: what
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
import itertools
import math
import traceback
import warnings

import torch
from _throughput_contenders import on_gpu
from _throughput_profile import profile_ours
from _throughput_rows import (
    fmt,
    free_memory,
    out_of_memory,
    params_equal,
    print_row,
    print_table,
    ratio,
    run_row,
)
from reference_encoder import default_attention

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

warnings.filterwarnings("ignore", category=UserWarning)  # megatron's no-Apex/TE notices

# --size: 16k tokens a step, and the study's tokens per GPU (12 sequences of 2,048)
SIZE_TOKENS = "16384,24576"


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sequential and args.warmup < 1:
        raise SystemExit("--sequential needs --warmup 1 or more (the timed steps' lead-in)")

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
    print_documents(args.documents)
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
    rows, headline = run_rows(args, precisions, attention, ref_attention, peak)
    print_table(rows)
    print_step0_losses(rows, args.vocab)
    print_results(rows, headline, " timing=back_to_back" if args.sequential else "")


def parse_args() -> argparse.Namespace:
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
    return args


def print_documents(documents: str) -> None:
    from megatron_mlmclm.data.mock import MEDIUM_RANGE, SHORT_MEAN, WEB_MEAN

    shapes = {
        "web": f"log-normal lengths, mean {WEB_MEAN:.0f} tokens, a long tail",
        "medium": f"uniform lengths from {MEDIUM_RANGE[0]} to {MEDIUM_RANGE[1] - 1} tokens, each "
        "row starting a document",
        "short": f"geometric lengths, mean {SHORT_MEAN} tokens",
    }
    print(
        f"documents: mock samples (no shards), data.mock_doc_length={documents}: "
        f"{shapes[documents]}, packed into rows; the same samples and masks for every "
        "contender"
    )


def run_rows(
    args, precisions, attention: str, ref_attention: str, peak
) -> tuple[list, dict | None]:
    """Every row of the grid, each printed as it ends; -> (the rows, the headline row or None)."""
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
    return rows, headline


def tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def print_step0_losses(rows: list[dict], vocab: int) -> None:
    print(f"\nloss at step 0 (a sanity check, same init scale; ln(vocab) = {math.log(vocab):.3f}):")
    for r in rows:
        if not r.get("oom"):
            losses = ", ".join(f"{k} {v:.3f}" for k, v in r["step0_loss"].items())
            print(f"  {r['label']}: {losses}")


def print_results(rows: list[dict], headline: dict | None, mode: str) -> None:
    """The RESULT lines: each row's ratios, then the headline's (the last line)."""
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


if __name__ == "__main__":
    defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does
    main()
