"""Retrieval: a SentenceTransformer (models.Transformer on the local folder + mean Pooling),
contrastive fine-tuning on (query, relevant document) pairs with in-batch negatives
(CachedMultipleNegativesRankingLoss), evaluated with NDCG@10 and recall@100 by cosine similarity.
A training batch never holds the same query or the same positive twice (finetune.no_duplicate_batches):
a query with two relevant documents, or a document relevant to two queries, would otherwise make a
relevant document one of the query's in-batch negatives.

The evaluated corpus is either the documents judged in the split's qrels (`corpus: judged`, as in
the study) or the whole corpus (`corpus: full`).
"""

from __future__ import annotations

import torch

from megatron_mlmclm.eval import metrics
from megatron_mlmclm.eval.data import load_split, subsample
from megatron_mlmclm.eval.families import Setup
from megatron_mlmclm.eval.heads import make_bidirectional


def _st_imports():
    """(SentenceTransformer, Transformer, Pooling, CachedMNRL) from the ST 6 layout, else ST 5.
    Imported here: sentence-transformers is optional ([eval] extra), needed by IR tasks only."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import CachedMultipleNegativesRankingLoss
        from sentence_transformers.models import Pooling, Transformer
    return SentenceTransformer, Transformer, Pooling, CachedMultipleNegativesRankingLoss


def build_sentence_transformer(model_dir: str, max_length: int, device):
    SentenceTransformer, Transformer, Pooling, _ = _st_imports()

    word = Transformer(model_dir, max_seq_length=max_length)
    make_bidirectional(word.auto_model)
    dim = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension
    pooling = Pooling(dim(), pooling_mode="mean")
    return SentenceTransformer(modules=[word, pooling], device=str(device))


def retrieve(model, data, corpus_mode: str, batch_size: int, k: int = 100) -> dict:
    """{qid: {doc_id: cosine}} for the top-k documents of each judged query."""
    if corpus_mode == "judged":
        doc_ids = sorted({d for docs in data.qrels.values() for d in docs if d in data.corpus})
    else:
        doc_ids = sorted(data.corpus)
    qids = [q for q in data.qrels if q in data.queries]

    def embed(texts):
        return model.encode(texts, batch_size=batch_size, convert_to_tensor=True,
                            normalize_embeddings=True, show_progress_bar=False)

    q_emb, d_emb = embed([data.queries[q] for q in qids]), embed([data.corpus[d] for d in doc_ids])
    run = {}
    k = min(k, len(doc_ids))
    for start in range(0, len(qids), 256):
        scores = q_emb[start:start + 256] @ d_emb.T
        top = torch.topk(scores.float(), k, dim=1)
        for row, q in enumerate(qids[start:start + 256]):
            run[q] = {doc_ids[j]: float(v) for v, j in zip(top.values[row].tolist(),
                                                             top.indices[row].tolist())}
    return run


def setup(task, tokenizer, cfg, max_length, device):
    CachedMultipleNegativesRankingLoss = _st_imports()[3]

    train = load_split(task, "train")
    pairs = subsample(train.pairs(), cfg.max_train_examples)
    evals = {s: load_split(task, s, cfg.max_eval_examples) for s in ("validation", "test")}
    model = build_sentence_transformer(cfg.model, max_length, device)
    loss_fn = CachedMultipleNegativesRankingLoss(model, mini_batch_size=cfg.ir_mini_batch_size)

    tokenize = getattr(model, "preprocess", None) or model.tokenize  # `tokenize` before ST 6

    def collate(items):
        return (tokenize([q for q, _ in items]), tokenize([d for _, d in items]))

    def loss(model_, batch):
        return loss_fn(list(batch), None)

    def evaluate(model_, split):
        data = evals[split]
        run = retrieve(model_, data, task.corpus, cfg.eval_batch_size)
        return {"ndcg@10": metrics.ndcg_at_k(run, data.qrels, 10),
                "recall@100": metrics.recall_at_k(run, data.qrels, 100)}

    return Setup(model=model, train_items=pairs, collate=collate, loss=loss, evaluate=evaluate,
                 batch_keys=[(f"q:{q}", f"d:{d}") for q, d in pairs],
                 info={"max_length": max_length, "train_pairs": len(pairs), "corpus": task.corpus,
                       "eval_queries": {s: len(d.qrels) for s, d in evals.items()}})
