"""The input form: how a model folder's tokenizer turns a fine-tuning text into token ids.

An encoder is fine-tuned on inputs of the form it was pretrained on. Three rules
(`FinetuneConfig.inputs`: the protocol's choice, `--inputs` overrides it):

- ``folder`` (protocol ``default``): the folder's tokenizer as saved, its template included, as
  the field's fine-tuning scripts (run_glue, sentence-transformers, MTEB) encode it: a BERT-style
  folder gives ``[CLS] text [SEP]``, RoBERTa ``<s> text </s>``, a Llama-3 decoder
  ``<|begin_of_text|> text``, an export of `mlmclm convert to-hf` the pretraining document (its
  tokenizer.json holds the document rule). An export written before exports held the rule (its
  ``mlmclm_export.json`` names no ``tokenizer_rule``) gets the document rule, with a note.
- ``document``: the pretraining document rule (megatron_mlmclm/document.py): BOS where the
  export's shards started documents with one, the text's tokens, then EOS (none where the shards
  ended documents without one), no template. For a folder whose tokenizer lost the rule.
- ``eos`` (protocol ``encodeval``): EncodEval's rule for every folder: the text's tokens, then
  the tokenizer's ``eos_token``, no template.

Under every rule text is text: a special token's string inside a text (``<mask>``, ``</s>``,
``[SEP]``, ``<|begin_of_text|>``) is encoded as its ordinary tokens (document.py `text_as_text`,
also saved with a fine-tuned model's tokenizer), so the only special tokens of an input are those
its rule adds, as in the shards `mlmclm preprocess` writes.

Token type ids go to the model only where its embeddings tell two apart (``type_vocab_size`` >= 2:
BERT); they mark the two texts of a pair (a task's ``pairs: tokenizer``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_mlmclm.document import document_tokenizer, shards_rule, text_as_text
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.paths import EXPORT_FILE

INPUT_RULES = ("folder", "document", "eos")


@dataclass(frozen=True)
class InputForm:
    """The rule a folder's inputs are encoded by."""

    rule: str  # folder (the tokenizer as saved) | document | eos (text, EOS, no template)
    eos: bool = False  # document / eos: EOS appended
    bos: bool = False  # document: BOS first (the shards started documents with one)
    type_ids: bool = False  # token type ids go to the model
    note: str | None = None  # one line for the user, when the rule is not the one asked for

    def describe(self) -> str:
        if self.rule == "folder":
            return "the folder's tokenizer as saved"
        return f"{self.tokens()}, no template ({self.rule} rule)"

    def tokens(self) -> str:
        return f"{'BOS, ' if self.bos else ''}text{', EOS' if self.eos else ''}"


def export_record(folder: Path) -> dict | None:
    """The record `mlmclm convert to-hf` writes beside an export; None for any other folder."""
    path = folder / EXPORT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def input_form(model_dir: str, tok, inputs: str = "folder", type_ids: bool = False) -> InputForm:
    """The form `tok` (the folder's tokenizer, as loaded) encodes inputs in under rule `inputs`;
    `type_ids`: the model takes token type ids."""
    if inputs not in INPUT_RULES:
        raise UsageError(f"--inputs {inputs} must be one of {', '.join(INPUT_RULES)}")
    folder = Path(model_dir)
    record = export_record(folder)
    if inputs == "eos":
        form = InputForm(inputs, eos=True, type_ids=type_ids)
    elif inputs == "document" or (record is not None and "tokenizer_rule" not in record):
        # the rule of the export's shards (BOS, EOS as they had them)
        form = InputForm("document", **shards_rule((record or {}).get("shards")), type_ids=type_ids)
        if inputs == "folder":  # an export written before exports held the rule
            form = dataclasses.replace(
                form,
                note=f"note: {model_dir} is an export of an earlier mlmclm whose tokenizer lacks "
                f"the document rule; its inputs are encoded as pretraining documents "
                f"({form.tokens()}, no template)",
            )
    else:
        form = InputForm(inputs, type_ids=type_ids)
    for added, name, verb in ((form.bos, "bos", "puts first"), (form.eos, "eos", "appends")):
        if added and getattr(tok, f"{name}_token_id") is None:
            raise UsageError(
                f"the tokenizer in {model_dir} has no {name} token, which the {form.rule} input "
                f"rule {verb}; use --inputs folder"
            )
    return form


def apply_input_form(tok, form: InputForm):
    """Make `tok` (a fast tokenizer) encode inputs in `form` (kept as ``tok.input_form``); in
    place, returned."""
    if form.rule == "folder":
        text_as_text(tok)  # saved with the tokenizer (a fine-tuned model's), as the rule is
    else:
        document_tokenizer(tok, bos=form.bos, eos=form.eos)
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if form.type_ids else [])
    tok.model_input_names = names
    tok.init_kwargs["model_input_names"] = names
    tok.input_form = form
    return tok


def load_tokenizer(model_dir: str, inputs: str = "folder"):
    """The folder's fast tokenizer, encoding inputs under rule `inputs` (its `InputForm` as
    ``tok.input_form``); one line for a folder without a usable tokenizer."""
    from transformers import AutoConfig, AutoTokenizer  # heavy; see eval/families/base.py

    folder = Path(model_dir)
    if not folder.is_dir():
        raise UsageError(f"model folder {model_dir} not found")
    if not (folder / "config.json").is_file():
        raise UsageError(f"model folder {model_dir} has no config.json; pass an exported HF folder")
    if not any(
        (folder / n).is_file()
        for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")
    ):
        raise UsageError(
            f"model folder {model_dir} has no tokenizer; save one there "
            f"(tokenizer.save_pretrained) or run `mlmclm tokenize`"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise UsageError(f"cannot load the tokenizer of {model_dir}: {e}") from None
    if tok.pad_token_id is None:
        raise UsageError(
            f"the tokenizer in {model_dir} has no pad token; add one "
            f"(e.g. `mlmclm tokenize` adds bos/eos/pad/mask)"
        )
    if not getattr(tok, "is_fast", False):
        raise UsageError(
            f"the tokenizer in {model_dir} is not a fast tokenizer; inputs are "
            f"encoded through its tokenizer.json (save one)"
        )
    # a token type embedding that tells two texts apart (BERT's 2; RoBERTa's 1 holds only 0)
    types = getattr(AutoConfig.from_pretrained(str(folder)), "type_vocab_size", 0) or 0
    return apply_input_form(tok, input_form(model_dir, tok, inputs, type_ids=types > 1))
