"""Task registry: small YAML entries describe each dataset, so a new dataset in a known format needs
no code.

Entries ship in `megatron_mlmclm/eval/tasks/*.yaml` (one file per family); more can be added with
`--task-file FILE.yaml` or $MLMCLM_EVAL_TASKS (paths separated by os.pathsep). A later entry with the
same name replaces an earlier one. The fields of an entry are those of `Task`; anything not listed
there is a UsageError, so a typo never silently falls back to a default.

Validation is never the reported test split: an entry whose validation and test name the same split
is refused. Where a release has no labelled test split, the public dev split becomes `test` and
`validation_holdout: F` carves the validation split out of train (a stable hash, see
data.in_holdout; `splits.validation` then names the train split), removing it from training.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.paths import data_dir

FAMILIES = {"sc": "accuracy", "tc": "f1", "qa": "f1", "ir": "ndcg@10"}  # family -> main metric
TABLES = ("csv", "tsv", "jsonl", "parquet")  # any sc / tc / qa table (eval/data.py read_table)
FORMATS = {"sc": ("glue_tsv", "glue_json", "hf", *TABLES), "tc": ("conll", "hf", *TABLES),
           "qa": ("squad", "hf", *TABLES), "ir": ("beir",)}
SPLITS = ("train", "validation", "test")


@dataclass
class Task:
    name: str
    family: str
    format: str
    splits: dict[str, str]
    path: Optional[str] = None  # folder under the data dir (or absolute); None for format hf
    # sc
    text_a: str = "text_a"
    text_b: Optional[str] = None
    label: str = "label"
    labels: Optional[list[str]] = None
    # tc
    token_column: int = 0
    tag_column: int = -1
    tokens_field: str = "tokens"  # hf and tables (csv/tsv/jsonl/parquet)
    tags_field: str = "ner_tags"  # hf and tables; integer tags are mapped through `labels`
    # qa
    version: int = 1
    doc_stride: int = 128
    max_answer_tokens: int = 30
    null_threshold: float = 0.0
    # every family: fraction of train carved out (by a hash) as the validation split; 0 = none
    validation_holdout: float = 0.0
    # ir
    corpus: str = "judged"
    # hf datasets (online only)
    hf_name: Optional[str] = None
    hf_config: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def metric(self) -> str:
        return FAMILIES[self.family]

    def folder(self) -> Path:
        if self.path is None:
            raise UsageError(f"task '{self.name}' has no path; set `path:` in its entry")
        p = Path(self.path)
        if not p.is_absolute():
            root = data_dir(required=True)
            p = root / p
        return p

    def file(self, split: str) -> Path:
        return self.folder() / self.splits[split]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _builtin_files() -> list[Path]:
    return sorted((Path(__file__).parent / "tasks").glob("*.yaml"))


def _parse(name: str, entry: Any, source: Path) -> Task:
    if not isinstance(entry, dict):
        raise UsageError(f"task '{name}' in {source}: expected a mapping of fields")
    known = {f.name for f in dataclasses.fields(Task)} - {"name"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise UsageError(f"task '{name}' in {source}: unknown field(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(sorted(known))}")
    family = entry.get("family")
    if family not in FAMILIES:
        raise UsageError(f"task '{name}' in {source}: family must be one of {', '.join(FAMILIES)}")
    fmt = entry.get("format")
    if fmt not in FORMATS[family]:
        raise UsageError(f"task '{name}' in {source}: format for family {family} must be one of "
                         f"{', '.join(FORMATS[family])}")
    splits = entry.get("splits") or {}
    missing = [s for s in SPLITS if s not in splits]
    if missing:
        raise UsageError(f"task '{name}' in {source}: splits needs {', '.join(missing)}")
    if fmt == "hf" and not entry.get("hf_name"):
        raise UsageError(f"task '{name}' in {source}: format hf needs hf_name")
    task = Task(name=name, **entry)
    if task.labels is not None:
        task.labels = [str(x) for x in task.labels]
    if task.corpus not in ("judged", "full"):
        raise UsageError(f"task '{name}': corpus must be 'judged' or 'full'")
    _check_splits(task, source)
    return task


def _check_splits(task: Task, source: Path) -> None:
    """Choosing the LR on the split whose score is reported would overstate it: refuse."""
    sp = {k: os.path.normpath(str(v)) for k, v in task.splits.items()}
    where = f"task '{task.name}' in {source}"
    if not 0 <= task.validation_holdout < 1:
        raise UsageError(f"{where}: validation_holdout must be in [0, 1)")
    if task.validation_holdout > 0:
        if sp["validation"] != sp["train"]:
            raise UsageError(f"{where}: validation_holdout carves validation out of train; set "
                             f"splits.validation to the train split ({task.splits['train']})")
        if sp["test"] == sp["train"]:
            raise UsageError(f"{where}: test is the train split; point test at a held-out split")
    elif sp["validation"] == sp["test"]:
        raise UsageError(f"{where}: validation and test are the same split "
                         f"({task.splits['test']}), so the LR would be chosen on the reported "
                         f"score; set `validation_holdout: 0.1` and splits.validation to the train "
                         f"split, or give validation its own split")


def load_registry(extra_files: list[str] | None = None) -> dict[str, Task]:
    files = list(_builtin_files())
    env = os.environ.get("MLMCLM_EVAL_TASKS")
    if env:
        files += [Path(p) for p in env.split(os.pathsep) if p]
    files += [Path(p) for p in (extra_files or [])]
    registry: dict[str, Task] = {}
    for f in files:
        if not f.is_file():
            raise UsageError(f"task file {f} not found")
        try:
            doc = yaml.safe_load(f.read_text()) or {}
        except yaml.YAMLError as e:
            raise UsageError(f"task file {f} is not valid YAML: {e}") from None
        if not isinstance(doc, dict):
            raise UsageError(f"task file {f}: expected `name: {{fields}}` entries")
        for name, entry in doc.items():
            registry[str(name)] = _parse(str(name), entry, f)
    return registry


def get_task(name: str, extra_files: list[str] | None = None, registry: dict | None = None) -> Task:
    registry = registry if registry is not None else load_registry(extra_files)
    if name not in registry:
        raise UsageError(f"unknown task '{name}'; known tasks: {', '.join(sorted(registry))} "
                         f"(add one with --task-file)")
    return registry[name]
