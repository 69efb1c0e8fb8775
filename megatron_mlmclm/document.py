"""What a pretraining document is, token by token: the one rule that `mlmclm preprocess` writes
the shards by, that `mlmclm convert to-hf` saves in an export's tokenizer, and that fine-tuning
inputs (eval/input_form.py) are encoded by where an input rule asks for it.

A document is its text's tokens, encoded without the tokenizer's own template (no BOS: a Llama-3
tokenizer would add one that no shard holds, a BERT-style one [CLS]/[SEP]), followed by EOS when
the shards end documents with it (`mlmclm preprocess` does, unless ``--no-append-eod``). An
encoder fine-tuned on inputs of another form meets token sequences it never saw in pretraining.

The text is encoded as the text it is: a special token's string inside it (``<mask>``, ``</s>``,
``<|begin_of_text|>``, ``[SEP]``: web text about NLP holds them) becomes that string's ordinary
tokens, never the special token (`tokenizers`' ``encode_special_tokens``); only the rule adds
special tokens.

The rule is expressed as a `tokenizers` post-processor that replaces the tokenizer's own: with it,
``tokenizer(text)`` (special tokens on) *is* the document, and truncation keeps the EOS. The shard
writer, an export's tokenizer and the fine-tuning inputs all encode through it, so none can drift
from the others.
"""

from __future__ import annotations

from tokenizers import Tokenizer, processors


def document_processor(eos_token: str | None, eos_id: int | None):
    """The post-processor that turns a text's tokens into a document: EOS appended, nothing else
    (a pair, should one be encoded, gets an EOS after each part)."""
    if eos_token is None:
        return processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    return processors.TemplateProcessing(
        single=f"$A {eos_token}",
        pair=f"$A {eos_token} $B:1 {eos_token}:1",
        special_tokens=[(eos_token, int(eos_id))],
    )


def make_document_tokenizer(
    backend: Tokenizer, eos_token: str | None, eos_id: int | None
) -> Tokenizer:
    """Make `backend` (a `tokenizers.Tokenizer`, e.g. a Hugging Face fast tokenizer's
    ``backend_tokenizer``) encode a text as a document when special tokens are on; in place,
    returned for convenience. Token ids of the text itself are unchanged; offsets lose the trimming
    a ByteLevel post-processor did (a token's span may include the space before it)."""
    backend.post_processor = document_processor(eos_token, eos_id)
    return text_as_text(backend)


def text_as_text(backend: Tokenizer) -> Tokenizer:
    """Make `backend` encode special-token strings in a text as ordinary text; in place. The
    setting is not part of a tokenizer's JSON: a copy made with ``Tokenizer.from_str`` (a worker
    process's) needs it again."""
    backend.encode_special_tokens = True
    return backend
