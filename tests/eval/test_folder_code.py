"""A Hugging Face folder is read as data: a folder only its own code could load (a model type or a
tokenizer class transformers lacks, named by ``auto_map``) is refused in one line, exit 2, by every
command that loads folders, with its code never run, even when stdin answers "y" to transformers'
question and without a terminal; a folder naming code of its own for a type transformers knows is
loaded by transformers' own classes, its code unread; a folder that lacks what loading needs is
one line too. The payload is real: transformers, allowed to, runs it (the last test)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kinds import build

from megatron_mlmclm.cli import main
from megatron_mlmclm.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
CORPUS = ["The cat sat on the mat.", "A dog ran in the park.", "EU rejects German call."] * 10
# a module that leaves a mark where it runs, then defines classes auto_map names
PAYLOAD = """import pathlib
pathlib.Path({marker!r}).write_text("ran")
import transformers
class EvilConfig(transformers.PretrainedConfig):
    model_type = "evilbert"
class EvilTokenizer(transformers.BertTokenizer):
    pass
"""
AUTO_MAP = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return build("bert", CORPUS, tmp_path_factory.mktemp("kinds") / "bert")


def with_code(bert, folder: Path, config=None, tokenizer=None) -> tuple[Path, Path]:
    """A copy of `bert` whose config.json / tokenizer_config.json are updated with `config` /
    `tokenizer`, holding evil.py; (the folder, the file its code would write)."""
    shutil.copytree(bert, folder)
    marker = folder.parent / f"{folder.name}-RAN"
    (folder / "evil.py").write_text(PAYLOAD.format(marker=str(marker)))
    for name, update in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        if update:
            doc = json.loads((folder / name).read_text())
            (folder / name).write_text(json.dumps({**doc, **update}))
    return folder, marker


def refused(argv, capsys, *needles) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err
    return err


def test_a_folder_only_its_own_code_loads_is_refused_with_yes_on_stdin(bert, tmp_path):
    """`yes y | mlmclm evaluate ...` without a terminal: one line, exit 2, the code never run,
    nothing written."""
    folder, marker = with_code(
        bert, tmp_path / "custom", config={"model_type": "evilbert", "auto_map": AUTO_MAP}
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, "-m", "megatron_mlmclm", "evaluate", "--model", str(folder)]
        + ["--task", "sst2", "--out", str(out), "--max-steps", "1"],
        input="y\n" * 1000,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    err = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(err) == 1, run.stderr
    assert str(folder) in err[0] and "'evilbert'" in err[0], err
    assert "evil.py" in err[0] and "never runs" in err[0], err
    assert not marker.exists() and not out.exists() and not (tmp_path / "modules").exists()


def test_every_loader_refuses_code_and_reads_known_types_natively(bert, tmp_path, capsys):
    from megatron_mlmclm.data.tokenizer import load_tokenizer as load_tokenizer_folder
    from megatron_mlmclm.eval.heads import load_encoder
    from megatron_mlmclm.eval.input_form import load_tokenizer

    # a tokenizer whose class is the folder's own code: evaluate, tokenize's loader, from-hf
    folder, marker = with_code(
        bert,
        tmp_path / "tok",
        tokenizer={
            "tokenizer_class": "EvilTokenizer",
            "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]},
        },
    )
    args = ["evaluate", "--model", str(folder), "--task", "sst2", "--show-inputs", "1"]
    refused(args, capsys, str(folder), "tokenizer is code of its own (evil.py)", "never runs")
    with pytest.raises(UsageError, match="tokenizer is code of its own"):
        load_tokenizer_folder(folder)
    llama = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**llama, "model_type": "llama"}))
    refused(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")], capsys, "never runs")
    assert not marker.exists() and not (tmp_path / "ckpt").exists()

    # code of its own for a type transformers knows: transformers' classes, the code unread
    folder, marker = with_code(bert, tmp_path / "native", config={"auto_map": AUTO_MAP})
    assert type(load_encoder(str(folder))).__name__ == "BertModel"
    assert (
        load_tokenizer(str(folder))("a b")["input_ids"]
        == load_tokenizer(str(bert))("a b")["input_ids"]
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    "case, needle",
    [
        ("unknown type", "model type 'nobert' is not one transformers"),
        ("no encoder class", "has no encoder class (AutoModel) for model type 'blip_text_model'"),
        ("no weights", "has no weights"),
        ("a missing shard", "names weight file(s) the folder lacks: model-00002-of-00002"),
        ("config not JSON", "config.json is not readable JSON"),
    ],
)
def test_a_folder_that_cannot_load_is_one_line(bert, tmp_path, capsys, case, needle):
    folder = tmp_path / "f"
    shutil.copytree(bert, folder)
    config = json.loads((folder / "config.json").read_text())
    if case == "unknown type":
        config["model_type"] = "nobert"
    elif case == "no encoder class":
        config["model_type"] = "blip_text_model"
    elif case in ("no weights", "a missing shard"):
        (folder / "model.safetensors").unlink()
    if case == "a missing shard":
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
        index["weight_map"]["b"] = "model-00002-of-00002.safetensors"
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text("{" if case == "config not JSON" else json.dumps(config))
    refused(
        ["evaluate", "--model", str(folder), "--task", "sst2", "--show-inputs", "1"],
        capsys,
        str(folder),
        needle,
    )


def test_the_payload_runs_where_transformers_is_allowed_to(bert, tmp_path):
    """The control: the same folder, loaded with trust_remote_code=True, runs its code."""
    folder, marker = with_code(
        bert, tmp_path / "custom", config={"model_type": "evilbert", "auto_map": AUTO_MAP}
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    code = (
        "import sys, transformers\n"
        "transformers.AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)"
    )
    subprocess.run([sys.executable, "-c", code, str(folder)], env=env, check=True, timeout=300)
    assert marker.read_text() == "ran"
