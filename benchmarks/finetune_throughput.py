"""Fine-tuning throughput: our loop (megatron_mlmclm.eval.finetune.train) vs a plain Hugging Face
Trainer at the same settings, on CPU or a GPU; and, on a GPU, several of our runs sharing it (as
`mlmclm evaluate --workers N` does).

Same tiny EuroBert + mean-pooling head (same init), same SST-2 examples, batch size, number of
steps, AdamW (0.9, 0.95, eps 1e-5, wd 0.1), 10% warmup + linear decay, gradient clipping 1.0,
dynamic padding with the same collate function and the same batches (the Trainer reads the examples
in our loop's order, sequentially: with dynamic padding another shuffle pads a different number
of tokens, 4% more or less at these settings), the same precision (fp32 on CPU, bf16 autocast
with fp32 weights on a GPU); no evaluation or checkpointing in either. The timed part is the
training loop only (model and data are built before the clock starts). Our loop reads the loss
back only at the validation curve's points (one here, the last step); the Trainer, as it runs by
default, checks each step's loss for NaN/inf on the host (`logging_nan_inf_filter`), so on a GPU
it waits for every step to finish before queueing the next.

    PYTHONPATH=. python benchmarks/finetune_throughput.py [--steps 60] [--threads 1]
    PYTHONPATH=. python benchmarks/finetune_throughput.py --quick   # seconds: 6 steps x 8, once
    # on a GPU: a 4-layer, 512-wide model, ours vs the Trainer, then 1, 2 and 4 of our runs at once
    PYTHONPATH=. python benchmarks/finetune_throughput.py --device cuda --hidden 512 --layers 4 \\
        --steps 200 --workers 1 2 4

Last line: RESULT finetune ratio=<ours_time/trainer_time> ours_s=<..> baseline_s=<..>
ours_eps=<..> baseline_eps=<..> [workers_eps=<N>:<examples/s>,...]

The planner's form (`--probe SIZE`): the evaluation probe of `mlmclm evaluate --probe`
(megatron_mlmclm/eval/probe.py) on a model preset's shape, its figures written to --out, which
`mlmclm plan` reads; on a GPU, at 210m over one task of each family:

    PYTHONPATH=. python benchmarks/finetune_throughput.py --probe 210m --tokenizer TOK \
        --tasks sst2 conll2003 squad scifact --out eval_probe_210m.json [--probe-steps 200]

Last line: RESULT finetune_probe size=<..> device=<..> <task>_step_ms=<..> ...
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time

import torch


def prepare(args, model_dir: str):
    """(SST-2 features, the run config, the collate function, a fresh model maker)."""
    from megatron_mlmclm.eval.families import load_split
    from megatron_mlmclm.eval.families.base import collate_ids
    from megatron_mlmclm.eval.families.sc import encode
    from megatron_mlmclm.eval.finetune import FinetuneConfig, seed_everything
    from megatron_mlmclm.eval.heads import MeanPoolClassifier, load_encoder
    from megatron_mlmclm.eval.input_form import load_tokenizer
    from megatron_mlmclm.eval.tasks import get_task

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(model_dir)
    task = get_task("sst2")
    n = args.steps * args.batch_size
    features = encode(task, load_split(task, "train", n), tok, 252, {"0": 0, "1": 1})
    cfg = FinetuneConfig(
        model=model_dir,
        task="sst2",
        lr=1e-4,
        batch_size=args.batch_size,
        max_steps=args.steps,
        epochs=None,
        eval_every=10**9,
        threads=args.threads,
        progress=False,
        device=args.device,
        precision=args.precision,
    )
    pad_id = tok.pad_token_id

    def fresh_model():
        seed_everything(0)
        return MeanPoolClassifier(load_encoder(model_dir), num_labels=2)

    return features, cfg, lambda items: collate_ids(items, pad_id), fresh_model


def run_ours(features, cfg, collate, fresh_model) -> float:
    """Seconds our loop takes for the run (after a device sync)."""
    from megatron_mlmclm.eval.families.base import Setup
    from megatron_mlmclm.eval.finetune import resolve_device, train

    device = resolve_device(cfg)
    setup = Setup(
        model=fresh_model(),
        train_items=features,
        collate=collate,
        loss=lambda m, b: m(**b).loss,
        evaluate=lambda m, s: {},
    )
    t = time.perf_counter()
    train(setup, cfg, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def worker(args, model_dir: str, barrier, results) -> None:
    """One of N runs sharing the device: built, then started with the others at once."""
    prepared = prepare(args, model_dir)
    run_ours(*prepared)  # warm-up: kernels, allocator
    barrier.wait()
    results.put(run_ours(*prepared))


def shared(args, model_dir: str, n: int) -> float:
    """Examples per second of `n` of our runs at once on the device (all of their examples over
    the slowest run's time)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(args, model_dir, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    times = [results.get() for _ in procs]
    for p in procs:
        p.join()
    return n * args.steps * args.batch_size / max(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="best of N for each side")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--precision", choices=("fp32", "bf16"), default=None, help="default: bf16 on a GPU"
    )
    p.add_argument(
        "--workers", type=int, nargs="*", default=[], help="also N of our runs at once (GPU)"
    )
    p.add_argument("--quick", action="store_true", help="6 steps x batch 8, one run each")
    p.add_argument("--probe", metavar="SIZE", help="the evaluation probe at a model preset")
    p.add_argument("--tokenizer", help="--probe: the tokenizer folder")
    p.add_argument("--tasks", nargs="+", default=["sst2", "conll2003", "squad", "scifact"])
    p.add_argument("--probe-steps", type=int, default=200)
    p.add_argument("--out", default="eval_probe.json", help="--probe: the figures' file")
    args = p.parse_args()
    if args.probe:
        return probe(args)
    if args.quick:
        args.steps, args.batch_size, args.repeats = 6, 8, 1
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    torch.set_num_threads(args.threads)

    from transformers import Trainer, TrainingArguments

    from megatron_mlmclm.eval.finetune import batches
    from megatron_mlmclm.eval.tiny import build_tiny_model, sample_texts
    from megatron_mlmclm.paths import data_dir

    tmp = tempfile.mkdtemp(prefix="ft_bench_")
    model_dir = str(
        build_tiny_model(
            f"{tmp}/tiny",
            sample_texts(data_dir(required=True)),
            hidden_size=args.hidden,
            layers=args.layers,
            max_positions=256,
        )
    )
    features, cfg, collate, fresh_model = prepare(args, model_dir)
    print(
        f"{len(features)} SST-2 examples, {args.steps} steps x batch {args.batch_size}, "
        f"hidden {args.hidden}, {args.layers} layers, {args.device} {args.precision}, "
        f"{torch.get_num_threads()} thread(s)"
    )

    class DictOut(torch.nn.Module):  # Trainer reads outputs["loss"]
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **batch):
            out = self.inner(**batch)
            return {"loss": out.loss, "logits": out.logits}

    # our loop's batches, in its order: the Trainer reads them sequentially
    ordered = [
        features[i]
        for idx in batches(len(features), args.batch_size, args.steps, cfg.seed)
        for i in idx
    ]

    def baseline() -> float:
        targs = TrainingArguments(
            output_dir=f"{tmp}/trainer",
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=cfg.lr,
            warmup_steps=int(0.1 * args.steps),
            lr_scheduler_type="linear",
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_epsilon=1e-5,
            max_grad_norm=1.0,
            logging_steps=10**9,
            save_strategy="no",
            eval_strategy="no",
            report_to=[],
            use_cpu=args.device == "cpu",
            bf16=args.precision == "bf16",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
            remove_unused_columns=False,
            train_sampling_strategy="sequential",
        )
        trainer = Trainer(
            model=DictOut(fresh_model()), args=targs, train_dataset=ordered, data_collator=collate
        )
        t = time.perf_counter()
        trainer.train()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t

    times = []  # the two sides alternate, so that a change of load touches both alike
    for _ in range(args.repeats):
        times.append((run_ours(features, cfg, collate, fresh_model), baseline()))
    ours_s, base_s = (min(side) for side in zip(*times))
    seen = args.steps * args.batch_size
    print(f"ours:    {ours_s:.2f} s  {seen / ours_s:.1f} examples/s")
    print(f"Trainer: {base_s:.2f} s  {seen / base_s:.1f} examples/s")
    extra = ""
    if args.workers:
        rates = {n: shared(args, model_dir, n) for n in args.workers}
        for n, eps in rates.items():
            print(f"{n} run(s) at once: {eps:.1f} examples/s in all")
        extra = " workers_eps=" + ",".join(f"{n}:{eps:.1f}" for n, eps in rates.items())
    print(
        f"RESULT finetune ratio={ours_s / base_s:.3f} ours_s={ours_s:.2f} baseline_s={base_s:.2f} "
        f"ours_eps={seen / ours_s:.1f} baseline_eps={seen / base_s:.1f}{extra}"
    )


def probe(args) -> None:
    """--probe SIZE: `mlmclm evaluate --probe`'s figures (eval/probe.py) -> --out."""
    from megatron_mlmclm.eval.probe import run_probe
    from megatron_mlmclm.eval.tiny import build_tokenizer, sample_texts
    from megatron_mlmclm.paths import data_dir

    tokenizer = args.tokenizer
    if tokenizer is None:  # a word-level tokenizer of the shipped data's words
        tokenizer = tempfile.mkdtemp(prefix="ft_probe_tok_")
        build_tokenizer(sample_texts(data_dir(required=True))).save_pretrained(tokenizer)
    record = run_probe(
        args.probe, tokenizer, args.tasks, args.out, steps=args.probe_steps, device=args.device
    )
    figures = " ".join(
        f"{name}_step_ms={f['step_s'] * 1e3:.1f} {name}_startup_s={f['startup_s']:.1f}"
        for name, f in record["tasks"].items()
    )
    print(json.dumps(record, indent=1))
    print(
        f"RESULT finetune_probe size={args.probe} device={record['device'].replace(' ', '_')} "
        f"{figures}"
    )


if __name__ == "__main__":
    main()
