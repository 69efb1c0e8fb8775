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
BERT); they mark the two texts of a pair (a task's ``pairs: tokenizer``, the default protocol's).

`inputs_record` is what a result records of the form it used: the templates as the tokenizer
applied them (``[CLS] $A [SEP]``, ``[CLS] $A [SEP] $B:1 [SEP]:1``, ``$A </s>``), and a warning
where nothing the model reads separates a task's two texts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_mlmclm.document import document_tokenizer, shards_rule, text_as_text
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.hf_folder import NO_CODE, check_model_folder
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


# what the templates are read from, and the texts a join's separator is tried between
PROBE = ("a", "b")
SENTENCES = ("The cat sat on the mat.", "A dog ran in the park.")
VISIBLE = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t"})


def applied_template(tok, *texts: str) -> str:
    """The template `tok` applies to one text or a pair (special tokens on), in the notation of
    `tokenizers`' TemplateProcessing: ``[CLS] $A [SEP] $B:1 [SEP]:1`` (``$A``/``$B``: the texts'
    tokens; ``:1``: a token type id other than 0, shown where the model takes them)."""
    enc = tok(*(texts or PROBE[:1]))
    form = getattr(tok, "input_form", None)
    types = enc.encodings[0].type_ids if form is not None and form.type_ids else None
    tokens = tok.convert_ids_to_tokens(enc["input_ids"])
    parts: list[str] = []
    for i, (token, seq) in enumerate(zip(tokens, enc.sequence_ids(0))):
        part = token.translate(VISIBLE) if seq is None else "$" + "AB"[seq]
        part += f":{types[i]}" if types and types[i] else ""
        if seq is None or not parts or parts[-1] != part:
            parts.append(part)
    return " ".join(parts)


def inputs_record(tok, pair: tuple[str, str, str] | None, pairs: str) -> dict:
    """What a result records of its inputs: the rule, the template of one text and, for a task
    of two texts (`pair`: the join's template and its two slots), the form they were fed in
    (`pairs`: the tokenizer's pair form, or the join inside the one-text template), with a
    warning where nothing the model reads separates the two."""
    form = tok.input_form
    record = {"rule": form.rule, "description": form.describe(), "single": applied_template(tok)}
    record["type_ids"] = form.type_ids
    if form.note:
        record["note"] = form.note
    if pair is None:
        return record
    template, slot_a, slot_b = pair
    record["pairs"] = pairs
    if pairs == "tokenizer":
        record["pair"] = applied_template(tok, *PROBE)
        warning = _pair_warning(tok, form)
    else:
        joined = template.format_map({slot_a: "$A", slot_b: "$B"}).translate(VISIBLE)
        record["pair"] = record["single"].replace("$A", joined, 1)
        record["template"] = template
        warning = _join_warning(tok, template, slot_a, slot_b)
    if warning:
        record["warning"] = warning
    return record


def describe_record(record: dict) -> str:
    """An inputs record (`inputs_record`) in one line: "one text `[CLS] $A [SEP]`; two texts
    `[CLS] $A [SEP] $B:1 [SEP]:1` (the tokenizer's pair form)"."""
    text = f"one text `{record['single']}`"
    if "pair" in record:
        how = "the tokenizer's pair form" if record["pairs"] == "tokenizer" else "joined"
        text += f"; two texts `{record['pair']}` ({how})"
    return text


def _pair_warning(tok, form: InputForm) -> str | None:
    """Where the tokenizer's pair form puts no token between the two texts (a template-less
    tokenizer, such as Qwen3's) and no token type tells them apart."""
    enc = tok(*SENTENCES)
    seq = enc.sequence_ids(0)
    if form.type_ids or not any(a == 0 and b == 1 for a, b in zip(seq, seq[1:])):
        return None
    return (
        "nothing separates the two texts: the tokenizer's pair form puts no token between them "
        "and the model takes no token types, so it reads one run-on text"
    )


def _join_warning(tok, template: str, slot_a: str, slot_b: str) -> str | None:
    """Where what the template puts between the two texts is lost by the tokenizer: the join
    encodes as the two texts with a plain space between them (BERT's normalizer turns a newline
    into a space; a byte-level BPE keeps it as ``Ċ``), or there is nothing between them."""
    marks = ["{" + slot_a + "}", "{" + slot_b + "}"]
    if not all(m in template for m in marks):
        return None
    at = sorted((template.index(m), m) for m in marks)
    start, end = at[0][0] + len(at[0][1]), at[1][0]
    between = template[start:end]
    texts = dict(zip((slot_a, slot_b), SENTENCES))
    spaced = template[:start] + " " + template[end:]
    ids = [tok(t.format_map(texts))["input_ids"] for t in (template, spaced)]
    if between and ids[0] != ids[1]:
        return None
    return (
        f"nothing the tokenizer keeps separates the two texts: the template's {between!r} "
        "between them encodes as a plain space does, so the model reads one run-on text "
        "(`pairs: tokenizer` feeds them in the tokenizer's pair form)"
    )


def load_tokenizer(model_dir: str, inputs: str = "folder"):
    """The folder's fast tokenizer, encoding inputs under rule `inputs` (its `InputForm` as
    ``tok.input_form``); one line for a folder without a usable tokenizer."""
    from transformers import AutoConfig, AutoTokenizer  # heavy; see eval/families/base.py

    check_model_folder(model_dir)  # one line for a folder that cannot load, before transformers
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), **NO_CODE)
        config = AutoConfig.from_pretrained(str(model_dir), **NO_CODE)
    except Exception as e:  # transformers' own reasons (a corrupt tokenizer.json, ...): one line
        raise UsageError(f"cannot load {model_dir}: {_first_line(e)}") from None
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
    types = getattr(config, "type_vocab_size", 0) or 0
    return apply_input_form(tok, input_form(model_dir, tok, inputs, type_ids=types > 1))


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
