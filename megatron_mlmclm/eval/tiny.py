"""A tiny random-init EuroBert encoder folder with a word-level tokenizer trained on given text.

For tests, smoke runs and the fine-tuning benchmark: no Hub download, seconds on CPU. The tokenizer
is cased (capitals matter for NER),
has <pad>/<unk>/<s>/</s>/<mask>, adds `<s> A </s>` (pairs: `<s> A </s> B </s>`), and is a fast
tokenizer (offsets and word ids work).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import EuroBertConfig, EuroBertModel, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<mask>"]


def build_tokenizer(texts: Iterable[str], vocab_size: int = 8000, pad: bool = True):
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = SPECIALS if pad else [s for s in SPECIALS if s != "<pad>"]
    tok.train_from_iterator(
        texts, trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=specials)
    )
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> $B:1 </s>:1",
        special_tokens=[("<s>", bos), ("</s>", eos)],
    )
    kwargs = dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>", mask_token="<mask>")
    if pad:
        kwargs["pad_token"] = "<pad>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def build_tiny_model(
    out_dir: str | Path,
    texts: Iterable[str],
    vocab_size: int = 8000,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 2,
    max_positions: int = 256,
    seed: int = 0,
    pad: bool = True,
) -> Path:
    out = Path(out_dir)
    tok = build_tokenizer(texts, vocab_size, pad=pad)
    torch.manual_seed(seed)
    cfg = EuroBertConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=tok.pad_token_id if pad else None,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        mask_token_id=tok.mask_token_id,
    )
    EuroBertModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def sample_texts(data_dir: str | Path, max_lines: int = 20000) -> list[str]:
    """Some text of each local evaluation dataset (SST-2, CoNLL-2003, MNLI/QQP, SQuAD, SciFact)."""
    d = Path(data_dir)
    texts: list[str] = []
    sst = d / "sst2" / "train.tsv"
    if sst.is_file():
        texts += [
            line.split("\t")[0]
            for line in sst.read_text(encoding="utf-8").splitlines()[1:max_lines]
        ]
    conll = d / "conll2003" / "train.txt"
    if conll.is_file():
        words = [
            line.split()[0]
            for line in conll.read_text(encoding="utf-8").splitlines()[: max_lines * 5]
            if line.strip()
        ]
        texts += [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]
    for sub in ("MNLI_subset", "QQP_subset"):
        f = d / "glue" / sub / "train.json"
        if f.is_file():
            rows = list(json.loads(f.read_text(encoding="utf-8")).values())[: max_lines // 4]
            texts += [r["text_a"] + " " + r["text_b"] for r in rows]
    squad = d / "squad_v1.1" / "train-subset-du2017-11877q.json"
    if squad.is_file():
        for art in json.loads(squad.read_text(encoding="utf-8"))["data"][:10]:
            for p in art["paragraphs"]:
                texts.append(p["context"])
                texts += [q["question"] for q in p["qas"]]
    sci = d / "scifact" / "beir_format"
    if (sci / "queries.jsonl").is_file():
        texts += [
            json.loads(line)["text"] for line in (sci / "queries.jsonl").read_text().splitlines()
        ]
        with gzip.open(sci / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= 1000:
                    break
                texts.append(json.loads(line)["text"])
    return texts
