"""Tokenizers with the four tokens pretraining needs: bos, eos, pad and mask.

Two ways to get one (``mlmclm tokenize``, commands/tokenize.py):
  * ``--from HF_FOLDER``: load a local Hugging Face tokenizer and guarantee the tokens. A missing
    mask (then pad) token takes the first unused ``<|reserved_special_token_N|>`` of the vocab
    (Llama 3.0 has 251, Llama 3.1 and 3.2 have 248), so the vocab size does not change; without
    one, ``<mask>`` / ``<pad>`` are added and the vocab grows (reported). Pad is never eos: eos is
    a real training token (it ends every document), so a pad equal to eos counts as missing.
    Missing bos/eos get ``<s>``/``</s>``.
  * ``--train INPUT ...``: byte-level BPE trained with the ``tokenizers`` library on the corpus,
    with ``<s>`` ``</s>`` ``<pad>`` ``<mask>`` as ids 0-3. No post-processor: the tokenizer never
    adds bos/eos itself; ``mlmclm preprocess`` appends eos to each document explicitly.

The output folder is a normal ``save_pretrained`` folder (``AutoTokenizer.from_pretrained(out)``
gives back mask/pad/bos/eos; ``special_tokens_map.json`` names them for other readers) plus
``mlmclm_tokenizer.json``:
``{bos_id, eos_id, pad_id, mask_id, vocab_size, source, mask_reserved_from, pad_reserved_from,
added_tokens, vocab_grew}`` where ``vocab_size`` is ``len(tokenizer)``. The folder is written under
a temporary name and renamed when complete.

What training needs from the folder (`token_spec_and_vocab` -> `TokenSpec`): the mask id, the ids
never masked and the vocabulary size (model.vocab_size when set, else ``len(tokenizer)``); the
pretraining run, its resume fingerprint and `convert to-hf` all derive them here. What identifies
the tokenizer (`tokenizer_fingerprint`: a hash of its vocabulary, its size, its bos/eos/pad/mask
ids) is recorded beside every shard (data/shards.py) and in every checkpoint, so that shards,
checkpoints and exports of another tokenizer are refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_mlmclm.config import RunConfig
from megatron_mlmclm.data.text_sources import expand_inputs, iter_texts
from megatron_mlmclm.errors import UsageError
from megatron_mlmclm.hf_folder import NO_CODE, refuse_code
from megatron_mlmclm.paths import check_output_folder

METADATA_FILE = "mlmclm_tokenizer.json"
REQUIRED = ("bos", "eos", "pad", "mask")
_RESERVED = re.compile(r"^<\|reserved_special_token_(\d+)\|>$")


# --------------------------------------------------------------------------------------------------
# What training needs to know about the tokenizer


@dataclass(frozen=True)
class TokenSpec:
    """What the objectives need to know about the tokenizer."""

    vocab_size: int
    mask_id: int
    special_ids: tuple[int, ...]  # never masked (bos, eos, pad, mask, ...)
    # tokenizer_fingerprint of data.tokenizer (None for mock data without one)
    tokenizer: dict[str, Any] | None = field(default=None, compare=False)


def token_spec_and_vocab(cfg: RunConfig, trained_with: dict[str, Any] | None = None) -> TokenSpec:
    """Special ids and vocabulary size from the tokenizer (or synthetic ones for mock data).
    `trained_with`: the tokenizer recorded in train.init_from's checkpoint, which data.tokenizer
    must be (checked first: a continued run's model.vocab_size is that checkpoint's)."""
    if cfg.data.tokenizer is None:
        if not cfg.data.mock:
            raise UsageError(
                "data.tokenizer is not set; give the folder written by `mlmclm tokenize`"
            )
        vocab = cfg.model.vocab_size or 1024
        return TokenSpec(vocab_size=vocab, mask_id=3, special_ids=(0, 1, 2, 3))
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = special_token_ids(tok)
    vocab = len(tok)
    fingerprint = tokenizer_fingerprint(tok)
    if trained_with and not same_tokenizer(fingerprint, trained_with):
        raise not_the_checkpoints_tokenizer(
            cfg.data.tokenizer, fingerprint, trained_with, cfg.train.init_from
        )
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab:
        if cfg.train.init_from:  # the vocabulary is the checkpoint's: the tokenizer is wrong
            raise UsageError(
                f"data.tokenizer {cfg.data.tokenizer} has {vocab} tokens, more than the "
                f"{cfg.model.vocab_size}-token vocabulary of train.init_from's checkpoint "
                f"({cfg.train.init_from}): it is not the tokenizer that model was trained with; "
                "set data.tokenizer to that one (convert writes it beside the checkpoints, "
                "as tokenizer/)"
            )
        raise UsageError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer "
            f"({vocab}); remove model.vocab_size to take it from the tokenizer"
        )
    specials = tuple(
        sorted(
            {int(v) for v in ids.values() if v is not None}
            | set(getattr(tok, "all_special_ids", []))
        )
    )
    return TokenSpec(
        vocab_size=cfg.model.vocab_size or vocab,
        mask_id=int(ids["mask_id"]),
        special_ids=specials,
        tokenizer=fingerprint,
    )


def not_the_checkpoints_tokenizer(
    path, mine: dict[str, Any], theirs: dict[str, Any], where
) -> UsageError:
    """data.tokenizer is not the one train.init_from's checkpoint (`where`) recorded: one line
    naming both and the fix."""
    fix = (
        f"set data.tokenizer={theirs['path']}"
        if theirs.get("path")
        else "set data.tokenizer to the tokenizer it was trained with"
    )
    return UsageError(
        f"data.tokenizer {path} ({describe_tokenizer(mine)}) is not the tokenizer of "
        f"train.init_from's checkpoint {where} ({describe_tokenizer(theirs)}); {fix}, and write "
        "the shards with it"
    )


def tokenizer_fingerprint(tok) -> dict[str, Any]:
    """What decides the ids a tokenizer writes: a hash of its vocabulary (every token with its id,
    added tokens included), its size and its bos/eos/pad/mask ids."""
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return {"vocab_sha256": digest, "vocab_size": len(tok), **special_token_ids(tok)}


TOKENIZER_KEYS = ("vocab_sha256", "vocab_size", "bos_id", "eos_id", "pad_id", "mask_id")


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two records (tokenizer or shard fingerprints) name the same tokenizer."""
    return all(a.get(k) == b.get(k) for k in TOKENIZER_KEYS)


def describe_tokenizer(fp: dict[str, Any]) -> str:
    """A tokenizer fingerprint in a few words, for messages."""
    return (
        f"{fp.get('vocab_size')} tokens, vocabulary sha256 {str(fp.get('vocab_sha256'))[:12]}, "
        f"bos/eos/pad/mask {fp.get('bos_id')}/{fp.get('eos_id')}/{fp.get('pad_id')}/"
        f"{fp.get('mask_id')}"
    )


# --------------------------------------------------------------------------------------------------
# Helpers


def special_token_ids(tok) -> dict[str, int | None]:
    """{'bos_id', 'eos_id', 'pad_id', 'mask_id'} of a HF tokenizer (None where missing)."""
    return {f"{name}_id": getattr(tok, f"{name}_token_id", None) for name in REQUIRED}


def _load_hf(path: str | os.PathLike):
    # Imported here: transformers takes a second and more to import, and a training run on
    # mock data, or any process that only reads TokenSpec, never needs it.
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise UsageError(
            f"tokenizer folder {p} does not exist; give a local Hugging Face "
            "tokenizer folder (downloads are not done here)"
        )
    refuse_code(p, tokenizer_only=True)  # one line for a tokenizer only its own code loads
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True, **NO_CODE)
    except UsageError:
        raise
    except Exception as e:  # OSError / ValueError from transformers for bad folders
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"cannot load a tokenizer from {p}: {msg}") from None


def load_tokenizer(path: str | os.PathLike):
    """The HF tokenizer in ``path``, checked to have bos, eos, pad (distinct from eos) and mask."""
    tok = _load_hf(path)
    missing = [
        n for n in ("mask", "pad", "bos", "eos") if getattr(tok, f"{n}_token_id", None) is None
    ]
    if missing:
        raise UsageError(
            f"tokenizer folder {path} has no {' / '.join(missing)} token; run "
            f"`mlmclm tokenize --from {path} --out NEW_DIR` to reserve one"
        )
    if tok.pad_token_id == tok.eos_token_id:
        raise UsageError(
            f"tokenizer folder {path} uses eos as pad; run "
            f"`mlmclm tokenize --from {path} --out NEW_DIR` to reserve a distinct pad"
        )
    return tok


def read_metadata(path: str | os.PathLike) -> dict | None:
    f = Path(path) / METADATA_FILE
    return json.loads(f.read_text()) if f.is_file() else None


def _prepare_out(out_dir: str | os.PathLike, force: bool, inputs: Sequence) -> Path:
    """`out_dir`, checked: new or empty, or with `force` an earlier tokenizer folder (it holds
    METADATA_FILE) that is none of the `inputs` and holds none of them (paths.py)."""
    out = Path(out_dir)
    check_output_folder(
        out, force=force, command="tokenize", marker=METADATA_FILE, inputs=inputs, flag="--out"
    )
    return out


def _commit(tmp: Path, out: Path) -> None:
    """Replace ``out`` by the completed ``tmp`` folder."""
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(tmp, out)


def _save(
    tok, out_dir: Path, source: str, reserved: dict, added: list[str], force: bool, inputs: Sequence
) -> Path:
    out = _prepare_out(out_dir, force, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)  # only now: a refusal leaves nothing behind
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for key in ("local_files_only", "is_local"):  # how it was loaded, not what it is
            tok.init_kwargs.pop(key, None)
        tok.save_pretrained(str(tmp))
        (tmp / "special_tokens_map.json").write_text(
            json.dumps(tok.special_tokens_map, indent=2, ensure_ascii=False) + "\n"
        )
        meta = dict(
            special_token_ids(tok),
            vocab_size=len(tok),
            source=str(source),
            mask_reserved_from=reserved.get("mask"),
            pad_reserved_from=reserved.get("pad"),
            added_tokens=added,
            vocab_grew=bool(added),
        )
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --------------------------------------------------------------------------------------------------
# From an existing HF tokenizer


def _unused_reserved(tok) -> list[str]:
    """``<|reserved_special_token_N|>`` in the vocab, by N, minus those already in a named role."""
    used = {
        getattr(tok, f"{n}_token", None) for n in ("bos", "eos", "unk", "pad", "mask", "cls", "sep")
    }
    found = []
    for t in tok.get_vocab():
        m = _RESERVED.match(t)
        if m and t not in used:
            found.append((int(m.group(1)), t))
    return [t for _, t in sorted(found)]


def prepare_tokenizer(
    source: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False, verbose: bool = True
) -> Path:
    """Load the HF tokenizer in ``source``, guarantee bos/eos/pad/mask, save it to ``out_dir``."""
    _prepare_out(out_dir, force, [source])  # fail before anything is loaded or reported
    tok = _load_hf(source)
    before = len(tok)
    free = _unused_reserved(tok)
    reserved: dict[str, str] = {}
    added: list[str] = []
    assign: dict[str, str] = {}
    if tok.bos_token_id is None:
        assign["bos_token"] = "<s>"
    if tok.eos_token_id is None:
        assign["eos_token"] = "</s>"
    for name, new in (("mask", "<mask>"), ("pad", "<pad>")):
        cur = getattr(tok, f"{name}_token_id")
        if cur is not None and not (name == "pad" and cur == tok.eos_token_id):
            continue
        if free:
            reserved[name] = assign[f"{name}_token"] = free.pop(0)
        else:
            assign[f"{name}_token"] = new
    vocab = tok.get_vocab()
    added = [t for t in assign.values() if t not in vocab]
    if assign:
        tok.add_special_tokens(assign)
    if verbose:
        for name in ("mask", "pad"):
            if name in reserved:
                print(f"{name} token: reserved {reserved[name]} (vocab size unchanged)")
        if added:
            print(f"added tokens {', '.join(added)}: vocab grew {before} -> {len(tok)}")
    return _save(tok, Path(out_dir), str(source), reserved, added, force, [source])


# --------------------------------------------------------------------------------------------------
# Byte-level BPE trained on the corpus


MAX_VOCAB = 4_194_304  # what a BPE trained here may hold (the trainer's tables overflow past 2^31)


def train_tokenizer(
    inputs: Sequence[str],
    out_dir: str | os.PathLike,
    vocab_size: int,
    text_key: str = "text",
    min_frequency: int = 2,
    max_documents: int | None = None,
    txt_split_lines: bool = False,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens (specials included) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<mask>"]
    if vocab_size < 256 + len(specials):
        raise UsageError(
            f"--vocab-size {vocab_size} is too small for byte-level BPE; use at least "
            f"{256 + len(specials)}"
        )
    if vocab_size > MAX_VOCAB:
        raise UsageError(
            f"--vocab-size {vocab_size:,} is past {MAX_VOCAB:,} (the largest vocabularies in use "
            "hold about 260,000 tokens)"
        )
    if not 0 <= min_frequency < 2**32:
        raise UsageError(f"--min-frequency must be in [0, 2^32), got {min_frequency}")
    if max_documents is not None and max_documents < 1:
        raise UsageError("--max-documents must be >= 1")
    _prepare_out(out_dir, force, inputs)  # fail before reading the corpus
    expand_inputs(inputs)  # missing inputs fail before the trainer starts

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        show_progress=progress and sys.stderr.isatty(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    count = {"docs": 0}

    def texts():
        bar = tqdm(
            desc="reading", unit="doc", disable=None if progress else True, total=max_documents
        )
        for t in iter_texts(inputs, text_key, txt_split_lines, max_documents):
            count["docs"] += 1
            bar.update(1)
            yield t
        bar.close()

    bpe.train_from_iterator(texts(), trainer)
    if count["docs"] == 0:
        raise UsageError(
            f"the corpus {' '.join(map(str, inputs))} has no non-empty document "
            f"under key '{text_key}'"
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        mask_token="<mask>",
        clean_up_tokenization_spaces=False,
    )
    if len(tok) < vocab_size and progress:
        print(
            f"note: the corpus gave only {len(tok)} tokens (asked {vocab_size}); "
            "train on more text or lower --min-frequency"
        )
    source = "bpe:" + ",".join(map(str, inputs))
    return _save(tok, Path(out_dir), source, {}, [], force, inputs)
