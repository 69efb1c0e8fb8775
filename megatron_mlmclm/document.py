"""What a pretraining document is, token by token: the one rule that `mlmclm preprocess` writes
the shards by, that `mlmclm convert to-hf` saves in an export's tokenizer, and that fine-tuning
inputs (eval/input_form.py) are encoded by where an input rule asks for it.

A document is its text's tokens, encoded without the tokenizer's own template (a Llama-3
tokenizer would add a BOS, a BERT-style one [CLS]/[SEP]), preceded by BOS where the shards start
documents with one (`mlmclm preprocess` never does; Megatron-LM's tools may) and followed by EOS
where they end documents with it (`mlmclm preprocess` does, unless ``--no-append-eod``). An encoder
fine-tuned on inputs of another form meets token sequences it never saw in pretraining.

The text is encoded as the text it is: a special token's string inside it (``<mask>``, ``</s>``,
``<|begin_of_text|>``, ``[SEP]``: web text about NLP holds them) becomes that string's ordinary
tokens, never the special token; only the rule adds special tokens (`text_as_text`).

The rule is expressed as a `tokenizers` post-processor that replaces the tokenizer's own: with it,
``tokenizer(text)`` (special tokens on) *is* the document, and truncation keeps the EOS. The shard
writer, an export's tokenizer and the fine-tuning inputs all encode through it, so none can drift
from the others. The post-processor is saved with the tokenizer (``save_pretrained``), so any tool
that loads an export gives the model its documents' form. An export leaves special-token strings
parsed as every Hugging Face tokenizer does by default (a fill-mask pipeline writes ``<mask>`` into
its text); ``split_special_tokens=True`` encodes them as text, as the shards do, and the
fine-tuning inputs and the models `mlmclm evaluate` saves do so.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, processors

UNREACHABLE = -1e9  # a Unigram score no segmentation of text picks while another exists


def document_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    """The post-processor that turns a text's tokens into a document: `bos` (token, id) before,
    `eos` after, nothing else (a pair, should one be encoded, gets them around each part)."""
    specials = [s for s in (bos, eos) if s is not None]
    around = ([bos[0]] if bos else []), ([eos[0]] if eos else [])

    def part(piece: str, type_id: str) -> str:
        return " ".join(f"{t}{type_id}" for t in [*around[0], piece, *around[1]])

    return processors.TemplateProcessing(
        single=part("$A", ""),
        pair=f"{part('$A', '')} {part('$B', ':1')}",
        special_tokens=[(token, int(i)) for token, i in specials],
    )


def document_tokenizer(tok, bos: bool = False, eos: bool = True, save_text_rule: bool = True):
    """Make `tok` (a Hugging Face fast tokenizer) encode a text as a pretraining document when
    special tokens are on: BOS first if `bos`, the text's tokens (special-token strings as text),
    EOS last if `eos`; in place, returned. Token ids of the text itself are unchanged; offsets
    lose the trimming a ByteLevel post-processor did (a token's span may include the space before
    it). `save_text_rule`: whether ``save_pretrained`` keeps the text-as-text setting
    (`text_as_text`)."""
    for wanted, name in ((bos, "bos"), (eos, "eos")):
        if wanted and getattr(tok, f"{name}_token_id") is None:
            raise ValueError(f"the document rule adds {name.upper()}, which the tokenizer lacks")
    tok.backend_tokenizer.post_processor = document_processor(
        (tok.bos_token, tok.bos_token_id) if bos else None,
        (tok.eos_token, tok.eos_token_id) if eos else None,
    )
    return text_as_text(tok, saved=save_text_rule)


def shards_rule(shards: dict | None) -> dict[str, bool]:
    """{bos, eos} for `document_tokenizer` from the record of a run's shards (data/shards.py:
    ``bos``, ``append_eod``): BOS first where the shards started documents with it, EOS last
    where they ended them with it; where the record does not say (no record, or shards that
    were not scanned), as `mlmclm preprocess` writes them: no BOS, EOS."""
    shards = shards or {}
    return {"bos": shards.get("bos") is True, "eos": shards.get("append_eod") is not False}


def special_tokens(tok) -> list[str]:
    """The strings of a Hugging Face tokenizer's special tokens: its named ones (bos, eos, mask,
    ...) and every added token marked special, longest first."""
    found = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    return sorted(found | set(tok.all_special_tokens), key=lambda t: (-len(t), t))


def text_as_text(tok, saved: bool = True):
    """Make `tok` (a Hugging Face fast tokenizer) encode special-token strings in a text as
    ordinary text; in place, returned: transformers' ``split_special_tokens`` (with `saved`, also
    kept in ``init_kwargs``, so ``save_pretrained`` writes it to tokenizer_config.json and any
    tool that loads the folder gets it), the backend's own flag (for `tokenizers` calls that
    bypass transformers) and, for a SentencePiece Unigram model, its special pieces scored out of
    reach (saved in tokenizer.json: harmless where special-token strings are parsed, which
    matches them before the model)."""
    tok.split_special_tokens = True
    if saved:
        tok.init_kwargs["split_special_tokens"] = True
    _specials_out_of_reach(tok.backend_tokenizer, special_tokens(tok))
    backend_text_as_text(tok.backend_tokenizer)
    return tok


def backend_text_as_text(backend: Tokenizer) -> Tokenizer:
    """The part of `text_as_text` a `tokenizers.Tokenizer` copy loses: a copy made with
    ``Tokenizer.from_str`` of a prepared tokenizer's JSON (a worker process's) has its
    post-processor and Unigram scores, not the flag; in place, returned."""
    backend.encode_special_tokens = True
    return backend


def _specials_out_of_reach(backend: Tokenizer, specials: list[str]) -> None:
    """A Unigram (SentencePiece) model holds the special tokens as pieces of its vocabulary, which
    special-token splitting leaves reachable from text ("[SEP]" in a text would still be the [SEP]
    piece): score them lowest, so that text is encoded by its other pieces (a special piece stays
    reachable only where no other piece covers its characters: the unknown piece costs more)."""
    if not isinstance(backend.model, models.Unigram):
        return
    state = json.loads(backend.to_str())["model"]
    wanted = set(specials)
    vocab = [(p, UNREACHABLE if p in wanted else s) for p, s in state["vocab"]]
    backend.model = models.Unigram(vocab, state.get("unk_id"), state.get("byte_fallback", False))
