"""Proof that the default (fast) path trains models on a GPU, on real shards.

    python tools/gpu_train_check.py compare DATA OUT [--steps 200] [--quick]
    python tools/gpu_train_check.py long DATA OUT [--seconds 240] [--quick]

DATA is a folder with `tok/` (a tokenizer from `mlmclm tokenize`), the shards
`shards/<name>_train_text_document` and `shards/<name>_valid_text_document` (from `mlmclm
preprocess`; the first train/valid prefixes found are used) and, for `long`, the fine-tuning
sets in the layout of $MLMCLM_DATA_DIR (`sst2/`, `conll2003/`). Each run is `mlmclm pretrain` as
a user runs it (210m, seq 2048, MLM 40%, bf16, 16,384 tokens a step; with --quick the tiny preset
at seq 128 in fp32, which runs on a CPU in minutes: bf16 matrix products are slow there).

compare: three runs on the same batches, at once (one GPU holds all three): the default path;
the reference path (`model.fusions=off`: megatron's own layers, hooks and unfused AdamW, eager)
from the same initialisation; and the default path from another initialisation seed
(`train.seed=2`), whose distance from the first is the noise the two paths are judged against.
Prints `RESULT gpu_train_compare ...` with the verdict of `judge_curves`.

long: the default path for up to --seconds of training (checkpoints along the way; the last one
counts), exported to Hugging Face and fine-tuned on SST-2 and CoNLL-2003 (`mlmclm evaluate`,
protocol default, one learning rate and seed), beside the same pipeline from a model trained one
step at a learning rate of 1e-12 (its random initialisation). Prints `RESULT gpu_train_long ...`
with the verdict of `judge_finetuned` and writes the loss curve to OUT/long_curve.tsv.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TASKS = ("sst2", "conll2003")


def run_config(data: Path, quick: bool) -> dict:
    train = sorted(glob.glob(str(data / "shards" / "*_train_text_document.idx")))
    valid = sorted(glob.glob(str(data / "shards" / "*_valid_text_document.idx")))
    if not train or not valid:
        sys.exit(f"no *_train_ / *_valid_text_document shards in {data / 'shards'}")
    seq = 128 if quick else 2048
    return {
        "data": {
            "train": [train[0][: -len(".idx")]],
            "valid": [valid[0][: -len(".idx")]],
            "tokenizer": str(data / "tok"),
            "loader": "sync",
        },
        "model": {"preset": "tiny" if quick else "210m", "seq_length": seq},
        "phases": [{"objective": "mlm", "mask_ratio": 0.4}],
        "train": {
            "micro_batch_size": 8,
            "global_batch_size": 8,
            "lr": 5.0e-4,
            "warmup_steps": 4 if quick else 50,
            "decay_steps": 0,
            "precision": "fp32" if quick else "bf16",
        },
        "checkpoint": {"save_interval": 0, "keep_last": 1},
        "logging": {"log_interval": 10, "eval_interval": 0, "tensorboard": True},
    }


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def pretrain(config: Path, out: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "megatron_mlmclm", "pretrain", str(config)]
    command += [f"output_dir={out}", *overrides]
    return subprocess.Popen(command, env=env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def curve(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}


def wait(procs: dict[str, subprocess.Popen], logs: Path) -> None:
    for name, proc in procs.items():
        if proc.wait() != 0:
            tail = (logs / f"{name}.log").read_text()[-3000:]
            sys.exit(f"{name} failed ({proc.returncode}):\n{tail}")


# ---- judges: pure functions of measured curves (tests/test_gpu_checks.py feeds them numbers) ----


def judge_curves(fast: dict, reference: dict, other_seed: dict, floor: float = 0.01) -> dict:
    """The default path against the reference path from the same initialisation, on the same
    batches, step by step: the mean absolute loss difference over the second half of the run
    must not exceed the mean distance of the default path from itself started at another
    initialisation (the noise of the question 'does it train the same model?'), or `floor`
    where that noise happens to be smaller. The first step (same weights, same batch: the
    forward alone) must agree to `floor` too."""
    steps = sorted(set(fast) & set(reference) & set(other_seed))
    late = steps[len(steps) // 2 :]
    diff = sum(abs(fast[s] - reference[s]) for s in late) / len(late)
    noise = sum(abs(fast[s] - other_seed[s]) for s in late) / len(late)
    first = abs(fast[steps[0]] - reference[steps[0]])
    worst = max(abs(fast[s] - reference[s]) for s in late)
    return {
        "steps": len(steps),
        "first_step_diff": first,
        "late_mean_diff": diff,
        "late_max_diff": worst,
        "late_mean_seed_spread": noise,
        "fast_tail": sum(fast[s] for s in late[-10:]) / len(late[-10:]),
        "reference_tail": sum(reference[s] for s in late[-10:]) / len(late[-10:]),
        "ok": first <= floor and diff <= max(noise, floor),
    }


def judge_finetuned(trained: dict[str, float], random_init: dict[str, float]) -> dict:
    """Every task's test score above the same pipeline's from the random initialisation."""
    return {
        "trained": trained,
        "random_init": random_init,
        "ok": bool(trained) and all(trained[t] > random_init[t] for t in trained),
    }


# ---- the two parts ----


def compare(args) -> dict:
    out, logs = Path(args.out), Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    config = out / "compare.yaml"
    config.write_text(yaml.safe_dump(run_config(Path(args.data), args.quick)))
    runs = {
        "fast": [],
        "reference": ["model.fusions=off"],
        "fast_seed2": ["train.seed=2"],
    }
    common = [f"train.steps={args.steps}"]
    procs = {
        name: pretrain(config, out / name, common + extra, logs / f"{name}.log")
        for name, extra in runs.items()
    }
    wait(procs, logs)
    verdict = judge_curves(*(curve(out / name) for name in runs))
    for name in runs:
        lines = (logs / f"{name}.log").read_text().splitlines()
        plan = [line for line in lines if "kernels on" in line]
        verdict[f"{name}_plan"] = plan[0].split("kernels on ", 1)[-1][:300] if plan else "?"
    return verdict


def scores(results: Path, model: str) -> dict[str, float]:
    out = {}
    for task in TASKS:
        (path,) = sorted((results / model / task).glob("lr*_seed*.json"))
        record = json.loads(path.read_text())
        test = record["metrics"]["test"]
        out[task] = float(test[record["metric"]] if isinstance(test, dict) else test)
    return out


def long(args) -> dict:
    out, logs = Path(args.out), Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    config = out / "long.yaml"
    cfg = run_config(Path(args.data), args.quick)
    cfg["train"].update(global_batch_size=16, steps=args.steps, decay_steps=args.steps // 10)
    cfg["checkpoint"].update(save_interval=args.save_interval, keep_last=1)
    config.write_text(yaml.safe_dump(cfg))
    start = time.time()
    trained = pretrain(config, out / "trained", [], logs / "trained.log")
    random_init = pretrain(
        config,
        out / "random_init",
        ["train.steps=1", "train.lr=1e-12", "train.warmup_steps=0", "train.decay_steps=0"],
        logs / "random_init.log",
    )
    wait({"random_init": random_init}, logs)
    try:
        trained.wait(timeout=args.seconds)
    except subprocess.TimeoutExpired:  # the last complete checkpoint counts
        trained.terminate()
        trained.wait()
    seconds = time.time() - start
    losses = curve(out / "trained")
    (out / "long_curve.tsv").write_text(
        "step\tloss\n" + "".join(f"{s}\t{v:.5f}\n" for s, v in sorted(losses.items()))
    )
    exports = {}
    for name in ("trained", "random_init"):
        hf = out / "hf" / name
        subprocess.run(
            [sys.executable, "-m", "megatron_mlmclm", "convert", "to-hf"]
            + [str(out / name / "checkpoints"), str(hf), "--force"],
            env=env(),
            check=True,
            stdout=(logs / f"export_{name}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        exports[name] = hf
    results = out / "eval"
    evaluate = [sys.executable, "-m", "megatron_mlmclm", "evaluate", "--model"]
    evaluate += [str(p) for p in exports.values()]
    evaluate += ["--task", *TASKS, "--lrs", str(args.finetune_lr), "--seeds", "0"]
    evaluate += ["--out", str(results), "--workers", str(args.workers), "--no-progress"]
    if args.quick:
        evaluate += ["--max-steps", "20", "--max-train-examples", "400"]
        evaluate += ["--max-eval-examples", "200", "--device", "cpu"]
    subprocess.run(
        evaluate,
        env=env(),
        check=True,
        stdout=(logs / "evaluate.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    verdict = judge_finetuned(scores(results, "trained"), scores(results, "random_init"))
    first, last = min(losses), max(losses)
    verdict.update(
        steps=last,
        tokens=last * cfg["train"]["global_batch_size"] * cfg["model"]["seq_length"],
        train_seconds=round(seconds, 1),
        first_loss=losses[first],
        last_loss=sum(losses[s] for s in sorted(losses)[-10:]) / min(10, len(losses)),
    )
    return verdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("part", choices=["compare", "long"])
    p.add_argument("data", help="tok/ and shards/ (and sst2/, conll2003/ for long)")
    p.add_argument("out")
    p.add_argument("--quick", action="store_true", help="tiny model, seq 128 (runs on a CPU)")
    p.add_argument("--steps", type=int, default=None, help="compare: 200; long: 3000")
    p.add_argument("--seconds", type=float, default=240.0, help="long: training time limit")
    p.add_argument("--save-interval", type=int, default=250)
    p.add_argument("--finetune-lr", type=float, default=5e-5)
    p.add_argument("--workers", type=int, default=4, help="long: fine-tuning runs at once")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 200 if args.part == "compare" else 3000
    os.environ.setdefault("MLMCLM_DATA_DIR", str(Path(args.data).resolve()))
    verdict = compare(args) if args.part == "compare" else long(args)
    Path(args.out, f"{args.part}.json").write_text(json.dumps(verdict, indent=1))
    fields = " ".join(f"{k}={v}" for k, v in verdict.items() if not k.endswith("_plan"))
    print(f"RESULT gpu_train_{args.part} {fields}")
    for key, value in verdict.items():
        if key.endswith("_plan"):
            print(f"PLAN {key[: -len('_plan')]}: {value}")


if __name__ == "__main__":
    main()
