"""Every family fine-tunes every kind of folder in its own input form: BERT, RoBERTa, ModernBERT,
DeBERTa-v2, EuroBERT, a raw Llama decoder and our own export (tests/eval/kinds.py: tiny models from
configs, tokenizers of the real kinds built here). The reference for each input is the folder's
tokenizer loaded afresh by transformers, as a user's script would load it; each kind's template
tokens are also named, so a dropped or added one fails. Text is text: a special token's string in
a text is encoded as its ordinary tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from kinds import KINDS, build

from megatron_mlmclm.cli import main
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.eval.families import ir, qa, sc, tc
from megatron_mlmclm.eval.finetune import FinetuneConfig, run_finetune, show_inputs
from megatron_mlmclm.eval.grid import preflight
from megatron_mlmclm.eval.input_form import load_tokenizer
from megatron_mlmclm.eval.protocols import resolve
from megatron_mlmclm.eval.tasks import get_task
from megatron_mlmclm.paths import EXPORT_FILE

# the special tokens each kind's template puts first and last (None: nothing there)
TEMPLATE = {
    "bert": ("[CLS]", "[SEP]"),
    "roberta": ("<s>", "</s>"),
    "modernbert": ("[CLS]", "[SEP]"),
    "deberta": ("[CLS]", "[SEP]"),
    "eurobert": ("<|begin_of_text|>", "<|end_of_text|>"),
    "llama": ("<|begin_of_text|>", None),
    "export": (None, "</s>"),
}
# the pair form each kind's tokenizer gives two texts, in the notation of `tokenizers` ($B:1: token
# type 1, shown where the model takes token types)
PAIR_TEMPLATE = {
    "bert": "[CLS] $A [SEP] $B:1 [SEP]:1",
    "roberta": "<s> $A </s> </s> $B </s>",
    "modernbert": "[CLS] $A [SEP] $B [SEP]",
    "deberta": "[CLS] $A [SEP] $B [SEP]",
    "eurobert": "<|begin_of_text|> $A <|end_of_text|> $B <|end_of_text|>",
    "llama": "<|begin_of_text|> $A <|begin_of_text|> $B",
    "export": "$A </s> $B </s>",
}
# strings of special tokens, met in web text about NLP
SPECIAL_TEXT = (
    "the <mask> token, </s> and <s>, <pad>, [MASK] and [SEP], <|begin_of_text|> and "
    "<|reserved_special_token_0|>"
)
PAIRS = [
    ("The cat sat on the mat.", "A cat was sitting.", "yes"),
    ("The war began in 1914.", "Nothing began.", "no"),
    (SPECIAL_TEXT, "Special tokens are text here.", "yes"),
    ("EU rejects German call.", "The EU agrees.", "no"),
]
SENTENCES = [
    (["EU", "rejects", "German", "call", "."], ["B-ORG", "O", "B-MISC", "O", "O"]),
    (["Peter", "Blackburn", "visited", "Paris"], ["B-PER", "I-PER", "O", "B-LOC"]),
]
CONTEXT = "The war began in 1914 in Europe."
QUESTIONS = [
    ("Who began it?", "The war", 0),
    ("When did it begin?", "1914", CONTEXT.index("1914")),
    ("Where was it?", "Europe", CONTEXT.index("Europe")),
]
DOCS = {f"d{i}": f"Passage {i} is about the cat number {i} in Europe." for i in range(8)}
QUERIES = {f"q{i}": f"which cat is number {i}" for i in range(8)}


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A task file with one small task per family (and the pair form of SC and QA), its data,
    and the texts the tokenizers are trained on."""
    root = tmp_path_factory.mktemp("forms")
    sc_rows = [{"premise": a, "hypothesis": b, "label": y} for a, b, y in PAIRS]
    tc_rows = [{"tokens": w, "tags": t} for w, t in SENTENCES]
    qa_rows = [
        {
            "id": str(i),
            "question": q,
            "context": CONTEXT,
            "answers": {"text": [a], "answer_start": [s]},
        }
        for i, (q, a, s) in enumerate(QUESTIONS)
    ]
    for split in ("train", "validation", "test"):
        _jsonl(root / "sc" / f"{split}.jsonl", sc_rows * 2)
        _jsonl(root / "tc" / f"{split}.jsonl", tc_rows * 2)
        _jsonl(root / "qa" / f"{split}.jsonl", qa_rows)
    _jsonl(root / "ir/corpus.jsonl", [{"_id": d, "title": "", "text": t} for d, t in DOCS.items()])
    _jsonl(root / "ir/queries.jsonl", [{"_id": q, "text": t} for q, t in QUERIES.items()])
    (root / "ir/qrels").mkdir()
    for split, ids in (("train", range(0, 6)), ("test", range(6, 8))):
        lines = "".join(f"q{i}\td{i}\t1\n" for i in ids)
        (root / "ir/qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + lines)
    splits = "splits: {train: train.jsonl, validation: validation.jsonl, test: test.jsonl}"
    entries = {
        "f_sc": f"family: sc\n  format: jsonl\n  path: {root / 'sc'}\n  {splits}\n"
        "  text_a: premise\n  text_b: hypothesis\n  label: label",
        "f_tc": f"family: tc\n  format: jsonl\n  path: {root / 'tc'}\n  {splits}\n"
        "  tags_field: tags",
        "f_qa": f"family: qa\n  format: jsonl\n  path: {root / 'qa'}\n  {splits}",
        "f_ir": f"family: ir\n  format: beir\n  path: {root / 'ir'}\n"
        "  splits: {train: train, validation: train, test: test}\n  validation_holdout: 0.5\n"
        '  query_template: "Query: {text}"\n  document_template: "Document: {text}"',
    }
    entries["f_sc_joined"] = entries["f_sc"] + "\n  pairs: joined"
    entries["f_ir_bounded"] = entries["f_ir"] + "\n  validation_documents: 2"
    yaml = root / "tasks.yaml"
    yaml.write_text("".join(f"{name}:\n  {body}\n" for name, body in entries.items()))
    corpus = [f"{a} {b}" for a, b, _ in PAIRS] + [" ".join(w) for w, _ in SENTENCES]
    corpus += [f"Question: {q}\nContext: {CONTEXT}" for q, _, _ in QUESTIONS]
    corpus += [f"Query: {t}" for t in QUERIES.values()] + [f"Document: {t}" for t in DOCS.values()]
    return {"file": str(yaml), "corpus": corpus * 4, "root": root}


def config(folder, task, tasks, **kw) -> FinetuneConfig:
    return FinetuneConfig(
        model=str(folder),
        task=task,
        lr=1e-3,
        max_steps=2,
        epochs=None,
        batch_size=4,
        eval_batch_size=8,
        eval_every=1,
        curve_examples=2,
        max_length=64,
        ir_mini_batch_size=4,
        threads=1,
        progress=False,
        task_files=[tasks["file"]],
        **kw,
    )


def entry(name, tasks, protocol="default"):
    return resolve(get_task(name, [tasks["file"]]), protocol)


def reference(folder, key="input_ids", **kw):
    """The folder's tokenizer as a user's script loads it (special-token strings as text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    kw = {"split_special_tokens": True, "return_token_type_ids": True, **kw}
    return lambda *texts: tok(*texts, **kw)[key]


def takes_token_types(folder) -> bool:
    """Whether the folder's model has a token type embedding that tells two texts apart."""
    config = json.loads((folder / "config.json").read_text())
    return (config.get("type_vocab_size") or 0) > 1


def check_template(ids, tok, kind):
    """`ids` begin and end with the kind's template tokens and hold no other special id."""
    first, last = TEMPLATE[kind]
    toks = tok.convert_ids_to_tokens(ids)
    specials = set(tok.all_special_ids)
    assert toks[0] == first if first else ids[0] not in specials, toks
    assert toks[-1] == last if last else ids[-1] not in specials, toks
    assert not set(ids[first is not None : len(ids) - (last is not None)]) & specials, toks


@pytest.mark.parametrize("kind", KINDS)
def test_every_family_fine_tunes_each_kind_in_its_own_form(kind, tasks, tmp_path):
    folder = build(kind, tasks["corpus"], tmp_path / kind)
    tok = load_tokenizer(str(folder))
    ref = reference(folder)
    cfg = config(folder, "f_sc", tasks)

    # SC: two texts in the tokenizer's pair form, token types where the model takes them
    sc_task = entry("f_sc", tasks)
    data = sc.inputs(sc_task, tok, cfg, 128)
    types = reference(folder, "token_type_ids")
    for item, (a, b, _) in zip(data.train, PAIRS * 2):
        if a != SPECIAL_TEXT:  # (a Unigram model reaches its special pieces from text: below)
            assert item["input_ids"] == ref(a, b) != ref(f"{a}\n{b}")
        assert item.get("token_type_ids") == (types(a, b) if takes_token_types(folder) else None)
    if kind == "bert":  # [CLS] a [SEP] then b [SEP] of type 1
        assert set(data.train[0]["token_type_ids"]) == {0, 1}
    # the join (an entry's `pairs: joined`): the template, one text, in the one-text form
    joined = sc.inputs(dataclasses.replace(sc_task, pairs="joined"), tok, cfg, 128)
    for item, (a, b, _) in zip(joined.train, PAIRS * 2):
        if a != SPECIAL_TEXT:
            assert item["input_ids"] == ref(f"{a}\n{b}")
        check_template(item["input_ids"], tok, kind)
    row, (first, last) = joined.train[2]["input_ids"], TEMPLATE[kind]
    text = tok.decode(row[first is not None : len(row) - (last is not None)])
    assert "".join(text.split()) == "".join(f"{PAIRS[2][0]}{PAIRS[2][1]}".split())  # decodes back
    # encodeval (a tokenizer with an EOS): EncodEval's join, the text's tokens then EOS
    if tok.eos_token_id is not None:
        eos = load_tokenizer(str(folder), "eos")
        plain = reference(folder, add_special_tokens=False)
        for item, (a, b, _) in zip(
            sc.inputs(entry("f_sc", tasks, "encodeval"), eos, cfg, 128).train, PAIRS
        ):
            if a != SPECIAL_TEXT:
                assert item["input_ids"] == plain(f"{a}\n{b}") + [tok.eos_token_id]

    # TC: template tokens carry no label; each word's first token carries its tag
    words, tags = SENTENCES[1]
    [feat] = tc.encode([{"tokens": words, "tags": tags}], tok, 128, {"O": 0}, "first")
    assert feat["input_ids"] == ref(" ".join(words))
    check_template(feat["input_ids"], tok, kind)
    owners = feat["words"]
    special = [i in tok.all_special_ids for i in feat["input_ids"]]
    assert all(w == -1 for w, s in zip(owners, special) if s)
    for w, word in enumerate(words):  # the tokens given to a word decode to it
        pieces = [i for i, o in zip(feat["input_ids"], owners) if o == w]
        assert tok.decode(pieces).replace(" ", "").replace("▁", "") == word

    # QA: one window holds the whole input, question and context in the pair form (joined by
    # the template where the entry asks); the answer's tokens decode to it
    qa_task = entry("f_qa", tasks)
    q, answer, start = QUESTIONS[1]
    record = {"id": "1", "question": q, "context": CONTEXT}
    record["answers"] = {"text": [answer], "answer_start": [start]}
    [window] = qa.windows(qa_task, [record], tok, 128, 16)
    assert window["input_ids"] == ref(q, CONTEXT)
    assert window.get("token_type_ids") == (
        types(q, CONTEXT) if takes_token_types(folder) else None
    )
    hits = qa.answer_tokens(window["offsets"], record)
    assert tok.decode([window["input_ids"][j] for j in hits]).strip() == answer
    [window] = qa.windows(dataclasses.replace(qa_task, pairs="joined"), [record], tok, 128, 16)
    assert window["input_ids"] == ref(f"Question: {q}\nContext: {CONTEXT}")
    check_template(window["input_ids"], tok, kind)
    hits = qa.answer_tokens(window["offsets"], record)
    assert tok.decode([window["input_ids"][j] for j in hits]).strip() == answer

    # IR: sentence-transformers encodes through the same form
    st = ir.build_sentence_transformer(str(folder), 64, "cpu", tok.input_form)
    query = "Query: which cat is number 3"
    assert st.preprocess([query])["input_ids"][0].tolist() == ref(query)

    # --show-inputs shows the form: the kind's pair template, each input's tokens
    shown = show_inputs(cfg, 3).splitlines()
    first, last = TEMPLATE[kind]
    single = " ".join(t for t in (first, "$A", last) if t)
    assert shown[1] == f"form: one text `{single}`; two texts `{PAIR_TEMPLATE[kind]}` (the " + (
        "tokenizer's pair form)"
    ), shown
    a, b, _ = PAIRS[1]
    assert shown[3].split(": ", 1)[1].split() == tok.convert_ids_to_tokens(ref(a, b)), shown
    row = shown[4].split(": ", 1)[1].split()  # special-token strings in the text are text
    assert "<mask>" not in row and row.count("[SEP]") == 2 * (TEMPLATE[kind][1] == "[SEP]")

    # a few steps of each family; the curve's first point scores a sample of validation
    for name in ("f_sc", "f_tc", "f_qa", "f_ir"):
        result = run_finetune(config(folder, name, tasks), log=lambda *_: None)
        assert result["status"] == "done" and result["steps"] == 2, name
        assert result["metric"] in result["metrics"]["test"], name
        inputs = result["info"]["inputs"]
        assert inputs["rule"] == "folder" and inputs["single"] == single, name
        assert inputs.get("pair") == (PAIR_TEMPLATE[kind] if name in ("f_sc", "f_qa") else None)
        if name != "f_ir":
            assert result["info"]["eval_examples"]["curve"] == 2, name


def test_the_pair_form_gives_bert_its_segments(tasks, tmp_path, capsys):
    """SC's two texts and QA's question and context in BERT's pair form, with token type ids; the
    join an entry may ask for (`pairs: joined`, its newline lost to BERT's normalizer) warned of
    by --show-inputs, evaluate and the result; a saved IR model keeps the form and the MTEB
    prompt keys."""
    folder = build("bert", tasks["corpus"], tmp_path / "bert")
    tok = load_tokenizer(str(folder))
    ref = reference(folder)
    cfg = config(folder, "f_sc", tasks)
    data = sc.inputs(entry("f_sc", tasks), tok, cfg, 64)
    a, b, _ = PAIRS[0]
    assert data.train[0]["input_ids"] == ref(a, b)
    types = data.train[0]["token_type_ids"]
    sep = tok.convert_tokens_to_ids("[SEP]")
    cut = data.train[0]["input_ids"].index(sep) + 1
    assert set(types[:cut]) == {0} and set(types[cut:]) == {1}

    q, answer, start = QUESTIONS[2]
    record = {"id": "2", "question": q, "context": CONTEXT}
    record["answers"] = {"text": [answer], "answer_start": [start]}
    [window] = qa.windows(entry("f_qa", tasks), [record], tok, 64, 16)
    assert window["input_ids"] == ref(q, CONTEXT) and window["token_type_ids"][-1] == 1
    hits = qa.answer_tokens(window["offsets"], record)
    assert tok.decode([window["input_ids"][j] for j in hits]) == answer
    # a long question at a small length: its own tokens are cut to 24 // 4, [CLS] and [SEP] stay
    long = dict(record, question=" ".join(["which cat"] * 20) + "?")
    head = [tok.cls_token_id, *ref(long["question"])[1:7], sep]
    for w in qa.windows(entry("f_qa", tasks), [long], tok, 24, 4):
        assert w["input_ids"][:8] == head and w["input_ids"][-1] == sep

    # the join: "a\nb" reads as "a b" to BERT, which --show-inputs, evaluate and the result say
    joined = sc.inputs(entry("f_sc_joined", tasks), tok, cfg, 64).train[0]["input_ids"]
    assert joined == ref(f"{a}\n{b}") == ref(f"{a} {b}")
    shown = show_inputs(config(folder, "f_sc_joined", tasks), 1).splitlines()
    warning = "nothing the tokenizer keeps separates the two texts: the template's '\\n'"
    assert shown[0].startswith(f"warning: bert / f_sc_joined: {warning}"), shown
    assert shown[2] == "form: one text `[CLS] $A [SEP]`; two texts `[CLS] $A\\n$B [SEP]` (joined)"
    logged = []
    preflight([config(folder, t, tasks) for t in ("f_sc", "f_sc_joined")], log=logged.append)
    assert [line.split(": ")[1] for line in logged] == ["bert / f_sc_joined"], logged
    result = run_finetune(config(folder, "f_sc_joined", tasks), log=lambda *_: None)
    assert result["info"]["inputs"]["warning"].startswith(warning)
    assert result["info"]["inputs"]["template"] == "{text_a}\n{text_b}"
    for name in ("f_sc", "f_qa"):  # BERT's pair form: no warning
        assert "warning" not in show_inputs(config(folder, name, tasks), 1), name

    from sentence_transformers import SentenceTransformer

    saved = tmp_path / "st"
    run_finetune(config(folder, "f_ir", tasks), log=lambda *_: None, save_to=saved)
    st = SentenceTransformer(str(saved), device="cpu")
    ids = st.preprocess(["a [SEP] b"])["input_ids"][0].tolist()
    assert ids[0] == tok.cls_token_id and ids[-1] == sep and ids.count(sep) == 1
    assert st.prompts["query"] == "Query: " and st.prompts["document"] == "Document: "


def test_an_earlier_export_gets_the_document_rule_and_encodeval_its_own(tasks, tmp_path, capsys):
    folder = build("export", tasks["corpus"], tmp_path / "export")
    # as an earlier mlmclm wrote it: the tokenizer without the rule, the record without its name
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    tokenizer = json.loads((legacy / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None
    (legacy / "tokenizer.json").write_text(json.dumps(tokenizer))
    (legacy / EXPORT_FILE).write_text(json.dumps({"arch": "eurobert"}))
    capsys.readouterr()
    assert (
        main(
            ["evaluate", "--model", str(legacy), "--task-file", tasks["file"]]
            + ["--task", "f_sc", "--show-inputs", "3"]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"note: {legacy} is an export of an earlier mlmclm") and len(out) == 6
    # the document rule's pair form: two documents, each text then its EOS
    assert (
        out[2]
        == "form: one text `$A </s>`; two texts `$A </s> $B </s>` (the tokenizer's pair form)"
    )
    # the row holding special-token strings is shown as its text: no special token but the EOSs
    row = out[5].split(": ", 1)[1].split()
    assert row[-1] == "</s>" and row.count("</s>") == 2, row
    assert not {"<mask>", "<s>", "<pad>"} & set(row), row
    assert "".join(t for t in row if t != "</s>").replace("Ġ", "") == "".join(
        f"{PAIRS[2][0]}{PAIRS[2][1]}".split()
    )
    tok = load_tokenizer(str(legacy))
    assert tok.input_form.rule == "document"
    assert tok("a b")["input_ids"] == load_tokenizer(str(folder))("a b")["input_ids"]
    # the rule of the export's shards, as its record has it: documents that began with BOS and
    # ended without EOS (Megatron-LM's shards may) are encoded so
    record = {"arch": "eurobert", "shards": {"bos": True, "append_eod": False}}
    (legacy / EXPORT_FILE).write_text(json.dumps(record))
    words = reference(folder)("a b")[:-1]  # the folder's document rule: text, EOS
    tok = load_tokenizer(str(legacy))
    assert tok("a b")["input_ids"] == [tok.bos_token_id, *words], tok.input_form
    assert tok.input_form.describe() == "BOS, text, no template (document rule)"

    # encodeval: text and eos_token for every folder, no template; no EOS token: refused
    roberta = build("roberta", tasks["corpus"], tmp_path / "roberta")
    tok = load_tokenizer(str(roberta), "eos")
    ids = tok("The cat sat.")["input_ids"]
    assert ids[-1] == tok.eos_token_id and ids[:-1] == reference(roberta)("The cat sat.")[1:-1]
    bert = build("bert", tasks["corpus"], tmp_path / "bert")
    with pytest.raises(UsageError, match="has no eos token"):
        load_tokenizer(str(bert), "eos")
    args = ["evaluate", "--model", str(bert), "--task-file", tasks["file"], "--task", "f_sc"]
    assert main([*args, "--protocol", "encodeval", "--show-inputs", "1"]) == 2
    assert "has no eos token" in capsys.readouterr().err
    # --inputs document asks for the document rule on any folder that has an EOS
    tok = load_tokenizer(str(roberta), "document")
    assert tok("The cat sat.")["input_ids"] == ids
    assert dataclasses.asdict(tok.input_form)["rule"] == "document"


def test_retrieval_validation_encodes_a_bounded_sample_and_test_the_corpus(
    tasks, tmp_path, monkeypatch
):
    """Under `corpus: full`, each validation ranks the judged documents and a fixed sample of
    `validation_documents` others; the test ranks the whole corpus once, on the final model. The
    documents are counted as sentence-transformers receives them."""
    from sentence_transformers import SentenceTransformer

    folder = build("export", tasks["corpus"], tmp_path / "export")
    encoded = []
    encode = SentenceTransformer.encode

    def counting(self, texts, **kw):
        encoded[-1] += sum(t.startswith("Document: ") for t in texts)
        return encode(self, texts, **kw)

    monkeypatch.setattr(SentenceTransformer, "encode", counting)
    cfg = config(folder, "f_ir_bounded", tasks)
    task = entry("f_ir_bounded", tasks)
    judged = {d for docs in ir.load_split(task, "validation").qrels.values() for d in docs}
    real_retrieve = ir.retrieve

    def retrieve(*args, **kw):  # one count per evaluation
        encoded.append(0)
        return real_retrieve(*args, **kw)

    monkeypatch.setattr(ir, "retrieve", retrieve)
    result = run_finetune(cfg, log=lambda *_: None)
    counts = result["info"]["documents_encoded"]
    assert encoded == counts["validation"] + counts["test"]
    assert len(counts["validation"]) == 2 and counts["test"] == [len(DOCS)]
    assert all(n <= len(judged) + 2 < len(DOCS) for n in counts["validation"])
    assert result["test_time_s"] > 0 and result["eval_time_s"] > 0
