"""What a run reports, from rank 0: the `[mlmclm]` lines, metrics.jsonl (one record per step, and
step 0's validation loss; a resumed run first drops the records past its checkpoint), TensorBoard
/ Weights & Biases (training/logs/sinks.py), the progress bar with a line every logging interval,
and each step's figures: throughput, MFU (flops.mfu_step_flops, the "for MFU" convention) and, every
logging interval, the straggler figures of the fault monitor.

The run's folder gets its config.yaml here too, and a decay branch the curve of its source up to
the branch point (`inherit_metrics`; training/start/branch.py says what a branch is).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from megatron_mlmclm import checkpoint as ckpt
from megatron_mlmclm.config import PhaseConfig, RunConfig, dump_yaml, resolved
from megatron_mlmclm.flops import mfu_step_flops
from megatron_mlmclm.runtime import distributed as rt
from megatron_mlmclm.training.faults.monitor import FaultMonitor
from megatron_mlmclm.training.logs import sinks


def log(message: str) -> None:
    """One `[mlmclm]` line on stderr from rank 0 (above the progress bar)."""
    if rt.is_main():
        tqdm.write(f"[mlmclm] {message}", file=sys.stderr)


def keep_records_before(path: Path, step: int) -> None:
    """metrics.jsonl keeps one record a step across resumes: a run that starts at `step` (the
    checkpoint it resumes from) drops the records of the steps it runs again (those past it, or
    every one where it starts from step 0, whose validation it logs again) and a line a kill cut
    short; rewritten under a temporary name, then renamed."""
    if not path.is_file():
        return
    kept, dropped = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = step > 0 and isinstance(record, dict) and record.get("step", 0) <= step
        except ValueError:
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped = True
    if dropped:
        tmp = path.with_name(f"{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)


class Metrics:
    """The run's records and progress; `should_log(step)` says when a step prints its line and
    gathers the straggler figures."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.log_interval = cfg.logging.log_interval
        self.file = None  # metrics.jsonl (rank 0, once opened)
        self.sinks: sinks.Sinks | None = None
        self.bar: tqdm | None = None
        self.vocab_size, self.world, self.peak = 0, 1, None

    def open(self, step: int, vocab_size: int, branched_from: Path | None) -> None:
        """Once processes and model exist. Rank 0: config.yaml, metrics.jsonl (appended to on a
        resume, after the records past `step`, the checkpoint it resumes from, are dropped) and
        the scalar sinks."""
        self.vocab_size, self.world = vocab_size, dist.get_world_size()
        self.peak = rt.device_peak_flops()  # None where unknown (CPU): no MFU
        if not rt.is_main():
            return
        out = Path(self.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        dump_yaml(self.cfg, out / "config.yaml")
        if branched_from is not None:  # the source's curve up to the branch point, once
            config = ckpt.read_trainer_state(branched_from)["trainer"]["config"]
            inherit_metrics(config, step, out)
        keep_records_before(out / "metrics.jsonl", step)
        self.file = open(out / "metrics.jsonl", "a", encoding="utf-8")
        self.sinks = sinks.Sinks(self.cfg, out, step)

    def should_log(self, step: int) -> bool:
        return step % self.log_interval == 0

    @contextlib.contextmanager
    def progress(self, step: int):
        """The progress bar of the training loop (rank 0), from `step`."""
        if rt.is_main():
            self.bar = tqdm(
                total=self.cfg.train.steps,
                initial=step,
                desc=self.cfg.name,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
        try:
            yield
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    def step_figures(
        self, step: int, phase_index: int, phase: PhaseConfig, tokens: float, elapsed: float
    ) -> dict[str, Any]:
        """The step's place and speed: tokens/s and, on a device of known peak, MFU."""
        t = self.cfg.train
        seq_length = resolved(phase.seq_length)  # a phase of the plan (resolved_phases)
        tokens_per_step = t.global_batch_size * seq_length
        flops = mfu_step_flops(
            self.cfg.model.shape(),
            self.vocab_size,
            seq_length,
            t.global_batch_size,
            int(tokens),
            causal=phase.objective == "clm",
        )
        out: dict[str, Any] = {
            "step": step,
            "phase": phase_index,
            "objective": phase.objective,
            "step_time_s": elapsed,
            "tokens_per_s": tokens_per_step / elapsed,
            "tokens_per_s_per_device": tokens_per_step / elapsed / self.world,
        }
        if self.peak:
            out["mfu"] = flops / elapsed / self.world / self.peak
        return out

    def straggler_figures(self, faults: FaultMonitor) -> dict[str, float]:
        """Collective (every rank calls it at the same step): rank 0's straggler figures."""
        return faults.interval(rt.device()) or {}

    def record(self, stats: dict[str, Any]) -> None:
        """One record: metrics.jsonl, the sinks, and the progress bar with its line."""
        if not rt.is_main():
            return
        if self.file is not None:
            self.file.write(json.dumps(stats) + "\n")
            self.file.flush()
        if self.sinks is not None:
            self.sinks.write(stats)
        if "loss" not in stats or self.bar is None:  # a validation-only record (step 0)
            return
        obj, bar = stats["objective"], self.bar
        bar.update(1)
        post = {
            "obj": obj,
            "loss": f"{stats['loss']:.4f}",
            "lr": f"{stats['lr']:.2e}",
            "tok/s": f"{stats['tokens_per_s']:.0f}",
        }
        if "val_loss" in stats:
            post["val"] = f"{stats['val_loss']:.4f}"
        bar.set_postfix(post)
        if self.should_log(stats["step"]):
            extra = f" val_loss {stats['val_loss']:.4f}" if "val_loss" in stats else ""
            if "host_syncs" in stats:  # pretrain --count-syncs
                extra += f" host_syncs {stats['host_syncs']}"
            if "straggler_rank" in stats:
                extra += (
                    f" slowest rank {stats['straggler_rank']} "
                    f"{stats['straggler_ratio']:.2f}x median"
                )
            bar.write(
                f"step {stats['step']:>6} {obj} loss {stats['loss']:.5f} acc "
                f"{stats['accuracy']:.4f} lr {stats['lr']:.3e} grad_norm "
                f"{stats['grad_norm']:.3f}{extra}",
                file=sys.stderr,
            )

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
        if self.file is not None:
            self.file.close()


def inherit_metrics(state_config: dict[str, Any], step: int, out: Path) -> bool:
    """Start this branch's metrics.jsonl with its source's records up to the branch point (so the
    folder holds the whole curve); False when the source's log is not where its config says."""
    source = Path(state_config.get("output_dir", "")) / "metrics.jsonl"
    target = out / "metrics.jsonl"
    if target.exists() or not source.is_file():
        return False
    lines = [
        line
        for line in source.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    target.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return True
