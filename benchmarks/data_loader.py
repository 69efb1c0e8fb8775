"""The data loaders (data.loader = sync | workers | dali) on real Gutenberg shards, on CPU.

1. Throughput: each loader hands over the micro-batches of consecutive training steps (seq 2048,
   MLM 40%, micro-batch 8, 4 micro-batches a step) as fast as it can; samples/s over the steps
   after the first (which starts the workers), best of --repeats runs with the loaders taking
   turns. `workers` and `dali` use --workers processes (default 2). Goal: >= 1,500 samples/s.
2. Overlap: the real Trainer's `train_step` (one torch thread; a small model at seq 2048, MLM 40%,
   dense document mask built in the step) fed by each loader, against the same step fed batches
   built before the clock started (`prebuilt`, a stand-in loader). The arms take turns in blocks
   of --block consecutive steps, each arm continuing its own step sequence, so a worker loader
   streams as in training; the first --settle steps of every block are not timed, so the queue a
   loader filled while other arms ran does not flatter it. Goal: workers/prebuilt <= 1.02, with
   --overlap-workers processes (default 1: one core for the step, one for the loader). Also
   printed: the minimum step time, the training thread's CPU time (time.thread_time: blind to
   other processes taking the core, and to the GIL, but not to a loader's work in that thread)
   and the time each step spent waiting for its batches (the loader's critical-path cost, which
   the whole-step ratio cannot resolve on a noisy machine when it is small).

The machine is shared: the load average is printed before and after; repeat when it is high.

    PYTHONPATH=. python benchmarks/data_loader.py [--work /tmp/bench_data]
    PYTHONPATH=. python benchmarks/data_loader.py --quick   # seconds: 8 books, 1k BPE, seq 256

--quick is a smoke run, not a measurement: the first 8 train books with a 1k BPE (in a temp dir
unless --work names one), seq 256, a few steps per loader and per arm.

Needs $MLMCLM_DATA_DIR (gutenberg_en/). Tokenizer and shards are built into --work (default: a
temp dir) with `mlmclm tokenize` / `mlmclm preprocess`, and reused when --work is given.
Last line: RESULT data_loader ratio=<workers_step_s/prebuilt_step_s> ours_s=<workers_step_s>
baseline_s=<prebuilt_step_s> workers_samples_per_s=.. dali_samples_per_s=.. sync_samples_per_s=..
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

warnings.filterwarnings("ignore")

MASK_RATIO, MBS, MICROBATCHES = 0.4, 8, 4


def build_data(work: Path, books: int | None = None) -> tuple[Path, str]:
    """An 8k BPE trained on 60 books and the train split's shards (244 books). A small vocabulary
    keeps the CPU training step of the overlap short; the loaders' cost hardly depends on it.
    `books`: only the first books, and a 1k BPE (--quick)."""
    from megatron_mlmclm.data.preprocess import preprocess
    from megatron_mlmclm.data.tokenizer import train_tokenizer
    from megatron_mlmclm.paths import data_dir

    source = str(data_dir(required=True) / "gutenberg_en" / "train.jsonl.gz")
    name = "gutenberg_train"
    if books is not None:
        name = f"gutenberg_train_first{books}"
        first = work / f"{name}.jsonl"
        if not first.is_file():
            with gzip.open(source, "rt", encoding="utf-8") as f:
                first.write_text("".join(line for _, line in zip(range(books), f)))
        source = str(first)
    tokenizer = work / ("tokenizer" if books is None else f"tokenizer_first{books}")
    if not (tokenizer / "mlmclm_tokenizer.json").is_file():
        train_tokenizer(
            [source],
            tokenizer,
            vocab_size=8192 if books is None else 1024,
            max_documents=60,
            progress=False,
        )
    prefix = work / "shards" / name
    if not Path(f"{prefix}_text_document.idx").is_file():
        preprocess([source], prefix, tokenizer, workers=2, progress=False)
    return tokenizer, f"{prefix}_text_document"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def throughput(kind: str, dataset, plan, workers: int, steps: int) -> float:
    from megatron_mlmclm.training.batches.loader import build_loader

    loader = build_loader(kind, dataset, plan, num_workers=workers, start_step=0)
    try:
        get = lambda s: loader.get(s, plan.first_sample(s), plan.phase(s))  # noqa: E731
        get(0)  # workers start, queues fill
        t0 = time.perf_counter()
        for s in range(1, steps):
            get(s)
        dt = time.perf_counter() - t0
    finally:
        loader.close()
    return (steps - 1) * plan.global_batch_size / dt


class Timed:
    """A loader that also records the seconds each step waits for it (its critical-path cost)."""

    def __init__(self, loader):
        self.loader, self.waits = loader, []

    def get(self, step, first_sample, phase):
        t0 = time.perf_counter()
        out = self.loader.get(step, first_sample, phase)
        self.waits.append(time.perf_counter() - t0)
        return out

    def close(self):
        self.loader.close()


class Prebuilt:
    """A loader whose batches were built before the clock started."""

    def __init__(self, datasets, plan, steps: int):
        """`datasets`: one per sample stream, as the trainer's loaders take them."""
        self.plan = plan
        self.batches = [
            plan.microbatches(datasets[plan.stream(s)], plan.first_sample(s), plan.phase(s))
            for s in range(steps)
        ]

    def get(self, step, first_sample, phase):
        return self.batches[step]

    def close(self):
        pass


def overlap(args, tokenizer: Path, prefix: str, kinds: list[str]):
    """Per arm: the timed step seconds and the seconds of those steps spent waiting for data."""
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.training.batches.loader import SyncLoader, build_loader
    from megatron_mlmclm.training.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench_data_loader_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    steps_per_arm = args.rounds * args.block
    cfg = load_config(
        None,
        [
            f"output_dir={out}",
            "checkpoint.resume=false",
            "logging.tensorboard=false",
            f"data.train=[{prefix}]",
            f"data.tokenizer={tokenizer}",
            f"data.cache_dir={out}/cache",
            "data.loader=sync",
            f"model.seq_length={args.seq}",
            "model.preset=tiny",
            f"model.num_layers={args.layers}",
            f"model.hidden_size={args.hidden}",
            f"model.ffn_hidden_size={3 * args.hidden}",
            f"model.num_attention_heads={args.heads}",
            f"model.num_query_groups={args.heads}",
            f"model.kv_channels={args.hidden // args.heads}",
            f"train.steps={steps_per_arm}",
            "train.warmup_steps=1",
            "train.decay_steps=1",
            f"train.micro_batch_size={args.overlap_mbs}",
            f"train.global_batch_size={args.overlap_mbs * MICROBATCHES}",
            "train.precision=fp32",
            f"phases.0.mask_ratio={MASK_RATIO}",
        ],
    )
    trainer = Trainer(cfg)
    trainer.setup()
    ds, plan = trainer.train_ds, trainer.plan
    loaders = {"prebuilt": Prebuilt(ds, plan, steps_per_arm), "sync": SyncLoader(ds, plan)}
    for kind in kinds:
        if kind not in loaders:
            loaders[kind] = build_loader(kind, ds, plan, args.overlap_workers, start_step=0)
    loaders = {name: Timed(loader) for name, loader in loaders.items()}
    names = list(loaders)
    n_params = sum(p.numel() for c in trainer.model_chunks for p in c.parameters())
    print(
        f"overlap: {n_params / 1e6:.2f}M parameters ({args.layers} layers, hidden "
        f"{args.hidden}, vocab {trainer.spec.vocab_size}), seq {args.seq}, {MICROBATCHES} "
        f"micro-batches of {args.overlap_mbs} a step, torch threads "
        f"{torch.get_num_threads()}, {args.overlap_workers} loader worker(s); {args.rounds} "
        f"rounds x blocks of {args.block} steps per arm ({args.settle} untimed), arms "
        f"{', '.join(names)}"
    )
    times, cpu, waits = {n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}
    position = {n: 0 for n in names}
    try:
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                trainer.loader = loaders[name]
                for k in range(args.block):
                    trainer.step = position[name]
                    phase = plan.phase(trainer.step)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    trainer.train_step(phase)
                    if k >= args.settle:
                        times[name].append(time.perf_counter() - t0)
                        cpu[name].append(time.thread_time() - c0)
                        waits[name].append(loaders[name].waits[-1])
                    position[name] += 1
    finally:
        for loader in loaders.values():
            loader.close()
        trainer.loader = None
        trainer.close()
    return times, cpu, waits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", help="folder for tokenizer and shards (kept; default: a temp dir)")
    p.add_argument(
        "--quick", action="store_true", help="seconds: 8 books, 1k BPE, seq 256, few steps"
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--workers", type=int, default=2, help="loader processes for throughput")
    p.add_argument("--steps", type=int, default=64, help="steps per loader for throughput")
    p.add_argument("--repeats", type=int, default=3, help="throughput runs per loader (best kept)")
    p.add_argument("--overlap-workers", type=int, default=1)
    p.add_argument("--overlap-mbs", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--settle", type=int, default=3)
    p.add_argument("--no-overlap", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats, args.rounds, args.block, args.settle = 6, 1, 1, 3, 1
        args.seq = 256
    torch.set_num_threads(1)

    from megatron_mlmclm.config import PhaseConfig, load_config
    from megatron_mlmclm.data.dataset import build_train_dataset
    from megatron_mlmclm.training.batches.batch_plan import Plan
    from megatron_mlmclm.training.trainer import token_spec_and_vocab

    try:
        import nvidia.dali  # noqa: F401

        kinds = ["sync", "workers", "dali"]
    except ImportError:
        kinds = ["sync", "workers"]
        print("DALI is not installed: the dali loader is skipped")
    if args.work:
        work = Path(args.work)
    else:
        work = Path(tempfile.mkdtemp(prefix="bench_data_loader_data_"))
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    print(f"load average before: {load_average()} ({os.cpu_count()} CPUs, shared)")
    t0 = time.perf_counter()
    tokenizer, prefix = build_data(work, books=8 if args.quick else None)
    print(f"data: {prefix} ({time.perf_counter() - t0:.1f} s to build or find)")

    cfg = load_config(None, [f"data.tokenizer={tokenizer}", f"data.train=[{prefix}]"])
    spec = token_spec_and_vocab(cfg)
    gbs = MBS * MICROBATCHES
    plan = Plan(
        (PhaseConfig("mlm", steps=args.steps, mask_ratio=MASK_RATIO),),
        spec,
        cfg.data.seed,
        args.steps,
        gbs,
        MBS,
        1,
        0,
    )
    dataset = build_train_dataset(
        [prefix], args.seq, args.steps * gbs, cfg.data.seed, work / "cache"
    )
    runs = {kind: [] for kind in kinds}
    for _ in range(args.repeats):  # loaders in turn, so machine noise hits each alike
        for kind in kinds:
            runs[kind].append(throughput(kind, dataset, plan, args.workers, args.steps))
    rates = {kind: max(r) for kind, r in runs.items()}
    for kind, r in runs.items():
        workers = "" if kind == "sync" else f", {args.workers} workers"
        print(
            f"throughput {kind}{workers}: best {rates[kind]:,.0f} samples/s, runs "
            f"{' '.join(f'{x:,.0f}' for x in r)} (seq {args.seq}, MLM {MASK_RATIO:.0%}, "
            f"{args.steps - 1} steps of {gbs} samples)"
        )
    print(f"load average after throughput: {load_average()}")

    ratio, ours_s, base_s = float("nan"), float("nan"), float("nan")
    if not args.no_overlap:
        times, cpu, waits = overlap(args, tokenizer, prefix, kinds)
        base_s = statistics.median(times["prebuilt"])
        base_min, base_cpu = min(times["prebuilt"]), statistics.median(cpu["prebuilt"])
        for name, ts in times.items():
            med, c = statistics.median(ts), statistics.median(cpu[name])
            print(
                f"step fed by {name:>8}: wall median {med:.4f} s ({med / base_s:.3f} x "
                f"prebuilt), min {min(ts):.4f} s ({min(ts) / base_min:.3f} x), max "
                f"{max(ts):.4f} s, n={len(ts)}; training-thread CPU median {c:.4f} s "
                f"({c / base_cpu:.3f} x); waits {1e3 * statistics.median(waits[name]):.2f} ms "
                f"a step for its batches"
            )
        ours_s = statistics.median(times["workers"])
        ratio = ours_s / base_s
        print(f"load average after overlap: {load_average()}")
    rest = " ".join(f"{k}_samples_per_s={v:.0f}" for k, v in rates.items())
    print(
        f"RESULT data_loader ratio={ratio:.3f} ours_s={ours_s:.4f} baseline_s={base_s:.4f} {rest}"
    )


if __name__ == "__main__":
    defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does
    main()
