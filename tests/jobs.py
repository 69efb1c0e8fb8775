"""Test helpers: launching `mlmclm pretrain` as a job or training in this process, reading its
metrics, and small BPE tokenizers.

A job starts one of two ways:
- `start` / `launch` (and `run_pretrain`, `kill_after_checkpoint`, `stop_after_step`, which use
  them): each rank is a process forked from a server that has already imported torch,
  megatron-core and the package (multiprocessing's forkserver, one per test worker). A rank runs
  the `mlmclm` entry point (or a script as `__main__`) with the environment torchrun gives it:
  RANK, WORLD_SIZE, LOCAL_RANK, and a store hosted by the launcher as torchrun's agent hosts it.
  What it skips is the interpreter start: about 6 CPU-seconds a rank on 2 cores (torch and
  megatron-core), most of what a small test run costs. A started job's ranks can be signalled
  (a stop signal reaches them as torchrun forwards it) or killed with their workers at once.
- `pretrain_cmd` with subprocess: the real `python -m torch.distributed.run` launch, for the tests
  of what the launcher itself does (hung ranks, restarts, a killed launcher, exit codes through
  torchrun, the SLURM scripts).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing import forkserver
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


# What a rank has imported before it starts: the entry point first, as `python -m megatron_mlmclm`
# (it defers megatron-core's kernel compilation before megatron-core is imported), then training.
PRELOAD = [
    "megatron_mlmclm.cli",
    "megatron_mlmclm.commands.pretrain",
    "megatron_mlmclm.training.pretrain",
    "torch._dynamo",  # imported by the first optimizer a run builds: 2-3 s
    # Hugging Face tokenizers (every command that reads a tokenizer folder: 1.2 s) and models
    # (convert, evaluate: 2.5 s more; Llama's module brings what Qwen3's and EuroBERT's share).
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
]


def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # The server starts with what job_env gives a job's interpreter at its start: the OpenMP
    # threads (libgomp reads them once, as torch loads) and the warnings filter.
    env, saved = job_env(), dict(os.environ)
    os.environ.update({k: env[k] for k in ("OMP_NUM_THREADS", "PYTHONWARNINGS")})
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx


def _rank_main(target: tuple[str, list[str]], env: dict, cwd: str, out: str, err: str) -> None:
    """One rank, in a process forked from the server: the job's environment, folder and output
    files, then the entry point or the script, and its exit status."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # A forkserver child inherits "forkserver" as its default start method; a fresh interpreter
    # has the platform's (fork): the loader's workers must start as they do in a real run.
    multiprocessing.set_start_method(None, force=True)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    import warnings

    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    kind, args = target
    code = 1
    try:
        if kind == "mlmclm":
            import megatron_mlmclm.__main__ as entry
            from megatron_mlmclm.cli import main

            sys.argv = [entry.__file__, *args]
            code = main(args)
        else:
            sys.argv = list(args)
            sys.path.insert(0, str(Path(args[0]).resolve().parent))  # as `python SCRIPT` has it
            runpy.run_path(args[0], run_name="__main__")
            code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what an interpreter's exit runs; a forked child skips it
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class Job:
    """A job of forked ranks (`start`): poll it, signal or kill it, wait for its end."""

    def __init__(self, target, procs, store, logs, files):
        self.target = target
        self.procs = procs
        self._store = store  # the ranks' rendezvous: kept alive until they have ended
        self._logs = logs
        self._files = files  # (stdout, stderr) path of each rank

    def poll(self) -> int | None:
        """None while it runs; else its exit status (a failed rank's, as torchrun reports)."""
        codes = [p.exitcode for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return None if None in codes else 0

    def send_signal(self, sig: int) -> None:
        """`sig` to every rank, as torchrun forwards a signal it receives."""
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, sig)

    def kill_tree(self) -> None:
        """SIGKILL to every rank and every process under it at once, as a node failure."""
        import psutil

        tree = []
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank = psutil.Process(p.pid)
                tree += [rank, *rank.children(recursive=True)]
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=30)

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Until every rank has ended, or one has failed (the others are then killed, as
        torchrun ends a job); -> its exit status and the ranks' output, rank 0 first."""
        deadline, late = time.monotonic() + timeout, False
        try:
            while self.poll() is None:  # all running, or some done and none failed
                if time.monotonic() > deadline:
                    late = True
                    break
                time.sleep(0.05)
        finally:
            if any(p.exitcode is None for p in self.procs):
                self.kill_tree()  # a failed rank's partners, or a job past its time
            for p in self.procs:
                p.join()
            self._store = None
        out, err = (
            "".join(Path(f[i]).read_text(errors="replace") for f in self._files) for i in (0, 1)
        )
        self._logs.cleanup()
        if late:  # with what the ranks had written, to say where they hung
            raise subprocess.TimeoutExpired(str(self.target), timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(self.target[1], self.poll() or 0, out, err)


def start(
    target: tuple[str, list[str]],
    nproc: int = 1,
    env: dict | None = None,
    cwd: str | Path | None = None,
) -> Job:
    """Start `target` — ("mlmclm", argv) or ("script", [path, *args]) — as a job of `nproc` ranks
    forked from the preloaded server. One rank is a world of one, as a plain `mlmclm pretrain`
    is; more ranks join a store hosted here, as torchrun's agent hosts it."""
    import torch.distributed as dist

    env = dict(job_env() if env is None else env)
    ctx = _forkserver()
    store = None
    ranks = [dict(env) for _ in range(nproc)]
    if nproc > 1:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for r, rank_env in enumerate(ranks):
            rank_env.update(
                RANK=str(r),
                LOCAL_RANK=str(r),
                GROUP_RANK="0",
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                TORCHELASTIC_USE_AGENT_STORE="True",  # the ranks join this store, as torchrun's
            )
    logs = tempfile.TemporaryDirectory(prefix="job")
    files = [(f"{logs.name}/out{r}", f"{logs.name}/err{r}") for r in range(nproc)]
    procs = [
        ctx.Process(target=_rank_main, args=(target, rank_env, str(cwd or os.getcwd()), *files[r]))
        for r, rank_env in enumerate(ranks)
    ]
    for p in procs:
        p.start()
    return Job(target, procs, store, logs, files)


def launch(
    target: tuple[str, list[str]],
    nproc: int = 1,
    timeout: int = 300,
    env: dict | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """`start`, then wait for the job's end; -> its exit status and the ranks' output, rank 0
    first. A failed rank ends the others, as torchrun does."""
    return start(target, nproc, env, cwd).wait(timeout)


def kill_after_checkpoint(argv: list[str], nproc: int, run_dir: Path, iteration: str) -> None:
    """`mlmclm ARGV` as a job, SIGKILLed (every rank and its workers at once) as soon as
    run_dir/checkpoints/ITERATION has appeared (checkpoints are renamed into place whole)."""
    job = start(("mlmclm", argv), nproc)
    target = Path(run_dir) / "checkpoints" / iteration
    deadline = time.monotonic() + 240
    try:
        while not target.is_dir() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        assert job.poll() is None, "the run ended before it could be killed"
    finally:
        job.kill_tree()
        job.wait()


def stop_after_step(argv: list[str], run_dir: Path, step: int) -> subprocess.CompletedProcess:
    """`mlmclm ARGV` as a world of one, sent SIGTERM (a scheduler's stop signal) once it has
    logged `step`; -> how it ended."""
    job = start(("mlmclm", argv))
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while (
        time.monotonic() < deadline
        and job.poll() is None
        and not (metrics.is_file() and f'"step": {step},' in metrics.read_text())
    ):
        time.sleep(0.02)
    job.send_signal(signal.SIGTERM)
    return job.wait(240)


def run_pretrain(
    config: Path,
    overrides: list[str],
    nproc: int = 1,
    check: bool = True,
    timeout: int = 300,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    proc = launch(("mlmclm", ["pretrain", str(config), *overrides]), nproc, timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def train_in_process(config, overrides: list[str], **options):
    """A whole run in this process (a world of one), torn down after; -> the Trainer."""
    from megatron_mlmclm.config import load_config  # megatron-core: imported when needed
    from megatron_mlmclm.runtime import distributed as rt
    from megatron_mlmclm.training.start.continued import checkpoint_model
    from megatron_mlmclm.training.trainer import Trainer

    # the config as `mlmclm pretrain` loads it: a continued run's model read from its checkpoint
    trainer = Trainer(load_config(config, overrides, checkpoint_model), **options)
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


def random_shard(prefix: Path, tokenizer: Path, seed: int, docs: int, low: int = 4) -> str:
    """A shard of `docs` documents of 5-59 random ids of `tokenizer`'s vocabulary (from `low`,
    none of its special tokens), each ended with its EOS, written with megatron's own builder and
    fingerprinted as `mlmclm preprocess` fingerprints what it writes. -> the prefix."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_mlmclm.data.shards import file_identity, shard_fingerprint, write_fingerprint
    from megatron_mlmclm.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    tok = load_tokenizer(tokenizer)
    special = set(tok.all_special_ids)
    ids = np.array([i for i in range(low, len(tok)) if i not in special], dtype=np.int32)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    largest = 0
    for n in rng.integers(5, 60, size=docs):
        doc = np.append(rng.choice(ids, size=n), np.int32(tok.eos_token_id))
        largest = max(largest, int(doc.max()))
        builder.add_item(torch.from_numpy(doc.astype(np.int32)))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    fingerprint = shard_fingerprint(tokenizer_fingerprint(tok), append_eod=True)
    write_fingerprint(prefix, {**fingerprint, "max_id": largest, **file_identity(prefix)})
    return str(prefix)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` (relative path -> SHA-256 of a file's bytes, "dir", or
    where a link points): two snapshots are equal when nothing was added, removed or changed."""
    import hashlib

    out = {}
    for p in sorted(Path(folder).rglob("*")):
        key = str(p.relative_to(folder))
        if p.is_symlink():
            out[key] = f"link:{os.readlink(p)}"
        elif p.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
