"""A row of benchmarks/train_throughput.py: its contenders built and timed (alternating step by
step, or one at a time back to back with --sequential), its figures (s/step, tokens/s, MFU over
whole rows and over the documents), and how a row and the table print."""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch
from _engine import time_back_to_back, time_rows
from _throughput_contenders import (
    Contender,
    Samples,
    build_ours,
    distopt_overrides,
    hf_contender,
    on_gpu,
    ours_contender,
    ref_contender,
)

GIB = 2**30


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


def ratio(row: dict, key: str) -> float | None:
    return row["ours_s"] / row[key] if row.get(key) and row.get("ours_s") else None


def ratio_of(row: dict, a: str, b: str) -> float | None:
    return row[a] / row[b] if row.get(a) and row.get(b) else None


def params_equal(row: dict) -> str:
    counts = set(row["params"].values())
    return "yes" if len(counts) == 1 else "no"


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


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
