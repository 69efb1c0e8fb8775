"""Fault injection, a test hook (docs/cluster.md#fault-injection-a-test-hook).

MLMCLM_INJECT_FAULTS holds faults separated by ';', each a kind and its settings:

    hang rank=1 step=5                 rank 1 blocks for good at the start of step 5
    stop rank=1 step=5                 rank 1 stops itself (SIGSTOP): it runs nothing at all
    nan rank=0 step=7 mode=transient   rank 0's loss is NaN at step 7, on the first attempt only
    nan rank=0 step=7 mode=persistent  ... on every attempt (the default)
    slow rank=1 ms=200                 rank 1 sleeps 200 ms inside every step
    spike rank=0 step=12 factor=1000   rank 0's loss (so its gradients) is scaled 1000x at step 12

Steps are 1-based, as logged. hang, stop and transient nan happen once per run folder (a marker
file in `<output_dir>/faults/` records that they did), so a restart runs through. The variable
passes through torchrun and sbatch to every rank.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_mlmclm.errors import UsageError

ENV = "MLMCLM_INJECT_FAULTS"
KINDS = {
    "hang": {"rank", "step"},
    "stop": {"rank", "step"},
    "nan": {"rank", "step", "mode"},
    "slow": {"rank", "ms"},
    "spike": {"rank", "step", "factor"},
}
OPTIONAL = {"mode"}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int | None = None
    ms: float = 0.0
    mode: str = "persistent"
    factor: float = 1.0


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *pairs = item.split()
        if kind not in KINDS:
            raise UsageError(
                f"{ENV}: unknown fault '{kind}' in '{item}'; kinds: {', '.join(KINDS)}"
            )
        settings = dict(p.split("=", 1) for p in pairs if "=" in p)
        required = KINDS[kind] - OPTIONAL
        if len(settings) != len(pairs) or not required <= set(settings) <= KINDS[kind]:
            raise UsageError(f"{ENV}: '{item}' must give {' '.join(sorted(required))} as key=value")
        try:
            fault = Fault(
                kind,
                int(settings["rank"]),
                int(settings["step"]) if "step" in settings else None,
                float(settings.get("ms", 0)),
                settings.get("mode", "persistent"),
                float(settings.get("factor", 1)),
            )
        except ValueError:
            raise UsageError(f"{ENV}: '{item}' has a value that is not a number") from None
        if fault.mode not in ("transient", "persistent"):
            raise UsageError(f"{ENV}: '{item}': mode must be transient or persistent")
        faults.append(fault)
    return faults


class Injector:
    """The faults of this rank, asked by the trainer at fixed points of a step."""

    def __init__(self, rank: int, folder: Path, text: str | None = None):
        text = os.environ.get(ENV, "") if text is None else text
        self.faults = [f for f in parse(text) if f.rank == rank]
        self.folder = Path(folder)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def once(self, f: Fault) -> bool:
        """True the first time `f` comes due in this run folder (and records that it did)."""
        marker = self.folder / f"injected-{f.kind}-rank{f.rank}-step{f.step}"
        if marker.exists():
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return True

    def at_step_start(self, step: int) -> None:
        for f in self.faults:
            if f.kind == "slow":
                time.sleep(f.ms / 1000.0)
            elif f.kind == "hang" and f.step == step and self.once(f):
                injected_hang()
            elif f.kind == "stop" and f.step == step and self.once(f):
                os.kill(os.getpid(), signal.SIGSTOP)

    def loss_scale(self, step: int) -> float:
        """What this step's loss is multiplied by: NaN for a nan fault, a spike's factor, else 1."""
        scale = 1.0
        for f in self.faults:
            if f.kind == "nan" and f.step == step and (f.mode == "persistent" or self.once(f)):
                scale = float("nan")
            elif f.kind == "spike" and f.step == step:
                scale *= f.factor
        return scale


def injected_hang() -> None:
    """Blocks for good; named so that the watchdog's stack dump shows where the rank hung."""
    while True:
        time.sleep(3600)
