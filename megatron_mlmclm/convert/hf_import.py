"""Hugging Face decoder (Llama family, Qwen3) or EuroBERT -> megatron checkpoint for continued MLM.

`from_hf(HF_DIR, OUT)` writes, under a temporary sibling of OUT renamed only after verification:

    OUT/checkpoints/iter_0000000/   megatron dist checkpoint (TP1/PP1 save, reshardable), whose
                                    trainer state holds the run config (explicit model fields) and
                                    the source record (family, HF config)
    OUT/tokenizer/                  the source tokenizer with bos/eos/pad/mask guaranteed (the
                                    shards of the continued run are written with it)
    OUT/config.yaml                 a ready run config: MLM at 40% masking, train.init_from set
    OUT/mlmclm_source.json          the source record (read by `convert to-hf` for the default arch)

Continue with ``mlmclm pretrain OUT/config.yaml data.train=[PREFIX]``. Supported: Llama 3.x,
SmolLM2-style tied embeddings, Mistral without sliding window, Qwen3 (qk-norm), EuroBERT and our
own exports (``is_causal: false``), each with the default RoPE or Llama 3.1-style ``llama3`` RoPE
scaling (Llama 3.1 / 3.2; carried into ``model.rope_scaling``). Refused with one line: other
architectures, MoE, sliding window, attention/MLP biases, other RoPE scaling kinds, non-SiLU MLPs,
a tokenizer larger than the model's vocabulary.

Tokens the completed tokenizer adds (mask, pad: where no reserved token is free) take new rows,
or rows of the embedding the source never trained (its vocabulary padded beyond its tokenizer, as
Qwen3's is); either way they start at the mean of the trained rows, and the import says so.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoConfig, AutoTokenizer

from megatron_mlmclm.checkpoint import iter_name
from megatron_mlmclm.config import RopeScalingConfig
from megatron_mlmclm.convert import common, mapping
from megatron_mlmclm.convert.embeddings import embedding_rows
from megatron_mlmclm.convert.hf_files import HFWeights
from megatron_mlmclm.convert.verify import (
    SEQ,
    Verification,
    compare,
    megatron_logits,
    streamed_hf_logits,
    verification_tokens,
)
from megatron_mlmclm.data.tokenizer import prepare_tokenizer, tokenizer_fingerprint
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.hf_folder import NO_CODE, refuse_code
from megatron_mlmclm.model.build import padded_vocab_size

FAMILIES = ("llama", "mistral", "qwen3", "eurobert")
MAX_SEQ_LENGTH = 2048  # default training length of the continued run (the weights do not care)


@dataclass
class ImportResult:
    path: Path
    checkpoint: Path
    family: str
    vocab_size: int
    vocab_grew: bool
    verification: Verification
    rows_set: tuple[int, ...] = ()  # source ids (mask, pad) whose untrained rows were set


def read_hf_config(hf_dir: Path):
    if not hf_dir.is_dir() or not (hf_dir / "config.json").is_file():
        raise UsageError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    try:
        raw = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{hf_dir / 'config.json'} is not valid JSON: {e}") from None
    model_type = raw.get("model_type")
    if _is_moe(raw):
        raise UsageError(
            f"{hf_dir} is a mixture-of-experts model ({model_type}); MoE is not "
            f"supported (supported: {', '.join(FAMILIES)})"
        )
    if model_type not in FAMILIES:
        raise UsageError(
            f"unknown architecture '{model_type}' in {hf_dir}; supported: {', '.join(FAMILIES)}"
        )
    refuse_code(hf_dir)  # a tokenizer only its own code loads: one line, the code never run
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True, **NO_CODE)
    except Exception as e:
        raise UsageError(f"cannot read the config of {hf_dir}: {common._first_line(e)}") from None
    return cfg


def _is_moe(raw: dict[str, Any]) -> bool:
    if "moe" in str(raw.get("model_type", "")) or raw.get("model_type") in ("mixtral", "dbrx"):
        return True
    return any(
        (raw.get(k) or 0) > 1 for k in ("num_local_experts", "num_experts", "n_routed_experts")
    )


def check_supported(cfg, hf_dir: Path) -> None:
    """One line for the first feature this converter cannot carry over exactly."""
    mt = cfg.model_type
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise UsageError(
            f"{hf_dir} uses attention or MLP biases, which our architecture lacks "
            "(no biases); not supported"
        )
    window = getattr(cfg, "sliding_window", None)
    if mt == "mistral" and window is not None:
        raise UsageError(
            f"{hf_dir} uses sliding-window attention (sliding_window={window}); "
            "only Mistral-style models without sliding window are supported"
        )
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (
        getattr(cfg, "layer_types", None) or []
    ):
        raise UsageError(f"{hf_dir} uses sliding-window attention; not supported")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"{hf_dir} uses hidden_act={act}; only SwiGLU (silu) MLPs are supported")
    rope_scaling(cfg, hf_dir)
    theta = rope_theta(cfg)
    if float(theta) != int(theta):
        raise UsageError(f"{hf_dir} has rope theta {theta}; megatron takes an integer rotary base")
    if getattr(cfg, "head_dim", None) is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads


def rope_scaling(cfg, hf_dir: Path) -> dict[str, Any] | None:
    """model.rope_scaling for the HF RoPE parameters: None (default RoPE) or the llama3 fields."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "llama3":
        raise UsageError(
            f"{hf_dir} uses RoPE scaling '{kind}', which our model does not "
            "implement; supported: default RoPE and llama3 scaling"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UsageError(
            f"{hf_dir} rotates only part of each head (partial_rotary_factor="
            f"{rope['partial_rotary_factor']}); not supported"
        )
    try:
        fields = {
            "type": "llama3",
            "factor": float(rope["factor"]),
            "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(
            f"{hf_dir} has llama3 RoPE scaling with a missing or invalid field "
            f"({common._first_line(e)})"
        ) from None
    RopeScalingConfig(**fields).validate()
    return fields


def rope_theta(cfg) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def model_fields(cfg, vocab_size: int) -> dict[str, Any]:
    fields = {ours: getattr(cfg, hf) for hf, ours in mapping.CONFIG_FIELDS}
    fields.update(
        preset=None,
        vocab_size=vocab_size,
        rotary_base=float(int(rope_theta(cfg))),
        seq_length=min(int(cfg.max_position_embeddings), MAX_SEQ_LENGTH),
        qk_layernorm=cfg.model_type == "qwen3",
        rope_scaling=rope_scaling(cfg, ""),
    )
    fields["tie_embeddings"] = bool(fields["tie_embeddings"])
    return fields


def from_hf(
    hf_dir, out, force: bool = False, seed: int = 1234, verbose: bool = True
) -> ImportResult:
    """Convert a local HF model folder into a verified megatron checkpoint folder at `out`.

    The checkpoint stores the weights in the source's dtype. Memory: our model, held in that dtype,
    and one of the source's tensors at a time: the source is read from disk tensor by tensor into
    it, and verified in float32, our model a layer at a time (verify.megatron_logits), against a
    forward that loads the source's layers one at a time (verify.streamed_hf_logits)."""
    hf_dir, out = Path(hf_dir).absolute(), Path(out).absolute()
    common.check_output(out, force, "import", [hf_dir])
    hf_cfg = read_hf_config(hf_dir)
    check_supported(hf_cfg, hf_dir)
    family = hf_cfg.model_type
    hf_vocab = int(hf_cfg.vocab_size)
    try:
        src_tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True, **NO_CODE)
    except Exception as e:
        raise UsageError(
            f"cannot load the tokenizer of {hf_dir}: {common._first_line(e)}"
        ) from None
    if len(src_tok) > hf_vocab:
        raise UsageError(
            f"the tokenizer of {hf_dir} has {len(src_tok)} tokens but the model's "
            f"vocabulary is {hf_vocab}; tokenizer and weights do not match (from-hf adds the "
            "mask and pad tokens itself: give the folder with the model's own tokenizer)"
        )
    weights = HFWeights(hf_dir)
    tied = bool(getattr(hf_cfg, "tie_word_embeddings", False))
    if not tied and "lm_head.weight" not in weights:
        raise UsageError(
            f"{hf_dir} has untied embeddings but no lm_head.weight (a bare model?); "
            "convert the *ForCausalLM / *ForMaskedLM folder"
        )

    with common.staged_output(out, force, "import", [hf_dir]) as tmp:
        tok_dir = prepare_tokenizer(hf_dir, tmp / "tokenizer", verbose=verbose)
        tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True, **NO_CODE)
        n_src, n_tok = len(src_tok), len(tok)
        vocab = max(hf_vocab, n_tok)
        grew = vocab > hf_vocab
        fields = model_fields(hf_cfg, vocab)
        dims = mapping.Dims(
            num_layers=fields["num_layers"],
            num_heads=fields["num_attention_heads"],
            num_groups=fields["num_query_groups"],
            head_dim=fields["kv_channels"],
            vocab_size=vocab,
            padded_vocab_size=padded_vocab_size(vocab, 1),
            tied=tied,
            qk_norm=fields["qk_layernorm"],
        )
        _check_keys(weights, family, dims, hf_dir)
        raw, cfg = common.continued_mlm_config(out, fields, seed)
        source = _source_record(hf_dir, hf_cfg, family, hf_vocab, grew)
        # held, and stored, in the source's dtype: filled without a wider copy
        build_cfg, model = common.build_imported(cfg, vocab, seed, weights.dtype())
        items = mapping.iter_hf_to_megatron(weights.get, family, dims, pad_vocab=False)
        keys = mapping.vocab_keys(family, dims)
        common.fill_model(model, items, "the Hugging Face weights", short_rows=keys)
        common.release_free_memory()
        trained = min(hf_vocab, n_src)  # rows of the source's tokens: the others never trained
        rows = embedding_rows(model, tok, trained, range(n_src, n_tok))
        record = {**tokenizer_fingerprint(tok), "path": str(out / "tokenizer")}
        ckpt = common.save_imported(tmp / "checkpoints", model, cfg, source, record)
        # The rows set on purpose are left out of the comparison: compared are the trained ones.
        ver = _verify(hf_dir, hf_cfg, ckpt, model, build_cfg, trained, rows.changed, weights)
        del model
        (tmp / common.SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        _write_run_config(tmp / "config.yaml", raw, hf_dir, final=out / "config.yaml")
    ckpt = out / "checkpoints" / iter_name(0)
    result = ImportResult(out, ckpt, family, vocab, grew, ver, tuple(rows.changed))
    if verbose:
        _report(result, hf_dir, hf_vocab, n_src, tok, rows, fields, tied)
    return result


def _check_keys(weights: HFWeights, family: str, dims: mapping.Dims, hf_dir: Path) -> None:
    unused = mapping.unused_hf_keys(weights.keys(), family, dims)
    if unused:
        raise UsageError(
            f"{hf_dir} has weights this converter cannot map (e.g. {unused[0]}); "
            "unsupported feature (biases, extra heads?)"
        )
    missing = mapping.missing_hf_keys(weights.keys(), family, dims)
    if missing:
        raise UsageError(
            f"Hugging Face weights have no {missing[0]}; not a {family} checkpoint this "
            "converter supports"
        )


def _source_record(hf_dir: Path, hf_cfg, family: str, hf_vocab: int, grew: bool) -> dict:
    return json.loads(
        json.dumps(
            {
                "family": family,
                "model_type": family,
                "hf_dir": str(hf_dir),
                "hf_config": hf_cfg.to_dict(),
                "vocab_size": hf_vocab,
                "vocab_grew": grew,
                "attention": "causal" if _source_causal(hf_cfg) else "bidirectional",
            },
            default=str,
        )
    )


def _report(result: ImportResult, hf_dir, hf_vocab, n_src, tok, rows, fields, tied) -> None:
    if result.vocab_grew:
        print(
            f"vocabulary grew {hf_vocab} -> {result.vocab_size} (tokens added for "
            "bos/eos/pad/mask); new embedding rows start at the mean of the trained rows"
        )
    added = range(n_src, len(tok))
    if added and added.start < hf_vocab:
        print(
            f"added tokens take rows {added.start}-{min(added.stop, hf_vocab) - 1} of the "
            f"source's {hf_vocab}-row embedding, beyond its {n_src}-token tokenizer (never "
            "trained): they start at the mean of the trained rows"
        )
    for line in rows.lines:
        print(line)
    print(
        f"end of document: {tok.eos_token} (id {tok.eos_token_id}), which `mlmclm preprocess "
        f"--tokenizer {result.path / 'tokenizer'}` appends to every document"
    )
    print(result.verification.line())
    print(
        f"imported {result.family} from {hf_dir} to {result.path}: {fields['num_layers']} "
        f"layers, hidden {fields['hidden_size']}, heads {fields['num_attention_heads']}/"
        f"{fields['num_query_groups']} kv, vocab {result.vocab_size}, tied={tied}"
    )
    print(f"continue with MLM: mlmclm pretrain {result.path / 'config.yaml'} data.train=[PREFIX]")


def _source_causal(hf_cfg) -> bool:
    return hf_cfg.model_type != "eurobert" and bool(getattr(hf_cfg, "is_causal", True))


def _verify(
    hf_dir: Path, hf_cfg, ckpt: Path, model, cfg, compared: int, changed, weights
) -> Verification:
    """Logits of the written checkpoint (loaded back into `model`) against the source's, over the
    first `compared` ids but the `changed` ones (rows set on purpose), on tokens without them.
    The source runs one layer at a time, after our model's logits are taken."""
    auto = "AutoModelForMaskedLM" if hf_cfg.model_type == "eurobert" else "AutoModelForCausalLM"
    causal = _source_causal(hf_cfg)
    seq = min(SEQ, cfg.model.seq_length)
    left_out = set(changed)
    keep = torch.tensor([i for i in range(compared) if i not in left_out])
    tokens = (
        verification_tokens(compared, seq=seq)
        if not changed
        else keep[verification_tokens(len(keep), seq=seq)]
    )
    common.reload_from_disk(model, ckpt)
    ours = megatron_logits(model, tokens, causal)[..., keep]
    common.drop_weights(model)  # our copy is done with: the source's layers take its place
    theirs, against = streamed_hf_logits(hf_dir, auto, tokens, weights)
    return compare(ours, theirs[..., keep], against, causal)


def _write_run_config(
    path: Path, raw: dict[str, Any], hf_dir: Path, final: Path, command: str = "convert from-hf"
) -> None:
    """Write the run config at `path` (staged); its header names where it will live, `final`."""
    header = (
        f"# Continued MLM pretraining from {hf_dir} (written by mlmclm {command}).\n"
        "# Set data.train to your shard prefixes (mlmclm preprocess), then:\n"
        f"#   mlmclm pretrain {final} data.train=[PREFIX] train.steps=N\n"
    )
    path.write_text(header + yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
