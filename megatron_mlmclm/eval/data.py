"""Readers: one per file format, each returning plain Python records for its family.

- sc: [{"text_a", "text_b" (or None), "label": str, "id" (only when the source has an id column)}]
- tc: [{"tokens": [str], "tags": [str]}]
- qa: [{"id", "question", "context", "answers": {"text": [str], "answer_start": [int]}}]
- ir: Beir(corpus {doc_id: text}, queries {qid: text}, qrels {qid: {doc_id: score}})

Besides the formats of the shipped tasks (glue_tsv, glue_json, conll, squad, beir), any sc, tc or qa
table reads without code as ``csv``, ``tsv``, ``jsonl`` or ``parquet`` (`read_table`). Text files
are UTF-8 with or without a byte-order mark, optionally gzipped.

`load_split(task, split, max_examples)` is the one entry point. It raises UsageError for a missing
file, a missing column or an empty split, so `mlmclm evaluate` can check every task before the
first run starts. A `max_examples` subset is a fixed random sample (seed 0, original order kept), the
same for every run of the grid.

`validation_holdout` (any family) is applied here, in one place (`holdout`): the validation split is
the train examples whose key hashes below the fraction, and train loses them.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.tasks import Task


def subsample(records: list, n: int | None) -> list:
    if n is None or n <= 0 or len(records) <= n:
        return records
    keep = sorted(random.Random(0).sample(range(len(records)), n))
    return [records[i] for i in keep]


def _need(path: Path, task: Task) -> Path:
    if not path.is_file():
        raise UsageError(f"task '{task.name}': data file {path} not found "
                         f"(set MLMCLM_DATA_DIR or fix `path`/`splits` of the task)")
    return path


def _open_text(path: Path):
    # utf-8-sig: a byte-order mark (as Excel and some exporters write) is dropped, not read as text
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


# ---------------------------------------------------------------------------------------- sc

ID_COLUMNS = ("idx", "id", "guid")  # an SC example's id, when the source has one


def _sc_rows(task: Task, rows: list[dict], where: str, require_values: bool = False) -> list[dict]:
    if not rows:
        return rows
    cols = [task.text_a, task.label] + ([task.text_b] if task.text_b else [])
    for col in cols:
        if col not in rows[0]:
            raise UsageError(f"task '{task.name}': column '{col}' missing in {where} "
                             f"(columns: {', '.join(map(str, rows[0]))})")
    if require_values:
        _check_values(task, rows, cols, where)
    id_col = next((c for c in ID_COLUMNS if c in rows[0]), None)
    return [{"text_a": str(r[task.text_a]),
             "text_b": str(r[task.text_b]) if task.text_b else None,
             "label": str(r[task.label]),
             **({"id": str(r[id_col])} if id_col else {})} for r in rows]


def read_glue_tsv(task: Task, path: Path) -> list[dict]:
    with _open_text(_need(path, task)) as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return _sc_rows(task, rows, str(path))


def read_glue_json(task: Task, path: Path) -> list[dict]:
    """A JSON object {"0": {...}, "1": ...}, a JSON list of objects, or JSON Lines."""
    with _open_text(_need(path, task)) as f:
        text = f.read()
    try:
        doc = json.loads(text)
        rows = list(doc.values()) if isinstance(doc, dict) else list(doc)
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return _sc_rows(task, rows, str(path))


# ---------------------------------------------------------------------------------------- tc

def read_conll(task: Task, path: Path) -> list[dict]:
    sentences, tokens, tags = [], [], []
    with _open_text(_need(path, task)) as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts or parts[0] == "-DOCSTART-":
                if tokens:
                    sentences.append({"tokens": tokens, "tags": tags})
                tokens, tags = [], []
                continue
            try:
                tokens.append(parts[task.token_column])
                tags.append(parts[task.tag_column])
            except IndexError:
                raise UsageError(f"task '{task.name}': {path}:{lineno} has {len(parts)} columns; "
                                 f"token_column={task.token_column}, tag_column={task.tag_column}"
                                 ) from None
    if tokens:
        sentences.append({"tokens": tokens, "tags": tags})
    return sentences


# ---------------------------------------------------------------------------------------- qa

def read_squad(task: Task, path: Path) -> list[dict]:
    with _open_text(_need(path, task)) as f:
        doc = json.load(f)
    if "data" not in doc:
        raise UsageError(f"task '{task.name}': {path} is not SQuAD JSON (no 'data' key)")
    out = []
    for article in doc["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                answers = [] if qa.get("is_impossible") else qa.get("answers", [])
                out.append({"id": str(qa["id"]), "question": qa["question"], "context": para["context"],
                            "answers": {"text": [a["text"] for a in answers],
                                        "answer_start": [int(a["answer_start"]) for a in answers]}})
    return out


# ------------------------------------------------------------------------------------ tables
# csv / tsv (standard quoting: quoted fields may hold the delimiter, newlines and doubled quotes),
# jsonl (JSON Lines, or one JSON array of objects) and parquet, for sc, tc and qa. Read with the csv
# module, json and pyarrow (already a dependency) rather than the `datasets` builders: the same
# result whether or not `datasets` is installed, no cache folder, and no pandas type inference,
# which would turn text such as "NA" or "null" into missing values and labels such as "01" into 1.

TABLE_FORMATS = ("csv", "tsv", "jsonl", "parquet")


def read_table(task: Task, path: Path) -> list[dict]:
    """Rows (dicts) of a csv/tsv/jsonl/parquet file, converted to the records of the family."""
    _need(path, task)
    where = f"task '{task.name}': {path}"
    try:
        if task.format in ("csv", "tsv"):
            with _open_text(path) as f:
                reader = csv.DictReader(f, delimiter="," if task.format == "csv" else "\t")
                rows = list(reader)
        elif task.format == "jsonl":
            rows = _json_rows(path)
        else:
            rows = pq.read_table(path).to_pylist()
    except (csv.Error, ValueError, OSError, UnicodeDecodeError) as e:  # json/arrow errors too
        raise UsageError(f"{where} is not readable as {task.format}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if any(not isinstance(r, dict) for r in rows):
        raise UsageError(f"{where}: every row must be an object with named fields")
    if task.family == "sc":
        return _sc_rows(task, rows, str(path), require_values=True)
    return (_tc_rows if task.family == "tc" else _qa_rows)(task, rows, str(path))


def _json_rows(path: Path) -> list:
    with _open_text(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _check_values(task: Task, rows: list[dict], cols: list[str], where: str) -> None:
    """A short csv row (or a null) leaves a field empty: name the row instead of reading 'None'."""
    for i, r in enumerate(rows, 1):
        for c in cols:
            if r.get(c) is None:
                raise UsageError(f"task '{task.name}': row {i} of {where} has no value for "
                                 f"'{c}'")


def _as_list(value, what: str, where: str) -> list:
    """A list cell: a list (jsonl, parquet), or in csv/tsv a JSON list or whitespace-separated."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            try:
                return list(json.loads(value))
            except ValueError:
                raise UsageError(f"{where}: {what} {value[:40]!r} is not a JSON list") from None
        return value.split()
    raise UsageError(f"{where}: {what} must be a list, got {type(value).__name__}")


def _tc_rows(task: Task, rows: list[dict], where: str) -> list[dict]:
    cols = [task.tokens_field, task.tags_field]
    if rows and any(c not in rows[0] for c in cols):
        raise UsageError(f"task '{task.name}': fields '{cols[0]}' and '{cols[1]}' are needed in "
                         f"{where} (fields: {', '.join(map(str, rows[0]))}; set tokens_field / "
                         "tags_field)")
    _check_values(task, rows, cols, where)
    out = []
    for i, r in enumerate(rows, 1):
        at = f"task '{task.name}': row {i} of {where}"
        tokens = [str(t) for t in _as_list(r[cols[0]], "tokens", at)]
        tags = _as_list(r[cols[1]], "tags", at)
        if tags and all(isinstance(t, int) or (isinstance(t, str) and t.isdigit()) for t in tags) \
                and task.labels:  # tag ids (as Hugging Face exports them) -> names
            try:
                tags = [task.labels[int(t)] for t in tags]
            except IndexError:
                raise UsageError(f"{at}: tag id out of range of `labels`") from None
        if len(tokens) != len(tags):
            raise UsageError(f"{at}: {len(tokens)} tokens but {len(tags)} tags")
        out.append({"tokens": tokens, "tags": [str(t) for t in tags]})
    return out


def _qa_rows(task: Task, rows: list[dict], where: str) -> list[dict]:
    """SQuAD-style fields: id, question, context, answers {text: [...], answer_start: [...]} (in
    csv/tsv a JSON object, or the flattened columns answers.text / answers.answer_start)."""
    if rows and "answers" not in rows[0] and "answers.text" in rows[0]:
        rows = [{**r, "answers": {"text": r["answers.text"],
                                  "answer_start": r.get("answers.answer_start")}} for r in rows]
    cols = ["question", "context", "answers"]
    if rows and any(c not in rows[0] for c in cols):
        raise UsageError(f"task '{task.name}': {where} needs SQuAD-style fields id, question, "
                         f"context, answers (fields: {', '.join(map(str, rows[0]))})")
    _check_values(task, rows, cols, where)
    out = []
    for i, r in enumerate(rows, 1):
        at = f"task '{task.name}': row {i} of {where}"
        ans = r["answers"]
        if isinstance(ans, str):
            try:
                ans = json.loads(ans)
            except ValueError:
                raise UsageError(f"{at}: answers {ans[:40]!r} is not JSON") from None
        if not isinstance(ans, dict) or "text" not in ans or "answer_start" not in ans:
            raise UsageError(f"{at}: answers must hold 'text' and 'answer_start' lists")
        texts = [str(t) for t in _as_list(ans["text"], "answers.text", at)]
        starts = [int(x) for x in _as_list(ans["answer_start"], "answers.answer_start", at)]
        if len(texts) != len(starts):
            raise UsageError(f"{at}: {len(texts)} answer texts but {len(starts)} starts")
        out.append({"id": str(r["id"]) if r.get("id") is not None else str(i),
                    "question": str(r["question"]), "context": str(r["context"]),
                    "answers": {"text": texts, "answer_start": starts}})
    return out


# ---------------------------------------------------------------------------------------- ir

@dataclass
class Beir:
    corpus: dict[str, str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]] = field(default_factory=dict)

    def pairs(self) -> list[tuple[str, str]]:
        """(query text, relevant document text) for every positive judgement."""
        return [(self.queries[q], self.corpus[d]) for q, docs in self.qrels.items()
                for d, s in docs.items() if s > 0 and q in self.queries and d in self.corpus]


def _read_jsonl(path: Path) -> list[dict]:
    with _open_text(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _beir_file(folder: Path, stem: str) -> Path | None:
    for name in (f"{stem}.jsonl", f"{stem}.jsonl.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _beir_base(task: Task) -> tuple[dict, dict]:
    """(corpus, queries) of a BEIR task, read once per Task object: the splits of one run (and of
    one preflight) share them. Kept on the object, outside its fields (not part of the protocol)."""
    cached = vars(task).get("_beir_base")
    if cached is not None:
        return cached
    folder = task.folder()
    corpus_f, queries_f = _beir_file(folder, "corpus"), _beir_file(folder, "queries")
    if corpus_f is None or queries_f is None:
        raise UsageError(f"task '{task.name}': {folder} needs corpus.jsonl[.gz] and queries.jsonl")
    corpus = {}
    for r in _read_jsonl(corpus_f):
        title = (r.get("title") or "").strip()
        corpus[str(r["_id"])] = f"{title} {r.get('text', '')}".strip() if title else r.get("text", "")
    queries = {str(r["_id"]): r["text"] for r in _read_jsonl(queries_f)}
    task._beir_base = (corpus, queries)
    return task._beir_base


def read_beir(task: Task, split: str) -> Beir:
    corpus, queries = _beir_base(task)
    qrels_f = _need(task.folder() / "qrels" / f"{task.splits[split]}.tsv", task)
    qrels: dict[str, dict[str, int]] = {}
    with open(qrels_f, encoding="utf-8") as f:
        for i, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if i == 0 and not parts[-1].lstrip("-").isdigit():
                continue  # header
            if len(parts) < 3:
                continue
            qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    qrels = dict(holdout(task, split, list(qrels.items()), key=lambda qd: qd[0]))  # query id
    return Beir(corpus=corpus, queries=queries, qrels=qrels)


# ------------------------------------------------------------------------------------ holdout

def in_holdout(key: str, fraction: float) -> bool:
    """Stable: md5 of the key, so the same examples are held out on every machine and run."""
    h = int(hashlib.md5(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < fraction


def holdout_key(task: Task, record: dict) -> str:
    """The example's id where the source has one; else its input text, so exact duplicates land on
    the same side. QA uses the paragraph: every question on it stays on one side (the official
    SQuAD splits are by article), so validation contexts are unseen in training."""
    if task.family == "qa":
        return record["context"]
    if record.get("id") is not None:
        return str(record["id"])
    if task.family == "tc":
        return " ".join(record["tokens"])
    return record["text_a"] if record["text_b"] is None else f"{record['text_a']}\t{record['text_b']}"


def holdout(task: Task, split: str, items: list, key=None) -> list:
    """With `validation_holdout` F > 0 both train and validation read the train split: validation
    keeps the items whose key hashes below F, train keeps the rest. Other splits pass through."""
    frac = task.validation_holdout
    if frac <= 0 or split not in ("train", "validation"):
        return items
    key = key or (lambda r: holdout_key(task, r))
    want = split == "validation"
    return [x for x in items if in_holdout(key(x), frac) == want]


# ------------------------------------------------------------------------------------- hf hub

def _read_hf(task: Task, split: str) -> list[dict]:
    try:
        import datasets  # optional dependency: only tasks read from the hub need it
    except ImportError:
        raise UsageError(f"task '{task.name}' reads a Hugging Face dataset; "
                         f"pip install datasets (and be online)") from None
    try:
        ds = datasets.load_dataset(task.hf_name, task.hf_config, split=task.splits[split])
    except Exception as e:  # network, unknown name, unknown split
        raise UsageError(f"task '{task.name}': cannot load {task.hf_name} split "
                         f"{task.splits[split]}: {e}") from None
    rows = list(ds)
    if task.family == "sc":
        feat = ds.features.get(task.label)
        if hasattr(feat, "names"):
            rows = [{**r, task.label: feat.names[r[task.label]]} for r in rows]
        return _sc_rows(task, rows, f"{task.hf_name}:{split}")
    if task.family == "tc":
        feat = ds.features[task.tags_field].feature
        names = getattr(feat, "names", None)
        return [{"tokens": list(r[task.tokens_field]),
                 "tags": [names[t] if names else str(t) for t in r[task.tags_field]]} for r in rows]
    # qa: squad-style columns
    return [{"id": str(r["id"]), "question": r["question"], "context": r["context"],
             "answers": {"text": list(r["answers"]["text"]),
                         "answer_start": list(r["answers"]["answer_start"])}} for r in rows]


# ---------------------------------------------------------------------------------- dispatch

_READERS = {"glue_tsv": read_glue_tsv, "glue_json": read_glue_json, "conll": read_conll,
            "squad": read_squad, **{fmt: read_table for fmt in TABLE_FORMATS}}


def load_split(task: Task, split: str, max_examples: int | None = None):
    """Records of one split (see module docstring); UsageError when it is empty."""
    if task.format == "beir":
        data = read_beir(task, split)
        if max_examples and split != "train":
            keep = subsample(sorted(data.qrels), max_examples)
            data.qrels = {q: data.qrels[q] for q in keep}
        n = len(data.pairs()) if split == "train" else len(data.qrels)
        if n == 0:
            raise UsageError(f"task '{task.name}': split '{split}' has no judged queries")
        return data
    if task.format == "hf":
        records = _read_hf(task, split)
    else:
        records = _READERS[task.format](task, task.file(split))
    records = holdout(task, split, records)
    if not records:
        raise UsageError(f"task '{task.name}': split '{split}' ({task.splits[split]}) is empty")
    return subsample(records, max_examples)


def label_list(task: Task, train_records: list[dict]) -> list[str]:
    """Label vocabulary: the entry's `labels`, else sorted labels / tags seen in train."""
    if task.family == "sc":
        seen = sorted({r["label"] for r in train_records})
        if task.labels:
            extra = [x for x in seen if x not in task.labels]
            if extra:
                raise UsageError(f"task '{task.name}': train labels {extra} not in `labels`")
            return list(task.labels)
        return seen
    if task.family == "tc":
        tags = sorted({t for r in train_records for t in r["tags"]})
        # "O" first so that index 0 is the outside tag.
        return (["O"] if "O" in tags else []) + [t for t in tags if t != "O"]
    return []
