"""Megatron-LM GPT checkpoint (torch_dist) -> our checkpoint for continued MLM, verified.

`from_megatron_lm(CKPT, OUT, tokenizer=DIR)` reads a checkpoint written by Megatron-LM's
``pretrain_gpt.py`` in the ``torch_dist`` format:

    CKPT/latest_checkpointed_iteration.txt   "10" (or "release")
    CKPT/iter_0000010/                       dist checkpoint: common.pt holds `args` (the run's
                                             argparse.Namespace), `iteration`, `checkpoint_version`;
                                             the model's tensors sit under megatron-core's own keys

CKPT may also be one ``iter_NNNNNNN`` / ``release`` folder. The architecture comes from the saved
`args` (num_layers, hidden_size, ffn_hidden_size, heads, num_query_groups, kv_channels, norm,
swiglu, rotary_base, llama3 RoPE scaling, qk_layernorm, tied embeddings, padded vocab, seq_length);
whatever our trunk cannot represent (LayerNorm, biases, learned absolute positions, GELU, MoE,
multi-latent attention, sliding windows, ...) is refused with one line. Megatron-LM checkpoints
carry no tokenizer: ``--tokenizer DIR`` (a folder from ``mlmclm tokenize``, with a mask token) is
required and must fit the checkpoint's padded vocabulary; embedding rows are taken as they are
(the mask/pad tokens that ``mlmclm tokenize`` adds start from the checkpoint's padding rows).

Both sides share megatron-core's parameter layout (fused QKV grouped by KV head, fc1 = [gate; up]),
so the tensors are copied by key; only the vocabulary padding changes. OUT gets the same files as
``convert from-hf`` (checkpoints/, tokenizer/, config.yaml, mlmclm_source.json), written under a
temporary name and kept only if our model, loaded from what was written, gives the logits of a
reference: megatron-core's GPTModel built from the saved args with the local layer spec, loaded with
the checkpoint's own tensors, run causally (float32, max |diff| <= 1e-4).
"""

from __future__ import annotations

import json
import shutil
import warnings
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mlmclm.checkpoint import iter_name
from megatron_mlmclm.checkpoint.reading import read_common_state
from megatron_mlmclm.convert import common
from megatron_mlmclm.convert.hf_import import ImportResult, _write_run_config
from megatron_mlmclm.convert.verify import (
    SEQ,
    Verification,
    compare,
    megatron_from_checkpoint,
    megatron_logits,
    verification_tokens,
)
from megatron_mlmclm.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.model.build import padded_vocab_size

TRACKER = "latest_checkpointed_iteration.txt"
FAMILY = "megatron-lm"
# Megatron-LM's RotaryEmbedding fixes these three llama3 parameters (only the factor is an arg).
MEGATRON_LLAMA3 = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def resolve(path) -> Path:
    """The iteration folder of a Megatron-LM save dir (via its tracker file) or the folder
    itself."""
    p = Path(path)
    if not p.exists():
        raise UsageError(
            f"Megatron-LM checkpoint {p} does not exist; give its save dir "
            f"(with {TRACKER}) or one iter_NNNNNNN folder"
        )
    if (p / TRACKER).is_file():
        text = (p / TRACKER).read_text().strip()
        if text == "release":
            p = p / "release"
        elif text.isdigit():
            p = p / f"iter_{int(text):07d}"
        else:
            raise UsageError(f"{p / TRACKER} holds {text!r}, not an iteration number or 'release'")
    if any(p.glob("mp_rank_*")):
        raise UsageError(
            f"{p} is a legacy (torch) Megatron-LM checkpoint; only the torch_dist "
            "format is supported: convert it with Megatron-LM's --ckpt-convert-format "
            "torch_dist first"
        )
    if not (p / "metadata.json").is_file() or not (p / "common.pt").is_file():
        raise UsageError(
            f"{p} is not a complete torch_dist checkpoint (no metadata.json / "
            "common.pt); give the save dir or one iter_NNNNNNN folder"
        )
    return p


def read_args(ckpt: Path) -> tuple[Namespace, dict[str, Any]]:
    """The saved argparse.Namespace and the rest of the common state (iteration, version), read
    as data: weights_only, admitting argparse.Namespace (attributes only, nothing to call)."""
    try:
        state = read_common_state(ckpt, allow=(Namespace,))
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot read {ckpt / 'common.pt'}: {common._first_line(e)}") from None
    if not isinstance(state, dict):
        raise UsageError(f"{ckpt / 'common.pt'} holds a {type(state).__name__}, not a state dict")
    if "trainer" in state:
        raise UsageError(
            f"{ckpt} is an mlmclm checkpoint, not a Megatron-LM one; continue from it "
            "with train.init_from, or export it with `mlmclm convert to-hf`"
        )
    args = state.get("args")
    if not isinstance(args, Namespace):
        raise UsageError(
            f"{ckpt} has no saved Megatron-LM args (common state keys: "
            f"{', '.join(sorted(map(str, state))) or 'none'}); not a Megatron-LM "
            "checkpoint"
        )
    return args, {k: v for k, v in state.items() if k != "args" and not isinstance(v, dict)}


def _arg(args: Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def check_supported(args: Namespace, ckpt: Path) -> None:
    """One line for the first setting our trunk (RMSNorm, SwiGLU, RoPE, no biases) cannot carry."""
    checks = (
        (
            _arg(args, "normalization", "LayerNorm") == "RMSNorm",
            f"normalization={_arg(args, 'normalization', 'LayerNorm')}; only RMSNorm is supported",
        ),
        (_arg(args, "swiglu", False), "a non-SwiGLU MLP (swiglu=False); only SwiGLU is supported"),
        (
            _arg(args, "position_embedding_type", "learned_absolute") == "rope",
            f"position_embedding_type={_arg(args, 'position_embedding_type', 'learned_absolute')}; "
            "only rope is supported",
        ),
        (
            not _arg(args, "add_bias_linear", True) and not _arg(args, "add_qkv_bias", False),
            "linear biases (add_bias_linear / add_qkv_bias); our architecture has none "
            "(Megatron-LM's --disable-bias-linear)",
        ),
        (
            not _arg(args, "num_experts"),
            f"a mixture of experts (num_experts={_arg(args, 'num_experts')}); MoE is not supported",
        ),
        (not _arg(args, "multi_latent_attention", False), "multi-latent attention; not supported"),
        (not _arg(args, "apply_layernorm_1p", False), "zero-centred norms (apply_layernorm_1p)"),
        (
            _arg(args, "window_size") is None,
            f"sliding-window attention (window_size={_arg(args, 'window_size')}); not supported",
        ),
        (
            float(_arg(args, "rotary_percent", 1.0)) == 1.0,
            f"partial rotary embeddings (rotary_percent={_arg(args, 'rotary_percent')})",
        ),
        (not _arg(args, "rotary_interleaved", False), "interleaved rotary embeddings"),
        (
            _arg(args, "rotary_seq_len_interpolation_factor") is None,
            "rotary sequence-length interpolation (rotary_seq_len_interpolation_factor)",
        ),
        (not _arg(args, "mtp_num_layers"), "multi-token prediction layers (mtp_num_layers)"),
        (
            not _arg(args, "heterogeneous_layers_config_path")
            and not _arg(args, "heterogeneous_layers_config_encoded_json"),
            "heterogeneous layers",
        ),
        (not _arg(args, "attention_output_gate", False), "gated attention output"),
    )
    for ok, what in checks:
        if not ok:
            raise UsageError(f"{ckpt} uses {what}; cannot convert")
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "padded_vocab_size",
        "seq_length",
    ):
        if not isinstance(_arg(args, name), int):
            raise UsageError(f"{ckpt}: the saved args have no {name}; not a GPT checkpoint")


def model_fields(args: Namespace, vocab_size: int) -> dict[str, Any]:
    """ModelConfig fields from the saved args (after check_supported)."""
    heads = args.num_attention_heads
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention", False) else None
    rope = None
    if _arg(args, "use_rope_scaling", False):
        rope = {
            "type": "llama3",
            "factor": float(_arg(args, "rope_scaling_factor", 8.0)),
            **MEGATRON_LLAMA3,
        }
    return {
        "preset": None,
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "ffn_hidden_size": _arg(args, "ffn_hidden_size") or 4 * args.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": groups or heads,
        "kv_channels": _arg(args, "kv_channels") or args.hidden_size // heads,
        "seq_length": args.seq_length,
        "vocab_size": vocab_size,
        "rotary_base": float(int(_arg(args, "rotary_base", 10000))),
        "rope_scaling": rope,
        "norm_epsilon": float(_arg(args, "norm_epsilon", 1e-5)),
        "init_method_std": float(_arg(args, "init_method_std", 0.02)),
        "qk_layernorm": bool(_arg(args, "qk_layernorm", False)),
        "tie_embeddings": not _arg(args, "untie_embeddings_and_output_weights", False),
    }


def _resize_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows (rows past the tokenizer are padding: zeros if the source has
    fewer)."""
    if t.shape[0] >= rows:
        return t[:rows].clone()
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def from_megatron_lm(
    checkpoint,
    out,
    tokenizer: str | None,
    force: bool = False,
    seed: int = 1234,
    verbose: bool = True,
) -> ImportResult:
    """Convert a Megatron-LM torch_dist checkpoint into a verified checkpoint folder at `out`."""
    out = Path(out).absolute()
    inputs = [checkpoint, *([tokenizer] if tokenizer else [])]
    common.check_output(out, force, "import", inputs)
    if not tokenizer:
        raise UsageError(
            "Megatron-LM checkpoints carry no tokenizer; pass --tokenizer DIR (a "
            "folder written by `mlmclm tokenize` from the tokenizer the model was "
            "trained with)"
        )
    tok_src = Path(tokenizer).absolute()
    tok = load_tokenizer(tok_src)  # one line if it is not a folder with bos/eos/pad/mask
    ckpt = resolve(checkpoint)
    args, info = read_args(ckpt)
    check_supported(args, ckpt)
    vocab = len(tok)
    if vocab > args.padded_vocab_size:
        raise UsageError(
            f"tokenizer {tok_src} has {vocab} tokens but the checkpoint's padded "
            f"vocabulary is {args.padded_vocab_size}; pass the tokenizer the model "
            "was trained with"
        )
    fields = model_fields(args, vocab)
    tensors = common.read_global_tensors(ckpt)
    ours = _resize_vocab_tensors(tensors, padded_vocab_size(vocab, 1))

    with common.staged_output(out, force, "import", inputs) as tmp:
        shutil.copytree(tok_src, tmp / "tokenizer")
        raw, cfg = common.continued_mlm_config(out, fields, seed)
        source = source_record(ckpt, args, info)
        record = {**tokenizer_fingerprint(tok), "path": str(out / "tokenizer")}
        build_cfg, saved = common.save_imported_checkpoint(
            tmp / "checkpoints", cfg, ours, source, vocab, seed, record
        )
        ver = _verify(args, tensors, saved, build_cfg, vocab, seed)
        (tmp / common.SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        _write_run_config(
            tmp / "config.yaml",
            raw,
            ckpt,
            final=out / "config.yaml",
            command="convert from-megatron-lm",
        )
    result = ImportResult(out, out / "checkpoints" / iter_name(0), FAMILY, vocab, False, ver)
    if verbose:
        _print_import(result, ckpt, info, fields, args)
    return result


def _resize_vocab_tensors(tensors: dict[str, torch.Tensor], padded: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with the embedding and output rows cut or padded to our padded
    vocabulary."""
    return {
        k: (
            _resize_vocab(v, padded)
            if k in ("embedding.word_embeddings.weight", "output_layer.weight")
            else v
        )
        for k, v in tensors.items()
    }


def source_record(ckpt: Path, args: Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """mlmclm_source.json: where the import came from, with Megatron-LM's plain-valued args (as
    JSON holds them)."""
    return json.loads(
        json.dumps(
            {
                "family": FAMILY,
                "checkpoint": str(ckpt),
                "attention": "causal",
                "iteration": info.get("iteration"),
                "checkpoint_version": info.get("checkpoint_version"),
                "megatron_lm_args": {
                    k: v
                    for k, v in vars(args).items()
                    if isinstance(v, (int, float, str, bool, type(None)))
                },
            },
            default=str,
        )
    )


def _print_import(
    result: ImportResult, ckpt: Path, info: dict[str, Any], fields: dict[str, Any], args: Namespace
) -> None:
    """The verification, what was imported, and the command that continues it with MLM."""
    out, vocab = result.path, result.vocab_size
    print(result.verification.line())
    print(
        f"imported Megatron-LM iteration {info.get('iteration')} from {ckpt} to {out}: "
        f"{fields['num_layers']} layers, hidden {fields['hidden_size']}, heads "
        f"{fields['num_attention_heads']}/{fields['num_query_groups']} kv, vocab {vocab} "
        f"(padded {args.padded_vocab_size} in the source), tied={fields['tie_embeddings']}"
    )
    print(f"continue with MLM: mlmclm pretrain {out / 'config.yaml'} data.train=[PREFIX]")


# --------------------------------------------------------------------------------------------------
# Verification against megatron-core's GPTModel built from the saved args


def reference_model(args: Namespace, tensors: dict[str, torch.Tensor]):
    """megatron-core GPTModel as Megatron-LM builds it from `args` (local spec, float32), holding
    the checkpoint's own tensors (every key must match: a check of the architecture too)."""
    f = model_fields(args, args.padded_vocab_size)
    config = TransformerConfig(
        num_layers=f["num_layers"],
        hidden_size=f["hidden_size"],
        ffn_hidden_size=f["ffn_hidden_size"],
        num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"],
        kv_channels=f["kv_channels"],
        normalization="RMSNorm",
        layernorm_epsilon=f["norm_epsilon"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=f["qk_layernorm"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(
                normalization="RMSNorm", qk_layernorm=f["qk_layernorm"]
            ),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=_arg(args, "max_position_embeddings") or args.seq_length,
            share_embeddings_and_output_weights=f["tie_embeddings"],
            position_embedding_type="rope",
            rotary_base=int(f["rotary_base"]),
            rope_scaling=bool(_arg(args, "use_rope_scaling", False)),
            rope_scaling_factor=float(_arg(args, "rope_scaling_factor", 8.0)),
        )
    common.load_global_tensors(model, tensors)
    return model.eval()


def _verify(args: Namespace, tensors, saved: Path, cfg, vocab: int, seed: int) -> Verification:
    common.init_single_process(seed)
    ref_model = reference_model(args, tensors)
    tokens = verification_tokens(vocab, seq=min(SEQ, cfg.model.seq_length))
    with torch.no_grad():
        ref = ref_model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    ours = megatron_logits(megatron_from_checkpoint(saved, cfg, vocab), tokens, causal=True)
    return compare(
        ref.float()[..., :vocab],
        ours[..., :vocab],
        "megatron-core GPTModel (Megatron-LM args, local spec)",
        causal=True,
    )
