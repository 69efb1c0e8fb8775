"""Reads a W&B offline run back: `python tests/wandb_records.py RUN.wandb` prints, as JSON, its
run record (project, display name, config) and its history (step -> {key: value}, wandb's own
`_` keys left out). Run by tests/test_wandb.py with an interpreter that has wandb.

The `.wandb` file is a LevelDB-style log of wandb's protobuf `Record`s, decoded here with wandb's
own protobuf definitions: wandb >= 0.2x no longer ships a Python reader for it.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

BLOCK, HEADER = 32768, 7  # the log's block size and record header (crc32, length, kind)


def records(path: Path):
    """Every Record of a .wandb file (records split over blocks are joined)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # full, or last fragment
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def summary(path: Path) -> dict:
    out = {"runs": [], "history": {}}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item
            }
            out["history"][rec.history.step.num] = {
                k: v for k, v in items.items() if not k.startswith("_")
            }
        elif kind == "run":
            out["runs"].append(
                {
                    "project": rec.run.project,
                    "display_name": rec.run.display_name,
                    "config": {u.key: json.loads(u.value_json) for u in rec.run.config.update},
                }
            )
    return out


if __name__ == "__main__":
    print(json.dumps(summary(Path(sys.argv[1]))))
