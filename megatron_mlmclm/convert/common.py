"""Shared plumbing of the converters: reading global tensors, the in-process TP1 model, output
folders.

Megatron's dist checkpoints store *global* tensors (layers stacked on dim 0 under one key, e.g.
``decoder.layers.self_attention.linear_qkv.weight`` of shape [L, qkv, h]), whatever TP/PP layout
wrote them. The exporter reads those directly with torch.distributed.checkpoint (no process groups),
so it never depends on the saved layout. The in-process model used for verification and import is
the trainer's EncoderLM built at TP1/PP1 on a gloo world of one.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException subclass
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_mlmclm.checkpoint import (
    load_checkpoint,
    read_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)
from megatron_mlmclm.checkpoint.reading import read_metadata, read_plain
from megatron_mlmclm.config import RunConfig, finalize_run_config, from_dict, to_dict
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.build import build_model_chunk, transformer_config
from megatron_mlmclm.model.kernels import Choice, plan_kernels
from megatron_mlmclm.paths import EXPORT_FILE, check_output_folder
from megatron_mlmclm.runtime.distributed import init_distributed, patch_megatron_core
from megatron_mlmclm.runtime.lifetime import checkpoint_helper_dies_with_us

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
SOURCE_FILE = "mlmclm_source.json"  # an import's record, beside its checkpoints folder


# --------------------------------------------------------------------------------------------------
# Checkpoints on disk


def resolve_source_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder, or a run's checkpoints folder, checked to be complete."""
    p = Path(path)
    if not p.exists():
        raise UsageError(
            f"checkpoint {p} does not exist; give a run's checkpoints folder or one "
            "iter_NNNNNNN folder"
        )
    ckpt = resolve_checkpoint(p)
    for name in ("metadata.json", "common.pt"):
        if not (ckpt / name).is_file():
            raise UsageError(
                f"checkpoint {ckpt} is incomplete (no {name}); use a complete iter_NNNNNNN folder"
            )
    if not any(ckpt.glob("*.distcp")):
        raise UsageError(f"checkpoint {ckpt} is incomplete (no .distcp shard files)")
    return ckpt


def read_common(ckpt: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint (common.pt), one clear line if unreadable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            common = read_trainer_state(ckpt)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(
            f"cannot read {ckpt / 'common.pt'}: {type(e).__name__}: {_first_line(e)}"
        ) from None
    if "config" not in common["trainer"]:
        raise UsageError(
            f"{ckpt} has no run config in its trainer state; it was not written by "
            "mlmclm pretrain or convert"
        )
    return common["trainer"]


def read_global_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a dist checkpoint as a global float32 tensor (any TP/PP layout), read
    as data (checkpoint/reading.py: a file that names anything else is refused)."""
    try:
        meta = read_metadata(ckpt)
        state = {
            k: torch.empty(v.size, dtype=v.properties.dtype)
            for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
            and not k.startswith("optimizer.")
            and "_extra_state" not in k
            and not k.startswith("rng_state")
        }
        read_plain(ckpt, state)
    except UsageError:
        raise
    except (Exception, CheckpointException) as e:  # truncated/missing shards, bad metadata
        raise UsageError(
            f"cannot read checkpoint {ckpt} (partial or corrupt?): "
            f"{type(e).__name__}: {_first_line(e)}"
        ) from None
    out = {k: v.float() for k, v in state.items()}
    for k, v in out.items():
        if not torch.isfinite(v).all():
            raise UsageError(
                f"checkpoint {ckpt} holds non-finite values in {k}; refusing to export"
            )
    return out


def saved_dtype(ckpt: Path, key: str = "embedding.word_embeddings.weight") -> torch.dtype:
    """The dtype a checkpoint stores its weights in (its embedding's), from its metadata."""
    dtype = stored_dtypes(ckpt).get(key)
    if dtype is None:
        raise UsageError(f"checkpoint {ckpt} has no tensor {key}; it is not a model checkpoint")
    return dtype


def stored_dtypes(ckpt: Path) -> dict[str, torch.dtype]:
    """The dtype each tensor of a checkpoint is stored in, by its key, from its metadata."""
    try:
        entries = read_metadata(ckpt).state_dict_metadata
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(
            f"cannot read checkpoint {ckpt} (partial or corrupt?): "
            f"{type(e).__name__}: {_first_line(e)}"
        ) from None
    return {
        k: v.properties.dtype for k, v in entries.items() if isinstance(v, TensorStorageMetadata)
    }


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


# --------------------------------------------------------------------------------------------------
# Run configs


def run_config_from_dict(raw: dict[str, Any], mock: bool = True):
    """RunConfig from a trainer-state dict, for an in-process TP1/PP1 model that computes in
    float32 (its weights are held in the dtype they are stored in: `build_encoder`)."""
    raw = copy.deepcopy(raw)
    raw["parallel"] = {}
    # Saved configs hold resolved steps next to the budget they came from (shares, tokens,
    # FLOPs): keep the steps only, and no per-phase data (the model is built on mock data).
    for ph in raw.get("phases") or []:
        if isinstance(ph, dict) and ph.get("steps") is not None:
            ph.update(share=None, tokens=None, flops=None, data=None)
    raw.setdefault("train", {}).update(
        precision="fp32", fp8=None, recompute=None, tokens=None, flops=None
    )
    raw.setdefault("data", {})["mock"] = mock
    if mock:  # only the model is needed: the run's shards would contradict mock data
        raw["data"].update(train=[], valid=[])
    raw.setdefault("checkpoint", {})["dir"] = None
    cfg = from_dict(RunConfig, raw, prefix="")
    return finalize_run_config(cfg)


# --------------------------------------------------------------------------------------------------
# The in-process model


def init_single_process(seed: int = 1234) -> None:
    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if (tp, pp) != (1, 1):
            raise UsageError(
                f"convert runs at TP1/PP1 in one process, but this process already "
                f"has TP{tp}/PP{pp}; run it without torchrun"
            )
    init_distributed(1, 1, None, seed)


def build_encoder(
    cfg,
    vocab_size: int,
    seed: int = 1234,
    dtype: torch.dtype = torch.float32,
    stored: Mapping[str, torch.dtype] | None = None,
):
    """The trainer's EncoderLM at TP1/PP1 on the CPU with the CPU's kernel plan (eager, SDPA),
    eval mode, on any machine, its weights held in `dtype` (or, where `stored` names a weight's
    dist-checkpoint key, the dtype stored there) and uninitialised: a load or a fill follows.
    Its arithmetic is float32 whatever the weights are held in (verify.megatron_logits), so that
    conversions and their verification run the arithmetic the CPU suite tests. On a GPU machine
    the machine's own plan would run the model in bf16 and compile its stack, and megatron-core
    would put its linear layers on the GPU and leave the norms on the CPU (the trainer moves its
    chunks; conversion has no use for the GPU). The layers run one by one, not as the plan's
    single stack: the verification casts each layer's weights to float32 as it runs."""
    cfg = copy.deepcopy(cfg)
    cfg.train.precision, cfg.runtime.device, cfg.model.compile = "fp32", "cpu", "off"
    init_single_process(seed)
    plan = replace(
        plan_kernels(cfg, "cpu"),
        plain_stack=Choice(False, "conversion: layer by layer, each in float32 as it runs"),
    )
    config = transformer_config(cfg, plan)
    # Every weight is loaded or filled after: no initialisation (each would hold a whole
    # parameter, the embedding, in memory beside the model while it is drawn)
    config.perform_initialization = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model_chunk(cfg, config, vocab_size, True, True, plan=plan, initialize=False)
    model = model.to("cpu").eval()
    hold_weights(model, dtype, stored or {})
    return model


def hold_weights(model, dtype: torch.dtype, stored: Mapping[str, torch.dtype]) -> None:
    """Each weight of a model given fresh memory, uninitialised and untouched (what it held is
    freed), in `dtype`, or the dtype `stored` names for its dist-checkpoint key."""
    keys = {name: key for name, (key, _) in _local_to_global(model).items()}
    for name, p in model.named_parameters():
        p.data = torch.empty(p.shape, dtype=stored.get(keys.get(name, ""), dtype))


def drop_weights(model) -> None:
    """Free a model's weights in place (each parameter emptied: the layers' cached references to
    their parameters would keep copies that `.to("meta")` makes alive), then the memory."""
    for p in model.parameters():
        p.data = torch.empty(0, dtype=p.dtype)
    release_free_memory()


def release_free_memory() -> None:
    """Free what only reference cycles still hold (megatron's sharded state dicts hold views of
    the weights in cycles) and hand the memory freed so far back to the system (glibc's
    malloc_trim; elsewhere nothing): a conversion frees tensors of every size as it streams, and
    the allocator keeps the smaller ones' pages, which would count in the peak of the next step."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


M_MMAP_THRESHOLD, MAPPED_FROM = -3, 1 << 20  # glibc's mallopt parameter; 1 MB


def map_large_allocations() -> None:
    """For a process whose work is one conversion (`mlmclm convert`): glibc maps every allocation
    of `MAPPED_FROM` bytes or more on its own, so that a tensor freed is handed back to the system
    at once. By default glibc raises that bound (up to 32 MB) as the process frees large blocks
    and keeps the blocks below it in its heap, where the tensors a conversion streams through
    leave freed pages that count in the peak of the next step. Elsewhere than glibc: nothing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)
    except (OSError, AttributeError):
        pass


def _local_to_global(model) -> dict[str, tuple[str, int | None]]:
    """state_dict name -> (dist-checkpoint key, layer index or None) of a TP1/PP1 model."""
    out = {}
    for name, sh in model.sharded_state_dict().items():
        key = getattr(sh, "key", None)
        if key is None or name.endswith("_extra_state") or not hasattr(sh, "data"):
            continue
        m = _LAYER.match(name)
        out[name] = (key, int(m.group(1)) if m else None)
    return out


def model_tensors(model) -> dict[tuple[str, int | None], torch.Tensor]:
    """(dist-checkpoint key, layer or None) -> the model's own tensor (no copy) of a TP1/PP1
    model: what a conversion reads from or writes into, one layer at a time."""
    state = model.state_dict(keep_vars=True)
    return {where: state[name].data for name, where in _local_to_global(model).items()}


def fill_model(model, items, what: str = "weights", short_rows=frozenset()) -> None:
    """Copy (key, layer, tensor) items into a TP1/PP1 model, one at a time (cast to its dtype);
    every model tensor must be given once, with its shape, and nothing else (one line otherwise).
    A tensor of a key in `short_rows` may have fewer rows: the model's others are zeroed (megatron's
    vocabulary padding)."""
    targets = model_tensors(model)
    seen = set()
    for key, layer, t in items:
        where = (key, layer)
        if where not in targets or where in seen:
            raise UsageError(f"{what} do not match the model: unexpected {key} (layer {layer})")
        dst = targets[where]
        rows = t.shape[0] if key in short_rows and t.dim() == dst.dim() else dst.shape[0]
        if tuple(t.shape) != (rows, *dst.shape[1:]) or rows > dst.shape[0]:
            raise UsageError(
                f"weight {key} has shape {tuple(t.shape)}, the model expects {tuple(dst.shape)}"
            )
        with torch.no_grad():
            dst[:rows].copy_(t)
            dst[rows:].zero_()
        seen.add(where)
    missing = sorted({k for k, _ in targets.keys() - seen})
    if missing:
        raise UsageError(f"{what} do not match the model: missing {missing[:3]}")


class _Part:
    """Some of a model's weights, as `load_checkpoint` sees a model chunk: those whose names
    `mine` accepts (whole dist-checkpoint keys: megatron reads a key's layers together)."""

    def __init__(self, model, mine):
        self.model, self._mine = model, mine

    def sharded_state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.model.sharded_state_dict().items() if self._mine(k)}

    def load_state_dict(self, state, strict: bool = False):
        result = self.model.load_state_dict(state, strict=False)
        return [k for k in result.missing_keys if self._mine(k)], result.unexpected_keys


def _read_order(name: str) -> int:
    """When `load_into` reads a weight: what a read holds twice while it copies it into the model
    first, while the other weights' memory is still untouched (build_encoder leaves it
    uninitialised), so that it costs no more than the rest of the model would: 0, megatron's
    gated MLP input (`linear_fc1`, read as its two halves and joined); 1, the weights outside the
    layers (the embedding, the largest tensor, which the storage reader holds as bytes and as a
    tensor); 2, the rest."""
    if name.endswith("mlp.linear_fc1.weight"):
        return 0
    return 2 if name.startswith("decoder.layers.") else 1


def load_into(model, ckpt: Path) -> None:
    """Load `ckpt` into a TP1 model with the trainer's load_checkpoint (any saved layout), in
    three reads (`_read_order`), so that the peak memory stays near the model's. A weight the
    checkpoint lacks is refused by load_checkpoint."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for group in range(3):
            part = _Part(model, lambda name, group=group: _read_order(name) == group)
            load_checkpoint(Path(ckpt), [part], optimizer=None, scheduler=None, load_rng=False)


def reload_from_disk(model, ckpt: Path) -> None:
    """Load `ckpt` back into the model that was saved there, each weight in the dtype it was
    held in: its weights first replaced by fresh memory, so that what the logits read comes from
    disk. The old are freed and handed back first: fresh memory that reused their pages would
    count as resident before the load touches it (`load_into` relies on the untouched part)."""
    shapes = [(p, p.shape) for p in model.parameters()]
    drop_weights(model)
    for p, shape in shapes:
        p.data = torch.empty(shape, dtype=p.dtype)
    load_into(model, ckpt)


def model_global_tensors(model) -> dict[str, torch.Tensor]:
    """Global tensors (dist-checkpoint keys, layers stacked) of a TP1/PP1 model."""
    state = model.state_dict()
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, (key, layer) in _local_to_global(model).items():
        t = state[name].detach().float().cpu()
        if layer is None:
            out[key] = t.clone()
        else:
            stacked.setdefault(key, {})[layer] = t
    for key, layers in stacked.items():
        out[key] = torch.stack([layers[i] for i in range(len(layers))])
    return out


def load_global_tensors(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy global tensors into a TP1/PP1 model; every model tensor must be given, no extras."""
    mapping = _local_to_global(model)
    wanted = {key for key, _ in mapping.values()}
    missing, extra = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing or extra:
        raise UsageError(
            f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    state = model.state_dict()
    new = {}
    for name, (key, layer) in mapping.items():
        src = tensors[key] if layer is None else tensors[key][layer]
        if tuple(src.shape) != tuple(state[name].shape):
            raise UsageError(
                f"weight {key} has shape {tuple(src.shape)}, the model expects "
                f"{tuple(state[name].shape)}"
            )
        new[name] = src.to(dtype=state[name].dtype, device=state[name].device)
    model.load_state_dict(new, strict=False)


# --------------------------------------------------------------------------------------------------
# Output folders: written under a temporary name, renamed when complete and verified


# What each kind of conversion writes: (its command, the record in every output folder it writes)
OUTPUTS = {
    "export": ("convert to-hf", EXPORT_FILE),
    "import": ("convert from-hf / from-megatron-lm", SOURCE_FILE),
}


def check_output(out: Path, force: bool, kind: str, inputs: Sequence = ()) -> None:
    """`out` new, or with `force` empty or an earlier output of the same `kind` of conversion (it
    holds that kind's record, OUTPUTS), none of the `inputs` and holding none of them, and no
    training run's folder (paths.py)."""
    command, marker = OUTPUTS[kind]
    check_output_folder(out, force=force, command=command, marker=marker, inputs=inputs)
    if out.exists() and not force:  # even an empty one: a conversion's OUT is a new folder
        raise UsageError(f"output {out} exists; choose another path or pass --force to replace it")


@contextlib.contextmanager
def staged_output(out: Path, force: bool, kind: str, inputs: Sequence = ()) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `out` (atomically renamed)."""
    check_output(out, force, kind, inputs)
    patch_megatron_core()  # every conversion builds megatron's model: refused before it writes
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def continued_mlm_config(out: Path, fields: dict[str, Any], seed: int) -> tuple[dict, RunConfig]:
    """The run config an import writes beside its checkpoint: MLM 40% from `out`'s weights.

    Returns the raw dict (written as config.yaml) and the validated RunConfig.
    """
    raw = {
        "name": out.name,
        "output_dir": str(out.parent / f"{out.name}-mlm"),
        "model": fields,
        "phases": [{"objective": "mlm", "mask_ratio": 0.4}],
        "data": {"tokenizer": str(out / "tokenizer"), "train": []},
        "train": {"init_from": str(out / "checkpoints"), "seed": seed},
    }
    cfg = from_dict(RunConfig, json.loads(json.dumps(raw)), prefix="")  # plain lists/floats
    cfg.data.mock = True  # validation only: the checkpoint config has no data yet
    finalize_run_config(cfg)
    cfg.data.mock = False
    return raw, cfg


def save_imported_checkpoint(
    ckpt_dir: Path,
    cfg: RunConfig,
    tensors: dict[str, torch.Tensor],
    source: dict[str, Any],
    vocab: int,
    seed: int,
    tokenizer: dict[str, Any],
):
    """Build our model for `cfg`, load the converted global `tensors` (one line if their keys are
    not our trunk's) and save it as step 0 (`save_imported`).

    Returns (the single-process config the model was built with, the checkpoint path).
    """
    build_cfg, model = build_imported(cfg, vocab, seed)
    load_global_tensors(model, tensors)
    return build_cfg, save_imported(ckpt_dir, model, cfg, source, tokenizer)


def build_imported(cfg: RunConfig, vocab: int, seed: int, dtype: torch.dtype = torch.float32):
    """(the single-process config, our model built for it, its weights held in `dtype`, the
    dtype the checkpoint will store): what an importer fills."""
    checkpoint_helper_dies_with_us()  # the writer's Manager, forked before the model exists
    build_cfg = run_config_from_dict(to_dict(cfg))
    return build_cfg, build_encoder(build_cfg, vocab, seed, dtype)


class _GivenToTheWriter:
    """The model as the checkpoint writer sees it when a conversion gives its weights up to it:
    megatron's sharded state dict with its factories applied (the gated MLP's input weight split
    into its gate and up halves, views of the parameter), each such view copied out and its
    parameter's memory freed at once, the parameter's shape kept (`reload_from_disk` allocates it
    anew). megatron-core's writer copies every view of a larger tensor before it writes
    (FileSystemWriterAsync.prepare_write_data): handed the views, it would hold a second copy of
    the gated MLP's weights, 41% of a Llama-shaped model, for the whole save."""

    def __init__(self, model):
        self.model = model

    def sharded_state_dict(self) -> dict[str, Any]:
        state = self.model.sharded_state_dict()
        apply_factories(state)
        views: dict[int, list[ShardedTensor]] = {}
        for t in nested_values(state):
            if isinstance(t, ShardedTensor) and isinstance(t.data, torch.Tensor):
                storage = t.data.untyped_storage()
                if storage.nbytes() > t.data.numel() * t.data.element_size():
                    views.setdefault(storage.data_ptr(), []).append(t)
        params = {p.untyped_storage().data_ptr(): p for p in self.model.parameters()}
        for ptr, tensors in views.items():
            for t in tensors:
                t.data = t.data.clone()
            param = params.get(ptr)
            if param is not None:  # nothing refers to its memory any more: given back
                param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)
        return state


def save_imported(
    ckpt_dir: Path, model, cfg: RunConfig, source: dict[str, Any], tokenizer: dict[str, Any]
) -> Path:
    """Save an imported model as step 0 with the import's provenance and the fingerprint of its
    tokenizer (data/tokenizer.py: what continued runs and exports are checked against). The
    model's weights are given up to the writer (`_GivenToTheWriter`): after the save, read them
    back from the checkpoint (`reload_from_disk`) before using the model again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return save_checkpoint(
            ckpt_dir,
            0,
            [_GivenToTheWriter(model)],
            None,
            None,
            {
                "config": to_dict(cfg),
                "source": source,
                "tokenizer": tokenizer,
                "consumed_samples": 0,
            },
            keep_last=1,
        )
