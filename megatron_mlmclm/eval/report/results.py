"""The runs a report reads: our result JSONs (`mlmclm evaluate`), and the paper's own runs from an
EncodEval results tree; and the choice of one protocol among them.

An EncodEval tree is ``<root>/<model>/<SC|TC|QA|IR>/<dataset>/<lr..._sd...>/results.json`` with
``{"validation": {"score", "scores_i"}, "test": {"score", "scores_i"}}`` (IR folders are named
``<training set>_lr1e-04_sd0``). Each becomes a run of protocol ``encodeval`` on the task whose
entry names the dataset (`encodeval_name`; else the dataset's own name), its score under the main
metric that protocol gives the task (eval/protocols.py).
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections import defaultdict
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.families import FAMILIES
from megatron_mlmclm.eval.protocols import PROTOCOLS, resolve
from megatron_mlmclm.eval.tasks import load_registry

RESULT_FILE = re.compile(r"^lr[^_]+_seed\d+_.+\.json$")
ENCODEVAL = "encodeval"
ENCODEVAL_RUN = re.compile(r"^(?:(?P<train>.+)_)?lr(?P<lr>[0-9.eE+-]+)_sd(?P<seed>\d+)$")


def protocol_name(result: dict) -> str:
    return result["protocol"].get("name", "default")


def _files(root: Path, pattern: str) -> list[Path]:
    """The files under `root` matching `pattern`, sorted; a folder that cannot be listed (no
    permission, a system folder) is one line."""
    try:
        return sorted(root.glob(pattern))
    except OSError as e:
        raise UsageError(f"cannot list {root}: {e}; give a results folder") from None


def load_results(folder: str | Path) -> tuple[list[dict], int]:
    """(finished results that carry a protocol, number of finished results without one)."""
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"results folder {folder} not found")
    out, legacy = [], 0
    for f in _files(root, "**/*.json"):
        if not RESULT_FILE.match(f.name) or f.name.endswith(".failed.json"):
            continue
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError, RecursionError):  # unreadable: being written, or damaged
            continue
        if isinstance(r, dict) and r.get("status") == "done" and "metrics" in r:
            if "protocol" not in r:
                legacy += 1
                continue
            problem = result_problem(r)
            if problem is not None:
                raise UsageError(f"result {f}: {problem}; fix the file or move it away")
            out.append(r)
    return out, legacy


def _number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def result_problem(r: dict) -> str | None:
    """What a finished result lacks that the report reads, or None: its names, its run's LR and
    seed, its grid, and a finite score under its metric for validation and test."""
    for key in ("model", "task", "family", "metric"):
        if not isinstance(r.get(key), str):
            return f"{key} is {r.get(key)!r}, not a name"
    if r["family"] not in FAMILIES:
        return f"family {r['family']!r} is none of {', '.join(FAMILIES)}"
    if not _number(r.get("lr")) or type(r.get("seed")) is not int:
        return f"lr {r.get('lr')!r} and seed {r.get('seed')!r} must be a number and an integer"
    grid = r.get("grid")
    if not (
        isinstance(grid, dict)
        and isinstance(grid.get("lrs"), list)
        and all(_number(x) for x in grid["lrs"])
        and isinstance(grid.get("seeds"), list)
        and all(type(x) is int for x in grid["seeds"])
    ):
        return "grid must hold lists of lrs (numbers) and seeds (integers)"
    for split in ("validation", "test"):
        scores = r["metrics"].get(split) if isinstance(r["metrics"], dict) else None
        score = scores.get(r["metric"]) if isinstance(scores, dict) else None
        if not _number(score):
            return f"metrics.{split}.{r['metric']} is {score!r}, not a finite number"
    protocol = r["protocol"]
    if not (
        isinstance(protocol, dict)
        and isinstance(protocol.get("id"), str)
        and isinstance(protocol.get("run_id"), str)
    ):
        return "protocol must hold an id and a run_id"
    return None


def encodeval_tasks(task_files: list[str] | None = None) -> dict[str, tuple[str, str]]:
    """{EncodEval dataset name: (our task name, its main metric under protocol encodeval)}."""
    out = {}
    for name, task in load_registry(task_files).items():
        if task.encodeval_name and not task.train_only:
            out[task.encodeval_name] = (name, resolve(task, ENCODEVAL).metric_name)
    return out


def _default_metric(family: str) -> str:
    return PROTOCOLS[ENCODEVAL].tasks.get(family, {}).get("metric") or FAMILIES[family].metrics[0]


def load_encodeval(
    root: str | Path,
    models: list[str] | None = None,
    tasks: set[str] | None = None,
    task_files: list[str] | None = None,
) -> list[dict]:
    """The runs of an EncodEval results tree as results of protocol encodeval; `models`: fnmatch
    patterns of the model folders to keep; `tasks`: the (our) task names to keep."""
    base = Path(root)
    if not base.is_dir():
        raise UsageError(f"EncodEval results folder {root} not found")
    known = encodeval_tasks(task_files)
    runs = []
    for f in _files(base, "*/*/*/*/results.json"):
        model, kind, dataset, run = f.parts[-5:-1]
        family = kind.lower()
        m = ENCODEVAL_RUN.match(run)
        if family not in FAMILIES or m is None:
            continue
        if models and not any(fnmatch.fnmatch(model, p) for p in models):
            continue
        task, metric = known.get(dataset, (dataset, _default_metric(family)))
        if tasks is not None and task not in tasks:
            continue
        try:
            doc = json.loads(f.read_text())
            scores = {s: {metric: float(doc[s]["score"])} for s in ("validation", "test")}
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(
                f"{f} is not an EncodEval result (validation.score, test.score)"
            ) from None
        runs.append(
            {
                "status": "done",
                "model": model,
                "task": task,
                "family": family,
                "metric": metric,
                "lr": float(m["lr"]),
                "seed": int(m["seed"]),
                "metrics": scores,
                "source": str(f),
                "protocol": {
                    "name": ENCODEVAL,
                    "id": f"{ENCODEVAL}:{dataset}",
                    "run_id": ENCODEVAL,
                    "external": True,
                    "run": {"source": "EncodEval results tree"},
                    "task": {"encodeval_name": dataset, "train_task": m["train"]},
                },
            }
        )
    if not runs:
        raise UsageError(
            f"no EncodEval results under {root} (<model>/<SC|TC|QA|IR>/<dataset>/"
            "lr<LR>_sd<S>/results.json)"
            + (" for these models and tasks" if models or tasks else "")
        )
    grids = defaultdict(lambda: (set(), set()))  # (model, task) -> the LRs and seeds it has
    for r in runs:
        lrs, seeds = grids[(r["model"], r["task"])]
        lrs.add(r["lr"])
        seeds.add(r["seed"])
    for r in runs:
        lrs, seeds = grids[(r["model"], r["task"])]
        r["grid"] = {"lrs": sorted(lrs), "seeds": sorted(seeds)}
    return runs


def _differing(dicts: list[dict]) -> list[str]:
    keys = sorted({k for d in dicts for k in d})
    return [k for k in keys if len({json.dumps(d.get(k), sort_keys=True) for d in dicts}) > 1]


def _describe(results: list[dict], id_key: str, part: str) -> str:
    """'id (n runs: field=value, ...)' per protocol, naming only the fields that differ."""
    groups = defaultdict(list)
    for r in results:
        groups[r["protocol"][id_key]].append(r)
    bodies = {i: g[0]["protocol"][part] for i, g in groups.items()}
    diff = _differing(list(bodies.values()))
    return "; ".join(
        f"{i} ({len(g)} runs: " + ", ".join(f"{k}={bodies[i].get(k)}" for k in diff) + ")"
        for i, g in sorted(groups.items())
    )


def select_protocol(
    results: list[dict], wanted: list[str] | None = None, external: list[dict] | None = None
) -> list[dict]:
    """Our results of one protocol (else a UsageError naming the protocols found), with the
    external runs (EncodEval's) when they follow the same protocol."""
    if wanted:
        keep = [
            r
            for r in results
            if any(
                r["protocol"]["id"].startswith(w) or r["protocol"]["run_id"].startswith(w)
                for w in wanted
            )
        ]
        if not keep:
            raise UsageError(
                f"no results match --protocol {' '.join(wanted)}; fine-tuning protocols "
                f"here: {_describe(results, 'run_id', 'run')}"
            )
        results = keep
    if len({r["protocol"]["run_id"] for r in results}) > 1:
        raise UsageError(
            f"the results mix fine-tuning protocols: {_describe(results, 'run_id', 'run')}; "
            f"pass --protocol RUN_ID to report one"
        )
    for task in sorted({r["task"] for r in results}):
        of_task = [r for r in results if r["task"] == task]
        if len({r["protocol"]["id"] for r in of_task}) > 1:
            raise UsageError(
                f"task {task} has results under more than one task entry: "
                f"{_describe(of_task, 'id', 'task')}; pass --protocol with the ids to keep"
            )
    if external:
        ours = {protocol_name(r) for r in results}
        if ours and ours != {ENCODEVAL}:
            raise UsageError(
                f"the paper's runs follow protocol {ENCODEVAL}, these results "
                f"protocol {', '.join(sorted(ours))}: evaluate with --protocol "
                f"{ENCODEVAL} to compare with them"
            )
        clash = {r["model"] for r in results} & {r["model"] for r in external}
        if clash:
            raise UsageError(
                f"model name(s) {', '.join(sorted(clash))} appear both in the results "
                "and in the EncodEval tree; rename your model folders"
            )
        results = results + external
    return results
