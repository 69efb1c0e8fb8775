"""`mlmclm study`: the study's design in miniature, end to end on CPU (design.py says what is run).

    tokenizer -> shards -> unigram floor -> pretraining (design.workers runs at a time, one thread
    each; a learning-curve decay branch once its branch point is saved) -> Hugging
    Face exports -> fine-tuning, task by task, with the LR grid widened while a chosen LR sits at
    its edge, then the learning-curve models at the LRs their recipe chose -> OUT/report.md
    (report.py, curves.py) and OUT/models/ (the per-model report)

Resumable like the quickstart: finished pretraining runs, exports and fine-tuning results are kept
and reused; the report is rebuilt from what is on disk. OUT/study.json records the design; a second
run with another design into the same folder is refused (the results would not be comparable).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from megatron_mlmclm.eval.grid import done_results, expand, run_grid, worker_pool
from megatron_mlmclm.eval.report import summarize
from megatron_mlmclm.eval.tasks import load_registry
from megatron_mlmclm.quickstart import build_corpus, cli, resolve_sources, small_run_config
from megatron_mlmclm.quickstart import log as quickstart_log
from megatron_mlmclm.study.design import (
    CURVE_RECIPES,
    IR_CORPUS,
    RECIPE,
    StudyDesign,
    branch_point,
    curve_key,
    decay_steps,
    parse_curve_key,
    parse_run_name,
    recipe_flops,
    run_name,
    run_steps,
    widen,
)
from megatron_mlmclm.study.runs import final_val_loss, finished, last_step, run_dir, steps_of


def log(message: str) -> None:
    quickstart_log(message, "study")


def run_study(out: str | Path, design: StudyDesign, data_folder: str | None = None) -> Path:
    design.check()
    corpus, tasks = resolve_sources(data_folder, design.tasks)
    out = Path(out).resolve()
    _claim_folder(out, design)
    start = time.time()
    tokenizer, prefixes = build_corpus(
        out,
        corpus,
        design.vocab_size,
        "1/6",
        "2/6",
        who="study",
        max_train_documents=design.train_documents,
    )
    floor = out / "unigram.json"
    if not floor.is_file():
        from megatron_mlmclm.data.unigram import unigram_cross_entropy  # megatron-core: slow import

        floor.write_text(
            json.dumps(
                {
                    "unigram_nats": unigram_cross_entropy(
                        tokenizer, prefixes["train"], prefixes["valid"]
                    )
                }
            )
        )
    log(
        f"unigram entropy of the validation tokens: "
        f"{json.loads(floor.read_text())['unigram_nats']:.3f} nats"
    )

    pretrain_all(out, design, tokenizer, prefixes)
    exports = export_all(out, design)
    grids = finetune_all(out, design, tasks, exports)

    from megatron_mlmclm.study.report import write_study_report  # matplotlib, scipy

    minutes = _record_invocation(out, start)
    report = write_study_report(out, design, grids)
    log(
        f"6/6 report: {report} (this invocation {minutes[-1]:.1f} min, all invocations "
        f"{sum(minutes):.1f} min)"
    )
    return report


def _claim_folder(out: Path, design: StudyDesign) -> None:
    design.check_folder(out)
    record = out / "study.json"
    if not record.is_file():
        out.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"design": design.to_dict()}, indent=1))


def _record_invocation(out: Path, start: float) -> list[float]:
    """Append this invocation's wall time (up to its report) to study.json; all of them, in min."""
    record = out / "study.json"
    saved = json.loads(record.read_text())
    saved.setdefault("invocations", []).append(
        {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start)),
            "minutes": round((time.time() - start) / 60, 2),
        }
    )
    record.write_text(json.dumps(saved, indent=1))
    return [i["minutes"] for i in saved["invocations"]]


# ---------------------------------------------------------------------------------------------
# Pretraining


def _config(out: Path, design: StudyDesign, name: str, tokenizer: Path, prefixes) -> Path:
    key, seed = parse_run_name(name)
    curve = parse_curve_key(key)
    if curve:
        cfg = _branch_config(out, design, name, curve, seed, tokenizer, prefixes)
    else:
        cfg = _recipe_config(out, design, name, key, seed, tokenizer, prefixes)
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _branch_config(
    out: Path,
    design: StudyDesign,
    name: str,
    curve: tuple[str, int],
    seed: int,
    tokenizer: Path,
    prefixes,
) -> dict:
    """A learning-curve budget of a single-objective recipe: the full run's config with its own
    budget and decay, branching off the full run's checkpoint where that decay starts."""
    key, budget = curve
    cfg = _recipe_config(out, design, run_name(key, seed), key, seed, tokenizer, prefixes)
    cfg.update(name=name, output_dir=str(run_dir(out, name)))
    cfg["train"].update(
        steps=budget,
        decay_steps=decay_steps(budget),
        branch_from=str(
            run_dir(out, run_name(key, seed)) / "checkpoints" / f"iter_{branch_point(budget):07d}"
        ),
    )
    del cfg["checkpoint"]["keep_steps"]
    return cfg


def _recipe_config(
    out: Path, design: StudyDesign, name: str, key: str, seed: int, tokenizer: Path, prefixes
) -> dict:
    recipe = RECIPE[key]
    init_from = None
    if recipe.continues:
        init_from = str(run_dir(out, run_name(recipe.continues, seed)) / "checkpoints")
    cfg = small_run_config(
        out,
        name,
        recipe.phases,
        steps_of(design, key),
        tokenizer,
        prefixes,
        preset=design.preset,
        seed=seed,
        lr=design.lr,
        micro_batch_size=design.micro_batch_size,
        eval_iters=design.eval_iters,
        evals=6,
        init_from=init_from,
    )
    if recipe.continues:
        # Another sample order than the base run's, so the continuation mostly reads new samples.
        cfg["data"]["seed"] = seed + 1000
    if recipe.flops_of:
        # The budget in FLOPs (the steps beside it must agree: config/ checks), counted at the
        # design's vocabulary, as budget_config does.
        cfg["train"]["flops"] = recipe_flops(design, recipe.flops_of)
        cfg["model"]["vocab_size"] = design.vocab_size
    if key in CURVE_RECIPES and design.curve_shares:  # where its learning-curve branches start
        cfg["checkpoint"]["keep_steps"] = [branch_point(b) for b in design.curve_budgets()]
    return cfg


def _can_start(out: Path, design: StudyDesign, name: str) -> bool:
    """A continuation once its base run has finished; a learning-curve branch once its full run
    has saved the branch point (the folder appears complete: checkpoints are renamed into place)."""
    key, seed = parse_run_name(name)
    curve = parse_curve_key(key)
    if curve:
        return (
            run_dir(out, run_name(curve[0], seed))
            / "checkpoints"
            / f"iter_{branch_point(curve[1]):07d}"
        ).is_dir()
    base = RECIPE[key].continues
    return not base or finished(out, design, run_name(base, seed))


def all_runs(design: StudyDesign) -> list[str]:
    """Every pretraining run of the study: the recipes, then the learning-curve branches."""
    return [run_name(r, s) for r, s in design.runs()] + [
        run_name(curve_key(k, b), s) for k, b, s in design.curve_runs()
    ]


def pretrain_all(out: Path, design: StudyDesign, tokenizer: Path, prefixes) -> None:
    """Every (recipe, seed) run, `design.workers` at a time (one thread each: two small runs side
    by side use two cores better than one run on both); a continuation starts once its base run
    has finished. A failing run stops the study with its exit status and log path."""
    names = all_runs(design)
    todo = [n for n in names if not finished(out, design, n)]
    log(
        f"3/6 pretraining: {len(names)} runs ({design.steps} steps; continuations "
        f"{design.cpt_steps}; learning-curve branches {design.curve_budgets()}), "
        f"{len(names) - len(todo)} done already, "
        f"{design.workers} at a time; logs in {out / 'runs'}/NAME/train.log"
    )
    if not todo:
        return
    total = {n: run_steps(design, n) for n in todo}
    bar = tqdm(total=sum(total.values()), desc="pretraining", unit="step")
    running: dict[str, tuple[subprocess.Popen, object]] = {}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # SIGTERM (kill, a scheduler's time limit) must reach the runs too: they save at the step in
    # flight and the next invocation resumes them.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        while todo or running:
            for name in list(todo):
                if len(running) >= design.workers:
                    break
                if not _can_start(out, design, name):
                    continue
                config = _config(out, design, name, tokenizer, prefixes)
                run_dir(out, name).mkdir(parents=True, exist_ok=True)
                logf = open(run_dir(out, name) / "train.log", "a")  # a resumed run keeps its log
                running[name] = (
                    subprocess.Popen(
                        [sys.executable, "-m", "megatron_mlmclm", "pretrain", str(config)],
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        env=env,
                    ),
                    logf,
                )
                todo.remove(name)
            time.sleep(0.25)  # a freed slot (or a saved branch point) is taken at once
            for name, (proc, logf) in list(running.items()):
                if proc.poll() is None:
                    continue
                logf.close()
                del running[name]
                if proc.returncode != 0:
                    logfile = run_dir(out, name) / "train.log"
                    last = [
                        line
                        for line in logfile.read_text(errors="replace").splitlines()
                        if line.strip()
                    ]
                    log(
                        f"pretraining {name} failed (exit {proc.returncode}): "
                        f"{last[-1] if last else ''} (log: {logfile})"
                    )
                    raise SystemExit(proc.returncode)
                log(f"pretrained {name}: final validation loss {final_val_loss(out, name):.3f}")
            bar.n = sum(
                min(total[n], last_step(run_dir(out, n) / "metrics.jsonl"))
                for n in total
                if n not in todo
            )
            bar.refresh()
    finally:
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.wait()
        signal.signal(signal.SIGTERM, previous)
        bar.close()


# ---------------------------------------------------------------------------------------------
# Exports and fine-tuning


def export_all(out: Path, design: StudyDesign) -> dict[str, Path]:
    """{run name: its Hugging Face folder} of every run, learning-curve branches included."""
    exports = {}
    for name in all_runs(design):
        target = out / "hf" / name
        if not (target / "config.json").is_file():
            log(f"4/6 export {name} to Hugging Face")
            cli(["convert", "to-hf", str(run_dir(out, name) / "checkpoints"), str(target)])
        exports[name] = target
    return exports


def next_grid(
    lrs: list[float], chosen: dict[str, float]
) -> tuple[list[str], list[str], list[float]]:
    """(models whose chosen LR is the grid's lowest, those at its highest, the grid widened
    along the ladder on each side that has one)."""
    low = sorted(m for m, lr in chosen.items() if lr == min(lrs))
    high = sorted(m for m, lr in chosen.items() if lr == max(lrs))
    return low, high, widen(lrs, bool(low), bool(high))


def task_file(out: Path, tasks: list[str]) -> Path:
    """The study's IR tasks: the registry's entries with corpus IR_CORPUS (design.py), in a task
    file every fine-tuning run reads (a later entry of a name replaces the registry's)."""
    registry = load_registry()
    ir = [registry[n] for n in tasks if n in registry and registry[n].family == "ir"]
    entries = {
        t.name: {
            **{k: v for k, v in dataclasses.asdict(t).items() if k != "name"},
            "corpus": IR_CORPUS,
        }
        for t in ir
    }
    path = out / "tasks.yaml"
    path.write_text(yaml.safe_dump(entries, sort_keys=False))
    return path


def finetune_settings(out: Path, design: StudyDesign) -> dict:
    return {
        "task_files": [str(out / "tasks.yaml")],
        "batch_size": design.batch_size,
        "max_steps": design.finetune_steps,
        "eval_every": design.finetune_steps,
        "max_length": design.max_length,
        "max_train_examples": design.max_train_examples,
        "max_eval_examples": design.max_eval_examples,
        "threads": 1,
        "progress": False,
    }


def finetune_all(
    out: Path, design: StudyDesign, tasks: list[str], exports: dict[str, Path]
) -> dict[str, dict]:
    """Per task: run the grid, and widen it along the ladder while any model's chosen LR is at
    an edge (at most design.max_widen times); then, on design.curve_tasks, the learning-curve
    models (finetune_curve). Returns {task: {"lrs", "widened", "edge", "results",
    "curve_results"}}, the results being those of the final grid."""
    task_file(out, tasks)
    # One pool of workers for every grid: each imports torch and transformers and reads a task's
    # splits once for the whole stage.
    pool = worker_pool(design.workers) if design.workers > 1 else None
    try:
        return _finetune_grids(out, design, tasks, exports, pool)
    finally:
        if pool is not None:
            pool.shutdown()


def _finetune_grids(out, design, tasks, exports, pool) -> dict[str, dict]:
    """finetune_all's grids, run in `pool` (None: one run at a time in this process)."""
    grids = {}
    curve_tasks = {t for name, t in zip(design.tasks, tasks) if name in design.curve_tasks}
    curves = {n: p for n, p in exports.items() if parse_curve_key(parse_run_name(n)[0])}
    models = [str(p) for n, p in exports.items() if n not in curves]
    for task in tasks:
        lrs, widened = sorted(design.lrs), []
        while True:
            log(
                f"5/6 fine-tune on {task}: lr {lrs} x seeds {design.finetune_seeds} x "
                f"{len(models)} models (finished runs are kept)"
            )
            cfgs = expand(
                models, [task], lrs, design.finetune_seeds, **finetune_settings(out, design)
            )
            summary = run_grid(cfgs, out / "eval", workers=design.workers, log=log, pool=pool)
            if summary["failed"]:
                raise SystemExit(
                    f"{summary['failed']} fine-tuning run(s) failed; their "
                    f"tracebacks are in {out / 'eval'}/**/*.failed.json"
                )
            results = done_results(cfgs, out / "eval")
            chosen = {r["model"]: r["best_lr"] for r in summarize(results)["per_task"]}
            low, high, wider = next_grid(lrs, chosen)
            if not (low or high) or wider == lrs or len(widened) >= design.max_widen:
                break
            widened.append({"from": lrs, "to": wider, "low": low, "high": high})
            log(
                f"{task}: chosen LR at the grid's edge for {', '.join(low + high)}; widening "
                f"to {wider}"
            )
            lrs = wider
        grids[task] = {
            "lrs": lrs,
            "widened": widened,
            "results": results,
            "edge": sorted(set(low) | set(high)),
            "curve_results": (
                finetune_curve(out, design, task, curves, chosen, pool)
                if task in curve_tasks
                else []
            ),
        }
    return grids


def finetune_curve(
    out: Path,
    design: StudyDesign,
    task: str,
    curves: dict[str, Path],
    chosen: dict[str, float],
    pool=None,
) -> list[dict]:
    """The learning-curve models of each recipe on `task`, every fine-tuning seed, at the LRs the
    recipe's full-budget models chose (`chosen`: model -> LR): each model's own choice is made on
    validation among those, at a fraction of the full grid's cost."""
    results = []
    for key in CURVE_RECIPES:
        models = [
            str(p) for n, p in curves.items() if parse_curve_key(parse_run_name(n)[0])[0] == key
        ]
        lrs = sorted(
            {chosen[m] for m in (run_name(key, s) for s in design.pretrain_seeds) if m in chosen}
        )
        if not models or not lrs:
            continue
        log(
            f"5/6 learning curve on {task}: {len(models)} {key} models at lr {lrs} x seeds "
            f"{design.finetune_seeds}"
        )
        cfgs = expand(models, [task], lrs, design.finetune_seeds, **finetune_settings(out, design))
        if run_grid(cfgs, out / "eval", workers=design.workers, log=log, pool=pool)["failed"]:
            raise SystemExit(
                f"fine-tuning run(s) of the learning curve failed; their tracebacks "
                f"are in {out / 'eval'}/**/*.failed.json"
            )
        results += done_results(cfgs, out / "eval")
    return results
