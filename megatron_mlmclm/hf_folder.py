"""A Hugging Face folder read as data, never as code.

A folder's config.json or tokenizer_config.json may name Python files of its own (``auto_map``);
transformers imports them when a loader is given ``trust_remote_code=True``, and when it is given
nothing and the folder's type is not one it knows, it asks on stdin (so ``yes y | mlmclm ...``
would run them). Every loader of this project passes `NO_CODE`, and `refuse_code` turns away a
folder that only its own code could load with one line before transformers is asked: a model type
transformers does not know, or a tokenizer class it has not. A folder that names code of its own
for a type transformers knows (EuroBERT's Hub folders do) is loaded with transformers' own classes,
the folder's files left unread, as transformers itself does under ``trust_remote_code=False``.

`check_model_folder` is what a model folder needs before any of it is loaded: its config, a type
with an encoder class (``AutoModel``), a tokenizer, and weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_mlmclm.errors import UsageError

# every from_pretrained of a folder given by a user: its own code is never imported
NO_CODE = {"trust_remote_code": False}
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")


def read_json(path: Path, folder: Path) -> dict:
    """A JSON object of the folder, or one line naming the file and what is wrong with it."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UsageError(f"{folder}: {path.name} is not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{folder}: {path.name} must hold a JSON object")
    return doc


def _code_files(auto_map) -> str:
    """The modules an ``auto_map`` names ("modeling_x.py, configuration_x.py"), for messages."""
    refs = auto_map.values() if isinstance(auto_map, dict) else []
    names = [r for ref in refs for r in (ref if isinstance(ref, list) else [ref]) if r]
    files = dict.fromkeys(f"{str(r).rsplit('--', 1)[-1].split('.')[0]}.py" for r in names)
    return ", ".join(files) or "auto_map"


def _own_code(doc: dict) -> str:
    """'; it names code of its own (FILES), which mlmclm never runs' where `doc` has an
    auto_map, else ''."""
    if not doc.get("auto_map"):
        return ""
    return f"; it names code of its own ({_code_files(doc['auto_map'])}), which mlmclm never runs"


def refuse_code(folder: str | Path, tokenizer_only: bool = False) -> None:
    """One line (UsageError) for a folder only its own code could load: config.json of a model
    type transformers does not know (with `tokenizer_only`, only where the tokenizer's class is
    not named, so that transformers would read the config to find it), or a tokenizer whose class
    is the folder's own code."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    root = Path(folder)
    tok_cfg = root / "tokenizer_config.json"
    tok_doc = read_json(tok_cfg, root) if tok_cfg.is_file() else {}
    tok_class = tok_doc.get("tokenizer_class")
    native = isinstance(tok_class, str) and tokenizer_class_from_name(tok_class) is not None
    if tok_doc.get("auto_map") and not native:  # without it, transformers reads tokenizer.json
        raise UsageError(
            f"{root}: its tokenizer is code of its own ({_code_files(tok_doc['auto_map'])}), "
            f"which mlmclm never runs (tokenizer class {tok_class!r} is not one transformers "
            f"{__version__} has); save a tokenizer of a class it has"
        )
    config = root / "config.json"
    if not config.is_file() or (tokenizer_only and native):
        return
    doc = read_json(config, root)
    model_type = doc.get("model_type")
    if model_type is None and doc.get("auto_map"):
        raise UsageError(f"{root}: config.json names no model_type{_own_code(doc)}")
    if model_type is not None and (
        not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES
    ):
        raise UsageError(
            f"{root}: model type {model_type!r} is not one transformers {__version__} knows"
            f"{_own_code(doc)}"
        )


def check_model_folder(folder: str | Path) -> dict:
    """A model folder's config.json (as a dict), or one line naming the folder and what stops it
    from loading: missing, no config, code of its own, a type without an encoder class in
    transformers, no tokenizer, no weights (or a sharded index naming a missing file)."""
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"model folder {folder} not found")
    if not (root / "config.json").is_file():
        raise UsageError(f"model folder {folder} has no config.json; pass an exported HF folder")
    refuse_code(root)
    doc = read_json(root / "config.json", root)
    model_type = doc.get("model_type")
    if model_type is not None and model_type not in MODEL_MAPPING_NAMES:  # a str: refuse_code
        raise UsageError(
            f"{root}: transformers {__version__} has no encoder class (AutoModel) for model "
            f"type {model_type!r}"
        )
    if not any((root / n).is_file() for n in TOKENIZER_FILES):
        raise UsageError(
            f"model folder {folder} has no tokenizer; save one there "
            f"(tokenizer.save_pretrained) or run `mlmclm tokenize`"
        )
    _check_weights(root)
    return doc


def _check_weights(root: Path) -> None:
    if any((root / n).is_file() for n in WEIGHTS):
        return
    for name in (f"{n}.index.json" for n in WEIGHTS):
        if (root / name).is_file():
            shards = read_json(root / name, root).get("weight_map")
            if not isinstance(shards, dict):
                raise UsageError(f"{root}: {name} has no weight_map")
            missing = sorted({str(s) for s in shards.values()} - {p.name for p in root.iterdir()})
            if missing:
                raise UsageError(
                    f"{root}: {name} names weight file(s) the folder lacks: "
                    f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
                )
            return
    raise UsageError(
        f"model folder {root} has no weights ({', '.join(WEIGHTS)} or a sharded index); "
        "save the model there (model.save_pretrained)"
    )
