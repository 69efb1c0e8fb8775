"""The README.md (model card) of an export: what it is, which class loads it and how to use it
right, per architecture.

The trap it names: an MLM-trained Llama- or Qwen3-family export is a `*ForCausalLM` class (with
`is_causal: false`), whose logits are the MLM logits but whose built-in `labels` loss is the
causal-LM loss, shifted by one position. Fine-tuning or continuing MLM through that loss trains
the wrong objective without a word; the card shows the MLM loss from the logits (and `--arch
eurobert`, where the family maps, gives `EuroBertForMaskedLM`, whose `labels` loss is MLM's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MLM_LOSS = """\
```python
import torch.nn.functional as F

# labels: the original ids at the masked positions, -100 everywhere else (no shift)
logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
```"""


def _loading(arch: str, causal_lm: bool, cls: str, qk_norm: bool) -> list[str]:
    if causal_lm:
        return [
            "## Load it",
            "",
            f"A causal decoder (`{cls}`, `is_causal: true`) for `generate()`: "
            "`AutoModelForCausalLM.from_pretrained(PATH)`. Its `labels` loss is the next-token "
            "loss (the labels shifted by one position), which is what it was trained with.",
        ]
    if arch == "eurobert":
        return [
            "## Load it",
            "",
            "`EuroBertForMaskedLM`, bidirectional: `AutoModelForMaskedLM` (MLM logits), "
            "`AutoModel` (hidden states), `AutoModelForSequenceClassification` and "
            "`AutoModelForTokenClassification` (a head on top) all load it, with no remote code.",
            "",
            "Its built-in loss is MLM's: `model(input_ids=..., labels=labels)` is the "
            "cross-entropy at the positions whose label is not -100, without a shift.",
        ]
    lines = [
        "## Load it",
        "",
        f"`{cls}` with `is_causal: false`: attention is bidirectional, and `logits[:, i]` are "
        "the MLM logits of position i (the token at i, not the next one). "
        "`AutoModelForCausalLM` loads it with its MLM head, `AutoModel` for hidden states, "
        "`AutoModelForSequenceClassification` and `AutoModelForTokenClassification` with a "
        "head on top; `AutoModelForMaskedLM` does not (transformers has no masked-LM class for "
        "this family), but the fill-mask pipeline below does.",
        "",
        f"**Its built-in loss is not the MLM loss.** `model(input_ids=..., labels=labels)` of a "
        f"`{cls}` computes the causal-LM loss: it shifts the labels by one position (position i "
        "is scored on token i+1). To continue MLM or fine-tune with the MLM objective, compute "
        "the loss from the logits:",
        "",
        MLM_LOSS,
    ]
    if not qk_norm:
        lines += [
            "",
            "Or export with `mlmclm convert to-hf --arch eurobert`: `EuroBertForMaskedLM` holds "
            "the same weights, loads with `AutoModelForMaskedLM`, and its `labels` loss is MLM's.",
        ]
    return lines


def model_card(record: dict[str, Any], hf_cfg, tok, path: str) -> str:
    """The card's text for an export at `path` with its record (mlmclm_export.json)."""
    arch, causal_lm = record["arch"], bool(record.get("causal_lm"))
    cls = (getattr(hf_cfg, "architectures", None) or ["?"])[0]
    qk_norm = arch == "qwen3"
    tokens = record.get("pretraining_tokens")
    what = record.get("objective") or "?"
    made = (
        f"step {record.get('iteration')} of `{record.get('run')}` ({what}"
        + (f", {tokens:,} tokens" if tokens else "")
        + ")"
    )
    if record.get("imported"):
        made = f"a {record['imported']} (the import itself: not trained here)"
    shards = record.get("shards") or {}
    eos = "without EOS" if shards.get("append_eod") is False else f"then EOS `{tok.eos_token}`"
    bos = f"BOS `{tok.bos_token}`, " if shards.get("bos") else ""
    ver = record.get("verification") or {}
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {'text-generation' if causal_lm else 'fill-mask'}",
        "tags: [megatron_mlmclm]",
        "---",
        "",
        f"# {Path(path).name}",
        "",
        f"{'A causal language model' if causal_lm else 'A bidirectional text encoder'} exported "
        f"by megatron_mlmclm (`mlmclm convert to-hf`) from {made}; weights in "
        f"{record.get('dtype')}. Before it was written, its logits were compared with the "
        f"checkpoint's: max difference {ver.get('max_abs_diff', float('nan')):.1e} on "
        f"{ver.get('batch')}x{ver.get('seq')} tokens. Where it comes from: `mlmclm_export.json`.",
        "",
        *_loading(arch, causal_lm, cls, qk_norm),
    ]
    if not causal_lm:
        lines += [
            "",
            "## Fill-mask",
            "",
            "```python",
            "from transformers import pipeline",
            "",
            f'fill = pipeline("fill-mask", model="{path}")',
            'print(fill(f"The capital of France is {fill.tokenizer.mask_token}."))',
            "```",
        ]
    if causal_lm:
        rule = "The saved tokenizer keeps its own template: a prompt does not end with EOS."
    else:
        rule = (
            f"The saved tokenizer encodes a text as the pretraining documents held it: {bos}the "
            f"text's tokens, {eos}. Mask token: `{tok.mask_token}`, pad token: "
            f"`{tok.pad_token}`. A special token's string in a text is parsed as that token (so "
            "the fill-mask pipeline's mask works); `tokenizer(text, split_special_tokens=True)` "
            "encodes it as text, as the pretraining shards hold it."
        )
    lines += ["", "## Tokenizer", "", rule, ""]
    return "\n".join(lines)


def write_model_card(folder: Path, record: dict[str, Any], hf_cfg, tok, path: str) -> None:
    (folder / "README.md").write_text(model_card(record, hf_cfg, tok, path), encoding="utf-8")
