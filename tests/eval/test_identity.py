"""A result follows the content of the model folder it fine-tuned (identity.py): a copied or
identically re-written folder keeps its results, a changed weight, tokenizer or export record
does not; the digests are cached by (path, size, modification time), so checking an unchanged
folder reads no weight. A re-export of one checkpoint: tests/test_convert.py."""

from __future__ import annotations

import json
import shutil

from megatron_mlmclm import identity
from megatron_mlmclm.cli import main
from megatron_mlmclm.eval.finetune import write_result
from megatron_mlmclm.eval.grid import expand, result_paths
from megatron_mlmclm.identity import IdentityCache, legacy_identity, model_identity
from megatron_mlmclm.paths import EXPORT_FILE

RECORD = {  # the fields `mlmclm convert to-hf` writes (convert/hf_export.py)
    "checkpoint": "runs/a/checkpoints/iter_0000200",
    "iteration": 200,
    "run": "a",
    "arch": "eurobert",
    "causal_lm": False,
    "saved_layout": {"tp": 1, "pp": 1, "dp": 2, "vpp": 0},
    "shards": {"vocab_sha256": "ab", "path": "/abs/tok", "bos": False, "append_eod": True},
    "tokenizer_rule": "document",
    "verification": {"max_abs_diff": 0.0, "batch": 2, "seq": 64},
}


def copy(src, dst):
    """A copy as `cp -r` makes it: new files, new modification times."""
    shutil.copytree(src, dst, copy_function=shutil.copy)
    return dst


def test_the_identity_is_the_folders_content(tiny_model, tmp_path):
    a = copy(tiny_model, tmp_path / "a" / "tiny")  # copies: other paths, other times
    b = copy(tiny_model, tmp_path / "b" / "tiny")
    base = model_identity(tiny_model)
    assert model_identity(a) == model_identity(b) == base
    weights = b / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes written anew
    (b / "README.md").write_text("a model card")
    (b / ".cache").mkdir()
    assert model_identity(b) == base

    def changed(edit) -> str:
        c = copy(tiny_model, tmp_path / f"c{len(list(tmp_path.iterdir()))}")
        edit(c)
        return model_identity(c)

    def edit_json(name, **values):
        def edit(folder):
            doc = json.loads((folder / name).read_text())
            doc.update(values)
            (folder / name).write_text(json.dumps(doc))

        return edit

    def tokenizer_template(folder):  # another special token after the text
        doc = json.loads((folder / "tokenizer.json").read_text())
        doc["post_processor"]["single"][-1]["SpecialToken"]["id"] = "<mask>"
        (folder / "tokenizer.json").write_text(json.dumps(doc))

    def weight(folder):
        raw = bytearray((folder / "model.safetensors").read_bytes())
        raw[-1] ^= 1
        (folder / "model.safetensors").write_bytes(bytes(raw))

    others = {
        "tokenizer.json": changed(tokenizer_template),
        "tokenizer_config.json": changed(edit_json("tokenizer_config.json", model_max_length=77)),
        "special_tokens_map.json": changed(
            lambda f: (f / "special_tokens_map.json").write_text('{"cls_token": "<s>"}')
        ),
        "a vocabulary": changed(lambda f: (f / "vocab.txt").write_text("a\nb\n")),
        "config.json": changed(edit_json("config.json", rms_norm_eps=1e-6)),
        "a weight": changed(weight),
        "an export record": changed(lambda f: (f / EXPORT_FILE).write_text(json.dumps(RECORD))),
    }
    assert base not in others.values() and len(set(others.values())) == len(others), others


def test_an_export_record_counts_less_its_volatile_fields(tiny_model, tmp_path):
    def with_record(name, **changes) -> str:
        folder = copy(tiny_model, tmp_path / name)
        (folder / EXPORT_FILE).write_text(json.dumps({**RECORD, **changes}))
        return model_identity(folder)

    base = with_record("base")
    same = {  # where the checkpoint was read from, its layout, the logits check, any path
        "checkpoint": "/elsewhere/iter_0000200",
        "saved_layout": {"tp": 2, "pp": 1, "dp": 1, "vpp": 0},
        "verification": {"max_abs_diff": 3e-7, "batch": 2, "seq": 64},
        "shards": {**RECORD["shards"], "path": "/other/tok"},
    }
    for key, value in same.items():
        assert with_record(f"same-{key}", **{key: value}) == base, key
    other = {
        "tokenizer_rule": "template",
        "shards": {**RECORD["shards"], "bos": True},
        "iteration": 400,
    }
    for key, value in other.items():
        assert with_record(f"other-{key}", **{key: value}) != base, key


def test_an_unchanged_folder_is_checked_without_reading_a_weight(tiny_model, tmp_path, monkeypatch):
    model = copy(tiny_model, tmp_path / "tiny")
    read = []
    digest = identity.file_digest
    monkeypatch.setattr(identity, "file_digest", lambda p: read.append(p.name) or digest(p))
    cache_file = tmp_path / "res" / identity.CACHE_FILE
    first = model_identity(model, IdentityCache(cache_file))
    assert "model.safetensors" in read and cache_file.is_file()
    read.clear()
    assert model_identity(model, IdentityCache(cache_file)) == first and read == []
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # re-written: read once more, the same model
    assert model_identity(model, IdentityCache(cache_file)) == first
    assert read == ["model.safetensors"]
    read.clear()
    assert model_identity(model, IdentityCache(cache_file)) == first and read == []

    # two array elements adding to the cache at once: each rewrites it whole, merged with what
    # it finds, so neither loses what was there and the file stays readable
    other = copy(tiny_model, tmp_path / "other")
    x, y = IdentityCache(cache_file), IdentityCache(cache_file)
    model_identity(other, x)
    (other / "extra.json").write_text("{}")
    model_identity(other, y)
    files = json.loads(cache_file.read_text())["files"]
    assert str((other / "extra.json").resolve()) in files
    assert str((model / "model.safetensors").resolve()) in files
    cache_file.write_text("{not json")  # a broken cache is only a cache: hashed again
    read.clear()
    assert model_identity(model, IdentityCache(cache_file)) == first and read


def test_results_follow_a_copy_and_a_tokenizer_change(tiny_model, tmp_path, capsys):
    """Through the grid: results written for a folder count for its copy, elsewhere under the
    same name, and no longer once its tokenizer changes; a result of schema 5 counts while the
    folder is as it was (that schema's identity: weights by size and time, no tokenizer)."""
    model = copy(tiny_model, tmp_path / "a" / "tiny")
    out = tmp_path / "res"
    cfgs = expand([str(model)], ["sst2"], [1e-3], [0, 1], max_steps=3)
    paths = result_paths(cfgs, out)
    for path, schema, ident in ((paths[0], 6, model_identity), (paths[1], 5, legacy_identity)):
        write_result({"schema": schema, "status": "done", "model_identity": ident(model)}, path)

    def states(folder):
        capsys.readouterr()
        args = ["evaluate", "--model", str(folder), "--task", "sst2", "--lrs", "1e-3",
                "--seeds", "0", "1", "--out", str(out), "--max-steps", "3", "--list"]  # fmt: skip
        assert main(args) == 0
        return [line.split("\t")[1] for line in capsys.readouterr().out.splitlines()]

    assert states(model) == ["done", "done"]
    moved = copy(model, tmp_path / "b" / "tiny")
    assert states(moved) == ["done", "todo"]  # schema 5 knew the weights by their times
    config = json.loads((moved / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77
    (moved / "tokenizer_config.json").write_text(json.dumps(config))
    assert states(moved) == ["todo", "todo"]
