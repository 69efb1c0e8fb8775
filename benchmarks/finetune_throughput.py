"""Fine-tuning throughput: our loop (megatron_mlmclm.eval.finetune.train) vs a plain Hugging Face
Trainer at the same settings on CPU.

Same tiny EuroBert + mean-pooling head (same init), same SST-2 examples, batch size, number of
steps, AdamW (0.9, 0.95, eps 1e-5, wd 0.1), 10% warmup + linear decay, gradient clipping 1.0,
dynamic padding with the same collate function; no evaluation or checkpointing in either. The
timed part is the training loop only (model and data are built before the clock starts).

    PYTHONPATH=. python benchmarks/finetune_throughput.py [--steps 60] [--threads 1]
    PYTHONPATH=. python benchmarks/finetune_throughput.py --quick   # seconds: 6 steps x 8, once

Last line: RESULT finetune ratio=<ours_time/trainer_time> ours_s=<..> baseline_s=<..>
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="best of N for each side")
    p.add_argument("--quick", action="store_true", help="6 steps x batch 8, one run each")
    args = p.parse_args()
    if args.quick:
        args.steps, args.batch_size, args.repeats = 6, 8, 1
    torch.set_num_threads(args.threads)

    from transformers import Trainer, TrainingArguments

    from megatron_mlmclm.eval.families import load_split
    from megatron_mlmclm.eval.families.base import Setup, collate_ids
    from megatron_mlmclm.eval.families.sc import encode
    from megatron_mlmclm.eval.finetune import FinetuneConfig, seed_everything, train
    from megatron_mlmclm.eval.heads import MeanPoolClassifier, load_encoder, load_tokenizer
    from megatron_mlmclm.eval.tasks import get_task
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
        eval_every=10**9,
        threads=args.threads,
        progress=False,
    )
    pad_id = tok.pad_token_id
    collate = lambda items: collate_ids(items, pad_id)  # noqa: E731
    print(
        f"{len(features)} SST-2 examples, {args.steps} steps x batch {args.batch_size}, "
        f"hidden {args.hidden}, {args.layers} layers, {torch.get_num_threads()} thread(s)"
    )

    def fresh_model():
        seed_everything(0)
        return MeanPoolClassifier(load_encoder(model_dir), num_labels=2)

    def ours() -> float:
        setup = Setup(
            model=fresh_model(),
            train_items=features,
            collate=collate,
            loss=lambda m, b: m(**b).loss,
            evaluate=lambda m, s: {},
        )
        t = time.perf_counter()
        train(setup, cfg, torch.device("cpu"))
        return time.perf_counter() - t

    class DictOut(torch.nn.Module):  # Trainer reads outputs["loss"]
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **batch):
            out = self.inner(**batch)
            return {"loss": out.loss, "logits": out.logits}

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
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
            remove_unused_columns=False,
        )
        trainer = Trainer(
            model=DictOut(fresh_model()), args=targs, train_dataset=features, data_collator=collate
        )
        t = time.perf_counter()
        trainer.train()
        return time.perf_counter() - t

    ours_s = min(ours() for _ in range(args.repeats))
    base_s = min(baseline() for _ in range(args.repeats))
    seen = args.steps * args.batch_size
    print(f"ours:    {ours_s:.2f} s  {seen / ours_s:.1f} examples/s")
    print(f"Trainer: {base_s:.2f} s  {seen / base_s:.1f} examples/s")
    print(
        f"RESULT finetune ratio={ours_s / base_s:.3f} ours_s={ours_s:.2f} baseline_s={base_s:.2f}"
    )


if __name__ == "__main__":
    main()
