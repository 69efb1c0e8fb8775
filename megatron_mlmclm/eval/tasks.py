"""Task registry: small YAML entries describe each dataset, so a new dataset in a known format needs
no code.

Entries ship in `megatron_mlmclm/eval/tasks/*.yaml` (one file per family); more can be added with
`--task-file FILE.yaml` or $MLMCLM_EVAL_TASKS (paths separated by os.pathsep). A later entry with
the same name replaces an earlier one. The fields of an entry are those of `Task`; anything not
listed there is a UsageError, so a typo never silently falls back to a default. What a field may
hold for a family (formats, metrics, methods) is the family's to say (eval/families/).

Validation is never the reported test split: an entry whose validation and test name the same split
is refused unless `validation_holdout` carves validation out of it (eval/splits.py). An entry whose
splits name only `train` is a training set for other tasks (an IR task's `train_task`).

`protocols: {NAME: {...}}` overrides fields of the entry (and the run's `max_steps` / `epochs`)
under one evaluation protocol (eval/protocols.py); `suites: [NAME]` puts the task in a named suite
(`mlmclm evaluate --suite NAME`); `encodeval_name` is the dataset's name in EncodEval's results tree
(`mlmclm report --encodeval`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_mlmclm.config.loader import from_dict, parse_yaml
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.families import FAMILIES
from megatron_mlmclm.paths import data_dir

SPLITS = ("train", "validation", "test")
HOLDOUT_METHODS = ("hash", "permutation")


@dataclass
class RunOverrides:
    """The run settings a task may set under a protocol, typed as the fine-tuning run's
    (eval/finetune.py's FinetuneConfig)."""

    max_steps: int | None = None
    epochs: float | None = None


RUN_OVERRIDES = tuple(f.name for f in dataclasses.fields(RunOverrides))


@dataclass
class Task:
    name: str
    family: str
    format: str
    splits: dict[str, str]
    path: str | None = None  # folder under the data dir (or absolute); None for format hf
    # every family
    metric: str | None = None  # the main metric; None: the family's first
    validation_holdout: float = 0.0  # fraction carved out as the validation split (splits.py)
    holdout_method: str = "hash"  # hash | permutation
    holdout_seed: int = 42  # permutation only
    suites: list[str] = field(default_factory=list)
    encodeval_name: str | None = None
    protocols: dict[str, dict] = field(default_factory=dict)
    # sc
    text_a: str = "text_a"
    text_b: str | None = None
    label: str = "label"
    labels: list[str] | None = None
    template: str | None = None  # sc: {text_a} {text_b}; qa: {question} {context}
    # sc, qa: two texts in the tokenizer's pair form (tokenizer(a, b)), or joined by the template
    # into one text (joined: EncodEval's, which protocol encodeval sets)
    pairs: str = "tokenizer"
    # tc
    token_column: int = 0
    tag_column: int = -1
    comment_prefix: str | None = None  # conll: lines starting with it are skipped (CoNLL-U "#")
    tokens_field: str = "tokens"  # hf and tables (csv/tsv/jsonl/parquet)
    tags_field: str = "ner_tags"  # hf and tables; integer tags are mapped through `labels`
    label_subtokens: str = "first"  # first | all: which sub-tokens of a word carry its tag
    # qa
    version: int = 1
    qa_head: str = "span"  # span | tagging
    doc_stride: int = 128
    max_answer_tokens: int = 30
    null_threshold: float = 0.0
    # ir
    corpus: str = "full"  # full | judged | judged_eval (families/ir.py)
    # corpus full: validation ranks the judged documents and this many others (seeded; 0: all)
    validation_documents: int = 100_000
    train_task: str | None = None  # the task whose train split gives the training pairs
    query_template: str = "{text}"
    document_template: str | None = None  # {title} {text}; None: "{title} {text}" or "{text}"
    query_field: str = "query"  # format pairs
    positive_field: str = "positive"  # format pairs
    batches: str = "no_duplicates"  # no_duplicates | shuffled
    # the Hugging Face Hub: the whole task (format hf), or where the local folder is absent
    hf_name: str | None = None
    hf_config: str | None = None
    hf_splits: dict[str, str] | None = None  # split -> Hub split name; default: `splits`
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def metric_name(self) -> str:
        """The main metric (the report's score)."""
        return FAMILIES[self.family].metric(self)

    @property
    def train_only(self) -> bool:
        return set(self.splits) == {"train"}

    def folder(self) -> Path:
        if self.path is None:
            raise UsageError(f"task '{self.name}' has no path; set `path:` in its entry")
        p = Path(self.path)
        if not p.is_absolute():
            root = data_dir(required=self.hf_name is None)
            p = (root or Path("<no data folder>")) / p
        return p

    def reads_hub(self) -> bool:
        """From the Hub: format hf, or an `hf_name` while the local folder is absent."""
        return self.format == "hf" or (self.hf_name is not None and not self.folder().is_dir())

    def hub_split(self, split: str) -> str:
        return (self.hf_splits or self.splits)[split]

    def local_layout(self) -> str:
        """The local folder and the files read there, for messages."""
        return f"{self.folder()} ({', '.join(FAMILIES[self.family].local_files(self))})"

    def holdout_source(self) -> str:
        """The split that `validation_holdout` carves validation out of: train, or test for a
        task without one (trained on another task's pairs)."""
        return "train" if "train" in self.splits else "test"

    def to_dict(self) -> dict:
        """The entry (what a result's protocol id hashes); with its training task's entry."""
        d = dataclasses.asdict(self)
        source = vars(self).get("train_source")
        if source is not None:
            d["train_task_entry"] = source.to_dict()
        return d


FIELDS = tuple(f.name for f in dataclasses.fields(Task))


def _builtin_files() -> list[Path]:
    return sorted((Path(__file__).parent / "tasks").glob("*.yaml"))


# A task's name is a folder of the results (--out/MODEL/TASK/) and of a fetch's staging folder:
# a plain name, never a path part.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: str, where: str) -> str:
    """`name` as a task's name may be, else UsageError."""
    if not PLAIN_NAME.fullmatch(name) or ".." in name:
        raise UsageError(
            f"{where}: task name {name!r} must be a plain name (letters, digits, . _ -; no path "
            "parts, at most 128 characters)"
        )
    return name


def _parse(name: str, entry: Any, source: Path) -> Task:
    where = f"task '{name}' in {source}"
    check_name(name, f"task file {source}")
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: expected a mapping of fields")
    known = set(FIELDS) - {"name"}
    unknown = sorted(map(str, set(entry) - known))
    if unknown:
        raise UsageError(
            f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
        )
    protocols = entry.get("protocols") or {}
    if not isinstance(protocols, dict):
        raise UsageError(f"{where}: protocols must be a mapping of protocol names to fields")
    task = from_dict(Task, {"name": name, **entry}, prefix=f"{name}.")  # typed, as a run config
    check(task, where)
    for proto, over in protocols.items():
        if not isinstance(proto, str) or not isinstance(over, dict):
            raise UsageError(
                f"{where}: protocols.{proto} must name a protocol and map it to fields"
            )
        bad = sorted(map(str, set(over) - (known - {"family", "protocols"}) - set(RUN_OVERRIDES)))
        if bad:
            raise UsageError(f"{where}: protocols.{proto} sets unknown field(s) {', '.join(bad)}")
        # typed as the entry's own fields are: a protocol's reading (eval/protocols.py) takes them
        fields = {k: v for k, v in over.items() if k not in RUN_OVERRIDES}
        from_dict(Task, {"name": name, **entry, **fields}, prefix=f"{name}.protocols.{proto}.")
        run = {k: v for k, v in over.items() if k in RUN_OVERRIDES}
        from_dict(RunOverrides, run, prefix=f"{name}.protocols.{proto}.")
    return task


def check(task: Task, where: str) -> None:
    """Every rule an entry must follow (also applied to an entry resolved for a protocol)."""
    family = FAMILIES.get(task.family)
    if family is None:
        raise UsageError(f"{where}: family must be one of {', '.join(FAMILIES)}")
    if task.format not in (*family.formats, "hf"):
        raise UsageError(
            f"{where}: format for family {task.family} must be one of "
            f"{', '.join((*family.formats, 'hf'))}"
        )
    splits = task.splits or {}
    need = [s for s in SPLITS if s != "train" or task.train_task is None]
    missing = [s for s in need if s not in splits]
    if missing and set(splits) != {"train"}:
        raise UsageError(
            f"{where}: splits needs {', '.join(missing)} (or train alone, for a training set)"
        )
    if task.format == "hf" and not task.hf_name:
        raise UsageError(f"{where}: format hf needs hf_name")
    if task.format != "hf" and task.hf_name and set(task.hf_splits or ()) != set(splits):
        raise UsageError(
            f"{where}: hf_name (read where the local folder is absent) needs hf_splits, the "
            f"Hub dataset's split for each of {', '.join(splits)}"
        )
    if task.labels is not None:
        task.labels = [str(x) for x in task.labels]
    if task.metric is not None and task.metric not in family.metrics:
        raise UsageError(
            f"{where}: metric for family {task.family} must be one of {', '.join(family.metrics)}"
        )
    if task.holdout_method not in HOLDOUT_METHODS:
        raise UsageError(f"{where}: holdout_method must be one of {', '.join(HOLDOUT_METHODS)}")
    family.check(task, where)
    if not task.train_only:
        _check_splits(task, where)


def _check_splits(task: Task, where: str) -> None:
    """Choosing the LR on the split whose score is reported would overstate it: refuse."""
    sp = {k: os.path.normpath(str(v)) for k, v in task.splits.items()}
    if not 0 <= task.validation_holdout < 1:
        raise UsageError(f"{where}: validation_holdout must be in [0, 1)")
    if task.validation_holdout > 0:
        source = task.holdout_source()
        if sp["validation"] != sp[source]:
            raise UsageError(
                f"{where}: validation_holdout carves validation out of {source}; "
                f"set splits.validation to the {source} split "
                f"({task.splits[source]})"
            )
        if sp["test"] == sp.get("train"):
            raise UsageError(f"{where}: test is the train split; point test at a held-out split")
    elif sp["validation"] == sp["test"]:
        raise UsageError(
            f"{where}: validation and test are the same split "
            f"({task.splits['test']}), so the LR would be chosen on the reported "
            f"score; set `validation_holdout: 0.1` and splits.validation to the train "
            f"split, or give validation its own split"
        )


# Every fine-tuning run loads the registry (0.2 s of YAML); a grid worker runs many: each file is
# parsed once per process, again when its size or modification time changes.
_PARSED: dict[tuple, Any] = {}


def _task_file(f: Path):
    stat = f.stat()
    key = (str(f.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _PARSED:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read task file {f}: {e}") from None
        _PARSED[key] = parse_yaml(text, f"task file {f}") or {}
    return copy.deepcopy(_PARSED[key])  # the entries are parsed into tasks a run may change


def load_registry(extra_files: list[str] | None = None) -> dict[str, Task]:
    files = list(_builtin_files())
    env = os.environ.get("MLMCLM_EVAL_TASKS")
    if env:
        files += [Path(p) for p in env.split(os.pathsep) if p]
    files += [Path(p) for p in (extra_files or [])]
    registry: dict[str, Task] = {}
    sources: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            raise UsageError(f"task file {f} not found")
        doc = _task_file(f)
        if not isinstance(doc, dict):
            raise UsageError(f"task file {f}: expected `name: {{fields}}` entries")
        for name, entry in doc.items():
            registry[str(name)] = _parse(str(name), entry, f)
            sources[str(name)] = f
    for name, task in registry.items():  # an IR task trained on another task's pairs
        if task.train_task is None:
            continue
        source = registry.get(task.train_task)
        if source is None or source.family != task.family:
            raise UsageError(
                f"task '{name}' in {sources[name]}: train_task '{task.train_task}' "
                f"is not a {task.family} task of the registry"
            )
        task.train_source = source
    return registry


def get_task(name: str, extra_files: list[str] | None = None, registry: dict | None = None) -> Task:
    registry = registry if registry is not None else load_registry(extra_files)
    if name not in registry:
        raise UsageError(
            f"unknown task '{name}'; known tasks: {', '.join(sorted(registry))} "
            f"(add one with --task-file)"
        )
    return registry[name]


def suite(name: str, registry: dict[str, Task]) -> list[str]:
    """The tasks of a suite, family by family (sc, tc, qa, ir), in registry order within one."""
    order = list(FAMILIES)
    tasks = sorted(
        (n for n, t in registry.items() if name in t.suites),
        key=lambda n: order.index(registry[n].family),
    )
    if not tasks:
        known = sorted({s for t in registry.values() for s in t.suites})
        raise UsageError(f"unknown suite '{name}'; known suites: {', '.join(known) or 'none'}")
    return tasks
