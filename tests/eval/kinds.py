"""Tiny model folders of the families users compare their encoders with, each with a tokenizer of
its real kind built here (no Hub): the model class from a config, the tokenizer's model, its
pre-tokenizer and its template as the released folders have them.

bert        WordPiece (``##``), ``[CLS] $A [SEP]`` (pairs ``[CLS] $A [SEP] $B [SEP]``, type ids
            0/1), BERT's tokenizer class (it returns token type ids), BertModel (it takes them)
roberta     byte-level BPE (``Ġ``), ``<s> $A </s>`` (RobertaProcessing: pairs
            ``<s> $A </s></s> $B </s>``), RobertaModel
modernbert  byte-level BPE, ``[CLS] $A [SEP]`` (pairs as BERT's), ModernBertModel (no token types)
deberta     Unigram with Metaspace (``▁``), ``[CLS] $A [SEP]`` (pairs as BERT's), DebertaV2Model
            (no token types: ``type_vocab_size`` 0, as DeBERTa-v3's)
eurobert    byte-level BPE with Llama-3's split, ``<|begin_of_text|> $A <|end_of_text|>``,
            EuroBertModel
llama       byte-level BPE with Llama-3's split, ``<|begin_of_text|> $A`` (a raw decoder's BOS),
            LlamaModel
export      our byte-level BPE (`mlmclm tokenize`) saved as `mlmclm convert to-hf` saves it: the
            document rule (text, EOS), the export record beside it; EuroBertModel
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers as tk_trainers

from megatron_mlmclm.paths import EXPORT_FILE

WIDTH = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
POSITIONS = 128
# Llama-3's split regex (tests/eval/test_inputs.py has it too, with Qwen's)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# BERT's special tokens (also ModernBERT's and DeBERTa-v3's)
BERT_TOKENS = dict(
    unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
)
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
]


def _bpe(corpus, specials, vocab_size=600, split=None):
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), byte_level])
        if split
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        tk_trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return tok


def _template(tok, single, pair, specials):
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(s, tok.token_to_id(s)) for s in specials]
    )


def _fast(tok, **tokens):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)


def bert_tokenizer(corpus):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        corpus,
        tk_trainers.WordPieceTrainer(vocab_size=600, special_tokens=specials, show_progress=False),
    )
    _template(tok, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1", ["[CLS]", "[SEP]"])
    from transformers import BertTokenizer

    # BERT's own class, as bert-base-cased's folder loads: it returns token type ids
    return BertTokenizer(tokenizer_object=tok, do_lower_case=False, **BERT_TOKENS)


def roberta_tokenizer(corpus):
    tok = _bpe(corpus, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok.post_processor = processors.RobertaProcessing(
        ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")), trim_offsets=True
    )
    return _fast(
        tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        cls_token="<s>",
        sep_token="</s>",
    )


def modernbert_tokenizer(corpus):
    tok = _bpe(corpus, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    _template(tok, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1", ["[CLS]", "[SEP]"])
    return _fast(tok, **BERT_TOKENS)


def deberta_tokenizer(corpus):
    tok = Tokenizer(models.Unigram())
    # SentencePiece's nmt_nfkc, as DeBERTa-v3's precompiled charsmap: NFKC, and every tab and
    # newline a space
    tok.normalizer = normalizers.Sequence(
        [normalizers.Replace(Regex(r"[\t\n\r]"), " "), normalizers.NFKC()]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    tok.train_from_iterator(
        corpus,
        tk_trainers.UnigramTrainer(
            vocab_size=400, special_tokens=specials, unk_token="[UNK]", show_progress=False
        ),
    )
    _template(tok, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1", ["[CLS]", "[SEP]"])
    return _fast(tok, **BERT_TOKENS)


def llama3_tokenizer(corpus, eos_in_template: bool):
    tok = _bpe(corpus, LLAMA_SPECIALS, split=LLAMA3_SPLIT)
    bos, eos = LLAMA_SPECIALS[:2]
    if eos_in_template:  # EuroBERT's
        _template(tok, f"{bos} $A {eos}", f"{bos} $A {eos} $B:1 {eos}:1", [bos, eos])
    else:  # Llama-3's
        _template(tok, f"{bos} $A", f"{bos} $A {bos} $B:1", [bos])
    return _fast(
        tok, bos_token=bos, eos_token=eos, pad_token=LLAMA_SPECIALS[3], mask_token=LLAMA_SPECIALS[2]
    )


def export_tokenizer(corpus, folder: Path):
    from megatron_mlmclm.data.tokenizer import load_tokenizer, train_tokenizer
    from megatron_mlmclm.document import document_tokenizer

    folder.mkdir()
    text = folder / "corpus.txt"
    text.write_text("\n".join(corpus))
    tok = load_tokenizer(train_tokenizer([str(text)], folder / "tok", 600, progress=False))
    document_tokenizer(tok)  # as `mlmclm convert to-hf` saves it
    return tok


def build(kind: str, corpus: list[str], out: Path) -> Path:
    """The tiny folder of `kind` at `out` (model from a config, tokenizer trained on `corpus`)."""
    import transformers as tf

    out.mkdir(parents=True)
    if kind == "export":
        tok = export_tokenizer(corpus, out.parent / f"{kind}-tokenizer")
    else:
        tok = {
            "bert": bert_tokenizer,
            "roberta": roberta_tokenizer,
            "modernbert": modernbert_tokenizer,
            "deberta": deberta_tokenizer,
            "eurobert": lambda c: llama3_tokenizer(c, eos_in_template=True),
            "llama": lambda c: llama3_tokenizer(c, eos_in_template=False),
        }[kind](corpus)
    common = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **WIDTH)
    torch.manual_seed(0)
    model = {
        "bert": lambda: tf.BertModel(tf.BertConfig(max_position_embeddings=POSITIONS, **common)),
        "roberta": lambda: tf.RobertaModel(  # one token type, as roberta-base's
            tf.RobertaConfig(max_position_embeddings=POSITIONS + 2, type_vocab_size=1, **common)
        ),
        "modernbert": lambda: tf.ModernBertModel(
            tf.ModernBertConfig(
                max_position_embeddings=POSITIONS,
                cls_token_id=tok.cls_token_id,
                sep_token_id=tok.sep_token_id,
                bos_token_id=tok.cls_token_id,
                eos_token_id=tok.sep_token_id,
                layer_types=["full_attention"],
                **common,
            )
        ),
        "deberta": lambda: tf.DebertaV2Model(
            tf.DebertaV2Config(max_position_embeddings=POSITIONS, **common)
        ),
        "eurobert": lambda: tf.EuroBertModel(
            tf.EuroBertConfig(max_position_embeddings=POSITIONS, num_key_value_heads=2, **common)
        ),
        "export": lambda: tf.EuroBertModel(
            tf.EuroBertConfig(max_position_embeddings=POSITIONS, num_key_value_heads=2, **common)
        ),
        "llama": lambda: tf.LlamaModel(
            tf.LlamaConfig(max_position_embeddings=POSITIONS, num_key_value_heads=2, **common)
        ),
    }[kind]()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if kind == "export":
        record = {"arch": "eurobert", "causal_lm": False, "tokenizer_rule": "document"}
        (out / EXPORT_FILE).write_text(json.dumps(record))
    return out


KINDS = ("bert", "roberta", "modernbert", "deberta", "eurobert", "llama", "export")
