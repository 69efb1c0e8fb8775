"""Where the shared real data lives: $MLMCLM_DATA_DIR, else ../shared/data beside the checkout;
and the name of the record `mlmclm convert to-hf` writes beside every export (read by the
report)."""

from __future__ import annotations

import os
from pathlib import Path

from megatron_mlmclm.errors import UsageError

# provenance written into every HF export: its checkpoint, verification and place in pretraining
EXPORT_FILE = "mlmclm_export.json"


def data_dir(required: bool = False) -> Path | None:
    env = os.environ.get("MLMCLM_DATA_DIR")
    candidates = [Path(env)] if env else []
    repo = Path(__file__).resolve().parent.parent
    candidates += [repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c
    if required:
        raise UsageError(
            "no data folder found; set MLMCLM_DATA_DIR to the folder holding "
            "gutenberg_en/, sst2/, conll2003/ ..."
        )
    return None
