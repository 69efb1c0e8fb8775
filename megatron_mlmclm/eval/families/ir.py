"""Retrieval: a SentenceTransformer (models.Transformer on the local folder + mean Pooling),
contrastive fine-tuning on (query, relevant document) pairs with in-batch negatives
(CachedMultipleNegativesRankingLoss), evaluated by cosine similarity.

The training pairs come from the task's own train qrels, or from another task's train split
(`train_task`: EncodEval trains on msmarco-pairs and evaluates MS MARCO, NQ and MLDR-en). Queries
and documents are the entry's `query_template` / `document_template` filled (EncodEval: "Query: "
and "Document: " prefixes) and encoded in the model's input form (eval/input_form.py): the
module's tokenizer is given that form, so sentence-transformers itself encodes them that way, also
in a saved folder.

`batches: no_duplicates` (default): a training batch never holds the same query or the same
positive twice (finetune.no_duplicate_batches): a query with two relevant documents, or a document
relevant to two queries, would otherwise make a relevant document one of the query's in-batch
negatives; `shuffled`: plain shuffled batches (sentence-transformers' default sampler, EncodEval).

The evaluated corpus (`corpus`): `full`, the whole corpus, as BEIR and MTEB rank it (the default;
the test split ranks it, on the final model; validation ranks the judged documents and
`validation_documents` others drawn once from the corpus, so a validation curve costs a bounded
number of encodings);
`judged`, the documents judged in the evaluated split's qrels (the mini-study's, where its small
models score near zero on the full corpus); `judged_eval`, those judged in the validation or the
test qrels (EncodEval: one corpus for both). Metrics: `ndcg@10` (trec_eval's), `ndcg@10_top10`
(EncodEval's, scikit-learn over the top 10 retrieved) and `recall@100`.

Formats: beir (corpus.jsonl[.gz], queries.jsonl[.gz], qrels/<split>.tsv: the BEIR distribution;
from the Hub, BeIR/<name> with its <name>-qrels), mldr (MLDR's JSON Lines of {query_id, query,
positive_passages: [{docid, text}]} per split and corpus.jsonl[.gz] of {docid, text}; negative
passages are not used) and pairs (a training set: a table of query / positive texts, as
msmarco-pairs).
"""

from __future__ import annotations

import inspect
import random
import time
from dataclasses import dataclass, field

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval import data, metrics
from megatron_mlmclm.eval.families.base import (
    Family,
    Inputs,
    Setup,
    check_template,
    fill,
    tokens_with,
)
from megatron_mlmclm.eval.splits import holdout, subsample
from megatron_mlmclm.hf_folder import NO_CODE

CORPUS = ("judged", "judged_eval", "full")
BATCHES = ("no_duplicates", "shuffled")


@dataclass
class Beir:
    corpus: dict[str, dict]  # doc id -> {"title", "text"}
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]] = field(default_factory=dict)


def query_text(task, text: str) -> str:
    return fill(task.query_template, text=text)


def document_text(task, doc: dict) -> str:
    if task.document_template is not None:
        return fill(task.document_template, title=doc.get("title", ""), text=doc["text"])
    title = (doc.get("title") or "").strip()
    return f"{title} {doc['text']}".strip() if title else doc["text"]


def _qrels_tsv(task, path) -> dict[str, dict[str, int]]:
    qrels: dict[str, dict[str, int]] = {}
    with data.open_text(path) as f:
        for i, line in enumerate(f):
            parts = line.rstrip("\r\n").split("\t")
            if i == 0 and not parts[-1].lstrip("-").isdigit():
                continue  # header
            if len(parts) >= 3:
                qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    return qrels


def _cached(task, key: str, make):
    """Corpus and queries are read once per Task object: the splits of one run (and of one
    preflight) share them. Kept on the object, outside its fields (not part of the protocol)."""
    cache = vars(task).setdefault("_cache", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def read_beir(task, split) -> Beir:
    folder = task.folder()

    def base():
        corpus_f = data.first_existing(folder, ("corpus.jsonl", "corpus.jsonl.gz"))
        queries_f = data.first_existing(folder, ("queries.jsonl", "queries.jsonl.gz"))
        if corpus_f is None or queries_f is None:
            raise UsageError(
                f"task '{task.name}': {folder} needs corpus.jsonl[.gz] and queries.jsonl[.gz]"
            )
        corpus = {
            str(r["_id"]): {"title": r.get("title") or "", "text": r.get("text", "")}
            for r in data.read_rows(task, [corpus_f], "jsonl")
        }
        return corpus, {
            str(r["_id"]): r["text"] for r in data.read_rows(task, [queries_f], "jsonl")
        }

    corpus, queries = _cached(task, "beir", base)
    qrels = _qrels_tsv(task, data.need(folder / "qrels" / f"{task.splits[split]}.tsv", task))
    return Beir(corpus=corpus, queries=queries, qrels=qrels)


def _mldr_split(task, rows: list[dict], corpus: dict) -> Beir:
    queries, qrels = {}, {}
    for r in rows:
        qid = str(r["query_id"])
        queries[qid] = r["query"]
        for p in r.get("positive_passages") or []:
            qrels.setdefault(qid, {})[str(p["docid"])] = 1
            corpus.setdefault(str(p["docid"]), {"title": "", "text": p.get("text", "")})
    return Beir(corpus=corpus, queries=queries, qrels=qrels)


def read_mldr(task, split) -> Beir:
    folder = task.folder()

    def base():
        f = data.first_existing(folder, ("corpus.jsonl", "corpus.jsonl.gz"))
        if f is None:
            raise UsageError(f"task '{task.name}': {folder} needs corpus.jsonl[.gz]")
        return {
            str(r["docid"]): {"title": "", "text": r["text"]}
            for r in data.read_rows(task, [f], "jsonl")
        }

    corpus = _cached(task, "mldr", base)
    rows = data.read_rows(task, data.files(task, task.splits[split]), "jsonl")
    return _mldr_split(task, rows, corpus)


def read_pairs(task, split) -> list[dict]:
    """A table of pairs, its format told by the file name (.parquet, .csv, .tsv, else JSON
    Lines)."""
    paths = data.files(task, task.splits[split])
    name = paths[0].name.removesuffix(".gz")
    fmt = next((f for f in ("parquet", "csv", "tsv") if name.endswith("." + f)), "jsonl")
    return _pair_records(task, data.read_rows(task, paths, fmt), paths[0])


def _pair_records(task, rows, where) -> list[dict]:
    cols = [task.query_field, task.positive_field]
    data.need_columns(task, rows, cols, where, " (set query_field / positive_field)")
    data.check_values(task, rows, cols, where)
    return [
        {"query": str(r[cols[0]]), "positive": {"title": "", "text": str(r[cols[1]])}} for r in rows
    ]


def hub_pairs(task, split):
    return _pair_records(task, data.hub_rows(task, split)[0], task.hf_name)


def hub_mldr(task, split):
    corpus = _cached(
        task,
        "mldr",
        lambda: {
            str(r["docid"]): {"title": "", "text": r["text"]}
            for r in data.hub_dataset(task, task.hf_name, "corpus", "corpus")
        },
    )
    rows = data.hub_dataset(task, task.hf_name, task.hf_config or "default", task.hub_split(split))
    return _mldr_split(task, list(rows), corpus)


def hub_beir(task, split):
    """BeIR/<name> (configs corpus and queries) with its qrels in BeIR/<name>-qrels."""

    def base():
        corpus = {
            str(r["_id"]): {"title": r.get("title") or "", "text": r["text"]}
            for r in data.hub_dataset(task, task.hf_name, "corpus", "corpus")
        }
        return corpus, {
            str(r["_id"]): r["text"]
            for r in data.hub_dataset(task, task.hf_name, "queries", "queries")
        }

    corpus, queries = _cached(task, "beir", base)
    qrels: dict[str, dict[str, int]] = {}
    for r in data.hub_dataset(task, f"{task.hf_name}-qrels", None, task.hub_split(split)):
        qrels.setdefault(str(r["query-id"]), {})[str(r["corpus-id"])] = int(r["score"])
    return Beir(corpus=corpus, queries=queries, qrels=qrels)


READERS = {"beir": read_beir, "mldr": read_mldr, "pairs": read_pairs}
HUB = {"beir": hub_beir, "mldr": hub_mldr, "pairs": hub_pairs}  # EncodEval's Hub datasets


def load_split(task, split, max_examples=None):
    """A Beir split (qrels carved by query id for `validation_holdout`; an evaluated split
    subsampled by query), or the pair records of a training set."""
    if split not in task.splits:
        raise UsageError(
            f"task '{task.name}' has no {split} split"
            + (" (a training set: evaluate a task that trains on it)" if task.train_only else "")
        )
    got = (HUB if task.reads_hub() else READERS)[task.format](task, split)
    if isinstance(got, list):  # pairs
        if not got:
            raise UsageError(f"task '{task.name}': split '{split}' has no pairs")
        return subsample(got, max_examples)
    got.qrels = dict(holdout(task, split, list(got.qrels.items()), key=lambda qd: qd[0]))
    if max_examples and split != "train":
        keep = subsample(sorted(got.qrels), max_examples)
        got.qrels = {q: got.qrels[q] for q in keep}
    n = len(pairs_of(task, got)) if split == "train" else len(got.qrels)
    if n == 0:
        raise UsageError(f"task '{task.name}': split '{split}' has no judged queries")
    return got


def pairs_of(task, split_data) -> list[tuple[str, str]]:
    """(query text, relevant document text), templated by `task`, for every positive judgement
    (or every pair of a training set)."""
    if isinstance(split_data, list):
        return [
            (query_text(task, r["query"]), document_text(task, r["positive"])) for r in split_data
        ]
    return [
        (query_text(task, split_data.queries[q]), document_text(task, split_data.corpus[d]))
        for q, docs in split_data.qrels.items()
        for d, s in docs.items()
        if s > 0 and q in split_data.queries and d in split_data.corpus
    ]


def training_pairs(task, max_examples) -> list[tuple[str, str]]:
    """The pairs `task` is fine-tuned on: its training task's train split, else its own."""
    source = vars(task).get("train_source") or task
    return subsample(pairs_of(source, load_split(source, "train")), max_examples)


def labels(task, train):
    return []


def layout(task) -> list[str]:
    """The files of the task's local format (beir, mldr; pairs: its split files)."""
    splits = list(dict.fromkeys(task.splits.values()))
    if task.format == "beir":
        return ["corpus.jsonl[.gz]", "queries.jsonl[.gz]", *(f"qrels/{s}.tsv" for s in splits)]
    if task.format == "mldr":
        return ["corpus.jsonl[.gz]", *splits]
    return splits


def check(task, where):
    if task.corpus not in CORPUS:
        raise UsageError(f"{where}: corpus must be one of {', '.join(CORPUS)}")
    if task.validation_documents < 0:
        raise UsageError(f"{where}: validation_documents must be >= 0")
    if task.batches not in BATCHES:
        raise UsageError(f"{where}: batches must be one of {', '.join(BATCHES)}")
    if task.format == "pairs" and set(task.splits) != {"train"}:
        raise UsageError(f"{where}: format pairs is a training set: give splits.train only")
    if "train" not in task.splits and task.train_task is None:
        raise UsageError(f"{where}: no train split: set train_task (the task whose pairs train it)")
    check_template(task.query_template, {"text"}, where, "query_template")
    check_template(task.document_template, {"title", "text"}, where, "document_template")


# -------------------------------------------------------------------------- model and metrics


def _st_imports():
    """(SentenceTransformer, Transformer, Pooling, CachedMNRL) from the ST 6 layout, else ST 5.
    Imported here: sentence-transformers is optional ([eval] extra), needed by IR tasks only."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.losses import (
            CachedMultipleNegativesRankingLoss,
        )
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import CachedMultipleNegativesRankingLoss
        from sentence_transformers.models import Pooling, Transformer
    return SentenceTransformer, Transformer, Pooling, CachedMultipleNegativesRankingLoss


def build_sentence_transformer(model_dir: str, max_length: int, device, form):
    """models.Transformer on the folder, its tokenizer in the run's input form (`form`, an
    eval.input_form.InputForm), and mean pooling."""
    from megatron_mlmclm.eval.heads import make_bidirectional
    from megatron_mlmclm.eval.input_form import apply_input_form

    SentenceTransformer, Transformer, Pooling, _ = _st_imports()

    # the folder's own code never runs (megatron_mlmclm/hf_folder.py); the loaders' keywords are
    # *_kwargs in sentence-transformers 6, *_args in 5
    names = ("model_kwargs", "processor_kwargs", "config_kwargs")
    if names[0] not in inspect.signature(Transformer.__init__).parameters:
        names = ("model_args", "tokenizer_args", "config_args")
    word = Transformer(model_dir, max_seq_length=max_length, **{n: dict(NO_CODE) for n in names})
    make_bidirectional(word.auto_model)
    apply_input_form(word.tokenizer, form)
    dim = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension
    pooling = Pooling(dim(), pooling_mode="mean")
    return SentenceTransformer(modules=[word, pooling], device=str(device))


def doc_ids_of(
    corpus_mode: str, split_data: Beir, evaluated: list[Beir], sample: int = 0
) -> list[str]:
    """The documents an evaluated split ranks. `full` with `sample` > 0: the split's judged
    documents and `sample` others of the corpus, drawn once (seed 0, the same for every run)."""
    if corpus_mode == "full":
        docs = sorted(split_data.corpus)
        if sample <= 0 or len(docs) <= sample:
            return docs
        judged = {d for q in split_data.qrels.values() for d in q if d in split_data.corpus}
        rest = [d for d in docs if d not in judged]
        if len(rest) <= sample:
            return docs
        return sorted(judged.union(random.Random(0).sample(rest, sample)))
    qrels = [split_data.qrels] if corpus_mode == "judged" else [e.qrels for e in evaluated]
    return sorted({d for q in qrels for docs in q.values() for d in docs if d in split_data.corpus})


# Documents encoded and scored at a time (their texts built, sorted by length, batched by tokens):
# the device holds the queries' embeddings and one chunk's, never the corpus's (MS MARCO's 8.8M
# passages at hidden size 1,728 would be 30 GB in bf16); the top k of each query is merged chunk
# by chunk on the host.
DOC_CHUNK = 65536


def embed(model, texts: list[str], max_tokens: int):
    """Unit-length embeddings of `texts`, in their order, in one tensor on the model's device (in
    the precision the model runs in: bf16 under autocast on GPU). Encoded longest first, in
    batches of at most `max_tokens` tokens with padding, so short texts share large batches."""
    import torch

    tok = model.tokenizer
    lengths = [
        len(x) for x in tok(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
    ]
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    out = None
    start = 0
    while start < len(order):
        idx = order[start : start + max(1, max_tokens // max(1, lengths[order[start]]))]
        emb = model.encode(
            [texts[i] for i in idx],
            batch_size=len(idx),
            convert_to_tensor=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        if out is None:
            out = emb.new_empty((len(texts), emb.shape[1]))
        out[torch.tensor(idx, device=out.device)] = emb
        start += len(idx)
    return out


def retrieve(model, task, split_data: Beir, doc_ids: list[str], max_tokens: int, k: int = 100):
    """{qid: {doc_id: cosine}} for the top-k documents of each judged query. The documents are
    encoded `DOC_CHUNK` at a time, each chunk scored against the queries before the next is
    encoded, so the device memory is bounded by one chunk whatever the corpus's size."""
    import torch

    qids = [q for q in split_data.qrels if q in split_data.queries]
    if not qids:
        return {}
    q_emb = embed(model, [query_text(task, split_data.queries[q]) for q in qids], max_tokens)
    k = min(k, len(doc_ids))
    values = torch.empty(len(qids), 0)
    indices = torch.empty(len(qids), 0, dtype=torch.long)
    for first in range(0, len(doc_ids), DOC_CHUNK):
        chunk = doc_ids[first : first + DOC_CHUNK]
        block = embed(
            model, [document_text(task, split_data.corpus[d]) for d in chunk], max_tokens
        ).T
        tops = [  # 256 queries at a time: a score block stays small
            torch.topk((q_emb[q : q + 256] @ block).float(), min(k, len(chunk)), dim=1)
            for q in range(0, len(qids), 256)
        ]
        del block  # before the next chunk is encoded
        v = torch.cat([values, torch.cat([t.values.cpu() for t in tops])], dim=1)
        i = torch.cat([indices, torch.cat([t.indices.cpu() for t in tops]) + first], dim=1)
        best = torch.topk(v, k, dim=1)
        values, indices = best.values, torch.gather(i, 1, best.indices)
    return {
        q: {doc_ids[j]: float(v) for v, j in zip(values[row].tolist(), indices[row].tolist())}
        for row, q in enumerate(qids)
    }


def prefix(template: str, slot: str = "text") -> str | None:
    """The template's text before `{slot}` when the template is that prefix and the slot alone."""
    marker = "{" + slot + "}"
    return (
        template[: -len(marker)] if template.endswith(marker) and template.count("{") == 1 else None
    )


def inputs(task, tokenizer, cfg, max_length) -> Inputs:
    """The training pairs; per evaluated split (validation, test; "curve", the curve's points, is
    validation) its data and the documents it ranks (`doc_ids_of`: under `corpus: full`,
    validation ranks the judged documents and `validation_documents` others, test the corpus)."""
    pairs = training_pairs(task, cfg.max_train_examples)
    data_ = {s: load_split(task, s, cfg.max_eval_examples) for s in ("validation", "test")}
    sample = {"validation": task.validation_documents, "test": 0}
    evals = {
        s: (d, doc_ids_of(task.corpus, d, list(data_.values()), sample[s]))
        for s, d in data_.items()
    }
    evals["curve"] = evals["validation"]
    source = vars(task).get("train_source") or task
    return Inputs(
        train=pairs,
        evals=evals,
        info={
            "max_length": max_length,
            "train_pairs": len(pairs),
            "train_task": source.name,
            "corpus": task.corpus,
            "batches": task.batches,
            "eval_queries": {s: len(d.qrels) for s, d in data_.items()},
            "eval_documents": {s: len(evals[s][1]) for s in data_},
            # documents encoded by each evaluation, in order (the curve's points, then test)
            "documents_encoded": {"validation": [], "test": []},
        },
    )


def setup(task, tokenizer, cfg, max_length, device) -> Setup:
    CachedMultipleNegativesRankingLoss = _st_imports()[3]
    data_ = inputs(task, tokenizer, cfg, max_length)
    pairs = data_.train
    model = build_sentence_transformer(cfg.model, max_length, device, tokenizer.input_form)
    loss_fn = CachedMultipleNegativesRankingLoss(model, mini_batch_size=cfg.ir_mini_batch_size)
    tokenize = getattr(model, "preprocess", None) or model.tokenize  # `tokenize` before ST 6

    def collate(items):
        return (tokenize([q for q, _ in items]), tokenize([d for _, d in items]))

    def loss(model_, batch):
        return loss_fn(list(batch), None)

    def evaluate(model_, split):
        split_data, docs = data_.evals[split]
        run = retrieve(model_, task, split_data, docs, cfg.eval_batch_size * max_length)
        data_.info["documents_encoded"]["test" if split == "test" else "validation"].append(
            len(docs)
        )
        return {
            "ndcg@10": metrics.ndcg_at_k(run, split_data.qrels, 10),
            "ndcg@10_top10": metrics.ndcg_at_k_retrieved(run, split_data.qrels, 10),
            "recall@100": metrics.recall_at_k(run, split_data.qrels, 100),
        }

    def save(folder: str) -> None:
        """A sentence-transformers folder (modules.json, the pooling config, the tokenizer in the
        run's input form); the templates, where they are prefixes, as its query/document
        prompts."""
        prompts = {
            "query": prefix(task.query_template),
            "document": prefix(task.document_template or "{text}"),
        }
        # the keys MTEB 2 reads (its PromptType: query, document); any other key it warns about
        model.prompts = {**model.prompts, **{k: v for k, v in prompts.items() if v}}
        model.save(folder)

    keys = [(f"q:{q}", f"d:{d}") for q, d in pairs] if task.batches == "no_duplicates" else None
    return Setup(
        model=model,
        train_items=pairs,
        collate=collate,
        loss=loss,
        evaluate=evaluate,
        batch_keys=keys,
        info=data_.info,
        save=save,
    )


def show(item, tokenizer, data_: Inputs) -> str:
    q, d = item
    qi, di = tokenizer(q)["input_ids"], tokenizer(d)["input_ids"]
    return (
        f"query: {tokens_with(tokenizer, qi, [None] * len(qi))}\n"
        f"    positive: {tokens_with(tokenizer, di, [None] * len(di))}"
    )


# the evaluation probe (eval/probe.py) encodes this many documents of a task's corpus (a seeded
# sample) and at most this many of its test queries
PROBE_DOCUMENTS = 4096
PROBE_QUERIES = 512


def probe(task, cfg, model, max_length: int, sync) -> dict:
    """Documents and queries encoded per second, as `retrieve` encodes them (longest first, in
    batches of `eval_batch_size` x `max_length` tokens), on a bounded sample: PROBE_DOCUMENTS
    documents of the test split's corpus and its first PROBE_QUERIES judged queries. `sync`
    waits for the device."""
    split = load_split(task, "test", PROBE_QUERIES)
    ids = sorted(split.corpus)
    ids = random.Random(0).sample(ids, min(PROBE_DOCUMENTS, len(ids)))
    queries = [query_text(task, split.queries[q]) for q in split.qrels if q in split.queries]
    out = {}
    for key, texts in (
        ("documents_per_s", [document_text(task, split.corpus[d]) for d in ids]),
        ("queries_per_s", queries),
    ):
        sync()
        t = time.perf_counter()
        embed(model, texts, cfg.eval_batch_size * max_length)
        sync()
        out[key] = len(texts) / (time.perf_counter() - t)
    return out


FAMILY = Family(
    name="ir",
    metrics=("ndcg@10", "ndcg@10_top10", "recall@100"),
    readers=READERS,
    load_split=load_split,
    labels=labels,
    check=check,
    inputs=inputs,
    setup=setup,
    show=show,
    layout=layout,
    probe=probe,
)
