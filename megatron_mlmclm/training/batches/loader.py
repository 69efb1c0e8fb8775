"""The trainer's micro-batches, built ahead of the step that uses them: `data.loader`.

Which samples a training step reads is a pure function of its number
(training/batches/batch_plan.py, `Plan`). So a loader can prepare the next steps while the current
one runs, and a resumed run's loader simply starts at its step: there is no iterator state to save.

- `sync`: built in the training process when the step asks (the reference; validation uses it).
- `workers`: torch DataLoader worker processes over "micro-batch m = s x num_microbatches + j",
  persistent, about two steps ahead; with CUDA the batch is pinned for a non-blocking copy.
- `dali`: an NVIDIA DALI pipeline: a parallel external_source in sample mode whose Python worker
  processes each build one row of a micro-batch (read the packed sample, shift it for CLM or mask
  it for MLM), DALI's prefetch queue, and the batch placed on the GPU when CUDA is present (a
  CPU-only pipeline otherwise).

All three hand over the same host tensors, bit for bit: tokens, labels, loss_mask, position_ids,
document_ids. The dense attention mask is built by the trainer on the device that uses it
(objectives.to_device). A request that is not the planned one (another first sample or phase, a
step past the run) is built synchronously, so a loader can only change speed, never batches.
"""

from __future__ import annotations

import contextlib
import gc
import math
import queue
import signal
import threading

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from megatron_mlmclm.config import PhaseConfig
from megatron_mlmclm.objectives import batch_arrays
from megatron_mlmclm.runtime.lifetime import children_die_with_us
from megatron_mlmclm.training.batches.batch_plan import Plan
from megatron_mlmclm.training.faults.preemption import SIGNALS

FIELDS = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "position_ids": torch.int64,
    "document_ids": torch.int32,
}


def build_loader(kind: str, datasets, plan: Plan, num_workers: int = 2, start_step: int = 0):
    """The `data.loader` named `kind`, already preparing step `start_step`. `datasets`: one per
    stream of the plan (or the one dataset of a one-stream run)."""
    if not isinstance(datasets, (list, tuple)):
        datasets = [datasets]
    if kind == "sync":
        return SyncLoader(datasets, plan)
    cls = {"workers": WorkerLoader, "dali": DaliLoader}[kind]
    loader = cls(datasets, plan, num_workers)
    if start_step < plan.steps:
        loader.seek(start_step)
    return loader


class SyncLoader:
    """Builds a step's micro-batches when asked."""

    def __init__(self, datasets, plan: Plan):
        self.datasets, self.plan = list(datasets), plan

    @property
    def dataset(self):
        """The dataset of a one-stream run."""
        return self.datasets[0]

    @dataset.setter
    def dataset(self, value) -> None:
        self.datasets[0] = value

    def get(self, step: int, first_sample: int, phase: PhaseConfig) -> list[dict]:
        """This rank's host micro-batches of training step `step`: the global batch at
        `first_sample` of the step's stream."""
        return self.plan.microbatches(self.datasets[self.plan.stream(step)], first_sample, phase)

    def close(self) -> None:
        pass


class _Ahead(SyncLoader):
    """Planned micro-batches from some step on, taken off their source by a thread of this process
    into a queue two steps deep, so the step finds them ready: receiving a micro-batch from worker
    processes costs about 0.5 ms (pipes, context switches), as much as building two samples. A
    jump (a step other than the next) restarts source and thread there."""

    def __init__(self, datasets, plan: Plan):
        super().__init__(datasets, plan)
        self.next_step: int | None = None
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.ready: queue.Queue = queue.Queue()

    def get(self, step, first_sample, phase):
        if not self.plan.planned(step, first_sample, phase):
            return super().get(step, first_sample, phase)
        if step != self.next_step:
            self.seek(step)
        out = []
        for _ in range(self.plan.num_microbatches):
            item = self.ready.get()
            if isinstance(item, BaseException):
                self.next_step = None  # the source failed: restart it on the next request
                raise item
            out.append(item)
        self.next_step = step + 1
        return out

    def seek(self, step: int) -> None:
        self.stop()
        self.start_source(step)
        self.next_step, self.stopping = step, threading.Event()
        self.ready = queue.Queue(maxsize=2 * self.plan.num_microbatches)
        self.thread = threading.Thread(
            target=self.fetch, args=(self.ready, self.stopping), name="mlmclm-loader", daemon=True
        )
        self.thread.start()

    def fetch(self, ready: queue.Queue, stopping: threading.Event) -> None:
        self.init_thread()
        while not stopping.is_set():
            try:
                item = self.next_microbatch()
            except BaseException as e:  # StopIteration past the plan, or a failed source
                item = e
            while not stopping.is_set():  # a full queue waits for the step, or for stop()
                try:
                    ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if isinstance(item, BaseException):
                return

    def stop(self) -> None:
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()
            self.thread = None

    def close(self) -> None:
        self.stop()

    def init_thread(self) -> None:
        pass

    def start_source(self, step: int) -> None:
        raise NotImplementedError

    def next_microbatch(self) -> dict:
        raise NotImplementedError


@contextlib.contextmanager
def starting_workers():
    """Start worker processes so that they neither stop on the trainer's signals nor finalize what
    they inherit from it.
    - The trainer's stop signals are blocked, so workers inherit a mask that never delivers them: a
      signal sent to every process of a job (SLURM's process tracking) then stops the trainer after
      a save (training/faults/preemption.py) and not a worker in mid-step, which would fail the
      step. Workers end with the trainer (or on SIGKILL), and get SIGKILL when the trainer is gone
      (runtime/lifetime.py), so none outlives a killed run.
    - The garbage collector is frozen, so a forked worker never collects an object it inherited.
      Among them may be cyclic garbage the trainer has not collected yet, such as a dropped DALI
      pipeline, whose finalizer shuts down threads that exist only in the trainer: run in a worker
      it crashed the worker or hung it for good (it hung a CI run). The trainer unfreezes at once
      and collects its garbage itself."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    gc.freeze()
    try:
        with children_die_with_us():
            yield
    finally:
        gc.unfreeze()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# --------------------------------------------------------------------------------------------------
# workers: torch DataLoader


def as_is(item):
    return item


class PlannedMicrobatches(torch.utils.data.Dataset):
    """Map-style: item m is micro-batch j = m % num_microbatches of step s = m // num_microbatches,
    as numpy arrays: pickled, they cross to the trainer several times faster than torch tensors
    (each of which would cost a shared-memory segment)."""

    def __init__(self, datasets, plan: Plan):
        self.datasets, self.plan = datasets, plan

    def __len__(self) -> int:
        return self.plan.steps * self.plan.num_microbatches

    def __getitem__(self, m: int) -> dict:
        step, j = divmod(int(m), self.plan.num_microbatches)
        return self.plan.arrays(
            self.datasets[self.plan.stream(step)],
            self.plan.first_sample(step),
            j,
            self.plan.phase(step),
        )


class _From(Sampler):
    """Items start, start + 1, ... to the end of the plan; `start` is set before each iter()."""

    def __init__(self, end: int):
        self.start, self.end = 0, end

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start


class WorkerLoader(_Ahead):
    def __init__(self, datasets, plan: Plan, num_workers: int):
        super().__init__(datasets, plan)
        items = PlannedMicrobatches(self.datasets, plan)
        self.sampler = _From(len(items))
        self.loader = DataLoader(
            items,
            batch_size=None,
            sampler=self.sampler,
            num_workers=num_workers,
            collate_fn=as_is,
            persistent_workers=True,
            prefetch_factor=max(2, math.ceil(2 * plan.num_microbatches / num_workers)),
        )
        self.it = None
        # With CUDA, micro-batches are pinned (by the fetch thread) for non-blocking copies.
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def start_source(self, step: int) -> None:
        self.sampler.start = step * self.plan.num_microbatches
        # The first iter() starts the persistent workers; later ones drop what is in flight.
        with starting_workers():
            self.it = iter(self.loader)

    def init_thread(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)

    def next_microbatch(self) -> dict:
        assert self.it is not None, "start_source() starts the workers first"
        out = {k: torch.from_numpy(v) for k, v in next(self.it).items()}
        return out if self.device is None else {k: v.pin_memory() for k, v in out.items()}

    def close(self) -> None:
        self.stop()
        it, self.it = self.it, None
        # torch's persistent workers end with their iterator's private shutdown, not with GC.
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


# --------------------------------------------------------------------------------------------------
# dali: NVIDIA DALI pipeline


class DaliSource:
    """external_source callback (sample mode): sample k of the pipeline's epoch is row
    k % micro_batch_size of the k // micro_batch_size-th micro-batch from `first_item` on."""

    def __init__(self, datasets, plan: Plan, first_item: int):
        self.datasets, self.plan, self.first_item = datasets, plan, first_item

    def __call__(self, info) -> tuple[np.ndarray, ...]:
        plan = self.plan
        m, row = divmod(info.idx_in_epoch, plan.micro_batch_size)
        m += self.first_item
        if m >= plan.steps * plan.num_microbatches:
            raise StopIteration
        step, j = divmod(m, plan.num_microbatches)
        position = plan.positions(plan.first_sample(step), j)[row]
        arrays = batch_arrays(
            [self.datasets[plan.stream(step)][position]],
            [position],
            plan.phase(step),
            plan.spec,
            plan.seed,
        )
        return tuple(arrays[k][0] for k in FIELDS)


class DaliLoader(_Ahead):
    def __init__(self, datasets, plan: Plan, num_workers: int):
        super().__init__(datasets, plan)
        self.num_workers = num_workers
        self.pipe = None
        # GPU placement: the pipeline's outputs land on this process's GPU.
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def start_source(self, step: int) -> None:
        """A new pipeline whose epoch starts at `step` (a DALI source cannot be moved)."""
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        self.pipe = None
        n = self.plan.num_microbatches
        kinds = types.DALIDataType
        dtypes = {torch.int64: kinds.INT64, torch.int32: kinds.INT32, torch.float32: kinds.FLOAT}
        # Forking a process that holds a CUDA context is unsupported: spawn then (the source and
        # the dataset are pickled to the workers).
        start = "spawn" if torch.cuda.is_initialized() else "fork"
        pipe = Pipeline(
            batch_size=self.plan.micro_batch_size,
            num_threads=1,
            device_id=self.device,
            py_num_workers=self.num_workers,
            py_start_method=start,
            prefetch_queue_depth=2,
            seed=0,
        )
        with pipe:
            outputs = fn.external_source(
                source=DaliSource(self.datasets, self.plan, step * n),
                num_outputs=len(FIELDS),
                batch=False,
                parallel=True,
                prefetch_queue_depth=max(2, 2 * n),
                dtype=[dtypes[t] for t in FIELDS.values()],
            )
            if self.device is not None:
                outputs = [o.gpu() for o in outputs]
            pipe.set_outputs(*outputs)
        with starting_workers():
            pipe.start_py_workers()
        pipe.build()
        self.pipe = pipe

    def init_thread(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)

    def next_microbatch(self) -> dict:
        # DALI's documented name for it; the plugin re-exports it without declaring it public.
        from nvidia.dali.plugin.pytorch import feed_ndarray  # pyright: ignore[reportPrivateImportUsage]

        assert self.pipe is not None, "start_source() builds the pipeline first"
        out = {}
        stream = torch.cuda.current_stream() if self.device is not None else None
        for (name, dtype), tensors in zip(FIELDS.items(), self.pipe.run()):
            dense = tensors.as_tensor()
            t = torch.empty(dense.shape(), dtype=dtype, device=self.device)
            out[name] = feed_ndarray(dense, t, cuda_stream=stream)
        if stream is not None:
            stream.synchronize()  # copies done before the training thread gets the batch
        return out

    def close(self) -> None:
        self.stop()
        self.pipe = None  # the last reference: the pipeline shuts down with its worker pool
