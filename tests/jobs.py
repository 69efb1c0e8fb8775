"""Test helpers: launching `mlmclm pretrain` as a real (torchrun) job and reading its metrics, and a
small BPE tokenizer trained on a ten-word corpus."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    # An in-process test may have made a world of one; a job must not inherit its address.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks share 2 cores
    env["PYTHONWARNINGS"] = "ignore"
    return env


def pretrain_cmd(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "megatron_mlmclm", "pretrain"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "megatron_mlmclm", "pretrain"]


def run_pretrain(config: Path, overrides: list[str], nproc: int = 1, check: bool = True,
                 timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(pretrain_cmd(nproc) + [str(config)] + overrides, env=job_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]  # skip step-0 validation


def word_tokenizer(root: Path, vocab_size: int) -> Path:
    """A byte-level BPE of `vocab_size` trained on 200 lines of ten random words; -> root/tok."""
    from megatron_mlmclm.data.tokenizer import train_tokenizer

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "encoder", "model", "token", "the", "of", "and"]
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(20))
                                               for _ in range(200)))
    train_tokenizer([str(root / "corpus.txt")], root / "tok", vocab_size, txt_split_lines=True,
                    progress=False, min_frequency=1)
    return root / "tok"
