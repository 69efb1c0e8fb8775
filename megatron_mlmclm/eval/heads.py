"""Loading an encoder folder's model and the task heads the families put on it (its tokenizer and
the form it encodes inputs in: eval/input_form.py).

Every model runs with bidirectional attention: `make_bidirectional` sets `config.is_causal=False`
(the transformers masking utilities then build a bidirectional mask for Llama/Qwen3-style models)
and clears `is_causal` on every attention module (SDPA would otherwise fall back to its causal
kernel when the mask is elided). EuroBert is bidirectional already.

Heads (which family uses which is the family's choice, eval/families/):
- SC: `MeanPoolClassifier` (AutoModel + masked mean pooling + linear), the same for every
  architecture. EuroBertForSequenceClassification has `classifier_pooling="mean"` and computes a
  correct masked mean, but it adds a dense+GELU layer and only exists for EuroBert (Llama/Qwen3
  classifiers pool the last token), so one small head of our own keeps the protocol identical
  across architectures.
- token classification (TC; QA as token tagging): AutoModelForTokenClassification where
  transformers has one, else `TokenTagger` (`token_classifier`).
- span QA: AutoModelForQuestionAnswering where transformers has one, else `SpanQAModel` (EuroBert
  has none): a linear start/end head over AutoModel (`span_qa_model`).
Our heads save with `save_pretrained(dir)` (encoder files + head.safetensors + head_config.json)
and load with `<Head>.from_pretrained(dir)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForQuestionAnswering,
    AutoModelForTokenClassification,
)

from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.hf_folder import NO_CODE


def make_bidirectional(model: nn.Module) -> nn.Module:
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for cfg in configs.values():
        try:
            cfg.is_causal = False
        except Exception:  # a frozen config attribute; the module flag below still applies
            pass
    for m in model.modules():
        if hasattr(m, "is_causal") and isinstance(m.is_causal, bool):
            m.is_causal = False
    return model


def max_positions(model_dir: str) -> int:
    cfg = AutoConfig.from_pretrained(model_dir, **NO_CODE)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 512


def load_encoder(model_dir: str) -> nn.Module:
    return make_bidirectional(AutoModel.from_pretrained(model_dir, **NO_CODE))


def _hidden_size(encoder: nn.Module) -> int:
    cfg = encoder.config
    return getattr(cfg, "hidden_size", None) or cfg.d_model


def _masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


class _HeadModel(nn.Module):
    """An AutoModel encoder plus a small head; saved as the encoder folder + head files."""

    kind = ""

    def __init__(self, encoder: nn.Module, **head_config):
        super().__init__()
        self.encoder = encoder
        self.head_config = dict(head_config)
        self.config = encoder.config

    def _encode(self, input_ids, attention_mask, token_type_ids=None):
        types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, **types
        ).last_hidden_state

    def save_pretrained(self, out_dir: str) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.encoder.save_pretrained(out)
        state = {
            k: v.detach().contiguous().cpu()
            for k, v in self.state_dict().items()
            if not k.startswith("encoder.")
        }
        save_file(state, str(out / "head.safetensors"))
        (out / "head_config.json").write_text(json.dumps({"kind": self.kind, **self.head_config}))

    @classmethod
    def from_pretrained(cls, model_dir: str):
        folder = Path(model_dir)
        cfg = json.loads((folder / "head_config.json").read_text())
        if cfg.pop("kind") != cls.kind:
            raise UsageError(f"{model_dir} holds a different head than {cls.__name__}")
        model = cls(load_encoder(model_dir), **cfg)
        missing, unexpected = model.load_state_dict(
            load_file(str(folder / "head.safetensors")), strict=False
        )
        bad = [k for k in missing if not k.startswith("encoder.")] + list(unexpected)
        if bad:
            raise UsageError(f"{model_dir}/head.safetensors does not match: {bad[:3]}")
        return model


class MeanPoolClassifier(_HeadModel):
    kind = "mean_pool_classifier"

    def __init__(self, encoder: nn.Module, num_labels: int):
        super().__init__(encoder, num_labels=num_labels)
        self.classifier = nn.Linear(_hidden_size(encoder), num_labels)

    def forward(self, input_ids, attention_mask, labels=None, token_type_ids=None, **_):
        hidden = self._encode(input_ids, attention_mask, token_type_ids)
        pooled = _masked_mean(hidden, attention_mask)
        logits = self.classifier(pooled.to(self.classifier.weight.dtype))
        loss = nn.functional.cross_entropy(logits.float(), labels) if labels is not None else None
        return SimpleNamespace(loss=loss, logits=logits)


class TokenTagger(_HeadModel):
    kind = "token_tagger"

    def __init__(self, encoder: nn.Module, num_labels: int):
        super().__init__(encoder, num_labels=num_labels)
        self.classifier = nn.Linear(_hidden_size(encoder), num_labels)

    def forward(self, input_ids, attention_mask, labels=None, token_type_ids=None, **_):
        logits = self.classifier(self._encode(input_ids, attention_mask, token_type_ids))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100
            )
        return SimpleNamespace(loss=loss, logits=logits)


class SpanQAModel(_HeadModel):
    kind = "span_qa"

    def __init__(self, encoder: nn.Module):
        super().__init__(encoder)
        self.qa_outputs = nn.Linear(_hidden_size(encoder), 2)

    def forward(
        self,
        input_ids,
        attention_mask,
        start_positions=None,
        end_positions=None,
        token_type_ids=None,
        **_,
    ):
        logits = self.qa_outputs(self._encode(input_ids, attention_mask, token_type_ids)).float()
        start, end = logits.unbind(-1)
        mask = attention_mask == 0
        start, end = start.masked_fill(mask, -1e4), end.masked_fill(mask, -1e4)
        loss = None
        if start_positions is not None:
            loss = (
                nn.functional.cross_entropy(start, start_positions)
                + nn.functional.cross_entropy(end, end_positions)
            ) / 2
        return SimpleNamespace(loss=loss, start_logits=start, end_logits=end)


def _auto_head(auto_cls, model_dir: str, **kwargs):
    """transformers' own head for this architecture, or None when it has none."""
    cfg = AutoConfig.from_pretrained(model_dir, **kwargs, **NO_CODE)
    if type(cfg) not in auto_cls._model_mapping:
        return None
    return make_bidirectional(auto_cls.from_pretrained(model_dir, **kwargs, **NO_CODE))


def token_classifier(model_dir: str, labels: list[str]) -> nn.Module:
    """A fresh token-classification model on the encoder (random head; seed torch first)."""
    id2label = dict(enumerate(labels))
    model = _auto_head(
        AutoModelForTokenClassification,
        model_dir,
        num_labels=len(labels),
        id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    )
    return model if model is not None else TokenTagger(load_encoder(model_dir), len(labels))


def span_qa_model(model_dir: str) -> nn.Module:
    """A fresh start/end span model on the encoder (random head; seed torch first)."""
    model = _auto_head(AutoModelForQuestionAnswering, model_dir)
    return model if model is not None else SpanQAModel(load_encoder(model_dir))
