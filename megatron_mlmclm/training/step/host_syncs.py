"""Operations that make the host wait for the device, counted: `mlmclm pretrain CONFIG
--count-syncs`, a diagnostic a user runs where steps leave the GPU idle.

A training step should queue its kernels and let the GPU run them while the host prepares the
next ones. Each operation below makes the host wait until the device has caught up (on CUDA a
stream synchronisation), and the GPU then idles while Python runs the next lines:

- reading a device value on the host: `.item()`, `bool(t)`, `float(t)`, `int(t)`, `.tolist()`,
  `.numpy()`, `.cpu()`;
- operations whose output size depends on the data: `nonzero`, boolean-mask indexing,
  `masked_select`, `unique`, `repeat_interleave` without `output_size`, `bincount`; and
  `torch.equal`, whose answer is a host bool;
- a blocking copy of host data to the device: `torch.tensor(data, device=...)`.

`HostSyncCounter` counts them by operation and by the line of code that asked, on any device. On
a CPU, where nothing waits, it counts what would wait on a GPU: that is how the CPU suite holds a
training step to a budget of synchronisations. Work on host tensors before they are sent to the
device (the loader building batches, the engine laying them out) runs under `on_host()`, which the
counter leaves out: on a GPU those tensors never touch the device. On CUDA,
`cuda_sync_debug_count` gives the ground truth: torch's own sync debug mode, one warning per
synchronising call.

With `--count-syncs` the trainer counts each training step under a `HostSyncCounter`
(`RunSyncs`): the step's count goes into its metrics.jsonl record and its log line
(`host_syncs`), and the run ends with the sites summed over its steps. The counter intercepts
every operation the step dispatches, so counted steps are slower: for a diagnosis, not a run to
time. The suite holds a step to its budget with it (tests/test_host_sync.py); the benchmarks'
profile mode uses both counts (benchmarks/train_throughput.py --profile).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mlmclm.errors import UsageError

# aten operations (by overload packet name) that wait for the device whatever their arguments.
WAITING_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), bool(t), float(t), int(t)
        "nonzero",
        "masked_select",
        "equal",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "bincount",
        "masked_scatter",
        "masked_scatter_",
    }
)
# Indexing with a boolean mask is nonzero underneath (forward and backward).
MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
# Python-level reads of a device tensor on the host.
HOST_READS = frozenset({"tolist", "numpy", "cpu"})

_host = threading.local()


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Mark work on host tensors (building or laying out a batch before its copy to the device):
    the counter does not count it. Never use it around work on device tensors."""
    depth = getattr(_host, "depth", 0)
    _host.depth = depth + 1
    try:
        yield
    finally:
        _host.depth = depth


def _in_host_work() -> bool:
    return getattr(_host, "depth", 0) > 0


def _is_bool_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _site() -> str:
    """The innermost caller outside torch and this module: `path:line in function`."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" in name or frame.filename == __file__ or "/contextlib.py" in name:
            continue
        short = name.split("site-packages/")[-1]
        return f"{short}:{frame.lineno} in {frame.name}"
    return "?"


class _Dispatch(TorchDispatchMode):
    def __init__(self, record: Callable[[str], None]):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not _in_host_work():
            if name in WAITING_OPS:
                self.record(name)
            elif name == "repeat_interleave" and kwargs.get("output_size") is None:
                if isinstance(args[0], torch.Tensor) and (
                    len(args) < 2 or isinstance(args[1], torch.Tensor)
                ):
                    self.record("repeat_interleave")
            elif name in MASK_INDEX_OPS and len(args) > 1:
                indices = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
                if any(_is_bool_mask(i) for i in indices):
                    self.record(f"{name} (boolean mask)")
        return func(*args, **kwargs)


def _wrap_read(original: Callable, record: Callable[[str], None], name: str) -> Callable:
    def read(self, *args, **kwargs):
        if not _in_host_work():
            record(name)
        return original(self, *args, **kwargs)

    return read


def _wrap_factory(original: Callable, record: Callable[[str], None], name: str) -> Callable:
    def factory(*args, **kwargs):
        if not _in_host_work() and kwargs.get("device") is not None:
            record(name)
        return original(*args, **kwargs)

    return factory


class HostSyncCounter:
    """`with HostSyncCounter() as c: ...` then `c.total`, `c.by_op`, `c.by_site` and
    `c.report()`. Counts the calling thread (on CPU that includes autograd's backward)."""

    def __init__(self):
        self.by_op: collections.Counter[str] = collections.Counter()
        self.by_site: collections.Counter[tuple[str, str]] = collections.Counter()
        self._mode: _Dispatch | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    def _record(self, op: str) -> None:
        self.by_op[op] += 1
        self.by_site[(op, _site())] += 1

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __enter__(self) -> HostSyncCounter:
        # Reads of a tensor on the host and blocking copies to the device happen above the
        # dispatcher (a CPU tensor's .tolist() dispatches nothing): count them at the Python
        # entry points, restored on exit.
        for name in sorted(HOST_READS):
            self._patch(
                torch.Tensor,
                name,
                _wrap_read(getattr(torch.Tensor, name), self._record, f"Tensor.{name}"),
            )
        for name in ("tensor", "as_tensor"):
            self._patch(
                torch,
                name,
                _wrap_factory(getattr(torch, name), self._record, f"torch.{name}(device=...)"),
            )
        self._mode = _Dispatch(self._record)
        self._mode.__enter__()
        return self

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved = []

    def report(self) -> str:
        lines = [f"{self.total} host synchronisations"]
        for (op, site), n in self.by_site.most_common():
            lines.append(f"  {n:4d}  {op:<28}  {site}")
        return "\n".join(lines)


def cuda_sync_debug_count(fn: Callable[[], Any]) -> tuple[int, list[str]]:
    """Run `fn` under torch.cuda.set_sync_debug_mode('warn') and count the synchronising calls
    torch reports (CUDA only): (count, the distinct messages)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    # One warning per synchronising call; torch also warns once that the mode is a prototype.
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    return len(syncs), sorted(set(syncs))


def refuse_uncountable(kernels) -> None:
    """--count-syncs on a plan whose steps the counter cannot run: under its dispatch mode
    torch.compile does not trace and FlexAttention's operator does not run."""
    if kernels.compile.on or kernels.attention == "flex":
        raise UsageError(
            "--count-syncs counts eager steps: torch.compile does not trace under its counter "
            "and FlexAttention does not run; add model.compile=off"
            + (" model.attention=sdpa" if kernels.attention == "flex" else "")
        )


class RunSyncs:
    """--count-syncs: every training step counted (`count`), the sites summed over the run."""

    def __init__(self):
        self.steps: list[int] = []  # each counted step's total
        self.by_site: collections.Counter[tuple[str, str]] = collections.Counter()

    @contextlib.contextmanager
    def count(self) -> Iterator[HostSyncCounter]:
        with HostSyncCounter() as counter:
            yield counter
        self.steps.append(counter.total)
        self.by_site.update(counter.by_site)

    def summary(self) -> list[str]:
        """The run's log lines: the counts per step and where they came from."""
        if not self.steps:
            return []
        per_step = sorted(self.steps)
        lines = [
            f"host synchronisations (--count-syncs) over {len(per_step)} steps: "
            f"{per_step[0]} to {per_step[-1]} a step, median {per_step[len(per_step) // 2]}"
        ]
        for (op, site), n in self.by_site.most_common():
            lines.append(f"  {n:6d}  {op:<28}  {site}")
        return lines
