"""Test helpers: launching `mlmclm pretrain` as a real (torchrun) job or training in this process,
reading its metrics, and small BPE tokenizers."""

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
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "megatron_mlmclm",
        "pretrain",
    ]


def run_pretrain(
    config: Path, overrides: list[str], nproc: int = 1, check: bool = True, timeout: int = 300
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        pretrain_cmd(nproc) + [str(config)] + overrides,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def train_in_process(config, overrides: list[str], **options):
    """A whole run in this process (a world of one), torn down after; -> the Trainer."""
    from megatron_mlmclm.config import load_config  # megatron-core: imported when needed
    from megatron_mlmclm.runtime import distributed as rt
    from megatron_mlmclm.training.trainer import Trainer

    trainer = Trainer(load_config(config, overrides), **options)
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.close()
        rt.destroy_distributed()
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # set for the world of one
            os.environ.pop(key, None)
    return trainer


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def curve(run_dir: Path) -> dict[int, float]:
    """step -> loss; a resumed run re-logs steps after its checkpoint: the last record wins."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]  # skip step-0 validation


def word_tokenizer(root: Path, vocab_size: int) -> Path:
    """A byte-level BPE of `vocab_size` trained on 200 lines of ten random words; -> root/tok."""
    from megatron_mlmclm.data.tokenizer import train_tokenizer

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "encoder", "model", "token", "the", "of", "and"]
    (root / "corpus.txt").write_text(
        "\n".join(" ".join(rng.choice(words) for _ in range(20)) for _ in range(200))
    )
    train_tokenizer(
        [str(root / "corpus.txt")],
        root / "tok",
        vocab_size,
        txt_split_lines=True,
        progress=False,
        min_frequency=1,
    )
    return root / "tok"


def line_tokenizer(root: Path) -> tuple[Path, int]:
    """A 300-token BPE trained on 200 numbered lines; -> (root/tok, its vocabulary size)."""
    from megatron_mlmclm.data.tokenizer import load_tokenizer, train_tokenizer

    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"text": f"line {i} of a small corpus, word {i * 7}"}) + "\n"
            for i in range(200)
        )
    )
    tok = train_tokenizer([str(corpus)], root / "tok", 300, progress=False)
    return tok, len(load_tokenizer(tok))
