"""Peak resident memory of `mlmclm convert from-hf` and `to-hf` on a stand-in of a given shape.

    python tools/convert_memory.py WORKDIR [--preset 1b] [--vocab 128256] [--dtype fp32|bf16]
                                   [--untied] [--export-dtype bf16]

Writes WORKDIR/hf: a Llama-family Hugging Face folder of the shape (random weights, written one
tensor at a time, so making it takes no memory of the model's size) with a small Llama-3-style
tokenizer (its model has `--vocab` rows, as many a tokenizer leaves untrained); then runs
`convert from-hf WORKDIR/hf WORKDIR/ckpt` and `convert to-hf WORKDIR/ckpt/checkpoints
WORKDIR/export` under `/usr/bin/time -v`, and prints each command's peak resident memory (its
"Maximum resident set size") against the size of the model's weights file, with that of a process
that only imports the converters (what any conversion starts with). The figures in docs/convert.md
come from here. Needs about three times the model's size in free disk. A WORKDIR that holds the
stand-in of an earlier run (WORKDIR/hf) is measured again with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_mlmclm.config.schema import MODEL_PRESETS  # noqa: E402
from megatron_mlmclm.convert.hf_files import write_safetensors  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tokenizer(out: Path) -> None:
    """A byte-level BPE with Llama 3's bos, eos and reserved special tokens (no mask or pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(4)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=506, show_progress=False, initial_alphabet=alphabet)
    bpe.train_from_iterator(["a stand-in of a decoder, for measuring conversion"] * 10, trainer)
    bpe.add_special_tokens(specials)
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=specials[0], eos_token=specials[1]
    ).save_pretrained(str(out))


def standin(out: Path, preset: str, vocab: int, dtype: torch.dtype, tied: bool) -> int:
    """A LlamaForCausalLM folder of the preset's shape; -> the weights file's size in bytes."""
    import transformers

    shape = MODEL_PRESETS[preset]
    h, ffn, layers = shape["hidden_size"], shape["ffn_hidden_size"], shape["num_layers"]
    heads, groups = shape["num_attention_heads"], shape["num_query_groups"]
    hd = shape["kv_channels"]
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=hd,
        max_position_embeddings=shape["seq_length"],
        tie_word_embeddings=tied,
        bos_token_id=506,
        eos_token_id=507,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
    )
    out.mkdir(parents=True)
    cfg.save_pretrained(str(out))
    tokenizer(out)
    entries = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        entries += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (heads * hd, h)),
            (p + "self_attn.k_proj.weight", (groups * hd, h)),
            (p + "self_attn.v_proj.weight", (groups * hd, h)),
            (p + "self_attn.o_proj.weight", (h, heads * hd)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (ffn, h)),
            (p + "mlp.up_proj.weight", (ffn, h)),
            (p + "mlp.down_proj.weight", (h, ffn)),
        ]
    entries.append(("model.norm.weight", (h,)))
    if not tied:
        entries.append(("lm_head.weight", (vocab, h)))
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for name, s in entries:
            if name.endswith("norm.weight"):
                yield name, 1 + 0.1 * torch.randn(s, generator=gen)
            else:
                yield name, 0.02 * torch.randn(s, generator=gen)

    path = out / "model.safetensors"
    spec = [(n, dtype, s) for n, s in entries]
    write_safetensors(path, spec, tensors(), metadata={"format": "pt"})
    return path.stat().st_size


def peak(cmd: list[str], cwd: Path) -> tuple[float, float, str]:
    """(peak resident memory in bytes, wall seconds, output) of a command run to completion."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["/usr/bin/time", "-v", *cmd], cwd=cwd, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return kb * 1024.0, wall, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--preset", default="1b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--untied", action="store_true")
    ap.add_argument("--export-dtype", choices=sorted(DTYPES), help="to-hf --dtype")
    args = ap.parse_args()
    work = args.workdir.absolute()
    if (work / "ckpt").exists() or (work / "export").exists():
        sys.exit(f"{work} holds ckpt/ or export/ of an earlier run; remove them first")
    weights = work / "hf" / "model.safetensors"
    if weights.is_file():  # the stand-in of an earlier run (its shape and dtype): reused
        size = weights.stat().st_size
    else:
        size = standin(work / "hf", args.preset, args.vocab, DTYPES[args.dtype], not args.untied)
    py = [sys.executable]
    env_python = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = env_python
    imports = "import megatron_mlmclm.convert.hf_import, megatron_mlmclm.convert.hf_export"
    rows = [("import the converters", *peak([*py, "-c", imports], work)[:2])]
    mlmclm = [*py, "-m", "megatron_mlmclm", "convert"]
    rows.append(("from-hf", *peak([*mlmclm, "from-hf", "hf", "ckpt"], work)[:2]))
    export = ["--dtype", args.export_dtype] if args.export_dtype else []
    rows.append(
        ("to-hf", *peak([*mlmclm, "to-hf", "ckpt/checkpoints", "export", *export], work)[:2])
    )
    exported = (work / "export" / "model.safetensors").stat().st_size
    print(
        json.dumps(
            {
                "preset": args.preset,
                "vocab": args.vocab,
                "dtype": args.dtype,
                "tied": not args.untied,
                "weights_bytes": size,
                "export_bytes": exported,
            }
        )
    )
    print(f"{'command':<24} {'peak RSS':>10} {'/ weights':>10} {'wall':>8}")
    for name, rss, wall in rows:
        print(f"{name:<24} {rss / 1e9:>8.2f} GB {rss / size:>9.2f}x {wall:>7.0f}s")


if __name__ == "__main__":
    main()
