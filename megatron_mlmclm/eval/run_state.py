"""A fine-tuning run's state, saved at its validation points, so that a run killed mid-way (a SLURM
time limit, a preempted node) continues where it stopped when its grid runs again, and ends with
the result the uninterrupted run would have had: the same curve and metrics (bitwise on CPU in
fp32; the same device and precision are required, see `run_key`).

What is saved: the model's and the optimizer's tensors, the schedule, every random generator the
run uses (Python's, NumPy's, torch's CPU and CUDA generators), the steps done (the batch order is
a function of the seed, so the run's place in it is the step), the validation curve so far, the
loss window since its last point, the examples seen and the time spent. One file,
`<result>.state/state.pt` (eval/grid.py names the folder), written by `torch.save` to a
temporary name, flushed to disk and renamed over the last one: a run killed while saving keeps
its previous state. It is read back with `torch.load(weights_only=True)` (no pickled code is ever
run) and memory-mapped, so checking whose state it is costs no tensor read.

A state is resumed only by the run that wrote it (`run_key`: the model folder's content
identity, the protocol id and every run setting that changes a number); any other is ignored,
with a line in the log, and overwritten by the run's own first save. The grid removes the folder
once the run's result is written.

The cost: a state holds the weights and AdamW's two moments, 12 bytes a parameter in fp32
(610m: about 7.3 GB; 6 in bf16-pure). It is saved at a validation point once `state_every_s`
seconds have passed since the run started or last saved (a FinetuneConfig execution knob, not
part of the protocol): by default 600 s, so a run shorter than 10 minutes never saves, and a
killed run loses at most 10 minutes and one validation interval; 0 saves at every validation
point; None never saves.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

STATE_FORMAT = 1
STATE_FILE = "state.pt"
# FinetuneConfig fields a resumed run may differ in: they change no number of the run (the task
# entry itself is in the protocol id; the device is compared by its type)
EXECUTION_ONLY = (
    "model",
    "model_name",
    "device",
    "threads",
    "progress",
    "save_model",
    "task_files",
    "grid_lrs",
    "grid_seeds",
    "state_every_s",
)


@dataclass
class Progress:
    """Where a run stands: steps done, the curve so far, the loss window since its last point
    (its sum, its number of steps), examples seen, the seconds spent, where it was resumed."""

    step: int = 0
    curve: list = field(default_factory=list)
    loss_sum: float = 0.0
    window: int = 0
    seen: int = 0
    train_time_s: float = 0.0
    eval_time_s: float = 0.0
    resumed_at: list = field(default_factory=list)

    def add_time(self, train_s: float, eval_s: float) -> Progress:
        self.train_time_s += train_s
        self.eval_time_s += eval_s
        return self


def run_key(
    cfg, identity: str, protocol_id: str, device: torch.device, precision: str, train_items: int
) -> dict:
    """What a state must agree with to be resumed by the run `cfg` (`train_items`: the task's
    training inputs as read now: the protocol id hashes the task's entry, not its files)."""
    config = {k: v for k, v in cfg.to_dict().items() if k not in EXECUTION_ONLY}
    return json.loads(
        json.dumps(
            {
                "format": STATE_FORMAT,
                "model_identity": identity,
                "protocol_id": protocol_id,
                "device": device.type,
                "precision": precision,
                "train_items": train_items,
                "config": config,
            },
            sort_keys=True,
        )
    )


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def rng_states(device: torch.device) -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    out = {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_states(states: dict, device: torch.device) -> None:
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def _same_tensors(saved: dict, live: dict) -> bool:
    return saved.keys() == live.keys() and all(
        saved[k].shape == live[k].shape and saved[k].dtype == live[k].dtype for k in live
    )


class RunState:
    """The state of one run in `folder` (see the module's head)."""

    def __init__(self, folder, key: dict, every_s: float | None, device, log=print):
        self.folder, self.key, self.every_s = Path(folder), key, every_s
        self.device, self.log = device, log
        self.last_save = time.monotonic()
        self.saves, self.save_time_s = 0, 0.0

    @property
    def path(self) -> Path:
        return self.folder / STATE_FILE

    def due(self) -> bool:
        return self.every_s is not None and time.monotonic() - self.last_save >= self.every_s

    def save(self, progress: Progress, model, optimizer, scheduler, info: dict) -> None:
        t = time.perf_counter()
        self.last_save = time.monotonic()  # also after a failed save: the next try waits
        state = {
            "key": self.key,
            "progress": json.dumps(asdict(progress)),
            "info": json.dumps(info),
            "rng": rng_states(self.device),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
        tmp = self.folder / f"{STATE_FILE}.tmp-{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:  # a full disk: the run goes on, resumable from its last state
            tmp.unlink(missing_ok=True)
            self.save_time_s += time.perf_counter() - t
            self.log(f"could not save the run's state at step {progress.step} ({e}); going on")
            return
        took = time.perf_counter() - t
        self.saves, self.save_time_s = self.saves + 1, self.save_time_s + took
        self.last_save = time.monotonic()
        size = self.path.stat().st_size
        self.log(
            f"saved the run's state at step {progress.step} to {self.path} "
            f"({size / 1e6:,.0f} MB in {took:.1f} s)"
        )

    def restore(self, model, optimizer, scheduler, info: dict) -> Progress | None:
        """Load the saved state into the run's model, optimizer, schedule, generators and
        `info` (in place) and return its progress; None (the run starts over) when there is
        none, or it is unreadable or of another run (a line in the log)."""
        if not self.path.is_file():
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            key = state["key"]
        except Exception as e:  # a state is only ever a shortcut
            self.log(f"the run's state {self.path} is unreadable ({e}); starting the run over")
            return None
        if key != self.key:
            what = ", ".join(_differences(key, self.key)) or "format"
            self.log(
                f"the state in {self.path} is of another run (it differs in {what}); "
                "starting the run over"
            )
            return None
        live_opt = optimizer.state_dict()
        if not _same_tensors(state["model"], model.state_dict()) or len(
            state["optimizer"]["param_groups"]
        ) != len(live_opt["param_groups"]):
            self.log(f"the state in {self.path} does not fit the model; starting the run over")
            return None
        model.load_state_dict(state["model"])  # copied into the parameters
        optimizer.load_state_dict(state["optimizer"])
        for moments in optimizer.state.values():  # on CPU these would be the mapped file's
            for k, v in moments.items():
                if torch.is_tensor(v) and v.device.type == "cpu":
                    moments[k] = v.clone()
        scheduler.load_state_dict(state["scheduler"])
        set_rng_states(state["rng"], self.device)
        info.update(json.loads(state["info"]))
        progress = Progress(**json.loads(state["progress"]))
        progress.resumed_at.append(progress.step)
        self.log(f"resumed the run at step {progress.step} from {self.path}")
        return progress

    def summary(self) -> dict:
        return {"saves": self.saves, "save_time_s": self.save_time_s, "every_s": self.every_s}


def remove_state(folder: str | Path) -> None:
    """Remove a run's state folder: the files a RunState writes there, then the folder if that
    leaves it empty (nothing else is ever deleted)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if p.name == STATE_FILE or p.name.startswith(f"{STATE_FILE}.tmp-"):
            p.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # something else is in it: left as it is
