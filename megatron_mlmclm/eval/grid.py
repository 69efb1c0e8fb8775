"""The learning-rate x seed sweep: expand, check, skip what is done, run (in parallel processes or
one SLURM array element), one result JSON per run.

Layout: <out>/<model name>/<task>/lr<lr>_seed<seed>_<protocol id>.json, written atomically when a
run finishes, so an interrupted sweep resumes where it stopped. The protocol id (finetune.protocol)
hashes the fine-tuning settings and the task entry as the evaluation protocol resolves it: a run
with other settings never counts as done; nor does a result of another model in the folder (its
content identity, identity.py: a re-trained and re-exported model is evaluated again, its
results overwritten; a copied or identically re-exported one is not). The files' digests are
cached in <out>/.model-identity-cache. A run in progress saves its state in <...>.state/ (eval/
run_state.py), which the next run of the grid resumes; it is removed once the result is written. A
run that raised leaves <...>.failed.json (traceback) and is retried next time. With `save_model`,
the fine-tuned model goes to <...>.model/ beside its JSON. With `done_file`, a grid that has every
run done writes that file (the plan's submit script reads it).

Before any run, `preflight` checks every input that can be wrong, the data first: a task whose
files are missing is refused in one line naming the command that fetches them (the grid never
reads a task from the Hub in place of its files, see eval/fetch.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import multiprocessing as mp
import os
import traceback
from pathlib import Path

import transformers
from tqdm.auto import tqdm

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.families import check_labels, inputs_record, load_split
from megatron_mlmclm.eval.fetch import require_data
from megatron_mlmclm.eval.finetune import (
    FinetuneConfig,
    protocol,
    run_finetune,
    write_result,
    write_text_atomic,
)
from megatron_mlmclm.eval.input_form import load_tokenizer
from megatron_mlmclm.eval.protocols import resolve, run_settings
from megatron_mlmclm.eval.run_state import remove_state
from megatron_mlmclm.eval.tasks import get_task, load_registry
from megatron_mlmclm.identity import CACHE_FILE, IdentityCache, legacy_identity, model_identity

DEFAULT_LRS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4)
DEFAULT_SEEDS = (0, 1, 2, 3, 4)


def expand(
    models: list[str], tasks: list[str], lrs, seeds, protocol: str = "default", **overrides
) -> list[FinetuneConfig]:
    """Grid order: model, task, lr, seed (stable, so an array index always names the same run).
    Each run takes the protocol's settings for its task (protocols.run_settings), then
    `overrides` (the flags a user gave)."""
    grid = {"grid_lrs": [float(x) for x in lrs], "grid_seeds": [int(x) for x in seeds]}
    registry = load_registry(overrides.get("task_files"))
    per_task = {t: run_settings(get_task(t, registry=registry), protocol) for t in tasks}
    return [
        FinetuneConfig(
            model=m,
            task=t,
            lr=float(lr),
            seed=int(s),
            protocol=protocol,
            **grid,
            **{**per_task[t], **overrides},
        )
        for m in models
        for t in tasks
        for lr in lrs
        for s in seeds
    ]


def result_path(out_dir: str | Path, cfg: FinetuneConfig, task) -> Path:
    """`task`: the entry of cfg.task as cfg.protocol resolves it (part of the protocol id)."""
    pid = protocol(cfg, task)["id"]
    return Path(out_dir) / cfg.name / cfg.task / f"lr{cfg.lr:g}_seed{cfg.seed}_{pid}.json"


def result_paths(cfgs: list[FinetuneConfig], out_dir: str | Path) -> list[Path]:
    registry = load_registry(cfgs[0].task_files) if cfgs else {}
    resolved = {
        (c.task, c.protocol): resolve(get_task(c.task, registry=registry), c.protocol) for c in cfgs
    }
    return [result_path(out_dir, c, resolved[(c.task, c.protocol)]) for c in cfgs]


def model_folder(result: Path) -> Path:
    """Where a run with `save_model` keeps its fine-tuned model."""
    return result.with_suffix(".model")


def state_folder(result: Path) -> Path:
    """Where the run of `result` keeps its state while it runs (eval/run_state.py)."""
    return result.with_suffix(".state")


def identity_cache(out_dir: str | Path) -> IdentityCache:
    return IdentityCache(Path(out_dir) / CACHE_FILE)


def is_done(path: Path, identity: str, legacy: str | None = None) -> bool:
    """A finished result at `path` of the model folder whose model_identity is `identity` (or,
    for a result of schema 5 or earlier, whose identity by that schema's rule is `legacy`)."""
    if not path.is_file():
        return False
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(result, dict) or result.get("status") != "done":
        return False
    recorded = result.get("model_identity")
    old = legacy is not None and (result.get("schema") or 0) < 6 and recorded == legacy
    return recorded == identity or old


def grid_state(cfgs: list[FinetuneConfig], out_dir: str | Path) -> list[tuple[Path, bool]]:
    """(result path, whether it is done) of each run of the grid, for its model folder as it is
    now."""
    cache = identity_cache(out_dir)
    models = dict.fromkeys(c.model for c in cfgs)
    identity = {m: (model_identity(m, cache), legacy_identity(m)) for m in models}
    return [(p, is_done(p, *identity[c.model])) for c, p in zip(cfgs, result_paths(cfgs, out_dir))]


def done_results(cfgs: list[FinetuneConfig], out_dir: str | Path) -> list[dict]:
    """The finished results of the grid's runs."""
    return [json.loads(p.read_text()) for p, done in grid_state(cfgs, out_dir) if done]


def preflight(cfgs: list[FinetuneConfig], log=print, hub: bool = True) -> None:
    """Every check that can fail on bad input, before the first run: task names, the data on
    disk (`hub`: a task of format hf may be read from the Hub; else it is refused too), model
    folders, tokenizers (present, with a pad token, an EOS where the input rule appends one),
    data files, columns, non-empty splits, evaluated labels the model can predict. A note on a
    folder's input form is logged once, and a warning where nothing separates a task's two
    texts."""
    files = cfgs[0].task_files if cfgs else []
    registry = load_registry(files)
    tasks = [get_task(n, registry=registry) for n in dict.fromkeys(c.task for c in cfgs)]
    require_data(tasks, hub, files)
    names = {}
    for c in cfgs:
        if names.setdefault(c.name, c.model) != c.model:
            raise UsageError(
                f"two model folders share the name '{c.name}' "
                f"({names[c.name]}, {c.model}); rename one folder"
            )
    tokenizers = {}
    for model, inputs in dict.fromkeys((c.model, c.inputs) for c in cfgs):
        tokenizers[(model, inputs)] = load_tokenizer(model, inputs)
        note = tokenizers[(model, inputs)].input_form.note
        if note:
            log(note)
    resolved = {}
    for name, proto in dict.fromkeys((c.task, c.protocol) for c in cfgs):
        task = resolve(get_task(name, registry=registry), proto)
        if task.train_only:
            raise UsageError(
                f"task '{name}' is a training set (splits: train only); evaluate a "
                "task that trains on it: "
                + (
                    ", ".join(n for n, t in registry.items() if t.train_task == name)
                    or "none in the registry"
                )
            )
        source = vars(task).get("train_source") or task
        load_split(source, "train", cfgs[0].max_train_examples)
        evals = {s: load_split(task, s, cfgs[0].max_eval_examples) for s in ("validation", "test")}
        check_labels(task, load_split(source, "train"), evals)
        resolved[(name, proto)] = task
    for c in {(c.model, c.inputs, c.task, c.protocol): c for c in cfgs}.values():
        record = inputs_record(resolved[(c.task, c.protocol)], tokenizers[(c.model, c.inputs)])
        if record.get("warning"):
            log(f"warning: {c.name} / {c.task}: {record['warning']}")


def _run_and_write(cfg_dict: dict, path: str, out_dir: str) -> tuple[str, str | None]:
    # Adding a task head prints transformers' "LOAD REPORT" (newly initialised classifier) for
    # every one of thousands of runs; it is expected, so keep only errors.
    transformers.logging.set_verbosity_error()
    cfg = FinetuneConfig(**cfg_dict)
    failed = Path(path).with_suffix(".failed.json")
    state = state_folder(Path(path))
    try:
        result = run_finetune(
            cfg,
            log=lambda line: print(f"{cfg.name}/{cfg.task} lr={cfg.lr:g} seed={cfg.seed}: {line}"),
            save_to=model_folder(Path(path)) if cfg.save_model else None,
            state_dir=state,
            identity_cache=identity_cache(out_dir),
        )
    except Exception:  # keep the sweep going; the failure is recorded and retried next time
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(
            json.dumps(
                {"status": "failed", "config": cfg_dict, "traceback": traceback.format_exc()},
                indent=1,
            )
        )
        return path, traceback.format_exc(limit=3)
    write_result(result, Path(path))
    failed.unlink(missing_ok=True)
    remove_state(state)  # after the result: a run killed in between resumes, not restarts
    return path, None


def worker_pool(workers: int) -> cf.ProcessPoolExecutor:
    """`workers` fine-tuning processes (fresh interpreters: spawned) that several grids can share
    (`run_grid(pool=...)`): each imports torch and transformers, and reads a task's splits
    (eval/families/base.py keeps them), once for all the grids instead of once per grid."""
    return cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))


def run_grid(
    cfgs: list[FinetuneConfig],
    out_dir: str | Path,
    workers: int = 1,
    array_index: int | None = None,
    log=print,
    pool: cf.Executor | None = None,
    runs_per_element: int = 1,
    done_file: str | Path | None = None,
) -> dict:
    """Run the pending runs of the grid; returns {"ran", "skipped", "failed"} counts. `pool`:
    a `worker_pool(workers)` to run them in (else the grid starts its own, or runs them here
    with one worker). `array_index` I: only runs I*K .. I*K+K-1 (K = `runs_per_element`), one
    element of an array of ceil(runs / K). `done_file`: written when every run of the whole grid
    (every element's) is done, for the model folders as they are now."""
    grid = cfgs
    if array_index is not None:
        k = runs_per_element
        elements = -(-len(cfgs) // k)
        if not 0 <= array_index < elements:
            raise UsageError(
                f"array index {array_index} outside the array of {elements} elements "
                f"(0..{elements - 1}) for a grid of {len(cfgs)} runs, {k} per element"
            )
        cfgs = cfgs[array_index * k : (array_index + 1) * k]
    preflight(cfgs, log, hub=array_index is None)
    states = grid_state(cfgs, out_dir)
    todo = [(c, p) for c, (p, done) in zip(cfgs, states) if not done]
    for p, done in states:
        if done:  # left by a run killed after writing its result
            remove_state(state_folder(p))
    summary = {"total": len(cfgs), "skipped": len(cfgs) - len(todo), "ran": 0, "failed": 0}
    log(
        f"evaluate: {len(cfgs)} runs, {summary['skipped']} already done, {len(todo)} to run "
        f"with {workers} worker(s) -> {out_dir}"
    )
    if todo:
        _run_pending(todo, summary, workers, log, pool, str(out_dir))
    if done_file is not None and all(done for _, done in grid_state(grid, out_dir)):
        write_done_file(Path(done_file), grid, out_dir)
    return summary


def write_done_file(path: Path, grid: list[FinetuneConfig], out_dir: str | Path) -> None:
    """The record that every run of `grid` is done: its runs, and the content identity of each
    model folder they fine-tuned (identity.py), which `mlmclm submit` compares with the export's
    as it is then (plan/submit.py, `evaluation_done`)."""
    cache = identity_cache(out_dir)
    models = {str(Path(m).resolve()): model_identity(m, cache) for m in {c.model for c in grid}}
    write_text_atomic(path, json.dumps({"runs": len(grid), "models": models}, indent=1) + "\n")


def _run_pending(
    todo, summary: dict, workers: int, log, pool: cf.Executor | None, out_dir: str
) -> None:
    """Run `todo` [(config, result path)], counting into `summary`."""
    if pool is None:
        workers = max(1, min(workers, len(todo)))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        todo = [
            (dataclasses.replace(c, progress=False, threads=c.threads or threads), p)
            for c, p in todo
        ]
    bar = tqdm(total=len(todo), desc="runs", disable=len(todo) == 1)

    def done(path, err):
        bar.update(1)
        if err:
            summary["failed"] += 1
            log(f"FAILED {path}:\n{err}")
        else:
            summary["ran"] += 1

    if pool is None and workers == 1:
        for c, p in todo:
            done(*_run_and_write(c.to_dict(), str(p), out_dir))
    else:
        own = pool is None
        pool = worker_pool(workers) if pool is None else pool
        try:
            futures = [pool.submit(_run_and_write, c.to_dict(), str(p), out_dir) for c, p in todo]
            for f in cf.as_completed(futures):
                done(*f.result())
        finally:
            if own:
                pool.shutdown()
    bar.close()
