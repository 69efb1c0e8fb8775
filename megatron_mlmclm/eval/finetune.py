"""One fine-tuning run: (model folder, task, learning rate, seed) -> result dict.

The loop is shared by the four families; each family (megatron_mlmclm/eval/families/) supplies the
model, the training items and their collate function, the loss and the evaluation (families.Setup).
The task entry is first resolved for the run's evaluation protocol (eval/protocols.py). Defaults
(the `default` protocol, docs/evaluate.md): batch 32, at most 1000 steps or one epoch, 10% warmup
then linear decay, AdamW (0.9, 0.95, eps 1e-5), weight decay 0.1 (not on biases and norm weights),
validation every 100 steps, bf16 autocast on GPU and fp32 on CPU, max length 0.99 x the model's
positions. Precision `bf16-pure` (the `encodeval` protocol) casts the model to bf16 before the
optimizer is built, so the weights and AdamW's state are bf16 and there is no fp32 master copy.

The test metric is computed once, on the final model; the validation curve (every `eval_every`
steps and at the end) is kept in the result, and the final validation score is what the report
uses to choose the learning rate.

`protocol(cfg, task)` is everything that changes a run's score except (model, lr, seed): the
fine-tuning settings in PROTOCOL_FIELDS (precision resolved) and the task entry. Its short hash
names the result file, so a changed protocol never reuses an old result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import platform
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval import families
from megatron_mlmclm.eval.families import Setup, family_of
from megatron_mlmclm.eval.heads import max_positions
from megatron_mlmclm.eval.input_form import describe_record, load_tokenizer
from megatron_mlmclm.eval.protocols import resolve
from megatron_mlmclm.eval.run_state import Progress, RunState, run_key
from megatron_mlmclm.eval.tasks import get_task
from megatron_mlmclm.identity import IdentityCache, model_identity

# 2: protocol and grid fields, protocol id in the file name; 3: inputs encoded as pretraining
# documents, the protocol's name; 4: inputs in the folder's own form (`inputs`), special-token
# strings encoded as text, the curve's intermediate points on a validation sample; 5: the model
# folder's identity (`model_identity`); 6: that identity is the folder's content (identity.py),
# `run_state` (the run's saved states), two texts in the tokenizer's pair form under default,
# `info.inputs` the record of the input form (rule, templates as applied, a warning)
RESULT_SCHEMA = 6
PRECISIONS = ("auto", "bf16", "fp32", "bf16-pure")


@dataclass
class FinetuneConfig:
    """One fine-tuning run (not to be confused with config.RunConfig, a pretraining run)."""

    model: str
    task: str
    lr: float = 5e-5
    seed: int = 0
    model_name: str | None = None  # label in results/report; default: the folder name
    protocol: str = "default"  # evaluation protocol (eval/protocols.py)
    inputs: str = "folder"  # the input form: folder | document | eos (eval/input_form.py)
    batch_size: int = 32
    eval_batch_size: int = 64
    # training stops at max_steps or after this many epochs, whichever is first (None: no cap)
    max_steps: int | None = 1000
    epochs: float | None = 1.0
    warmup_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-5
    grad_clip: float = 1.0  # 0 disables
    eval_every: int = 100
    # the validation curve's intermediate points score this many validation examples (a fixed
    # sample); its last point, which picks the LR, the whole split
    curve_examples: int = 2000
    max_length: int | None = None  # cap on the sequence length
    max_length_ratio: float = 0.99  # of the model's max positions
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    ir_mini_batch_size: int = 32  # CachedMNRL chunk size (memory only; the loss is the same)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32 | bf16-pure
    threads: int | None = None  # torch CPU threads; None: leave torch's default
    task_files: list[str] = field(default_factory=list)
    progress: bool = True
    save_model: bool = False  # keep the fine-tuned model (run_finetune's save_to)
    # save the run's state (to resume it) at a validation point once this many seconds have passed
    # since the run started or last saved: 0 = at every validation point, None = never
    # (eval/run_state.py; only where the run is given a state folder: the grid's runs)
    state_every_s: float | None = 600.0
    # the LR x seed grid this run belongs to: the report's seed set counts requested runs too
    grid_lrs: list[float] = field(default_factory=list)
    grid_seeds: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The model's label, a folder of the results (`--model .` or `..`: the folder's own
        name, never a path part that would put the results outside --out)."""
        given = Path(self.model.rstrip("/") or "/")
        return self.model_name or (given if given.name not in ("", "..") else given.resolve()).name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# FinetuneConfig fields that change a run's score (with precision resolved, see `protocol`). The
# others do not: model/task/lr/seed are keyed separately, model_name only labels, grid_* describe
# the sweep, and eval_batch_size, eval_every (evaluation never touches the RNG or the weights),
# curve_examples (the curve's intermediate points only), ir_mini_batch_size (CachedMNRL: same
# loss), device, threads, task_files (the entry itself is hashed), progress, save_model and
# state_every_s are execution knobs. tests/eval/test_protocol.py checks every field is in exactly
# one of the two sets.
PROTOCOL_FIELDS = (
    "protocol",
    "inputs",
    "batch_size",
    "max_steps",
    "epochs",
    "warmup_ratio",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "grad_clip",
    "max_length",
    "max_length_ratio",
    "max_train_examples",
    "max_eval_examples",
    "precision",
)
NOT_PROTOCOL_FIELDS = (
    "model",
    "task",
    "lr",
    "seed",
    "model_name",
    "eval_batch_size",
    "eval_every",
    "curve_examples",
    "ir_mini_batch_size",
    "device",
    "threads",
    "task_files",
    "progress",
    "save_model",
    "grid_lrs",
    "grid_seeds",
    "state_every_s",
)


def _short_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


# The step budget: a protocol may set it per task (EncodEval trains CoNLL-2003 for one epoch, SST-2
# for 1,000 steps), so it is part of a run's protocol id but not of the recipe (run_id).
STEP_FIELDS = ("max_steps", "epochs")


def protocol(cfg: FinetuneConfig, task) -> dict:
    """{"name", "id", "run_id", "run", "task"}: `name` = the evaluation protocol, `run` = the
    PROTOCOL_FIELDS (precision resolved for this machine), `task` = the task entry as the protocol
    resolves it (splits, holdout, metric, ...); `run_id` hashes `run` but the step budget (one
    fine-tuning recipe across tasks), `id` hashes both (names the result file)."""
    run = {k: getattr(cfg, k) for k in PROTOCOL_FIELDS}
    run["precision"] = resolved_precision(cfg, resolve_device(cfg))
    body = {"run": run, "task": task.to_dict()}
    recipe = {k: v for k, v in run.items() if k not in STEP_FIELDS}
    return {"name": cfg.protocol, "id": _short_hash(body), "run_id": _short_hash(recipe), **body}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def resolve_device(cfg: FinetuneConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {cfg.device} asked for but CUDA is not available")
    return dev


def resolved_precision(cfg: FinetuneConfig, device: torch.device) -> str:
    if cfg.precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return cfg.precision


def autocast_for(cfg: FinetuneConfig, device: torch.device):
    if resolved_precision(cfg, device) in ("bf16", "bf16-pure"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def make_optimizer(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and normalisation weights (1-D parameters)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = {"fused": True} if next(model.parameters()).is_cuda else {"foreach": True}
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **kwargs
    )


def linear_warmup_decay(optimizer, warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1) if warmup else 1.0
        return max(0.0, (total - step) / max(total - warmup, 1))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def num_steps(n_train: int, cfg: FinetuneConfig, per_epoch: int | None = None) -> int:
    """max_steps or `epochs` epochs, whichever comes first (a None cap does not apply)."""
    per_epoch = per_epoch or math.ceil(n_train / cfg.batch_size)
    caps = [
        c
        for c in (cfg.max_steps, None if cfg.epochs is None else math.ceil(per_epoch * cfg.epochs))
        if c is not None
    ]
    if not caps:
        raise UsageError(f"task {cfg.task}: neither max_steps nor epochs bounds the run")
    return max(1, min(caps))


def batches(n: int, batch_size: int, steps: int, seed: int):
    """`steps` index batches: seeded shuffles, epoch after epoch (the last batch of an epoch may be
    short)."""
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        perm = torch.randperm(n, generator=g).tolist()
        for i in range(0, n, batch_size):
            yield perm[i : i + batch_size]
            done += 1
            if done >= steps:
                return


def no_duplicate_epoch(keys: list[tuple], batch_size: int, g: torch.Generator) -> list[list[int]]:
    """One epoch of batches in which no two items share a key value. With in-batch negatives (IR),
    a repeated query or positive in a batch makes a correct document count as a negative. The
    epoch is a seeded shuffle filled greedily: an item that clashes with the batch being filled
    waits for a later batch (the rule of sentence-transformers' NoDuplicatesBatchSampler, which
    needs a `datasets.Dataset`), so every item is seen once; the last batches may be short."""
    remaining = torch.randperm(len(keys), generator=g).tolist()
    out = []
    while remaining:
        batch, used, later = [], set(), []
        for i in remaining:
            if len(batch) < batch_size and used.isdisjoint(keys[i]):
                batch.append(i)
                used.update(keys[i])
            else:
                later.append(i)
        out.append(batch)
        remaining = later
    return out


def no_duplicate_batches(keys: list[tuple], batch_size: int, steps: int, seed: int):
    """Like `batches`, epoch after epoch of `no_duplicate_epoch`."""
    g = torch.Generator().manual_seed(seed)
    done = 0
    while True:
        for batch in no_duplicate_epoch(keys, batch_size, g):
            yield batch
            done += 1
            if done >= steps:
                return


def max_length_for(cfg: FinetuneConfig) -> int:
    length = int(cfg.max_length_ratio * max_positions(cfg.model))
    if cfg.max_length:
        length = min(length, cfg.max_length)
    return max(length, 8)


def build_setup(cfg: FinetuneConfig, task, tokenizer, device) -> Setup:
    return families.setup(task, tokenizer, cfg, max_length_for(cfg), device)


def batch_order(setup: Setup, cfg: FinetuneConfig) -> tuple[int, Iterator[list[int]]]:
    """(the run's steps, its batches of train item indices: a function of the seed alone)."""
    n, keys = len(setup.train_items), setup.batch_keys
    if keys is not None:  # an epoch may take more batches than n / batch_size: count the first
        first = no_duplicate_epoch(keys, cfg.batch_size, torch.Generator().manual_seed(cfg.seed))
        steps = num_steps(n, cfg, per_epoch=len(first))
        return steps, no_duplicate_batches(keys, cfg.batch_size, steps, cfg.seed)
    steps = num_steps(n, cfg)
    return steps, batches(n, cfg.batch_size, steps, cfg.seed)


def train(
    setup: Setup,
    cfg: FinetuneConfig,
    device: torch.device,
    log=print,
    state: RunState | None = None,
    watch=None,
) -> dict:
    """The shared loop; returns steps, curve and timings. `state`: where the run saves its state
    at validation points and resumes from (eval/run_state.py). `watch` (the evaluation probe,
    eval/probe.py): its `started()` is called before the first step, its `stepped(step, batch)`
    after each, with the batch as collated on the host."""
    model = setup.model.to(device)
    if resolved_precision(cfg, device) == "bf16-pure":  # before the optimizer: no fp32 copy
        model.to(torch.bfloat16)
    model.train()
    steps, order = batch_order(setup, cfg)
    optimizer = make_optimizer(model, cfg)
    scheduler = linear_warmup_decay(optimizer, int(cfg.warmup_ratio * steps), steps)
    autocast = autocast_for(cfg, device)
    done = (state and state.restore(model, optimizer, scheduler, setup.info)) or Progress()
    curve, seen, window = done.curve, done.seen, done.window
    # the losses since the curve's last point, summed on the device: the host reads them only at
    # the curve's points, so a step never waits for the device to finish the one before
    loss_sum = torch.full((), done.loss_sum, device=device)
    t0, eval_time = time.perf_counter(), 0.0
    bar = tqdm(
        total=steps,
        initial=done.step,
        desc=f"{cfg.task} lr={cfg.lr:g} seed={cfg.seed}",
        disable=not cfg.progress,
        leave=False,
    )
    if watch is not None:
        watch.started()
    for step, idx in enumerate(itertools.islice(order, done.step, None), done.step + 1):
        host = setup.collate([setup.train_items[i] for i in idx])
        batch = to_device(host, device)
        with autocast():
            loss = setup.loss(model, batch)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach().float()
        window += 1
        seen += len(idx)
        bar.update(1)
        if watch is not None:
            watch.stepped(step, host)
        if step % cfg.eval_every == 0 or step == steps:
            train_loss = (loss_sum / window).item()
            loss_sum.zero_()
            window = 0
            te = time.perf_counter()
            model.eval()
            with torch.no_grad(), autocast():  # the last point, which picks the LR: all of it
                metrics = setup.evaluate(model, "validation" if step == steps else "curve")
            model.train()
            eval_time += time.perf_counter() - te
            curve.append({"step": step, "train_loss": train_loss, **metrics})
            bar.set_postfix(loss=f"{train_loss:.3f}")
            if state is not None and step < steps and state.due():
                spent = (time.perf_counter() - t0 - eval_time - state.save_time_s, eval_time)
                progress = dataclasses.replace(done, step=step, seen=seen, loss_sum=0.0, window=0)
                state.save(progress.add_time(*spent), model, optimizer, scheduler, setup.info)
    bar.close()
    spent = time.perf_counter() - t0 - eval_time - (state.save_time_s if state else 0.0)
    train_time = done.train_time_s + spent
    return {
        "steps": steps,
        "examples_seen": seen,
        "validation_curve": curve,
        "train_time_s": train_time,
        "eval_time_s": done.eval_time_s + eval_time,
        "train_examples_per_s": seen / max(train_time, 1e-9),
        "resumed_at": done.resumed_at,
    }


def _run_state(
    cfg: FinetuneConfig,
    task,
    setup: Setup,
    identity: str,
    device: torch.device,
    state_dir: str | Path | None,
    log,
) -> RunState | None:
    """The run's saved state in `state_dir` (None: it saves none), keyed by what a resume must
    match (`run_key`): the model folder's content, the protocol, device, precision, inputs."""
    if state_dir is None or cfg.state_every_s is None:
        return None
    precision = resolved_precision(cfg, device)
    pid, n = protocol(cfg, task)["id"], len(setup.train_items)
    key = run_key(cfg, identity, pid, device, precision, n)
    return RunState(state_dir, key, cfg.state_every_s, device, log)


def run_finetune(
    cfg: FinetuneConfig,
    log=print,
    save_to: str | Path | None = None,
    state_dir: str | Path | None = None,
    identity_cache: IdentityCache | None = None,
) -> dict:
    """Fine-tune once and return the result dict (see docs/evaluate.md for its schema); with
    `save_to`, the fine-tuned model is written there (IR: a sentence-transformers folder); with
    `state_dir`, the run saves its state there every `cfg.state_every_s` seconds at a validation
    point, and resumes from the state it finds there (eval/run_state.py)."""
    t_start = time.perf_counter()
    identity = model_identity(cfg.model, identity_cache)  # of the folder about to be read
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task = resolve(get_task(cfg.task, cfg.task_files), cfg.protocol)
    tokenizer = load_tokenizer(cfg.model, cfg.inputs)
    device = resolve_device(cfg)
    seed_everything(cfg.seed)
    setup = build_setup(cfg, task, tokenizer, device)
    state = _run_state(cfg, task, setup, identity, device, state_dir, log)
    out = train(setup, cfg, device, log=log, state=state)
    model = setup.model
    model.eval()
    validation = {
        k: v for k, v in out["validation_curve"][-1].items() if k not in ("step", "train_loss")
    }
    t_test = time.perf_counter()
    with (
        torch.no_grad(),
        autocast_for(cfg, device)(),
    ):  # the registry keeps test apart from validation
        test = setup.evaluate(model, "test")
    test_time = time.perf_counter() - t_test
    if save_to is not None:
        setup.save(str(save_to))
    return {
        "schema": RESULT_SCHEMA,
        "status": "done",
        "model": cfg.name,
        "model_path": str(Path(cfg.model).resolve()),
        "model_identity": identity,
        "task": task.name,
        "family": task.family,
        "metric": task.metric_name,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "protocol": protocol(cfg, task),
        "grid": {
            "lrs": list(cfg.grid_lrs) or [cfg.lr],
            "seeds": list(cfg.grid_seeds) or [cfg.seed],
        },
        "config": cfg.to_dict(),
        "task_config": task.to_dict(),
        "metrics": {"validation": validation, "test": test},
        "validation_curve": out["validation_curve"],
        "steps": out["steps"],
        "train_examples": len(setup.train_items),
        "examples_seen": out["examples_seen"],
        "train_examples_per_s": out["train_examples_per_s"],
        "train_time_s": out["train_time_s"],
        "eval_time_s": out["eval_time_s"],
        "test_time_s": test_time,
        "wall_time_s": time.perf_counter() - t_start,
        "device": str(device),
        "precision": resolved_precision(cfg, device),
        # the run's saved states: the steps it was resumed at, saves and their seconds
        "run_state": {"resumed_at": out["resumed_at"], **(state.summary() if state else {})},
        "info": {**setup.info, "inputs": families.inputs_record(task, tokenizer)},
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "host": platform.node(),
        "pid": os.getpid(),
    }


def show_inputs(cfg: FinetuneConfig, n: int) -> str:
    """The first `n` training inputs of the run's task, as the model sees them: tokens with their
    labels (no model is built)."""
    task = resolve(get_task(cfg.task, cfg.task_files), cfg.protocol)
    tokenizer = load_tokenizer(cfg.model, cfg.inputs)
    family = family_of(task)
    cfg = dataclasses.replace(cfg, max_eval_examples=1)  # evaluation data is not shown
    data = family.inputs(task, tokenizer, cfg, max_length_for(cfg))
    form, record = tokenizer.input_form, families.inputs_record(task, tokenizer)
    lines = [form.note] if form.note else []
    if record.get("warning"):
        lines.append(f"warning: {cfg.name} / {task.name}: {record['warning']}")
    lines.append(
        f"== {cfg.name} / {task.name} (protocol {cfg.protocol}; inputs: {form.describe()}): "
        f"the first {min(n, len(data.train))} of {len(data.train)} training inputs =="
    )
    lines.append(f"form: {describe_record(record)}")
    for i, item in enumerate(data.train[:n]):
        lines.append(f"#{i} {family.show(item, tokenizer, data)}")
    return "\n".join(lines)


def write_result(result: dict, path: Path) -> None:
    """Atomic write: a crash never leaves a half-written result that would be skipped."""
    write_text_atomic(path, json.dumps(result, indent=1))


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
