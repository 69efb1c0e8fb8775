"""A fine-tuned IR model saved as a sentence-transformers folder loads as is with
SentenceTransformer(path) and embeds exactly as the model that was fine-tuned; templates that are
prefixes become its query / document prompts."""

from __future__ import annotations

import dataclasses
import json

import torch

from megatron_mlmclm.eval.families import ir
from megatron_mlmclm.eval.finetune import FinetuneConfig, seed_everything, train
from megatron_mlmclm.eval.input_form import load_tokenizer
from megatron_mlmclm.eval.tasks import load_registry


def test_saved_ir_model_is_a_sentence_transformers_folder(tiny_model, tmp_path, data):
    from sentence_transformers import SentenceTransformer

    task = dataclasses.replace(
        load_registry()["scifact"],
        query_template="Query: {text}",
        document_template="Document: {text}",
    )
    cfg = FinetuneConfig(
        model=tiny_model,
        task="scifact",
        lr=1e-3,
        max_steps=2,
        batch_size=8,
        max_train_examples=16,
        max_eval_examples=8,
        ir_mini_batch_size=4,
        progress=False,
    )
    seed_everything(0)
    setup = ir.setup(task, load_tokenizer(tiny_model), cfg, 64, torch.device("cpu"))
    train(setup, cfg, torch.device("cpu"))
    folder = tmp_path / "st"
    setup.save(str(folder))

    modules = json.loads((folder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling"]
    pooling = json.loads((folder / modules[1]["path"] / "config.json").read_text())
    # mean pooling, in the keys of sentence-transformers 6 (pooling_mode) or 5 (one flag per mode)
    assert (
        pooling.get("pooling_mode", "mean" if pooling.get("pooling_mode_mean_tokens") else "")
        == "mean"
    )

    loaded = SentenceTransformer(str(folder), device="cpu")
    texts = [
        "Query: stem cells in mice",
        "Document: Nanotechnologies are emerging platforms.",
        "short",
    ]
    setup.model.eval()
    with torch.no_grad():
        want = setup.model.encode(texts, convert_to_tensor=True)
        got = loaded.encode(texts, convert_to_tensor=True)
    assert torch.allclose(want, got, atol=1e-5)
    # the document tokenizer came along: EOS last, as in pretraining
    eos = loaded.tokenizer.eos_token_id
    assert loaded.preprocess(["short"])["input_ids"][0].tolist()[-1] == eos
    # the prefixes are prompts: encoding by prompt name equals encoding the templated text
    assert loaded.prompts["query"] == "Query: " and loaded.prompts["document"] == "Document: "
    with torch.no_grad():
        by_name = loaded.encode(["stem cells in mice"], prompt_name="query", convert_to_tensor=True)
    assert torch.allclose(by_name[0], want[0], atol=1e-5)
