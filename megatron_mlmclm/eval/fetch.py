"""Evaluation data on disk: which files a task reads (`missing_files`), and `fetch`, which writes a
task's Hub dataset (`hf_name`) into the local layout its entry names, so that machines without
internet (a cluster's compute nodes) read it from `$MLMCLM_DATA_DIR`.

`mlmclm evaluate` itself never downloads a task's data: `require_data` refuses, before anything
is loaded, a task whose files are missing, in one line naming the fetch command (without it, a
run on a machine without internet would retry the Hub for half a minute, holding its GPU, before
failing). `missing_data` answers the same question for a plan's submit script: which tasks'
data are missing under a data folder, and the command that fetches each.

`mlmclm evaluate --fetch` runs it. Each task is written aside (a `.fetch-<task>` folder under the
data folder), read back through its family's local reader and compared, split by split, with what
the same family reads from the Hub (`evaluate` on an online machine without the folder); only then
are its files moved into place. A task whose files are all present is left alone.

A split names a file or a glob: the file written for a glob is the pattern with a trailing `*`
dropped (`dev.jsonl*` -> `dev.jsonl`) and any other `*` replaced by the Hub's one-shard name
(`mnli/train-*.parquet` -> `mnli/train-00000-of-00001.parquet`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval import data
from megatron_mlmclm.eval.families import load_split
from megatron_mlmclm.eval.families.qa import records as qa_records
from megatron_mlmclm.eval.families.sc import records as sc_records
from megatron_mlmclm.eval.families.tc import records as tc_records
from megatron_mlmclm.eval.tasks import Task, check_name, get_task, load_registry
from megatron_mlmclm.paths import data_dir

STANDARD_SPLITS = ("train", "validation", "test")
EITHER = {
    "corpus": ("corpus.jsonl", "corpus.jsonl.gz"),
    "queries": ("queries.jsonl", "queries.jsonl.gz"),
}


def local_name(pattern: str) -> str:
    """The file a fetch writes for a split's file name or glob (the module's head)."""
    return pattern.removesuffix("*").replace("*", "00000-of-00001")


def _split_files(task: Task) -> dict[str, str]:
    """split -> the file (or glob) it reads under the task's folder, as the readers look for it."""
    if task.format == "beir":
        return {s: f"qrels/{name}.tsv" for s, name in task.splits.items()}
    return dict(task.splits)


def required_files(task: Task) -> list[tuple[str, ...]]:
    """The files (or globs) `task` reads, relative to its folder, each as its alternatives (a
    corpus may be gzipped); [] for a task read from the Hub as a whole (format hf). `mlmclm plan`
    records them so that `mlmclm submit` can check a data folder with the standard library."""
    if task.format == "hf":
        return []
    need = sorted(set(_split_files(task).values()))
    if task.format == "tner":
        need += sorted({str(Path(f).parent / "label.json") for f in task.splits.values()})
    either = {"beir": ("corpus", "queries"), "mldr": ("corpus",)}.get(task.format, ())
    return [(n,) for n in need] + [EITHER[kind] for kind in either]


def missing_files(task: Task) -> list[str]:
    """The files (or globs) of `task` that are absent under its folder; [] when all are there.
    A task read from the Hub as a whole (format hf) has no local files."""
    required = required_files(task)
    if not required:
        return []
    folder = task.folder()
    return [
        str(folder / (names[0] if len(names) == 1 else f"{names[0]}[.gz]"))
        for names in required
        if not any(any(folder.glob(n)) for n in names)
    ]


def fetchable(task: Task) -> bool:
    """Whether `fetch` can write the task's local layout from the Hub."""
    return task.hf_name is not None and task.path is not None and task.format in WRITERS


def hub_task(task: Task) -> Task:
    """`task` read from the Hub: its folder pointed nowhere, every split named on the Hub
    (`hf_splits`, else the split's own name: train, validation, test)."""
    splits = task.hf_splits or {s: s for s in task.splits if s in STANDARD_SPLITS}
    missing = [s for s in task.splits if s not in splits]
    if missing:
        raise UsageError(
            f"task '{task.name}': hf_splits does not name the Hub split of {', '.join(missing)}"
        )
    return _moved(task, data.HUB_ONLY, hf_splits=dict(splits))


def _moved(task: Task, path: str, **changes) -> Task:
    out = dataclasses.replace(task, path=path, **changes)
    if vars(task).get("train_source") is not None:
        out.train_source = task.train_source  # type: ignore[attr-defined]
    return out


def check_data(tasks: list[Task], root: Path | None) -> list[str]:
    """Before a plan submits evaluation arrays: every task (and the task an IR task trains on)
    has its files under `root` (the data folder its jobs read), or can be fetched into it. Returns
    the names of those to fetch; UsageError for the first that is neither."""
    to_fetch = []
    for t in _with_training_tasks(tasks).values():
        if t.format == "hf":
            continue  # read from the Hub by every run
        folder = Path(t.path) if root is None else root / t.path  # an absolute path stays
        missing = missing_files(_moved(t, str(folder))) if folder.is_absolute() else [t.path]
        if not missing:
            continue
        if not fetchable(t):
            raise UsageError(
                f"task '{t.name}': its data are not in {root or '$MLMCLM_DATA_DIR'} "
                f"({missing[0]} is missing) and it has no Hub source to fetch them from; "
                "put the files there or choose other --eval-tasks"
            )
        to_fetch.append(t.name)
    return to_fetch


def _missing_under(task: Task, root: Path | None) -> list[str]:
    """The files of `task` absent under `root` (None: the data folder its runs read)."""
    if root is None:
        return missing_files(task)
    folder = Path(task.path) if Path(task.path).is_absolute() else Path(root) / task.path
    return missing_files(_moved(task, str(folder)))


def fetch_command(names: list[str], root: Path | None, task_files=()) -> str:
    """The command that fetches the data of tasks `names` into `root` (None: $MLMCLM_DATA_DIR)."""
    where = f"MLMCLM_DATA_DIR={shlex.quote(str(root))} " if root is not None else ""
    files = "".join(f" --task-file {shlex.quote(str(f))}" for f in task_files)
    return f"{where}mlmclm evaluate --task {' '.join(names)}{files} --fetch"


def missing_data(
    names: list[str], root: str | Path | None = None, task_files=()
) -> dict[str, str | None]:
    """{task: the command that fetches its data into `root`} for each task of `names` whose files,
    or those of the task it trains on, are not under `root` (None: the data folder its runs read,
    $MLMCLM_DATA_DIR, else ../shared/data); the command is None for a task that cannot be fetched
    (no Hub source: its files must be put there by hand; format hf: read from the Hub by every
    run, which an array element refuses). Only looks for files: reads none, contacts nothing.
    For a plan's submit script: an evaluation array of these tasks would fail at its start."""
    registry = load_registry(list(task_files))
    root = None if root is None else Path(root).resolve()
    out: dict[str, str | None] = {}
    for name in dict.fromkeys(names):
        task = get_task(name, registry=registry)
        if task.format == "hf":
            out[name] = None
            continue
        needed = _with_training_tasks([task]).values()
        if any(_missing_under(t, root) for t in needed):
            fetchable_all = all(fetchable(t) for t in needed if _missing_under(t, root))
            out[name] = fetch_command([name], root, task_files) if fetchable_all else None
    return out


def require_data(tasks: list[Task], hub: bool = True, task_files=()) -> None:
    """Before a run reads any data: every task's files (and those of the task it trains on) are
    in the data folder, else one line (UsageError) naming what is missing and the command that
    fetches it: `mlmclm evaluate` never reads the Hub in their place (`--fetch` does, on a
    machine with internet). A task of format hf (read from the Hub by every run) passes with
    `hub`, and is refused without it (an array element never contacts the Hub)."""
    missing: dict[str, list[str]] = {}  # task -> its missing files (and its training task's)
    unfetchable: list[str] = []
    local = [t for t in tasks if t.format != "hf"]
    in_folder = [t for t in _with_training_tasks(local).values() if not Path(t.path).is_absolute()]
    if in_folder and data_dir() is None:
        env = os.environ.get("MLMCLM_DATA_DIR")
        why = f"MLMCLM_DATA_DIR={env} does not exist" if env else "set MLMCLM_DATA_DIR"
        raise UsageError(
            f"no data folder ({why}); fetch the data of {', '.join(t.name for t in local)} "
            "into it first, online: "
            f"`{fetch_command([t.name for t in local], _data_root(), task_files)}`"
        )
    for task in tasks:
        if task.format == "hf":
            if not hub:
                raise UsageError(
                    f"task '{task.name}' is read from the Hugging Face Hub (format hf), which an "
                    "array element never contacts; evaluate a task with local files "
                    "(`mlmclm evaluate --list-tasks`)"
                )
            continue
        for t in _with_training_tasks([task]).values():
            absent = _missing_under(t, None)
            missing.setdefault(task.name, []).extend(absent)
            unfetchable += [t.name] if absent and not fetchable(t) else []
    missing = {name: files for name, files in missing.items() if files}
    if not missing:
        return
    names, files = list(missing), [f for fs in missing.values() for f in fs]
    fix = (
        f"put the files there (no Hub source for {', '.join(unfetchable)})"
        if unfetchable
        else f"fetch them first, online: `{fetch_command(names, _data_root(), task_files)}`"
    )
    raise UsageError(
        f"the data of task{'s' * (len(names) > 1)} {', '.join(names)} are not on disk "
        f"({files[0]}{f' and {len(files) - 1} more' if len(files) > 1 else ''} missing); {fix} "
        "(`mlmclm evaluate` never downloads them)"
    )


def _data_root() -> Path | None:
    env = os.environ.get("MLMCLM_DATA_DIR")
    return Path(env).resolve() if env else data_dir()


def _with_training_tasks(tasks: list[Task]) -> dict[str, Task]:
    out: dict[str, Task] = {}
    for t in tasks:
        out.setdefault(t.name, t)
        source = vars(t).get("train_source")
        if source is not None:
            out.setdefault(source.name, source)
    return out


# ------------------------------------------------------------------------ writers, one per format
# Each takes (the task as read from the Hub, the folder to write into) and writes every file of
# the task's local layout.


def _jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")


def _by_file(task: Task) -> dict[str, str]:
    """Each local file -> the split it is written from (validation carved out of train shares
    train's file)."""
    out: dict[str, str] = {}
    for split, pattern in _split_files(task).items():
        out.setdefault(local_name(pattern), split)
    return out


def _hub(task: Task, split: str):
    return data.hub_dataset(task, task.hf_name, task.hf_config, task.hub_split(split))


def write_parquet(task: Task, folder: Path) -> None:
    """A snapshot of the Hub's parquet files (nyu-mll/glue's layout; pairs)."""
    for name, split in _by_file(task).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        _hub(task, split).to_parquet(str(folder / name))


def write_glue_tsv(task: Task, folder: Path) -> None:
    """GLUE's unquoted TSV: a header row of the entry's columns (and `idx` where the Hub has an
    id, so that the validation carve keys the same examples), one example a line."""
    for name, split in _by_file(task).items():
        rows, names = data.hub_rows(task, split)
        recs = sc_records(task, rows, f"{task.hf_name}:{split}", class_names=names.get(task.label))
        ids = bool(recs) and "id" in recs[0]
        cols = [task.text_a, *([task.text_b] if task.text_b else []), task.label]
        lines = ["\t".join(cols + ["idx"] * ids)]
        for r in recs:
            cells = [r["text_a"], *([r["text_b"]] if task.text_b else []), r["label"]]
            cells += [r["id"]] * ids
            if any(c is None or "\t" in c or "\n" in c for c in cells):
                raise UsageError(
                    f"task '{task.name}': a row of {split} cannot be GLUE TSV: {cells}"
                )
            lines.append("\t".join(cells))
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _tagged(task: Task, split: str) -> list[dict]:
    rows, names = data.hub_rows(task, split)
    return tc_records(task, rows, f"{task.hf_name}:{split}", labels=names.get(task.tags_field))


def write_conll(task: Task, folder: Path) -> None:
    """Whitespace-separated columns (the token and the tag where the entry reads them, `_`
    elsewhere), a blank line between sentences."""
    width = max(2, task.token_column + 1, task.tag_column + 1)
    for name, split in _by_file(task).items():
        lines = []
        for r in _tagged(task, split):
            for token, tag in zip(r["tokens"], r["tags"]):
                if len(token.split()) != 1 or len(tag.split()) != 1:
                    raise UsageError(f"task '{task.name}': {token!r}/{tag!r} is not one column")
                cells = ["_"] * width
                cells[task.token_column], cells[task.tag_column] = token, tag
                lines.append("\t".join(cells))
            lines.append("")
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_tner(task: Task, folder: Path) -> None:
    """tner's layout: JSON Lines {tokens, tags: [ids]} and label.json {tag: id} beside them."""
    splits = {name: _tagged(task, split) for name, split in _by_file(task).items()}
    ids: dict[str, int] = {}
    for recs in splits.values():
        for r in recs:
            for tag in r["tags"]:
                ids.setdefault(tag, len(ids))
    for name, recs in splits.items():
        _jsonl(
            folder / name,
            ({"tokens": r["tokens"], "tags": [ids[t] for t in r["tags"]]} for r in recs),
        )
        (folder / name).with_name("label.json").write_text(json.dumps(ids), encoding="utf-8")


def _questions(task: Task, split: str) -> list[dict]:
    return qa_records(task, data.hub_rows(task, split)[0], f"{task.hf_name}:{split}")


def _by_context(recs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in recs:
        out.setdefault(r["context"], []).append(r)
    return out


def write_squad(task: Task, folder: Path) -> None:
    """SQuAD JSON: one article per paragraph, its questions (`is_impossible` for v2's
    unanswerable ones)."""
    for name, split in _by_file(task).items():
        paragraphs = [
            {
                "context": context,
                "qas": [
                    {
                        "id": q["id"],
                        "question": q["question"],
                        "answers": [
                            {"text": t, "answer_start": s}
                            for t, s in zip(q["answers"]["text"], q["answers"]["answer_start"])
                        ],
                        **(
                            {"is_impossible": not q["answers"]["text"]} if task.version == 2 else {}
                        ),
                    }
                    for q in qs
                ],
            }
            for context, qs in _by_context(_questions(task, split)).items()
        ]
        doc = {
            "version": "v2.0" if task.version == 2 else "1.1",
            "data": [{"title": "", "paragraphs": paragraphs}],
        }
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")


def _spans(q: dict) -> list[tuple[str, int]]:
    return list(zip(q["answers"]["text"], q["answers"]["answer_start"]))


def write_record(task: Task, folder: Path) -> None:
    """SuperGLUE's ReCoRD: one passage a line with its queries (answer `end` inclusive)."""
    for name, split in _by_file(task).items():
        _jsonl(
            folder / name,
            (
                {
                    "passage": {"text": context},
                    "qas": [
                        {
                            "id": q["id"],
                            "query": q["question"],
                            "answers": [
                                {"start": s, "end": s + len(t) - 1, "text": t} for t, s in _spans(q)
                            ],
                        }
                        for q in qs
                    ],
                }
                for context, qs in _by_context(_questions(task, split)).items()
            ),
        )


def write_qed(task: Task, folder: Path) -> None:
    """QED's JSON Lines: one question a line, its answers as the annotation's paragraph spans."""
    for name, split in _by_file(task).items():
        _jsonl(
            folder / name,
            (
                {
                    "example_id": q["id"],
                    "question_text": q["question"],
                    "paragraph_text": q["context"],
                    "annotation": {
                        "answer": [
                            {"paragraph_reference": {"string": t, "start": s, "end": s + len(t)}}
                            for t, s in _spans(q)
                        ]
                    },
                }
                for q in _questions(task, split)
            ),
        )


def write_beir(task: Task, folder: Path) -> None:
    """BEIR's distribution from BeIR/<name> (configs corpus, queries) and BeIR/<name>-qrels."""
    for kind in ("corpus", "queries"):
        rows = data.hub_dataset(task, task.hf_name, kind, kind)
        keep = ("_id", "title", "text") if kind == "corpus" else ("_id", "text")
        _jsonl(folder / EITHER[kind][0], ({k: r.get(k) or "" for k in keep} for r in rows))
    for name, split in _by_file(task).items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = data.hub_dataset(task, f"{task.hf_name}-qrels", None, task.hub_split(split))
        with open(path, "w", encoding="utf-8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            for r in rows:
                f.write(f"{r['query-id']}\t{r['corpus-id']}\t{int(r['score'])}\n")


def write_mldr(task: Task, folder: Path) -> None:
    """MLDR's release: corpus.jsonl {docid, text} and one JSON Lines file per split."""
    _jsonl(folder / "corpus.jsonl", data.hub_dataset(task, task.hf_name, "corpus", "corpus"))
    for name, split in _by_file(task).items():
        config = task.hf_config or "default"
        _jsonl(folder / name, data.hub_dataset(task, task.hf_name, config, task.hub_split(split)))


WRITERS: dict[str, Callable[[Task, Path], None]] = {
    "glue_tsv": write_glue_tsv,
    "parquet": write_parquet,
    "pairs": write_parquet,
    "conll": write_conll,
    "tner": write_tner,
    "squad": write_squad,
    "record": write_record,
    "qed": write_qed,
    "beir": write_beir,
    "mldr": write_mldr,
}


# ---------------------------------------------------------------------------------- the command


def _same(a, b) -> bool:
    return vars(a) == vars(b) if dataclasses.is_dataclass(a) else list(a) == list(b)


def fetch_task(task: Task, root: Path) -> str:
    """Write `task`'s local layout under `root` from the Hub and verify it; a line saying what
    was done."""
    check_name(task.name, "fetch")  # its staging folder sits beside the data, never above
    if not missing_files(task):
        return f"{task.name}: present in {task.folder()}"
    if not fetchable(task):
        raise UsageError(
            f"task '{task.name}': {task.folder()} lacks {', '.join(missing_files(task))} and the "
            f"entry has no Hub dataset in a format fetch writes (hf_name, path; formats "
            f"{', '.join(WRITERS)}); put the files there"
        )
    hub = hub_task(task)
    stage = root / f".fetch-{task.name}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        WRITERS[task.format](hub, stage)
        local = _moved(task, str(stage))
        for split in task.splits:  # the local reader against the Hub's, split by split
            if not _same(load_split(local, split), load_split(hub, split)):
                raise UsageError(
                    f"task '{task.name}': split {split} read back from {stage} differs from "
                    f"{task.hf_name}; nothing was moved into place"
                )
        folder = Path(task.path) if Path(task.path).is_absolute() else root / task.path
        written = sorted(p for p in stage.rglob("*") if p.is_file())
        for p in written:
            target = folder / p.relative_to(stage)
            target.parent.mkdir(parents=True, exist_ok=True)
            p.replace(target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return f"{task.name}: fetched {task.hf_name} into {folder} ({len(written)} files), verified"


def fetch(tasks: list[Task], root: Path, log=print) -> None:
    """Fetch every task of `tasks` (and the training task an IR task trains on) into `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for t in _with_training_tasks(tasks).values():
        log(fetch_task(t, root))
