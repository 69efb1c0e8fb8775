"""The datasets of a run: one per sample stream of the phase plan (config/phases.py), and the
validation datasets, one per sequence length a phase trains at."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_mlmclm.config import PhasePlan, RunConfig, Stream, resolved
from megatron_mlmclm.data.dataset import build_train_dataset, temperature_blend
from megatron_mlmclm.data.mock import MockPackedDataset
from megatron_mlmclm.data.tokenizer import TokenSpec
from megatron_mlmclm.runtime import distributed as rt


def build_datasets(cfg: RunConfig, spec: TokenSpec, plan: PhasePlan, sample_offset: int = 0):
    """([train dataset per stream of the phase plan], {seq_length: valid dataset} or None); rank 0
    builds the sample-index caches first.

    A stream's dataset holds every sample the run reads from it, shifted by `sample_offset` when a
    resume with checkpoint.allow_data_change continues the stream from consumed_samples.
    Validation reads data.valid at each seq_length a phase trains at.
    """
    gbs, d = cfg.train.global_batch_size, cfg.data
    n_valid = cfg.logging.eval_iters * gbs
    lengths = sorted({resolved(s.seq_length) for s in plan.streams})

    def train_items(stream: Stream) -> list[str]:
        if stream.temperature is not None:
            return temperature_blend(d.train, stream.temperature)
        return list(stream.data) if stream.data is not None else d.train

    share = cfg.runtime.limits.index_memory  # of the memory and disk an index may take

    def build():
        if d.mock:
            train = [
                MockPackedDataset(
                    max(s.samples + sample_offset, gbs),
                    resolved(s.seq_length),
                    spec.vocab_size,
                    d.seed,
                    kind=d.mock_kind,
                    doc_length=d.mock_doc_length,
                )
                for s in plan.streams
            ]
            return train, {
                n: MockPackedDataset(
                    n_valid,
                    n,
                    spec.vocab_size,
                    d.seed + 1,
                    kind=d.mock_kind,
                    doc_length=d.mock_doc_length,
                )
                for n in lengths
            }
        train = [
            build_train_dataset(
                train_items(s),
                resolved(s.seq_length),
                max(s.samples + sample_offset, gbs),
                d.seed,
                d.cache_dir,
                memory_share=share,
            )
            for s in plan.streams
        ]
        valid = (
            {
                n: build_train_dataset(d.valid, n, n_valid, d.seed, d.cache_dir, memory_share=share)
                for n in lengths
            }
            if d.valid
            else None
        )
        return train, valid

    if dist.is_initialized() and dist.get_world_size() > 1 and not d.mock:
        if rt.is_main():
            out = build()
        dist.barrier()
        if not rt.is_main():
            out = build()
        return out
    return build()


def index_summary(datasets) -> str:
    """The start's line on the training streams' sample indexes: how many came from the cache
    (data.cache_dir, default `cache/` beside the first prefix), how many were built."""
    indexes = [
        ds.index
        for stream in datasets
        for ds in getattr(stream, "datasets", [stream])
        if hasattr(ds, "index")
    ]
    if not indexes:
        return ""
    hits = sum(ix.from_cache for ix in indexes)
    where = sorted({str(Path(ix.cache_path).parent) for ix in indexes if ix.cache_path})
    cached = f" (cache {', '.join(where)})" if where else " (not cached: no writable cache folder)"
    built = len(indexes) - hits
    return f"sample indexes: {hits} of {len(indexes)} loaded from the cache, {built} built{cached}"
