"""QA windows (doc stride) put the answer where it is, keep the question part and EOS in every
window, and v2 null-score handling; for the template's join (EncodEval's), whose tokens around
the context every window keeps."""

from __future__ import annotations

import dataclasses

import torch

from megatron_mlmclm.eval.families.qa import encode_train, postprocess, windows
from megatron_mlmclm.eval.input_form import load_tokenizer
from megatron_mlmclm.eval.tasks import load_registry

CONTEXT = " ".join(f"w{i}" for i in range(60)) + " the answer is Paris France today ."
RECORD = {
    "id": "q1",
    "question": "where is it ?",
    "context": CONTEXT,
    "answers": {"text": ["Paris France"], "answer_start": [CONTEXT.index("Paris")]},
}


def test_doc_stride_windows_label_the_answer(tiny_model):
    tok = load_tokenizer(tiny_model)
    task = dataclasses.replace(load_registry()["squad"], pairs="joined")
    full = tok(f"Question: {RECORD['question']}\nContext: {CONTEXT}")["input_ids"]
    feats = encode_train(task, [RECORD], tok, max_length=32, stride=8)
    assert len(feats) > 2  # long context -> several windows
    hits = [f for f in feats if f["start_positions"] > 0]
    assert hits and all(f["start_positions"] == 0 for f in feats if f not in hits)
    for f in hits:
        span = f["input_ids"][f["start_positions"] : f["end_positions"] + 1]
        assert tok.decode(span) == "Paris France"
    head = full[: len(tok(f"Question: {RECORD['question']}\nContext:")["input_ids"]) - 1]
    for f in feats:  # every window: the question part, a slice of the context, then EOS
        assert f["input_ids"][: len(head)] == head and f["input_ids"][-1] == tok.eos_token_id
        assert len(f["input_ids"]) <= 32

    evals = windows(task, [RECORD], tok, 32, 8)
    words = [[o and CONTEXT[o[0] : o[1]].strip() for o in e["offsets"]] for e in evals]
    f, s = next(  # a window holding the whole answer
        (i, j)
        for i, w in enumerate(words)
        for j in range(len(w) - 1)
        if w[j : j + 2] == ["Paris", "France"]
    )
    starts = [torch.zeros(len(e["input_ids"])) for e in evals]
    ends = [torch.zeros(len(e["input_ids"])) for e in evals]
    starts[f][s], ends[f][s + 1] = 5.0, 5.0
    assert postprocess([RECORD], evals, starts, ends, 1, 30, 0.0) == {"q1": "Paris France"}
    # v2: the null score (position 0; the lowest over the windows, as in HF run_qa) above the
    # best span -> no answer
    for st, en in zip(starts, ends):
        st[0], en[0] = 6.0, 6.0
    assert postprocess([RECORD], evals, starts, ends, 2, 30, 0.0) == {"q1": ""}
    assert postprocess([RECORD], evals, starts, ends, 2, 30, 5.0) == {"q1": "Paris France"}


def test_a_long_question_loses_its_own_tokens_only(tiny_model):
    """max_length 32 leaves stride 8 room only if the question takes <= 8 tokens: a 40-word
    question is cut to a quarter of max_length, its own last tokens only: every window keeps the
    template's tokens around it (<s>, "Question:", the separator "Context:", </s>), and the answer
    is still labelled in the context."""
    tok = load_tokenizer(tiny_model)
    task = dataclasses.replace(load_registry()["squad"], pairs="joined")
    long = dict(RECORD, question=" ".join(["where"] * 40) + " ?")
    feats = encode_train(task, [long], tok, max_length=32, stride=8)
    hits = [f for f in feats if f["start_positions"] > 0]
    assert hits
    for f in hits:
        assert (
            tok.decode(f["input_ids"][f["start_positions"] : f["end_positions"] + 1])
            == "Paris France"
        )
    # the reference: the tokenizer's own encoding of the template around the first 8 words (one
    # token each in this word-level vocabulary), less the </s> it ends with
    head = tok(f"Question: {' '.join(['where'] * 8)}\nContext: ")["input_ids"][:-1]
    assert (
        head[0] == tok.bos_token_id and len(head) == 1 + 2 + 8 + 2
    )  # <s> Question : ... Context :
    for w in windows(task, [long], tok, 32, 8):
        assert w["input_ids"][: len(head)] == head and w["input_ids"][-1] == tok.eos_token_id
        assert w["offsets"][len(head)] is not None and len(w["input_ids"]) <= 32
