"""Nothing we start outlives its parent, and one run owns its output folder.

torchrun starts each rank in a session of its own, so a SIGKILL of the launcher's process group
(a node agent's cleanup, a Ctrl-C'd `kill -9`) used to leave the ranks training on with parent 1,
their loader workers and megatron's spawned helper beside them, still writing checkpoints into a
folder that a restarted run then shared. Now:
- `die_with_parent()`: the kernel sends SIGKILL to this process when its parent ends
  (PR_SET_PDEATHSIG). Ranks under torchrun call it first thing; forked workers started inside
  `children_die_with_us()` call it too, and `checkpoint_helper_dies_with_us()` starts
  dist_checkpointing's Manager (which megatron would start at the first save, and which
  outlived every killed run) with it as the server's initializer. multiprocessing's resource
  trackers end by themselves once every process holding their pipe is gone.
- `RunLock`: an flock on `<output_dir>/.mlmclm.lock` held by rank 0 for the run's life; a second
  run pointed at a live run's folder is refused in one line (exit 2) naming the other run, and the
  lock of a dead run (the kernel drops an flock with its process) is taken over; a run that ends
  cleanly clears its record, so only a dead run's is reported, and a run refused before it wrote
  anything leaves no folder behind.
- `write_exit_code`: a rank's exit status written to $MLMCLM_EXIT_FILE, for a launcher that sees
  only torchrun's exit 1 (examples/slurm/pretrain.sbatch reads it).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from megatron_mlmclm.errors import UsageError

PR_SET_PDEATHSIG = 1
LOCK_NAME = ".mlmclm.lock"
EXIT_FILE_ENV = "MLMCLM_EXIT_FILE"


def write_exit_code(code: int) -> None:
    """Tell a launcher that sees only torchrun's exit 1 which code this rank ended with."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{code}\n")
    except OSError:
        pass


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Ask for SIGKILL when the parent ends (Linux); exit now if it already has. True when set.

    The death signal follows the parent *thread*: the processes calling this are all started from
    their parent's main thread (torchrun's agent, the trainer's main thread)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    parent = os.getppid()
    if parent == 1 or (expected_parent is not None and parent != expected_parent):
        os._exit(1)  # the parent ended before the signal was armed
    return True


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


_forking_parent: int | None = None


def _arm_forked_child() -> None:
    if _forking_parent is not None:
        die_with_parent(_forking_parent)


os.register_at_fork(after_in_child=_arm_forked_child)


@contextlib.contextmanager
def children_die_with_us():
    """Processes forked inside the block (loader workers) get SIGKILL when this process ends."""
    global _forking_parent
    previous, _forking_parent = _forking_parent, os.getpid()
    try:
        yield
    finally:
        _forking_parent = previous


def checkpoint_helper_dies_with_us() -> None:
    """Start, from the main thread, the Manager process behind megatron's checkpoint-writer
    results queue, armed to die with this process; megatron then finds its queue made.

    megatron starts that Manager with `spawn`: a fresh interpreter that imports torch to unpickle
    the first write result, about 2 CPU-seconds in every rank that saves. It is forked here
    instead (a run calls this before its process groups, model and threads exist), so it starts
    with torch already imported. (megatron forks its writer processes from the training process
    at every save anyway.)"""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", True) is not None:
        return  # already made, or a megatron-core that keeps no such queue
    import multiprocessing
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=die_with_parent)
    filesystem_async._results_queue = manager.Queue()  # a row of mcore_patches/registry.yaml
    _keep.append(manager)  # alive as long as this process


_keep: list = []


class RunLock:
    """An exclusive flock on a run's output folder, with who holds it written inside."""

    def __init__(self, output_dir: str | os.PathLike):
        self.folder = Path(output_dir)
        self.path = self.folder / LOCK_NAME
        self.file = None
        self.taken_over: dict | None = None  # the holder record of a dead run, if any
        self.created = False  # the folder did not exist before this lock

    def acquire(self) -> None:
        """Take the lock or raise UsageError naming the live run that holds it."""
        self.created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(f)
            f.close()
            raise UsageError(
                f"{self.folder} is the output_dir of a live run ({_describe(holder)}); two runs "
                "would write the same checkpoints: stop that run or choose another output_dir"
            ) from None
        previous = _read(f)
        self.taken_over = previous or None
        f.seek(0)
        f.truncate()
        f.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": "mlmclm " + " ".join(sys.argv[1:]),
                }
            )
            + "\n"
        )
        f.flush()
        self.file = f

    def release(self) -> None:
        """A run that ends cleanly clears its record: only a dead run's is found and taken over."""
        if self.file is not None:
            self.file.seek(0)
            self.file.truncate()
            if self.created and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
                self.path.unlink()  # still holding it: a run refused before any work
                self.folder.rmdir()
            fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
            self.file.close()
            self.file = None


def _read(f) -> dict:
    f.seek(0)
    try:
        return json.loads(f.read() or "{}")
    except json.JSONDecodeError:
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
        f"{holder.get('command')}"
    )
