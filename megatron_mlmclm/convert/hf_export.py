"""megatron checkpoint (any TP/PP layout) -> Hugging Face folder, verified before it is kept.

`to_hf(CKPT, OUT)` loads the checkpoint into the trainer's EncoderLM at TP1 (as the trainer loads
it: any saved layout), maps its tensors with the family table of `mapping.py` one at a time into
``model.safetensors`` (in the checkpoint's dtype, or `dtype`), writes ``config.json``, the
tokenizer (with its mask token, and the pretraining document rule of the run's shards saved in it:
BOS and EOS as the shards had them, special-token strings as text; document.py), ``README.md``
(model_card.py) and the export record into a temporary sibling of OUT, then runs that folder with
plain transformers (no remote code; its weights read a module at a time) and compares its logits
with the EncoderLM's, both in float32. Only then is the folder renamed to OUT. It holds one copy of
the model, in the dtype the checkpoint stores it in (or the export's, where that is narrower).

Architectures (``arch``):
  eurobert  EuroBertForMaskedLM (native in transformers 5): AutoModel, AutoModelForMaskedLM,
            AutoModelForSequenceClassification and AutoModelForTokenClassification all load it;
            attention is bidirectional.
  llama     LlamaConfig with ``is_causal: false`` (bidirectional), LlamaForCausalLM weights
            (the lm_head gives MLM logits); for weights that came from a Llama-family model.
  qwen3     Qwen3Config with ``is_causal: false``; needs qk-norm.
The default is the family recorded when the weights were imported (``convert from-hf``), followed
through ``train.init_from`` of continued runs, else eurobert (qwen3 when the model has qk-norm).
``causal_lm=True`` writes a causal LlamaForCausalLM (Qwen3ForCausalLM with qk-norm) for generation.

The tokenizer is the run's (``data.tokenizer``); one given with ``--tokenizer`` must be the one the
checkpoint recorded (data/tokenizer.py `tokenizer_fingerprint`: vocabulary, size, special ids).
The export's record (``mlmclm_export.json``) carries the run's ``shards``: the tokenizer and the
rule its pretraining documents were written by (data/shards.py: ``append_eod``, ``bos``,
``special_tokens_as_text``), by which evaluation encodes fine-tuning inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import torch
import transformers

from megatron_mlmclm.checkpoint import (
    checkpoint_iteration,
    complete_checkpoints,
    resolve_checkpoint,
)
from megatron_mlmclm.config import final_model, tokens_at_step
from megatron_mlmclm.convert import common, mapping
from megatron_mlmclm.convert.hf_files import write_safetensors
from megatron_mlmclm.convert.model_card import write_model_card
from megatron_mlmclm.convert.verify import (
    SEQ,
    Verification,
    compare,
    megatron_from_checkpoint,
    megatron_logits,
    streamed_hf_logits,
    verification_tokens,
)
from megatron_mlmclm.data.tokenizer import (
    TOKENIZER_KEYS,
    describe_tokenizer,
    load_tokenizer,
    same_tokenizer,
    special_token_ids,
    token_spec_and_vocab,
    tokenizer_fingerprint,
)
from megatron_mlmclm.document import document_tokenizer, shards_rule
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.build import padded_vocab_size
from megatron_mlmclm.paths import EXPORT_FILE

ARCHS = ("eurobert", "llama", "qwen3")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class ExportResult:
    path: Path
    arch: str
    causal_lm: bool
    vocab_size: int
    checkpoint: Path
    verification: Verification


def find_source(ckpt: Path, trainer: dict[str, Any], hops: int = 8) -> dict[str, Any] | None:
    """The HF source record of a checkpoint: its own, else that of its train.init_from chain."""
    seen = set()
    for _ in range(hops):
        if trainer.get("source"):
            return trainer["source"]
        for sidecar in (ckpt.parent.parent / common.SOURCE_FILE, ckpt.parent / common.SOURCE_FILE):
            if sidecar.is_file():
                return json.loads(sidecar.read_text())
        init = (trainer.get("config") or {}).get("train", {}).get("init_from")
        if not init or init in seen:
            return None
        seen.add(init)
        try:
            ckpt = resolve_checkpoint(init, verify=False)  # provenance only
            trainer = common.read_common(ckpt)
        except (UsageError, OSError):
            return None
    return None


def resolve_arch(
    arch: str | None, causal_lm: bool, qk_norm: bool, source: dict[str, Any] | None
) -> str:
    if arch is None:
        family = (source or {}).get("family")
        arch = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3"}.get(family)
        if arch == "qwen3" and not qk_norm:  # a Qwen3 without its qk-norm: the Llama classes
            arch = "llama"
        if arch is None:
            arch = "qwen3" if qk_norm else ("llama" if causal_lm else "eurobert")
    if arch not in ARCHS:
        raise UsageError(f"--arch {arch} is unknown; choose one of {', '.join(ARCHS)}")
    if causal_lm and arch == "eurobert":
        raise UsageError("--causal-lm writes a decoder; use --arch llama (or qwen3 with qk-norm)")
    if qk_norm and arch != "qwen3":
        raise UsageError(
            f"this checkpoint has qk-norm (model.qk_layernorm=true), which {arch} "
            "lacks; export with --arch qwen3"
        )
    if arch == "qwen3" and not qk_norm:
        raise UsageError(
            "--arch qwen3 needs qk-norm, which this checkpoint lacks; use --arch eurobert or llama"
        )
    return arch


def hf_config(
    arch: str,
    m,
    vocab_size: int,
    ids: dict[str, int | None],
    causal_lm: bool,
    max_positions: int,
    clf_pooling: str,
):
    """The transformers config object for `arch` from a ModelConfig (CONFIG_FIELDS, reversed)."""
    kw: dict[str, Any] = {hf: getattr(m, ours) for hf, ours in mapping.CONFIG_FIELDS}
    kw.update(
        vocab_size=vocab_size,
        rope_parameters=rope_parameters(m),
        max_position_embeddings=max_positions,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=ids.get("bos_id"),
        eos_token_id=ids.get("eos_id"),
        pad_token_id=ids.get("pad_id"),
    )
    if arch == "eurobert":
        return transformers.EuroBertConfig(
            **kw,
            mlp_bias=False,
            mask_token_id=ids["mask_id"],
            classifier_pooling=clf_pooling,
            architectures=["EuroBertForMaskedLM"],
        )
    if arch == "llama":
        head = "LlamaForCausalLM"
        cfg = transformers.LlamaConfig(**kw, mlp_bias=False, architectures=[head])
    else:
        head = "Qwen3ForCausalLM"
        cfg = transformers.Qwen3Config(
            **kw, use_sliding_window=False, sliding_window=None, architectures=[head]
        )
    cfg.is_causal = bool(causal_lm)
    if ids.get("mask_id") is not None:
        cfg.mask_token_id = ids["mask_id"]
    return cfg


def rope_parameters(m) -> dict[str, Any]:
    """HF `rope_parameters` of a ModelConfig: default RoPE, or llama3 scaling (read by Llama, Qwen3
    and EuroBERT alike through transformers' shared RoPE initialisers)."""
    # megatron builds RoPE from int(rotary_base); the export must use the same frequencies.
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(int(m.rotary_base))}
    r = m.rope_scaling
    if r is not None:
        rope.update(
            rope_type=r.type,
            factor=r.factor,
            low_freq_factor=r.low_freq_factor,
            high_freq_factor=r.high_freq_factor,
            original_max_position_embeddings=r.original_max_position_embeddings,
        )
    return rope


def add_legacy_rope_keys(path: Path) -> None:
    """Also write `rope_theta` (+ `rope_scaling` when scaled), the keys transformers 4.x and other
    readers of Llama configs look for; transformers 5 reads either form the same."""
    raw = json.loads(path.read_text())
    rope = dict(raw.get("rope_parameters") or {})
    raw["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = rope
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def auto_class(arch: str) -> str:
    return "AutoModelForMaskedLM" if arch == "eurobert" else "AutoModelForCausalLM"


def to_hf(
    checkpoint,
    out,
    arch: str | None = None,
    causal_lm: bool = False,
    tokenizer: str | None = None,
    force: bool = False,
    clf_pooling: str = "late",
    dtype: str | None = None,
    verbose: bool = True,
) -> ExportResult:
    """Export a megatron checkpoint to a verified Hugging Face folder at `out`, its weights in
    `dtype` (fp32, bf16 or fp16; default: the dtype the checkpoint stores them in).

    Memory: our model, held in the dtype the checkpoint stores it in (the export's where that is
    narrower), and a piece of one tensor of the export at a time: the weights file is written
    tensor by tensor, and verified in float32, our model a layer at a time, by a forward that
    loads its layers one at a time."""
    out = Path(out).absolute()
    inputs = [checkpoint, *([tokenizer] if tokenizer else [])]
    common.check_output(out, force, "export", inputs)
    if clf_pooling not in ("late", "mean", "bos"):
        raise UsageError(f"--clf-pooling {clf_pooling} must be late, mean or bos")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype} must be one of {', '.join(DTYPES)}")
    ckpt = common.resolve_source_checkpoint(checkpoint)
    trainer = common.read_common(ckpt)
    cfg = common.run_config_from_dict(trainer["config"])
    m = final_model(cfg)  # the last phase's RoPE base, room for the longest phase

    if tokenizer is None and cfg.data.tokenizer:
        inputs.append(cfg.data.tokenizer)  # the run's own tokenizer: never replaced either
    tok, vocab, ids = run_tokenizer(ckpt, trainer, cfg, tokenizer, verbose)
    source = find_source(ckpt, trainer)
    arch = resolve_arch(arch, causal_lm, m.qk_layernorm, source)
    family = arch
    dims = export_dims(m, vocab)
    torch_dtype = DTYPES[dtype] if dtype is not None else common.saved_dtype(ckpt)
    hf_cfg = hf_config(arch, m, vocab, ids, causal_lm, max_positions(m, source), clf_pooling)
    if verbose:
        _notes(arch, causal_lm, cfg, source)

    record = export_record(ckpt, trainer, cfg, arch, causal_lm, source, torch_dtype)
    if not causal_lm:  # any tool that loads the export encodes inputs as the model was pretrained
        # special-token strings parsed as by any HF tokenizer: a fill-mask pipeline's <mask> works
        document_tokenizer(tok, **shards_rule(record.get("shards")), save_text_rule=False)
    hf_cfg.dtype = torch_dtype
    with common.staged_output(out, force, "export", inputs) as tmp:
        # our model, as stored, loaded as the trainer loads it: the one copy this export holds
        model = megatron_from_checkpoint(ckpt, cfg, vocab)
        common.release_free_memory()
        round_weights(model, torch_dtype)  # what the export holds, and is verified against
        hf_cfg.save_pretrained(str(tmp))
        add_legacy_rope_keys(tmp / "config.json")
        write_weights(model, tmp / "model.safetensors", family, dims, torch_dtype, ckpt)
        tok.save_pretrained(str(tmp))
        ver = _verify(model, cfg, vocab, tmp, arch, causal_lm)
        del model
        record["verification"] = ver.__dict__
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
        write_model_card(tmp, record, hf_cfg, tok, str(out))
    result = ExportResult(out, arch, causal_lm, vocab, ckpt, ver)
    if verbose:
        _print_export(result, trainer, m.num_layers)
    return result


def export_dims(m, vocab: int) -> mapping.Dims:
    """The shapes the tensor mapping needs of the final model `m` (config.final_model)."""
    return mapping.Dims(
        num_layers=m.num_layers,
        num_heads=m.num_attention_heads,
        num_groups=m.num_query_groups,
        head_dim=m.kv_channels,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size(vocab, 1),
        tied=m.tie_embeddings,
        qk_norm=m.qk_layernorm,
    )


def max_positions(m, source: dict[str, Any] | None) -> int:
    """The export's max_position_embeddings: the imported source's, else the run's sequence
    length; the context RoPE scaling reaches where that length is within its original one."""
    max_pos = int(
        (source or {}).get("hf_config", {}).get("max_position_embeddings") or m.seq_length
    )
    r = m.rope_scaling
    if r is not None and max_pos <= r.original_max_position_embeddings:
        max_pos = int(r.original_max_position_embeddings * r.factor)  # the context it scales to
    return max_pos


def _print_export(result: ExportResult, trainer: dict[str, Any], num_layers: int) -> None:
    """The verification and what was exported."""
    kind = "causal LM" if result.causal_lm else "bidirectional encoder"
    print(f"{result.verification.line()}")
    print(
        f"exported {result.checkpoint} (saved at {_layout_text(trainer.get('layout'))}) to "
        f"{result.path}: {result.arch} {kind}, vocab {result.vocab_size}, {num_layers} layers"
    )


def run_tokenizer(ckpt: Path, trainer: dict[str, Any], cfg, tokenizer: str | None, verbose: bool):
    """(the tokenizer an export saves, the vocabulary the run trained, the run's special ids):
    `tokenizer` (else the run's data.tokenizer), which must be the one the checkpoint recorded."""
    tok_dir = tokenizer or cfg.data.tokenizer
    if tok_dir is None:
        raise UsageError(
            f"checkpoint {ckpt} was trained without a tokenizer (mock data); pass "
            "--tokenizer DIR (a folder written by `mlmclm tokenize`)"
        )
    tok = load_tokenizer(tok_dir)
    recorded = trainer.get("tokenizer")
    if recorded and not same_tokenizer(tokenizer_fingerprint(tok), recorded):
        raise UsageError(
            f"tokenizer {tok_dir} ({describe_tokenizer(tokenizer_fingerprint(tok))}) is not the "
            f"one checkpoint {ckpt} was trained with ({describe_tokenizer(recorded)}); pass that "
            f"one{' (' + recorded['path'] + ')' if recorded.get('path') else ''}"
        )
    vocab = trained_vocab_size(cfg, tok, verbose)
    if len(tok) > vocab:
        raise UsageError(
            f"tokenizer {tok_dir} has {len(tok)} tokens but the model's vocabulary "
            f"is {vocab}; pass the tokenizer the checkpoint was trained with"
        )
    # The run's special ids (the same as the tokenizer's, once it is the run's)
    ids = {k: recorded[k] for k in TOKENIZER_KEYS[2:]} if recorded else special_token_ids(tok)
    return tok, vocab, ids


def _notes(arch: str, causal_lm: bool, cfg, source: dict[str, Any] | None) -> None:
    qk_norm = final_model(cfg).qk_layernorm
    if arch != "eurobert" and arch == resolve_arch(None, causal_lm, qk_norm, source):
        if not causal_lm:
            print(
                f"note: exporting as {arch} (the source family, is_causal=false); its built-in "
                "labels loss is the causal-LM one (README.md: the MLM loss)"
                + (
                    ""
                    if qk_norm  # EuroBERT has no qk-norm
                    else "; --arch eurobert gives the EuroBERT classes (AutoModelForMaskedLM)"
                )
            )
    if not causal_lm and cfg.phases and cfg.phases[-1].objective == "clm":
        print("note: the last phase of this run was CLM; --causal-lm exports it for generation")


def export_record(ckpt, trainer, cfg, arch, causal_lm, source, dtype) -> dict[str, Any]:
    """The export's record (paths.EXPORT_FILE) but its verification figure."""
    return {
        "checkpoint": str(ckpt),
        "iteration": trainer.get("iteration"),
        **pretraining_record(cfg, trainer.get("iteration"), imported_source(trainer)),
        "arch": arch,
        "causal_lm": causal_lm,
        "saved_layout": trainer.get("layout"),
        "source": source,
        **({"shards": trainer["shards"]} if trainer.get("shards") else {}),
        # how the saved tokenizer encodes a text: the pretraining document rule, or (a causal LM,
        # for generation, whose prompts must not end with EOS) the tokenizer's own template
        "tokenizer_rule": "template" if causal_lm else "document",
        "dtype": DTYPE_NAMES[dtype],
    }


def pretraining_record(
    cfg, iteration: int | None, imported: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Where a checkpoint stands in its pretraining, for learning curves: the run, the run its
    curve belongs to (a decay branch's stable source, else itself), its objectives in phase order
    and the tokens read so far (a branch counts its source's steps, which it shares; a continued
    run only its own). An import's checkpoint (`imported`: its source record) has read nothing
    here and trained with no objective of its run: it says what it is instead, and stays off the
    learning curves (no token count)."""
    lineage = (
        Path(cfg.train.branch_from).parents[1].name
        if cfg.train.branch_from
        else Path(cfg.output_dir).name
    )
    if imported is not None:
        origin = imported.get("hf_dir") or imported.get("checkpoint")
        return {
            "run": cfg.name,
            "lineage": lineage,
            "objective": None,
            "pretraining_tokens": None,
            "imported": f"{imported.get('family')} model imported from {origin}",
        }
    tokens = tokens_at_step(cfg, int(iteration)) if iteration is not None else None
    objective = " -> ".join(k for k, _ in groupby(ph.objective for ph in cfg.phases))
    return {
        "run": cfg.name,
        "lineage": lineage,
        "objective": objective,
        "pretraining_tokens": tokens,
    }


def imported_source(trainer: dict[str, Any]) -> dict[str, Any] | None:
    """The source record of a checkpoint an importer wrote (step 0 with a source), else None."""
    return trainer.get("source") if trainer.get("iteration") == 0 else None


def export_name(tokens: int, iteration: int) -> str:
    """`step0001000-tokens2.05M`: the step and the tokens read, in an export folder's name."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if tokens >= scale:
            return f"step{iteration:07d}-tokens{tokens / scale:.3g}{unit}"
    return f"step{iteration:07d}-tokens{tokens}"


def to_hf_many(
    ckpt_dir, out, steps: list[int] | None = None, force: bool = False, **options
) -> list[ExportResult]:
    """Export several checkpoints of a run's checkpoints folder into OUT/step<N>-tokens<T>/: the
    `steps` given (None: every complete checkpoint). Every checkpoint and target is checked before
    the first export; each export is verified as to_hf's."""
    ckpt_dir = Path(ckpt_dir)
    found = {checkpoint_iteration(c): c for c in complete_checkpoints(ckpt_dir)}
    if not found:
        raise UsageError(
            f"{ckpt_dir} holds no complete checkpoint (iter_NNNNNNN folders); give a "
            "run's checkpoints folder"
        )
    missing = sorted(set(steps or []) - set(found))
    if missing:
        raise UsageError(
            f"{ckpt_dir} holds no complete checkpoint of step {missing[0]}; it has "
            f"{', '.join(map(str, sorted(found)))}"
        )
    picked = [found[s] for s in sorted(set(steps) if steps else found)]
    out = Path(out).absolute()
    targets = []
    for ckpt in picked:
        trainer = common.read_common(ckpt)
        cfg = common.run_config_from_dict(trainer["config"])
        it = int(trainer["iteration"])
        target = out / export_name(tokens_at_step(cfg, it), it)
        common.check_output(
            target, force, "export", [ckpt_dir, *filter(None, [options.get("tokenizer")])]
        )
        targets.append((ckpt, target))
    return [to_hf(ckpt, target, force=force, **options) for ckpt, target in targets]


def trained_vocab_size(cfg, tok, verbose: bool) -> int:
    """The (unpadded) vocabulary the run trained with, as the trainer derived it."""
    try:
        return token_spec_and_vocab(cfg).vocab_size
    except UsageError:  # the run's tokenizer folder is gone: trust the one given
        if verbose:
            print(
                f"note: the run's tokenizer {cfg.data.tokenizer} is not readable; taking the "
                f"vocabulary size ({len(tok)}) from --tokenizer"
            )
        return cfg.model.vocab_size or len(tok)


def _verify(model, cfg, vocab: int, folder: Path, arch: str, causal_lm: bool) -> Verification:
    """Our model's logits (as loaded, rounded to the export's dtype) against the folder's, run
    by transformers one layer at a time after our model is put away."""
    tokens = verification_tokens(vocab, seq=min(SEQ, cfg.model.seq_length))
    ours = megatron_logits(model, tokens, causal_lm)[..., :vocab]
    common.drop_weights(model)  # our copy is done with: the export's layers take its place
    theirs, against = streamed_hf_logits(folder, auto_class(arch), tokens)
    return compare(ours, theirs[..., :vocab], against, causal_lm)


def round_weights(model, dtype) -> None:
    """Our model's weights rounded to the export's `dtype` where it is no wider than the one they
    are held in (held in it from now on, cast a weight at a time). A wider export rounds nothing:
    its tensors are widened a piece at a time as they are written (hf_files.write_safetensors)."""
    for p in model.parameters():
        if p.dtype != dtype and dtype.itemsize <= p.dtype.itemsize:
            p.data = p.data.to(dtype)


def write_weights(model, path: Path, family: str, dims, dtype, ckpt: Path) -> None:
    """model.safetensors from our model, one tensor at a time (each cut, cast and written before
    the next is made); a non-finite weight is one line."""
    targets = common.model_tensors(model)

    def get(key: str, layer):
        if (key, layer) not in targets:
            raise UsageError(
                f"checkpoint {ckpt} has no tensor {key}; it does not match the {family} layout "
                f"(tied={dims.tied}, qk_norm={dims.qk_norm})"
            )
        return targets[(key, layer)]

    def meta(key: str, layer):
        return torch.empty_like(get(key, layer), device="meta")

    def finite(name: str, t) -> None:  # a slice at a time: isfinite copies what it reads
        if not all(torch.isfinite(part).all() for part in t.reshape(-1).split(1 << 22)):
            raise UsageError(
                f"checkpoint {ckpt} holds non-finite values in {name}; refusing to export"
            )

    shapes = mapping.iter_megatron_to_hf(meta, family, dims)
    entries = [(name, dtype, tuple(t.shape)) for name, t in shapes]
    tensors = mapping.iter_megatron_to_hf(get, family, dims)
    write_safetensors(path, entries, tensors, metadata={"format": "pt"}, check=finite)


def _layout_text(layout: dict | None) -> str:
    if not layout:
        return "unknown layout"
    return f"TP{layout.get('tp', 1)}/PP{layout.get('pp', 1)}/DP{layout.get('dp', 1)}"
