"""What the fault monitor costs (training/faults/monitor.py): per training step, and from a hang to
a job ready to requeue.

1. Step cost, CPU, one process. A tiny Trainer (model.preset=tiny, vocabulary 1000, mock data,
   data.loader=sync, fp32, world of one) runs its steps exactly as Trainer._train_loop calls the
   monitor around them (faults.step_started, train_step, stragglers.step_ended, the logging
   interval's gather, faults.step_ended). Four modes alternate in blocks of --block steps, the order
   rotating each round, all in the same process:
   - bare: train_step alone, none of the loop's monitor calls (for information);
   - off: the loop's calls with trainer.faults.watchdog = None (what train.hang_timeout_s=0 does);
   - on: a running HangWatchdog at its default poll (1 s) and automatic allowances (the default
     train.hang_timeout_s=None: each step's enter takes the median of the recent step times);
   - on-0.01: the same with poll_s=0.01, a pessimistic 100 wake-ups a second.
   A fresh watchdog thread is started for each "on" block and stopped (joined) after it, so no
   thread runs during the other modes' blocks. The headline is the median s/step of on-0.01
   against off; a 95% interval comes from a bootstrap over rounds (resampling whole rounds keeps
   each round's on and off blocks together, so slow drift of the machine cancels), and the
   per-round ratios' quartiles are printed too.
2. Hang to requeue-ready. A DP2 run under torchrun (tests/test_faults.py's config, 8 steps,
   checkpoints every 3) with MLMCLM_INJECT_FAULTS="hang rank=1 step=5", train.hang_timeout_s=T and
   MLMCLM_EXIT_FILE. The script polls <output_dir>/metrics.jsonl for step 4's record and measures
   until the launcher exits (and checks that every process of the job is gone and that the exit
   file says 76). The headline hang_to_exit_s is that wall time; minus T it is the detection and
   teardown overhead. The breakdown uses the injector's marker file (touched as the hang starts)
   and the watchdog's stack dump (written as it fires).

    PYTHONPATH=. python benchmarks/fault_monitor.py [--hang-timeout 10] [--threads 1]
    PYTHONPATH=. python benchmarks/fault_monitor.py --quick   # seconds: 2 x 4 steps, no DP2 run

Last line: RESULT fault_monitor ratio=<on_s/off_s> on_s=<..> off_s=<..> hang_to_exit_s=<..>
timeout_s=<T>, where on is the poll_s=0.01 watchdog.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from megatron_mlmclm.mcore_patches.jit import defer_kernel_compilation

warnings.filterwarnings("ignore", category=UserWarning)  # megatron's no-Apex/TE notices

REPO = Path(__file__).resolve().parent.parent
MODES = ("bare", "off", "on", "on-0.01")
POLLS = {"on": 1.0, "on-0.01": 0.01}


# --------------------------------------------------------------------------------------------------
# 1. Step cost


def build_tiny_trainer(args):
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.training.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench_fault_monitor_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    cfg = load_config(
        None,
        [
            f"output_dir={out}",
            f"checkpoint.dir={out}/ckpt",
            "checkpoint.resume=false",
            "logging.tensorboard=false",
            "logging.log_interval=10",
            "data.mock=true",
            "data.loader=sync",
            "model.preset=tiny",
            "model.vocab_size=1000",
            "train.steps=1000000",
            "train.warmup_steps=10",
            "train.decay_steps=10",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.micro_batch}",
            "train.precision=fp32",
        ],
    )
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer, cfg


def measure_steps(args) -> dict:
    import torch

    from megatron_mlmclm.runtime import distributed as rt
    from megatron_mlmclm.training.faults.watchdog import HangWatchdog

    torch.set_num_threads(args.threads)
    trainer, cfg = build_tiny_trainer(args)
    faults = trainer.faults
    if faults.watchdog is not None:  # the one setup() started: stopped, so only ours run
        faults.watchdog.stop()
        faults.watchdog.thread.join()
        faults.watchdog = None
    log_interval = cfg.logging.log_interval

    def one_step(mode: str) -> float:
        phase = trainer.phase_at_step(trainer.step)
        t0 = time.perf_counter()
        if mode == "bare":
            trainer.train_step(phase)
            trainer.step += 1
            return time.perf_counter() - t0
        faults.step_started(trainer.step + 1)
        trainer.train_step(phase)
        trainer.step += 1
        faults.stragglers.step_ended()
        if trainer.step % log_interval == 0:
            faults.interval(rt.device())
        elapsed = time.perf_counter() - t0
        faults.step_ended(elapsed)
        return time.perf_counter() - t0

    def block(mode: str, n: int) -> list[float]:
        dog = None
        if mode in POLLS:
            dog = HangWatchdog(0, Path(cfg.output_dir) / "faults", None, None, poll_s=POLLS[mode])
            dog.step_times.extend(history)  # as a watchdog that has seen the run so far
            dog.start()
        faults.watchdog = dog
        try:
            return [one_step(mode) for _ in range(n)]
        finally:
            faults.watchdog = None
            if dog is not None:
                dog.stop()
                dog.thread.join()
                history.extend(dog.step_times)

    history: list[float] = []
    for mode in MODES * args.warmup:  # untimed
        block(mode, args.block)
    history = history[-50:]
    rounds = []  # per round: mode -> the block's step times
    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        rounds.append({mode: block(mode, args.block) for mode in order})
        history = history[-50:]
    wall = time.perf_counter() - t_start
    trainer.close()
    return {
        "rounds": rounds,
        "wall_s": wall,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def bootstrap_ratio(rounds, num: str, den: str, n: int = 2000, seed: int = 0):
    """95% interval of median(num)/median(den), resampling whole rounds."""
    rng = np.random.default_rng(seed)
    a = [np.asarray(r[num]) for r in rounds]
    b = [np.asarray(r[den]) for r in rounds]
    ratios = []
    for _ in range(n):
        pick = rng.integers(0, len(rounds), len(rounds))
        ratios.append(
            np.median(np.concatenate([a[i] for i in pick]))
            / np.median(np.concatenate([b[i] for i in pick]))
        )
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


# --------------------------------------------------------------------------------------------------
# 2. Hang to requeue-ready

CONFIG = {
    "data": {"mock": True},
    "model": {"preset": "tiny", "vocab_size": 1000},
    "train": {
        "steps": 8,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "warmup_steps": 2,
        "decay_steps": 2,
    },
    "phases": [{"objective": "clm", "share": 0.5}, {"objective": "mlm", "share": 0.5}],
    # Every 3 steps: the requeue resumes from step 3, and no save sits between step 4's record
    # and the hang at the start of step 5.
    "checkpoint": {"save_interval": 3, "keep_last": 2},
    "logging": {"tensorboard": False, "log_interval": 2},
}
HANG_STEP = 5


def job_env() -> dict[str, str]:
    """As tests/jobs.py's job_env."""
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks share the cores
    env["PYTHONWARNINGS"] = "ignore"
    return env


def step_logged(metrics: Path, step: int) -> bool:
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if m.get("step") == step and "loss" in m:
            return True
    return False


def measure_hang(timeout_s: float, limit_s: float) -> dict:
    import psutil
    import yaml

    root = Path(tempfile.mkdtemp(prefix="bench_fault_hang_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    config, run, exit_file = root / "run.yaml", root / "run", root / "exit_code"
    config.write_text(yaml.safe_dump(CONFIG))
    env = {
        **job_env(),
        "MLMCLM_INJECT_FAULTS": f"hang rank=1 step={HANG_STEP}",
        "MLMCLM_EXIT_FILE": str(exit_file),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "megatron_mlmclm",
        "pretrain",
        str(config),
        f"output_dir={run}",
        f"train.hang_timeout_s={timeout_s:g}",
    ]
    metrics = run / "metrics.jsonl"
    stderr_path = root / "stderr.txt"
    with open(stderr_path, "w") as err:
        t_launch = time.time()
        launcher = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
        tree: dict[int, psutil.Process] = {}
        t_step4 = t_exit_file = None
        killed = False
        while launcher.poll() is None:
            now = time.time()
            if t_step4 is None and step_logged(metrics, HANG_STEP - 1):
                t_step4 = now
            if t_exit_file is None and exit_file.exists():
                t_exit_file = now
            try:
                for p in psutil.Process(launcher.pid).children(recursive=True):
                    tree.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                pass
            if now - t_launch > limit_s:
                os.killpg(launcher.pid, signal.SIGKILL)
                killed = True
                launcher.wait()
                break
            time.sleep(0.02)
        t_exit = time.time()

    # Every process the job started (ranks, loader workers, checkpoint helpers) must be gone:
    # polled as the launcher was, a zombie counting as gone.
    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    alive = [p for p in tree.values() if running(p)]

    def name(p: psutil.Process) -> str:
        try:
            return f"{p.pid} " + " ".join(p.cmdline()[-3:])
        except psutil.Error:
            return str(p.pid)

    last_names = [name(p) for p in alive]
    while alive and time.time() - t_exit < 30:
        time.sleep(0.02)
        alive = [p for p in alive if running(p)]
    t_all_gone = time.time()
    stderr = stderr_path.read_text(errors="replace")

    def mtime(path: Path):
        return path.stat().st_mtime if path.exists() else None

    marker = run / "faults" / f"injected-hang-rank1-step{HANG_STEP}"
    dump = run / "faults" / f"hang-rank1-step{HANG_STEP}.txt"
    return {
        "cmd": cmd,
        "returncode": launcher.returncode,
        "killed": killed,
        "t_launch": t_launch,
        "t_step4": t_step4,
        "t_hang": mtime(marker),
        "t_fired": mtime(dump),
        "t_exit_file_seen": t_exit_file,
        "t_exit": t_exit,
        "leftover": [p.pid for p in alive],
        "outlived_launcher": last_names,
        "leftover_wait_s": t_all_gone - t_exit,
        "exit_code": exit_file.read_text().strip() if exit_file.exists() else None,
        "rank_exitcode_76": "exitcode  : 76" in stderr,
        "named": f"rank 1 hung: step {HANG_STEP} made no progress" in stderr,
        "stderr_tail": stderr[-1500:],
    }


# --------------------------------------------------------------------------------------------------


def hang_to_requeue(T: float) -> float:
    """Part 2, printed; returns hang_to_exit_s."""
    h = measure_hang(T, limit_s=T + 180)
    print(
        f"\n2. hang to requeue-ready: DP2 torchrun, {CONFIG['train']['steps']} steps, "
        f"MLMCLM_INJECT_FAULTS='hang rank=1 step={HANG_STEP}', train.hang_timeout_s={T:g} "
        f"(watchdog poll 1 s)"
    )
    print("   " + " ".join(h["cmd"][1:]).replace(str(REPO) + "/", ""))
    if h["t_step4"] is None:
        print(
            f"   step {HANG_STEP - 1} was never seen in metrics.jsonl (launcher exit "
            f"{h['returncode']}, killed={h['killed']}); stderr tail:\n{h['stderr_tail']}"
        )
        hang_to_exit = float("nan")
    else:
        t0 = h["t_step4"]
        hang_to_exit = h["t_exit"] - t0

        def rel(t):
            return f"{t - t0:+8.2f} s" if t is not None else "       n/a"

        print(f"   {'launch':<52}{rel(h['t_launch'])}")
        print(f"   {'step 4 seen in metrics.jsonl (t0, polled every 20 ms)':<52}{rel(t0)}")
        print(f"   {'rank 1 hangs at step 5 (injector marker mtime)':<52}{rel(h['t_hang'])}")
        print(f"   {'watchdog fires: stack dump written (mtime)':<52}{rel(h['t_fired'])}")
        print(f"   {'exit file seen':<52}{rel(h['t_exit_file_seen'])}")
        print(f"   {'launcher exited':<52}{rel(h['t_exit'])}")
        if h["t_hang"] is not None and h["t_fired"] is not None:
            print(
                f"   detection: fired {h['t_fired'] - h['t_hang']:.2f} s after the hang began "
                f"(T={T:g} + {h['t_fired'] - h['t_hang'] - T:.2f} s poll latency)"
            )
            print(
                f"   teardown: launcher gone {h['t_exit'] - h['t_fired']:.2f} s after the "
                f"watchdog fired"
            )
        print(
            f"   hang_to_exit_s = {hang_to_exit:.2f} s; minus T = {hang_to_exit - T:.2f} s "
            f"(detection + teardown overhead)"
        )
    ok = h["exit_code"] == "76"
    print(
        f"   checks: exit file says {h['exit_code']!r} ({'ok' if ok else 'EXPECTED 76'}); "
        f"launcher exit status {h['returncode']}; torchrun reports 'exitcode  : 76': "
        f"{h['rank_exitcode_76']}; the hung rank is named: {h['named']}; processes left after "
        f"the launcher: {len(h['outlived_launcher'])}"
        + (
            f" (all gone {h['leftover_wait_s']:.2f} s after it: {h['outlived_launcher']})"
            if h["outlived_launcher"]
            else ""
        )
        + (f"; STILL RUNNING after 30 s: pids {h['leftover']}" if h["leftover"] else "")
    )
    if not ok:
        print(f"   stderr tail:\n{h['stderr_tail']}")
    return hang_to_exit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 2 rounds x 4 steps; the hang run only with --hang-timeout",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=24, help="timed rounds (every mode once)")
    p.add_argument("--block", type=int, default=25, help="steps per mode per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        help="train.hang_timeout_s T of the hang run (default 10; with --quick: no hang run)",
    )
    args = p.parse_args()
    if args.quick:
        args.rounds, args.block = 2, 4
    T = args.hang_timeout if args.hang_timeout is not None else 10.0

    s = measure_steps(args)
    rounds = s["rounds"]
    times = {m: [t for r in rounds for t in r[m]] for m in MODES}
    med = {m: statistics.median(times[m]) for m in MODES}
    print(
        f"1. step cost: torch {s['torch']}, {s['threads']} torch thread(s), CPU, fp32; model "
        f"preset tiny (4 layers, hidden 128, seq 128), vocab 1000, micro-batch "
        f"{args.micro_batch}, data.loader=sync; {args.rounds} rounds x {len(MODES)} modes x "
        f"{args.block} steps ({s['wall_s']:.0f} s), after {args.warmup} untimed round(s)"
    )
    print(
        f"   {'mode':<8} {'median s/step':>13} {'q1':>8} {'q3':>8} {'min':>8}   "
        f"{'vs off':>6}  95% CI (bootstrap over rounds)  per-round ratio q1..q3"
    )
    for m in MODES:
        q1, q3 = quartiles(times[m])
        row = f"   {m:<8} {med[m]:>13.5f} {q1:>8.5f} {q3:>8.5f} {min(times[m]):>8.5f}   "
        if m != "off":
            lo, hi = bootstrap_ratio(rounds, m, "off")
            per = [statistics.median(r[m]) / statistics.median(r["off"]) for r in rounds]
            p1, p3 = quartiles(per)
            row += (
                f"{med[m] / med['off']:>6.3f}  [{lo:.3f}, {hi:.3f}]{'':<19}"
                f"{statistics.median(per):.3f} ({p1:.3f}..{p3:.3f})"
            )
        else:
            row += f"{1.0:>6.3f}"
        print(row)
    lo, hi = bootstrap_ratio(rounds, "on-0.01", "off")
    verdict = "within noise (the interval holds 1)" if lo <= 1.0 <= hi else "outside the noise"
    print(
        f"   on-0.01 / off = {med['on-0.01'] / med['off']:.3f}, 95% CI [{lo:.3f}, {hi:.3f}]: "
        f"{verdict}"
    )

    if args.quick and args.hang_timeout is None:
        print(
            "\n2. hang to requeue-ready: not run (--quick; the DP2 torchrun job takes about 30 s "
            "on 2 cores: give --hang-timeout T to run it)"
        )
        hang_to_exit, T = float("nan"), float("nan")
    else:
        hang_to_exit = hang_to_requeue(T)
    print(
        f"RESULT fault_monitor ratio={med['on-0.01'] / med['off']:.3f} "
        f"on_s={med['on-0.01']:.5f} off_s={med['off']:.5f} hang_to_exit_s={hang_to_exit:.2f} "
        f"timeout_s={T:g}"
    )


if __name__ == "__main__":
    defer_kernel_compilation()  # before megatron-core is imported, as `mlmclm` does
    main()
