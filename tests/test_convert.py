"""`mlmclm convert`: exact round trips, layout independence, plain-transformers loading, bad input.

Everything is tiny (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab ~300) and built locally: the
tokenizer is a byte-level BPE trained on a generated corpus, HF models are random-initialised from
configs, megatron checkpoints come from short `mlmclm pretrain` runs on mock data.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from jobs import job_env, run_pretrain, snapshot, word_tokenizer
from safetensors.torch import load_file

from megatron_mlmclm.cli import main as cli_main
from megatron_mlmclm.convert.common import read_global_tensors
from megatron_mlmclm.convert.hf_export import resolve_arch, to_hf
from megatron_mlmclm.convert.hf_import import from_hf

MODEL = {
    "preset": None,
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "seq_length": 64,
}
HF_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)
VOCAB_TOKENIZER = 300


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path.parent)) for p in path.parent.glob(path.name + "*")}


# --------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Tokenizer, three HF decoders and megatron checkpoints at TP1, TP2 and PP2 (same weights)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("convert")
    tok_dir = word_tokenizer(root, VOCAB_TOKENIZER)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(tok) == VOCAB_TOKENIZER

    # megatron: TP1 trained 2 steps; TP2 and PP2 start from it and save after one step at
    # lr 1e-30 (an fp32 no-op on weights of magnitude > 1e-22), so their iter_0000001 holds the TP1
    # weights saved at another layout.
    config = root / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data": {"mock": True, "tokenizer": str(tok_dir)},
                "model": MODEL,
                "train": {"micro_batch_size": 1, "global_batch_size": 2},
                "phases": [{"objective": "clm", "share": 0.5}, {"objective": "mlm", "share": 0.5}],
                "logging": {"tensorboard": False},
            }
        )
    )
    run_pretrain(
        config,
        [
            f"output_dir={root / 'tp1'}",
            "train.steps=2",
            "train.warmup_steps=0",
            "train.decay_steps=0",
        ],
    )
    lr0 = [
        f"train.init_from={root / 'tp1' / 'checkpoints'}",
        "train.steps=1",
        "train.lr=1e-30",
        "train.warmup_steps=0",
        "train.decay_steps=0",
        "phases=[{objective: mlm}]",
    ]
    for name, key in (
        ("tp2", "tensor_model_parallel_size"),
        ("pp2", "pipeline_model_parallel_size"),
    ):
        run_pretrain(config, [f"output_dir={root / name}", f"parallel.{key}=2", *lr0], nproc=2)

    hf = {}
    for name, kind, extra in (
        ("llama", "llama", dict(vocab_size=320, tie_word_embeddings=False)),
        ("llama_tied", "llama", dict(vocab_size=300, tie_word_embeddings=True)),
        ("qwen3", "qwen3", dict(vocab_size=320, tie_word_embeddings=False)),
    ):
        hf[name] = make_hf(root / f"hf_{name}", kind, tok, **extra)
    return {
        "root": root,
        "tok": tok_dir,
        "config": config,
        "hf": hf,
        "ckpt": {
            "tp1": root / "tp1" / "checkpoints",
            "tp2": root / "tp2" / "checkpoints" / "iter_0000001",
            "pp2": root / "pp2" / "checkpoints" / "iter_0000001",
        },
    }


def make_hf(
    path: Path, kind: str, tok, seed: int = 0, dtype: torch.dtype = torch.float32, **extra
) -> Path:
    """A random decoder of `kind` saved with `tok` at `path`, its weights stored in `dtype`."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(
        HF_DIMS,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    kw.update(extra)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**kw))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # norms away from 1 so a mapping mistake shows in the logits
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def exported(ws):
    """The TP1 checkpoint exported as EuroBERT (the default for our own models)."""
    return to_hf(ws["ckpt"]["tp1"], ws["root"] / "export_tp1", verbose=False)


def megatron_reference(
    ws, ckpt_dir: Path, tokens: torch.Tensor, causal: bool, rounded: torch.dtype | None = None
) -> torch.Tensor:
    """Logits of the trainer's model loaded the trainer's way, independent of the converter, in
    float32 (its weights first `rounded` to that dtype, kept in float32)."""
    from megatron_mlmclm.checkpoint import latest_checkpoint, load_checkpoint
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.model.build import build_model_chunk, transformer_config
    from megatron_mlmclm.objectives import document_attention_mask
    from megatron_mlmclm.runtime.distributed import init_distributed

    cfg = load_config(
        ws["config"],
        ["train.precision=fp32", "train.steps=2", "train.warmup_steps=0", "train.decay_steps=0"],
    )
    init_distributed(1, 1, None, 0)
    model = build_model_chunk(cfg, transformer_config(cfg), VOCAB_TOKENIZER, True, True).eval()
    load_checkpoint(latest_checkpoint(ckpt_dir), [model], load_rng=False)
    if rounded is not None:
        for p in model.parameters():
            p.data = p.data.to(rounded).float()
    b, s = tokens.shape
    mask = document_attention_mask(torch.zeros(b, s, dtype=torch.long), causal)
    with torch.no_grad():
        logits = model(tokens, torch.arange(s).expand(b, s), mask)
    return logits[..., :VOCAB_TOKENIZER].float()


def run_cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main(["convert", *map(str, args)])
    return rc, capsys.readouterr().err


def assert_refused(capsys, out: Path, *args, match: str) -> None:
    rc, err = run_cli(capsys, *args)
    assert rc == 2, err
    assert err.strip().count("\n") == 0 and match in err, err
    assert not out.exists() and not list(out.parent.glob(out.name + ".tmp-*"))


# --------------------------------------------------------------------------------------------------
# megatron -> HF


def test_export_loads_in_plain_transformers_and_matches_megatron(ws, exported):
    import transformers

    out = exported.path
    assert exported.verification.max_abs_diff <= 1e-4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "eurobert" and cfg["vocab_size"] == VOCAB_TOKENIZER
    assert "auto_map" not in cfg
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.mask_token_id is not None and tok.mask_token_id == cfg["mask_token_id"]
    # the tokenizer encodes a text as the shards hold it: its tokens, then EOS; nothing else
    text = "alpha beta gamma"
    words = transformers.AutoTokenizer.from_pretrained(str(ws["tok"]))(
        text, add_special_tokens=False
    )
    assert tok(text)["input_ids"] == words["input_ids"] + [tok.eos_token_id]
    # two texts (a sentence pair, as run_glue gives them): two documents, each ending with EOS,
    # as the shards hold them
    second = transformers.AutoTokenizer.from_pretrained(str(ws["tok"]))(
        "delta epsilon", add_special_tokens=False
    )
    assert tok(text, "delta epsilon")["input_ids"] == (
        words["input_ids"] + [tok.eos_token_id] + second["input_ids"] + [tok.eos_token_id]
    )
    # a special token's string in the text: the token, as any HF tokenizer parses it (a fill-mask
    # pipeline's input), and with split_special_tokens the text it is, as the shards hold it
    assert tok(f"{text} {tok.mask_token}")["input_ids"][-2] == tok.mask_token_id
    ids = tok(f"{text} {tok.mask_token}", split_special_tokens=True)["input_ids"]
    assert tok.mask_token_id not in ids and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[:-1]) == f"{text} {tok.mask_token}"
    fill = transformers.pipeline("fill-mask", model=str(out), tokenizer=tok, top_k=1)
    assert len(fill(f"{text} {tok.mask_token}")) == 1  # one prediction for the one mask
    assert json.loads((out / "mlmclm_export.json").read_text())["tokenizer_rule"] == "document"

    tokens = torch.randint(0, VOCAB_TOKENIZER, (2, 48), generator=torch.Generator().manual_seed(7))
    ref_bi = megatron_reference(ws, ws["ckpt"]["tp1"], tokens, causal=False)
    ref_causal = megatron_reference(ws, ws["ckpt"]["tp1"], tokens, causal=True)
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = mlm(input_ids=tokens).logits
    assert (got - ref_bi).abs().max().item() < 1e-4
    assert (got - ref_causal).abs().max().item() > 1e-3  # really bidirectional

    base = transformers.AutoModel.from_pretrained(str(out), dtype=torch.float32)
    assert type(base).__name__ == "EuroBertModel"
    for auto, head in (
        (transformers.AutoModelForSequenceClassification, ("dense", "classifier")),
        (transformers.AutoModelForTokenClassification, ("classifier",)),
    ):
        model, info = auto.from_pretrained(str(out), num_labels=3, output_loading_info=True)
        assert all(k.startswith(head) for k in info["missing_keys"]), info
        with torch.no_grad():
            assert torch.isfinite(model(input_ids=tokens).logits).all()


def test_export_same_weights_from_any_layout(ws, exported):
    ref = load_file(str(exported.path / "model.safetensors"))
    for layout in ("tp2", "pp2"):
        res = to_hf(ws["ckpt"][layout], ws["root"] / f"export_{layout}", verbose=False)
        got = load_file(str(res.path / "model.safetensors"))
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (layout, k)
        saved = json.loads((res.path / "mlmclm_export.json").read_text())["saved_layout"]
        assert saved[layout[:2]] == 2


def test_a_re_export_of_one_checkpoint_is_the_same_model(ws, exported, monkeypatch):
    """Converting one checkpoint again (named by another path) writes the same bytes, but for
    the record's `checkpoint` and the model card (which names the folder), and the evaluation
    counts both exports as one model (identity.py): a re-conversion keeps the model's results."""
    from megatron_mlmclm.identity import model_identity

    monkeypatch.chdir(ws["root"])
    again = to_hf("tp1/checkpoints", ws["root"] / "export_tp1_again", verbose=False).path
    first = exported.path
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    differ = [n for n in names if (first / n).read_bytes() != (again / n).read_bytes()]
    assert differ == ["README.md", "mlmclm_export.json"]
    a, b = (json.loads((d / "mlmclm_export.json").read_text()) for d in (first, again))
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == ["checkpoint"]
    assert model_identity(first) == model_identity(again)


def test_megatron_hf_megatron_round_trip_is_exact(ws, exported):
    back = from_hf(exported.path, ws["root"] / "reimport", verbose=False)
    assert back.family == "eurobert" and not back.vocab_grew
    src = read_global_tensors(exported.checkpoint)
    got = read_global_tensors(back.checkpoint)
    assert got.keys() == src.keys()
    for k in src:
        a, b = src[k], got[k]
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            a, b = a[:VOCAB_TOKENIZER], b[:VOCAB_TOKENIZER]  # rows past the vocab are padding
        assert torch.equal(a, b), k


def test_causal_lm_export(ws):
    import transformers

    res = to_hf(ws["ckpt"]["tp1"], ws["root"] / "export_clm", causal_lm=True, verbose=False)
    assert res.arch == "llama"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(res.path), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.is_causal
    tokens = torch.randint(0, VOCAB_TOKENIZER, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(input_ids=tokens).logits
    ref = megatron_reference(ws, ws["ckpt"]["tp1"], tokens, causal=True)
    assert (got - ref).abs().max().item() < 1e-4
    out = model.generate(tokens[:, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)
    # for generation, a prompt is not ended by EOS: the tokenizer keeps its own template
    tok = transformers.AutoTokenizer.from_pretrained(str(res.path))
    assert tok.eos_token_id not in tok("alpha beta")["input_ids"]
    assert json.loads((res.path / "mlmclm_export.json").read_text())["tokenizer_rule"] == "template"


def test_sentence_transformers_mean_pooling(exported):
    from sentence_transformers import SentenceTransformer, models

    word = models.Transformer(str(exported.path))
    pool = models.Pooling(word.get_word_embedding_dimension(), "mean")
    st = SentenceTransformer(modules=[word, pool], device="cpu")
    emb = st.encode(["alpha beta gamma", "the model of the encoder"], convert_to_tensor=True)
    assert emb.shape == (2, 64) and torch.isfinite(emb).all()
    assert not torch.allclose(emb[0], emb[1])


# --------------------------------------------------------------------------------------------------
# HF -> megatron


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen3"])
def test_hf_megatron_hf_round_trip_is_exact(ws, name):
    from megatron_mlmclm.config import load_config

    src_dir = ws["hf"][name]
    imp = from_hf(src_dir, ws["root"] / f"imp_{name}", verbose=False)
    assert imp.verification.max_abs_diff <= 1e-4 and not imp.vocab_grew
    trainer = torch.load(imp.checkpoint / "common.pt", weights_only=False)["trainer"]
    model_cfg = trainer["config"]["model"]
    assert model_cfg["preset"] is None and model_cfg["tie_embeddings"] == (name == "llama_tied")
    assert model_cfg["qk_layernorm"] == (name == "qwen3") and model_cfg["rotary_base"] == 500000.0
    assert model_cfg["rope_scaling"] is None
    assert trainer["source"]["family"] == name.split("_")[0]
    run = load_config(imp.path / "config.yaml", ["data.mock=true"])
    assert run.train.init_from == str(imp.path / "checkpoints")
    assert [p.objective for p in run.phases] == ["mlm"] and run.phases[0].mask_ratio == 0.4

    exp = to_hf(imp.path / "checkpoints", ws["root"] / f"reexport_{name}", verbose=False)
    assert exp.arch == ("qwen3" if name == "qwen3" else "llama")  # the source family by default
    cfg = json.loads((exp.path / "config.json").read_text())
    assert cfg["is_causal"] is False and cfg["tie_word_embeddings"] == (name == "llama_tied")
    assert cfg["rope_parameters"]["rope_type"] == "default" and "rope_scaling" not in cfg
    src, got = (
        load_file(str(src_dir / "model.safetensors")),
        load_file(str(exp.path / "model.safetensors")),
    )
    if name == "llama_tied":
        src.pop("lm_head.weight", None)
    assert got.keys() == src.keys()
    # transformers zeroes the row of the config's pad token (nn.Embedding's padding_idx) and never
    # trains it: the import starts it at the mean of the other rows, and says so
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ws["tok"]))
    pad = tok.pad_token_id
    assert imp.rows_set == (pad,)
    emb = src["model.embed_tokens.weight"]
    assert torch.count_nonzero(emb[pad]) == 0
    others = torch.cat([emb[:pad], emb[pad + 1 : len(tok)]])  # the tokenizer's trained rows
    torch.testing.assert_close(got["model.embed_tokens.weight"][pad], others.mean(0))
    got["model.embed_tokens.weight"][pad] = 0
    for k in src:
        assert torch.equal(got[k], src[k].float()), k


# Llama 3.1-style RoPE scaling. original_max_position_embeddings=32 (not megatron's built-in 8192)
# and factor 16 (not 8), so a converter that passed only the factor, or none, would be caught; the
# logits are compared at 160 positions, far past 32, where the scaled low frequencies matter.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
LONG = 160


def _megatron_run_logits(
    run_yaml: Path, tokens: torch.Tensor, causal: bool, overrides=()
) -> torch.Tensor:
    """Logits of the model a `mlmclm pretrain` of `run_yaml` would start from (its init_from)."""
    from megatron_mlmclm.checkpoint import latest_checkpoint, load_checkpoint
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.model.build import build_model_chunk, transformer_config
    from megatron_mlmclm.objectives import document_attention_mask
    from megatron_mlmclm.runtime.distributed import init_distributed

    cfg = load_config(
        run_yaml,
        [
            "data.mock=true",
            "train.precision=fp32",
            f"model.seq_length={tokens.shape[1]}",
            *overrides,
        ],
    )
    init_distributed(1, 1, None, 0)
    model = build_model_chunk(cfg, transformer_config(cfg), VOCAB_TOKENIZER, True, True).eval()
    load_checkpoint(latest_checkpoint(cfg.train.init_from), [model], load_rng=False)
    b, s = tokens.shape
    mask = document_attention_mask(torch.zeros(b, s, dtype=torch.long), causal)
    with torch.no_grad():
        logits = model(tokens, torch.arange(s).expand(b, s), mask)
    return logits[..., :VOCAB_TOKENIZER].float()


def _hf_logits(path: Path, tokens: torch.Tensor, auto: str = "AutoModelForCausalLM", **kw):
    import transformers

    model = getattr(transformers, auto).from_pretrained(str(path), dtype=torch.float32, **kw)
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits[..., :VOCAB_TOKENIZER].float()


def test_llama3_rope_scaling_round_trip(ws, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ws["tok"]))
    src = make_hf(
        tmp_path / "llama31",
        "llama",
        tok,
        vocab_size=320,
        tie_word_embeddings=False,
        rope_parameters=dict(LLAMA3_ROPE),
        max_position_embeddings=256,
    )
    tokens = torch.randint(
        0, VOCAB_TOKENIZER, (2, LONG), generator=torch.Generator().manual_seed(5)
    )
    ref = _hf_logits(src, tokens)  # HF's own forward, llama3 frequencies
    plain = _hf_logits(
        src, tokens, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}
    )
    assert (plain - ref).abs().max().item() > 1e-3  # the scaling matters (10x the tolerance)

    imp = from_hf(src, tmp_path / "imp", verbose=False)
    assert imp.verification.max_abs_diff <= 1e-4
    model_cfg = yaml.safe_load((imp.path / "config.yaml").read_text())["model"]
    assert model_cfg["rope_scaling"] == {
        "type": "llama3",
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    ours = _megatron_run_logits(imp.path / "config.yaml", tokens, causal=True)
    assert (ours - ref).abs().max().item() < 1e-4
    unscaled = _megatron_run_logits(
        imp.path / "config.yaml", tokens, causal=True, overrides=["model.rope_scaling=null"]
    )
    assert (unscaled - plain).abs().max().item() < 1e-4  # and without it, plain RoPE

    # Back to HF: the causal export reproduces the source's forward; EuroBERT carries it too.
    exp = to_hf(imp.path / "checkpoints", tmp_path / "exp", causal_lm=True, verbose=False)
    cfg = json.loads((exp.path / "config.json").read_text())
    assert cfg["rope_parameters"] == LLAMA3_ROPE and cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert (_hf_logits(exp.path, tokens) - ref).abs().max().item() < 1e-4
    bert = to_hf(imp.path / "checkpoints", tmp_path / "bert", arch="eurobert", verbose=False)
    assert json.loads((bert.path / "config.json").read_text())["rope_parameters"] == LLAMA3_ROPE
    bidir = _megatron_run_logits(imp.path / "config.yaml", tokens, causal=False)
    got = _hf_logits(bert.path, tokens, "AutoModelForMaskedLM")
    assert (got - bidir).abs().max().item() < 1e-4


def test_llama32_legacy_rope_scaling_config_and_bad_rope(ws, capsys, tmp_path):
    """A config.json as Llama 3.2 ships it (`rope_scaling` + top-level `rope_theta`) imports the
    same; other RoPE kinds and invalid llama3 fields are refused with one line."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ws["tok"]))
    src = make_hf(
        tmp_path / "legacy",
        "llama",
        tok,
        vocab_size=300,
        tie_word_embeddings=True,
        rope_parameters=dict(LLAMA3_ROPE),
        max_position_embeddings=256,
    )
    raw = json.loads((src / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    (src / "config.json").write_text(json.dumps(raw))
    imp = from_hf(src, tmp_path / "imp", verbose=False)
    model_cfg = yaml.safe_load((imp.path / "config.yaml").read_text())["model"]
    assert model_cfg["rope_scaling"]["original_max_position_embeddings"] == 32
    assert model_cfg["rotary_base"] == 500000.0

    out = tmp_path / "out"
    for bad, match in (
        (
            {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "yarn",
        ),
        (dict(LLAMA3_ROPE, high_freq_factor=0.5), "high_freq_factor"),
    ):
        path = make_hf(
            tmp_path / bad["rope_type"],
            "llama",
            tok,
            vocab_size=300,
            rope_parameters=bad,
            max_position_embeddings=256,
        )
        assert_refused(capsys, out, "from-hf", path, out, match=match)


def test_vocab_grows_for_mask_token(tmp_path):
    """A tokenizer without mask/pad gets them added; embeddings grow with mean rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(61)]
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    small = PreTrainedTokenizerFast(
        tokenizer_object=wl, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    assert small.mask_token_id is None and len(small) == 64
    src = make_hf(tmp_path / "hf", "llama", small, vocab_size=64, tie_word_embeddings=False)
    res = from_hf(src, tmp_path / "imp", verbose=False)
    assert res.vocab_grew and res.vocab_size == 66  # <mask> and <pad> added
    state = read_global_tensors(res.checkpoint)
    orig = load_file(str(src / "model.safetensors"))
    for ours, theirs in (
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "lm_head.weight"),
    ):
        assert torch.equal(state[ours][:64], orig[theirs])
        assert torch.allclose(state[ours][64], orig[theirs].mean(0))


# --------------------------------------------------------------------------------------------------
# One copy of the model: the other side read and written a tensor or a layer at a time


def test_safetensors_written_and_read_a_tensor_at_a_time(tmp_path):
    """Our streaming writer's files load with the safetensors package, and our reader reads the
    package's files; a file cut short is refused."""
    from safetensors.torch import save_file

    from megatron_mlmclm.convert.hf_files import SafetensorsFile, write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).bfloat16(),
        "c.fp16": torch.randn(2, 2, 2, generator=g).half(),
        "d.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "e.empty": torch.zeros(0, 4),
        "f.scalar": torch.tensor(2.5),
    }
    ours = tmp_path / "ours.safetensors"
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    write_safetensors(ours, entries, iter(tensors.items()), metadata={"format": "pt"})
    back = load_file(str(ours))
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    # cast on the way to the entry's dtype, as an export in bf16 writes float32 weights
    write_safetensors(ours, [("a", torch.bfloat16, (3, 5))], [("a", tensors["a"])])
    assert torch.equal(load_file(str(ours))["a"], tensors["a"].bfloat16())
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, str(theirs))
    st = SafetensorsFile(theirs)
    assert all(torch.equal(st.get(k), v) for k, v in tensors.items())
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(theirs.read_bytes()[:-3])
    with pytest.raises(ValueError, match="outside the file"):
        SafetensorsFile(cut)


def _unit_bytes(model) -> dict[str, int]:
    """Weight bytes per module that runs as one: each layer, and embedding, norm and head."""
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        unit = ".".join(parts[:3] if parts[1] == "layers" else parts[:-1])
        out[unit] = out.get(unit, 0) + p.nbytes
    return out


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen3", "eurobert"])
def test_streamed_forward_is_transformers_own_a_layer_at_a_time(ws, exported, name):
    """The verification's Hugging Face side: transformers' forward, its weights read as each
    module runs; the logits of the model loaded whole, exactly, and never more than the largest
    module's weights held at once."""
    import transformers

    from megatron_mlmclm.convert.verify import streamed_hf_logits

    folder = exported.path if name == "eurobert" else ws["hf"][name]
    auto = "AutoModelForMaskedLM" if name == "eurobert" else "AutoModelForCausalLM"
    model = getattr(transformers, auto).from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa"
    )
    tokens = torch.randint(0, VOCAB_TOKENIZER, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.eval()(input_ids=tokens).logits
    stats: dict[str, int] = {}
    got, cls = streamed_hf_logits(folder, auto, tokens, stats=stats)
    assert cls == type(model).__name__ and torch.equal(got, ref)
    units = _unit_bytes(model)
    assert stats["peak"] == max(units.values()) < sum(units.values()) / 2
    tied = name == "llama_tied"  # the head reads the embedding's rows again
    assert stats["loaded"] == sum(units.values()) + tied * units["model.embed_tokens"]


def test_conversions_read_and_write_a_layer_at_a_time(ws, tmp_path, monkeypatch):
    """from-hf reads each source tensor as the model takes it (never the whole source first);
    to-hf hands its writer the tensors as they are made, not a state dict."""
    from megatron_mlmclm.convert import common, hf_export, hf_files

    events: list[str] = []
    read, fill = hf_files.HFWeights.get, common.fill_model

    def get(self, name):
        events.append("read")
        return read(self, name)

    def fill_model(model, items, *args, **kw):
        def spy():
            for item in items:
                events.append("fill")
                yield item

        return fill(model, spy(), *args, **kw)

    monkeypatch.setattr(hf_files.HFWeights, "get", get)
    monkeypatch.setattr(common, "fill_model", fill_model)
    from_hf(ws["hf"]["llama"], tmp_path / "imp", verbose=False)
    last = max(i for i, e in enumerate(events) if e == "fill")  # then the verification reads
    runs = "".join("r" if e == "read" else "f" for e in events[: last + 1]).split("f")[:-1]
    assert len(runs) > 3 and max(len(r) for r in runs) <= 3  # q, k and v of a layer at most

    handed = []
    write = hf_export.write_safetensors

    def write_safetensors(path, entries, tensors, **kw):
        handed.append(isinstance(tensors, types.GeneratorType))
        return write(path, entries, tensors, **kw)

    monkeypatch.setattr(hf_export, "write_safetensors", write_safetensors)
    to_hf(ws["ckpt"]["tp1"], tmp_path / "exp", verbose=False)
    assert handed == [True]


def test_bf16_export_halves_the_folder_and_verifies(ws, exported, tmp_path):
    """`--dtype bf16`: half the weights' bytes, the checkpoint's weights rounded to bf16 (the
    export is verified against those), loadable by transformers."""
    import transformers

    rc = cli_main(
        ["convert", "to-hf", str(ws["ckpt"]["tp1"]), str(tmp_path / "bf16")]
        + [
            "--dtype",
            "bf16",
        ]
    )
    assert rc == 0
    full = load_file(str(exported.path / "model.safetensors"))
    half = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {t.dtype for t in full.values()} == {torch.float32}
    assert all(torch.equal(half[k], v.bfloat16()) for k, v in full.items())
    fp32, bf16 = (p / "model.safetensors" for p in (exported.path, tmp_path / "bf16"))
    assert abs(bf16.stat().st_size - fp32.stat().st_size / 2) < 4096  # the header aside
    record = json.loads((tmp_path / "bf16" / "mlmclm_export.json").read_text())
    assert record["dtype"] == "bf16" and record["verification"]["max_abs_diff"] <= 1e-4
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "bf16"))
    assert model.dtype == torch.bfloat16
    assert json.loads((exported.path / "mlmclm_export.json").read_text())["dtype"] == "fp32"


def test_a_bf16_model_is_run_in_float32_one_layer_at_a_time(ws):
    """The verification's forward of a model held in bf16: float32 arithmetic (megatron's own
    forward of the same weights rounded to bf16, run in float32, to 1e-5), with one layer's
    weights at most in float32 while it runs (the embedding never), and the model's weights
    given back as they were, bf16, after."""
    from megatron_mlmclm.convert import common, verify
    from megatron_mlmclm.convert.hf_export import round_weights

    ckpt = common.resolve_source_checkpoint(ws["ckpt"]["tp1"])
    cfg = common.run_config_from_dict(common.read_common(ckpt)["config"])
    model = verify.megatron_from_checkpoint(ckpt, cfg, VOCAB_TOKENIZER)  # stored in float32
    round_weights(model, torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert {p.dtype for p in before.values()} == {torch.bfloat16}
    seen = []

    def running(i):  # inside layer i's forward, before its attention
        def hook(attention, args):
            in_float32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
            seen.append((i, args[0].dtype, in_float32))

        return hook

    for i, layer in enumerate(model.decoder.layers):
        layer.self_attention.core_attention.register_forward_pre_hook(running(i))
    tokens = torch.randint(0, VOCAB_TOKENIZER, (2, 48), generator=torch.Generator().manual_seed(7))
    got = verify.megatron_logits(model, tokens, causal=False)[..., :VOCAB_TOKENIZER]
    ref = megatron_reference(ws, ws["ckpt"]["tp1"], tokens, causal=False, rounded=torch.bfloat16)
    assert (got - ref).abs().max().item() < 1e-5
    unrounded = megatron_reference(ws, ws["ckpt"]["tp1"], tokens, causal=False)
    assert (unrounded - ref).abs().max().item() > 1e-3  # the model really holds bf16 values
    assert [(i, dtype) for i, dtype, _ in seen] == [(0, torch.float32), (1, torch.float32)]
    for i, _, in_float32 in seen:
        assert in_float32 == {k for k in before if k.startswith(f"decoder.layers.{i}.")}
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[n]), n


def test_a_bf16_source_converts_in_bf16_both_ways_and_a_wrong_weight_fails(
    ws, capsys, tmp_path, monkeypatch
):
    """A bf16 source is held in bf16 by from-hf and by to-hf (default and --dtype fp32), stored and
    exported as it was, and verified in float32 to 1e-4, where bf16 arithmetic would miss by
    more than 1e-3. One weight negated (in what the import stores, or in what the export writes)
    fails the verification: exit 2, nothing left."""
    import transformers
    from transformers import AutoTokenizer

    from megatron_mlmclm.convert import common, hf_export, hf_import, mapping

    tok = AutoTokenizer.from_pretrained(str(ws["tok"]))
    src = make_hf(
        tmp_path / "bf16", "llama", tok, vocab_size=320, tie_word_embeddings=False,
        dtype=torch.bfloat16,
    )  # fmt: skip
    held = []
    for module in (hf_import, hf_export):

        def spy(model, *args, real=module.megatron_logits):
            held.append({p.dtype for p in model.parameters()})
            return real(model, *args)

        monkeypatch.setattr(module, "megatron_logits", spy)
    imp = from_hf(src, tmp_path / "imp", verbose=False)
    exp = to_hf(imp.path / "checkpoints", tmp_path / "exp", verbose=False)
    wide = to_hf(imp.path / "checkpoints", tmp_path / "wide", dtype="fp32", verbose=False)
    assert held == [{torch.bfloat16}] * 3
    assert set(common.stored_dtypes(imp.checkpoint).values()) == {torch.bfloat16}
    assert max(r.verification.max_abs_diff for r in (imp, exp, wide)) <= 1e-4
    tokens = torch.randint(0, VOCAB_TOKENIZER, (2, 64), generator=torch.Generator().manual_seed(0))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)
        with torch.no_grad():
            logits[dtype] = model.eval()(input_ids=tokens).logits.float()
    assert (logits[torch.bfloat16] - logits[torch.float32]).abs().max().item() > 1e-3
    source = load_file(str(src / "model.safetensors"))
    written = load_file(str(exp.path / "model.safetensors"))
    widened = load_file(str(wide.path / "model.safetensors"))
    (pad,) = imp.rows_set  # set on purpose (the import says so): the others are the source's
    written["model.embed_tokens.weight"][pad] = source["model.embed_tokens.weight"][pad]
    widened["model.embed_tokens.weight"][pad] = source["model.embed_tokens.weight"][pad].float()
    assert written.keys() == source.keys() == widened.keys()
    for k, v in source.items():
        assert v.dtype == torch.bfloat16 and torch.equal(written[k], v), k
        assert widened[k].dtype == torch.float32 and torch.equal(widened[k], v.float()), k

    def negate_largest(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        i = t.abs().argmax()
        t.view(-1)[i] = -t.view(-1)[i]
        return t

    iter_hf, write = mapping.iter_hf_to_megatron, hf_export.write_safetensors

    def wrong_import(*args, **kw):
        for key, layer, t in iter_hf(*args, **kw):
            yield key, layer, negate_largest(t) if (key, layer) == (FC2, 1) else t

    def wrong_export(path, entries, tensors, **kw):
        wrong = ((n, negate_largest(t) if n == DOWN else t) for n, t in tensors)
        return write(path, entries, wrong, **kw)

    monkeypatch.setattr(mapping, "iter_hf_to_megatron", wrong_import)
    out = tmp_path / "out"
    assert_refused(capsys, out, "from-hf", src, out, match="verification failed")
    monkeypatch.setattr(mapping, "iter_hf_to_megatron", iter_hf)
    monkeypatch.setattr(hf_export, "write_safetensors", wrong_export)
    assert_refused(capsys, out, "to-hf", imp.path / "checkpoints", out, match="verification failed")


FC2, DOWN = "decoder.layers.mlp.linear_fc2.weight", "model.layers.1.mlp.down_proj.weight"


def _python_blocks(readme: Path) -> list[str]:
    return [part.split("```")[0] for part in readme.read_text().split("```python\n")[1:]]


def _masked_batch() -> dict[str, torch.Tensor]:
    """Two rows of random ids, 40% of positions masked: `labels` holds their ids, -100 elsewhere."""
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(4, VOCAB_TOKENIZER, (2, 24), generator=g)
    labels = torch.full_like(input_ids, -100)
    masked = torch.rand(input_ids.shape, generator=g) < 0.4
    labels[masked] = input_ids[masked]
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)


def _check_encoder_card(folder: Path, auto: str, shifts: bool, eurobert_advice: bool) -> None:
    """The card of an encoder export: whether it warns that the built-in `labels` loss shifts
    (and then its MLM-loss snippet gives the cross-entropy at the masked positions, computed here
    position by position; else the built-in loss is that one), whether it offers `--arch
    eurobert`, and its fill-mask example runs."""
    import transformers

    card = (folder / "README.md").read_text()
    assert "pipeline_tag: fill-mask" in card and "A bidirectional text encoder" in card
    assert ("shifts the labels by one position" in card) == shifts, card
    assert ("--arch eurobert" in card) == eurobert_advice, card
    model = getattr(transformers, auto).from_pretrained(str(folder), dtype=torch.float32)
    assert f"`{type(model).__name__}`" in card  # the class it names is the one that loads
    batch = _masked_batch()
    labels = batch["labels"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        builtin = model(input_ids=batch["input_ids"], labels=labels).loss
    at = (labels != -100).nonzero().tolist()
    mlm = sum(-logits[b, i].log_softmax(-1)[labels[b, i]] for b, i in at) / len(at)
    blocks = _python_blocks(folder / "README.md")
    loss_block = [b for b in blocks if "cross_entropy" in b]
    if shifts:
        scope = dict(model=model, **batch)
        with torch.no_grad():
            exec(loss_block[0], scope)
        torch.testing.assert_close(scope["loss"], mlm)
        assert (builtin - mlm).abs() > 1e-3  # the built-in loss is another objective
    else:
        assert not loss_block
        torch.testing.assert_close(builtin, mlm)
    fill = [b for b in blocks if "fill-mask" in b]
    assert len(fill) == 1 and str(folder) in fill[0]
    exec(fill[0], {})


def test_the_model_card_gives_the_mlm_loss_and_the_fill_mask_pipeline(ws, exported, tmp_path):
    """The README of a Llama-family encoder export says its built-in `labels` loss shifts, gives
    the MLM loss and offers `--arch eurobert`; EuroBERT's built-in loss is MLM's."""
    imp = from_hf(ws["hf"]["llama"], tmp_path / "imp", verbose=False)
    llama = to_hf(imp.path / "checkpoints", tmp_path / "llama", verbose=False).path
    # the import's own checkpoint, exported: its record says it is the import, trained nothing
    record = json.loads((llama / "mlmclm_export.json").read_text())
    assert record["objective"] is None and record["pretraining_tokens"] is None
    assert record["imported"] == f"llama model imported from {ws['hf']['llama']}"
    _check_encoder_card(llama, "AutoModelForCausalLM", shifts=True, eurobert_advice=True)
    _check_encoder_card(exported.path, "AutoModelForMaskedLM", shifts=False, eurobert_advice=False)


def test_the_qwen3_and_causal_lm_cards(ws, tmp_path):
    """A Qwen3-family encoder export's card: `Qwen3ForCausalLM`, its shifted built-in loss and the
    MLM loss, and no `--arch eurobert` (EuroBERT has no qk-norm). The `--causal-lm` export's
    card: a causal model for generation whose built-in loss, the next-token one (computed here
    from the logits), is what it was trained with; no MLM loss, fill-mask or EuroBERT advice."""
    import transformers

    imp = from_hf(ws["hf"]["qwen3"], tmp_path / "imp", verbose=False)
    qwen3 = to_hf(imp.path / "checkpoints", tmp_path / "qwen3", verbose=False).path
    _check_encoder_card(qwen3, "AutoModelForCausalLM", shifts=True, eurobert_advice=False)

    clm = to_hf(imp.path / "checkpoints", tmp_path / "clm", causal_lm=True, verbose=False).path
    card = (clm / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and "A causal language model" in card
    assert "`Qwen3ForCausalLM`, `is_causal: true`" in card and "next-token loss" in card
    assert not _python_blocks(clm / "README.md")  # no MLM loss, no fill-mask
    for absent in ("--arch eurobert", "fill-mask", "is not the MLM loss", "Mask token"):
        assert absent not in card, absent
    model = transformers.AutoModelForCausalLM.from_pretrained(str(clm), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.is_causal
    ids = _masked_batch()["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        builtin = model(input_ids=ids, labels=ids).loss
    nll = -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])
    torch.testing.assert_close(builtin, nll.mean())


# --------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing left behind, nothing overwritten without --force


def test_refuses_unsupported_hf_models(ws, capsys, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ws["tok"]))
    out = tmp_path / "out"
    cases = {
        "sliding": (
            make_hf(tmp_path / "mistral", "mistral", tok, vocab_size=300, sliding_window=16),
            "sliding-window",
        ),
        "bias": (
            make_hf(tmp_path / "bias", "llama", tok, vocab_size=300, attention_bias=True),
            "biases",
        ),
        "vocab": (make_hf(tmp_path / "small", "llama", tok, vocab_size=256), "tokenizer"),
    }
    unknown = tmp_path / "gpt2"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    cases["unknown"] = (unknown, "unknown architecture")
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
    cases["moe"] = (moe, "mixture-of-experts")
    for src, match in cases.values():
        assert_refused(capsys, out, "from-hf", src, out, match=match)
    # Mistral without sliding window is supported.
    ok = make_hf(tmp_path / "mistral_ok", "mistral", tok, vocab_size=300, sliding_window=None)
    rc, err = run_cli(capsys, "from-hf", ok, out)
    assert rc == 0, err


def test_refuses_partial_or_corrupt_checkpoints(ws, capsys, tmp_path):
    src = ws["ckpt"]["tp1"]
    latest = (src / "latest").read_text().strip()
    out = tmp_path / "out"
    for case in ("metadata", "common", "truncated"):
        bad = tmp_path / case / "checkpoints"
        shutil.copytree(src, bad)
        it = bad / latest
        if case == "metadata":
            (it / "metadata.json").unlink()
        elif case == "common":
            (it / "common.pt").unlink()
        else:
            for f in it.glob("*.distcp"):
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
        for target in (bad, it):
            assert_refused(
                capsys, out, "to-hf", target, out, "--tokenizer", ws["tok"], match="checkpoint"
            )


def test_output_exists_needs_force_and_failed_verification_leaves_nothing(
    ws, capsys, tmp_path, monkeypatch
):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = run_cli(capsys, "to-hf", ws["ckpt"]["tp1"], out)
    assert rc == 2 and "--force" in err and (out / "keep.txt").read_text() == "mine"
    rc, err = run_cli(capsys, "from-hf", ws["hf"]["llama"], out)
    assert rc == 2 and (out / "keep.txt").exists()
    # --force replaces only an earlier export (its mlmclm_export.json): not this folder
    rc, err = run_cli(capsys, "to-hf", ws["ckpt"]["tp1"], out, "--force")
    assert rc == 2 and "not written by `mlmclm convert to-hf`" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    rc, err = run_cli(capsys, "to-hf", ws["ckpt"]["tp1"], out, "--force")  # empty: filled
    assert rc == 0, err
    (out / "keep.txt").write_text("mine")
    rc, err = run_cli(capsys, "to-hf", ws["ckpt"]["tp1"], out, "--force")
    assert rc == 0, err
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob("exists.*"))  # no temporary or old folders left

    import megatron_mlmclm.convert.verify as verify

    monkeypatch.setattr(verify, "TOLERANCE", -1.0)  # any difference (even 0) fails
    fresh = tmp_path / "fresh"
    assert_refused(capsys, fresh, "to-hf", ws["ckpt"]["tp1"], fresh, match="verification failed")
    assert_refused(capsys, fresh, "from-hf", ws["hf"]["qwen3"], fresh, match="verification failed")
    rc, err = run_cli(capsys, "to-hf", ws["ckpt"]["tp1"], out, "--force")
    assert rc == 2 and (out / "model.safetensors").is_file()  # the old output survives a failure


def test_force_never_replaces_a_run_folder(ws, capsys, tmp_path):
    """`convert to-hf RUN/checkpoints RUN --force` (an export aimed at its own run's folder) and
    an import aimed at a run's folder: refused in one line, every file of the run in place."""
    run = tmp_path / "runs" / "X"
    shutil.copytree(ws["root"] / "tp1", run)
    (run / "tensorboard").mkdir(exist_ok=True)
    (run / "tensorboard" / "events.out").write_bytes(b"scalars")
    before = snapshot(run)
    assert {"checkpoints", "metrics.jsonl", "config.yaml"} <= set(before)
    for args, match in (
        (
            ("to-hf", run / "checkpoints", run, "--tokenizer", ws["tok"], "--force"),
            "holds the input",
        ),
        (("to-hf", run / "checkpoints" / "iter_0000002", run, "--force"), "holds the input"),
        (("from-hf", ws["hf"]["llama"], run, "--force"), "training run's folder"),
    ):
        rc, err = run_cli(capsys, *args)
        assert rc == 2 and match in err and err.strip().count("\n") == 0, err
        assert snapshot(run) == before
    assert sorted(p.name for p in run.parent.iterdir()) == ["X"]  # no staging folder left


def test_tokenizer_larger_than_vocab_and_tools_script(ws, capsys, tmp_path):
    from transformers import AutoTokenizer

    big = AutoTokenizer.from_pretrained(str(ws["tok"]))
    big.add_tokens([f"extra{i}" for i in range(20)])
    big.save_pretrained(str(tmp_path / "big"))
    # As large as the run's, but not it: mask and pad swapped (an export would mask with pad).
    swapped = AutoTokenizer.from_pretrained(str(ws["tok"]))
    swapped.mask_token, swapped.pad_token = swapped.pad_token, swapped.mask_token
    swapped.save_pretrained(str(tmp_path / "swapped"))
    assert len(swapped) == VOCAB_TOKENIZER
    out = tmp_path / "out"
    for tok in ("big", "swapped"):
        args = ("to-hf", ws["ckpt"]["tp1"], out, "--tokenizer", tmp_path / tok)
        assert_refused(capsys, out, *args, match="is not the one checkpoint")
    # The Megatron-style script runs the same code: exit 2 and one line on an existing output.
    out.mkdir()
    env = job_env()
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parent.parent / "tools" / "convert_checkpoint.py"),
            "--loader",
            "megatron",
            "--saver",
            "hf",
            "--load-dir",
            str(ws["ckpt"]["tp1"]),
            "--save-dir",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "exists" in proc.stderr


def test_wrong_arch_for_qk_norm_is_refused(ws, capsys, tmp_path):
    imp = ws["root"] / "imp_qwen3"
    if not imp.exists():
        from_hf(ws["hf"]["qwen3"], imp, verbose=False)
    out = tmp_path / "out"
    assert_refused(
        capsys, out, "to-hf", imp / "checkpoints", out, "--arch", "eurobert", match="qk-norm"
    )
    assert_refused(capsys, out, "to-hf", ws["ckpt"]["tp1"], out, "--arch", "qwen3", match="qk-norm")
    # The default follows the source family where the model still is it: a checkpoint recorded as
    # a Qwen3 import whose model has no qk-norm is exported as a Llama.
    assert resolve_arch(None, False, True, {"family": "qwen3"}) == "qwen3"
    assert resolve_arch(None, False, False, {"family": "qwen3"}) == "llama"
    assert resolve_arch(None, False, False, {"family": "mistral"}) == "llama"
    assert resolve_arch(None, False, False, None) == "eurobert"


def test_the_conversion_model_is_the_cpus_whatever_the_run_trained_with():
    """Conversion and its verification build the model fp32, eager and on the CPU, whatever the
    run's own config says (a GPU run: bf16, compiled stack). On a GPU machine the run's plan left
    megatron's linear layers on the GPU beside the norms on the CPU and failed in the compiled
    stack: the export of a model trained on an H100 did not verify."""
    from megatron_mlmclm.config import load_config
    from megatron_mlmclm.convert.common import build_encoder

    cfg = load_config(
        None,
        [
            "data.mock=true",
            "model.preset=tiny",
            "model.num_layers=2",
            "model.vocab_size=256",
            "train.precision=bf16",
            "model.compile=on",
        ],
    )
    model = build_encoder(cfg, 256)
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.float32, "cpu")}
    kernels = model.decoder.layers[0].kernels
    assert not kernels.compiled and cfg.train.precision == "bf16"  # the run's config untouched
