"""An export's fine-tuning inputs are the token ids `mlmclm preprocess` writes for the same text:
for every family (SC, TC, QA windows, IR through sentence-transformers; two texts in the pair form
are the two texts' documents one after the other, joined by a template one document) and for
three kinds of
tokenizer (our byte-level BPE; a Llama-3 kind whose own template adds a BOS; a Qwen3 kind with no
BOS), saved as `mlmclm convert to-hf` saves an export's tokenizer. The reference is the .bin shard
that `preprocess` writes, read back with megatron-core. A special token's string in a text is
encoded as text, as `preprocess` encodes it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_mlmclm.cli import main
from megatron_mlmclm.data.preprocess import preprocess
from megatron_mlmclm.data.tokenizer import load_tokenizer as load_tokenizer_folder
from megatron_mlmclm.data.tokenizer import prepare_tokenizer, train_tokenizer
from megatron_mlmclm.document import document_tokenizer
from megatron_mlmclm.eval.families import ir, qa, sc, tc
from megatron_mlmclm.eval.input_form import load_tokenizer
from megatron_mlmclm.eval.tasks import load_registry
from megatron_mlmclm.paths import EXPORT_FILE

CORPUS = [
    "The war began in 1914 in Europe, and the cat sat on the mat.",
    "EU rejects German call to boycott British lamb.",
    "Who began it? A cat was sitting. Premise: Hypothesis: Question: Context: Query: Document:",
] * 20
PAIR = {"text_a": "The cat sat.", "text_b": "A cat was sitting.", "label": "entailment"}
WORDS = ["EU", "rejects", "German", "call", "to", "boycott", "British", "lamb", "."]
TAGS = ["B-ORG", "O", "B-MISC", "O", "O", "O", "B-MISC", "O", "O"]
QUESTION = {
    "id": "q",
    "question": "Who began it?",
    "context": "The war began in 1914 in Europe.",
    "answers": {"text": ["The war"], "answer_start": [0]},
}
QUERY, DOC = "what began in 1914", {"title": "", "text": "The war began in 1914."}
# The regular expressions the Llama-3 and Qwen2/3 tokenizers split text with before byte-level BPE.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def hub_kind(folder, split: str, specials: list[str], bos: str | None, eos: str):
    """A byte-level BPE in the form of a Hub tokenizer (its split regex; Llama-3 kind: a template
    adding BOS), made ready for pretraining by `mlmclm tokenize --from` (prepare_tokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400,
            show_progress=False,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos).save_pretrained(
        str(folder / "hub")
    )
    return prepare_tokenizer(folder / "hub", folder / "tok", verbose=False)


def our_bpe(folder):
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    return train_tokenizer([str(corpus)], folder / "tok", 400, progress=False)


KINDS = {
    "bpe": our_bpe,
    "llama3": lambda d: hub_kind(
        d,
        LLAMA3_SPLIT,
        ["<|begin_of_text|>", "<|end_of_text|>"]
        + [f"<|reserved_special_token_{i}|>" for i in range(4)],
        "<|begin_of_text|>",
        "<|end_of_text|>",
    ),
    "qwen3": lambda d: hub_kind(
        d, QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>"
    ),
}


def model_folder(tok_dir, out):
    """A tiny EuroBert on the tokenizer (enough for sentence-transformers to load it), saved as
    an export: the tokenizer with the document rule, the export record beside it."""
    from transformers import EuroBertConfig, EuroBertModel

    tok = load_tokenizer_folder(tok_dir)
    torch.manual_seed(0)
    EuroBertModel(
        EuroBertConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ).save_pretrained(out)
    document_tokenizer(tok)
    tok.save_pretrained(out)
    (out / EXPORT_FILE).write_text(json.dumps({"tokenizer_rule": "document"}))
    return out


def shard_ids(texts: list[str], tok_dir, folder) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = folder / "texts.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess([str(src)], folder / "shard", tok_dir, progress=False)
    ds = IndexedDataset(str(folder / "shard_text_document"))
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_family_encodes_inputs_as_preprocess_writes_documents(kind, tmp_path):
    tok_dir = KINDS[kind](tmp_path)
    folder = model_folder(tok_dir, tmp_path / "model")
    reg = load_registry()
    # the join (EncodEval's, and an entry's `pairs: joined`): the template's one text
    mnli, squad = (dataclasses.replace(reg[t], pairs="joined") for t in ("mnli", "squad"))
    ir_task = reg["msmarco"]
    texts = [
        sc.text_of(mnli, PAIR),
        " ".join(WORDS),
        f"Question: {QUESTION['question']}\nContext: {QUESTION['context']}",
        ir.query_text(ir_task, QUERY),
        ir.document_text(ir_task, DOC),
    ]
    pairs = [PAIR["text_a"], PAIR["text_b"], QUESTION["question"], QUESTION["context"]]
    want, as_pairs = (lambda ids: (ids[:5], ids[5:]))(shard_ids(texts + pairs, tok_dir, tmp_path))
    tok = load_tokenizer(str(folder))

    # the pair form (the default protocol's): the first text's document, then the second's
    got = sc.encode(reg["mnli"], [PAIR], tok, 128, {"entailment": 0})[0]["input_ids"]
    assert got == as_pairs[0] + as_pairs[1]
    assert qa.windows(reg["squad"], [QUESTION], tok, 128, 32)[0]["input_ids"] == (
        as_pairs[2] + as_pairs[3]
    )

    got_sc = sc.encode(mnli, [PAIR], tok, 128, {"entailment": 0})[0]["input_ids"]
    got_tc = tc.encode(
        [{"tokens": WORDS, "tags": TAGS}],
        tok,
        128,
        {t: i for i, t in enumerate(set(TAGS))},
        "first",
    )[0]
    got_qa = qa.windows(squad, [QUESTION], tok, 128, 32)
    st = ir.build_sentence_transformer(str(folder), 128, "cpu", tok.input_form)
    got_ir = [st.preprocess([t])["input_ids"][0].tolist() for t in texts[3:]]
    assert got_sc == want[0]
    assert got_tc["input_ids"] == want[1]
    assert len(got_qa) == 1 and got_qa[0]["input_ids"] == want[2]
    assert got_ir == want[3:]
    for ids in want:  # the document rule itself: EOS last, no BOS
        assert ids[-1] == tok.eos_token_id and tok.bos_token_id not in ids

    # the tokens given to each word are that word (decoded independently, one word at a time)
    words = got_tc["words"]
    for w, word in enumerate(WORDS):
        pieces = [i for i, x in zip(got_tc["input_ids"], words) if x == w]
        assert tok.decode(pieces).strip() == word
    first = [words.index(w) for w in range(len(WORDS))]
    assert [i for i, lab in enumerate(got_tc["labels"]) if lab != -100] == first
    # EncodEval's alignment: every token of a word carries its tag; a word's prediction is the
    # majority of its tokens' (a tie: the tag predicted first)
    label2id = {t: i for i, t in enumerate(sorted(set(TAGS)))}
    every = tc.encode([{"tokens": WORDS, "tags": TAGS}], tok, 128, label2id, "all")[0]
    assert every["input_ids"] == want[1]
    assert every["labels"] == [label2id[TAGS[w]] if w >= 0 else -100 for w in words]
    assert tc.word_tags(
        [1, 0, 1, 2, 2, 0, 1], [0, 0, 0, 1, 1, 2, 2], 4, ["O", "A", "B"], "all"
    ) == ["A", "B", "O", "O"]  # word 3 has no token (cut by truncation)
    # QA as EncodEval's token tagging: one window, 1 on the first answer's tokens
    [tagged] = qa.encode_tagging(squad, [QUESTION], tok, 128)
    assert tagged["input_ids"] == want[2]
    answer = [i for i, x in zip(tagged["input_ids"], tagged["labels"]) if x == 1]
    assert tok.decode(answer).strip() == "The war"

    # any tool loading the export encodes the documents: the rule is in its tokenizer.json
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(folder))(texts)["input_ids"] == want
    if kind == "llama3":  # what the tokenizer does left to itself: the test can tell
        raw = AutoTokenizer.from_pretrained(str(tok_dir))(texts[0])["input_ids"]
        assert raw[0] == tok.bos_token_id and raw[1:] == want[0][:-1]


def test_show_inputs_prints_tokens_with_labels(tmp_path, capsys, data):
    folder = model_folder(our_bpe(tmp_path), tmp_path / "model")
    capsys.readouterr()
    assert (
        main(
            [
                "evaluate",
                "--model",
                str(folder),
                "--task",
                "conll2003",
                "mnli",
                "--show-inputs",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "model / conll2003 (protocol default; inputs: the folder's tokenizer as saved): the "
        "first 2 of 14041 training inputs" in out
    )
    first = out.splitlines()[2]  # EU rejects German call to boycott British lamb .
    assert first.startswith("#0 ") and "/B-ORG" in first and first.endswith("</s>/-")
    assert "ĠGerman/B-MISC" in first or "ĠGer" in first
    # MNLI's premise and hypothesis as two documents, each ending with EOS
    pair = next(line for line in out.splitlines() if "label=entailment: " in line)
    assert pair.count(" </s>") == 2 and pair.endswith(" </s>") and "Premise" not in pair
    assert not (tmp_path / "results").exists()
