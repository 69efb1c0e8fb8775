"""A Hugging Face folder's weight files, read and written one tensor at a time.

Conversion holds one copy of the model (ours, in memory) and streams the other side: the source's
tensors are read from disk as each is needed, and an export's are written as each is made. Files
are read with plain reads, not memory-mapped (pages of a mapped file count in the process's
resident memory once touched, so reading a whole model through a map holds a second copy of it
in the page tables until the map is closed).

The safetensors format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
length, a JSON header mapping each name to its dtype, shape and [begin, end) byte offsets in the
data that follows (and ``__metadata__``: string pairs), then the tensors' bytes, contiguous and
little-endian. `write_safetensors` writes the header from the list of tensors to come, then each
tensor as it is produced; the `safetensors` package reads the result (tested).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from megatron_mlmclm.errors import UsageError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the safetensors package's own bound
PIECE = 1 << 22  # elements cast and written at a time (a widening cast copies what it casts)


def _header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path} is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER:
        raise ValueError(f"{path} declares a {n}-byte header")
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path} has no safetensors header")
    return header, 8 + n


class SafetensorsFile:
    """The tensors of one .safetensors file, each read from disk when asked for."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            header, self.start = _header(f, self.path)
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            if e.get("dtype") not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name} has dtype {e.get('dtype')}")
            begin, end = (int(x) for x in e["data_offsets"])
            shape = tuple(int(x) for x in e["shape"])
            dtype = DTYPES[e["dtype"]]
            numel = 1
            for s in shape:
                numel *= s
            if end - begin != numel * dtype.itemsize or self.start + end > size or begin < 0:
                raise ValueError(f"{self.path}: tensor {name} lies outside the file")
            self.entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        if end > begin:
            with open(self.path, "rb") as f:
                f.seek(self.start + begin)
                view = memoryview(out.view(-1).view(torch.uint8).numpy())
                if f.readinto(view) != end - begin:
                    raise ValueError(f"{self.path}: tensor {name} is truncated")
        return out


class HFWeights:
    """Every tensor of a Hugging Face model folder by name (safetensors, sharded or not; else
    pytorch_model*.bin, loaded without code and memory-mapped), read when asked for. Names are
    the model's own (a bare model's, saved without the ``model.`` prefix, get it)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._where: dict[str, tuple[Any, str]] = {}
        files = sorted(self.folder.glob("*.safetensors"))
        try:
            if files:
                for path in files:
                    st = SafetensorsFile(path)
                    self._where.update({k: (st, k) for k in st.keys()})
            else:
                bins = sorted(self.folder.glob("pytorch_model*.bin"))
                if not bins:
                    raise UsageError(
                        f"{self.folder} has no weights (*.safetensors or pytorch_model*.bin)"
                    )
                for path in bins:
                    state = _load_bin(path)
                    self._where.update({k: (state, k) for k in state})
        except UsageError:
            raise
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(
                f"cannot read the weights in {self.folder} (corrupt or partial?): {first}"
            ) from None
        if not any(k.startswith("model.") for k in self._where):
            self._where = {
                ("model." + k if k != "lm_head.weight" else k): v for k, v in self._where.items()
            }

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """The tensor, in the dtype it is stored in, read now."""
        source, key = self._where[name]
        try:
            t = source.get(key) if isinstance(source, SafetensorsFile) else source[key]
        except Exception as e:
            raise UsageError(
                f"cannot read tensor {name} of {self.folder} (corrupt or partial?): "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
            ) from None
        return t

    def dtype(self) -> torch.dtype:
        """The floating dtype the weights are stored in (the first floating tensor's)."""
        for source, key in self._where.values():
            dt = source.dtype(key) if isinstance(source, SafetensorsFile) else source[key].dtype
            if dt.is_floating_point:
                return dt
        return torch.float32


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin's tensors (no code run), memory-mapped where its format allows."""
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (pre-zip) format cannot be mapped
        return torch.load(str(path), map_location="cpu", weights_only=True)


def write_safetensors(
    path: str | Path,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    check: Callable[[str, torch.Tensor], None] | None = None,
) -> None:
    """Write a .safetensors file of `entries` (name, dtype, shape, in the order they come), whose
    tensors `tensors` yields in that order, each written (cast to its entry's dtype a piece at a
    time) before the next is asked for. `check(name, tensor)` sees each before it is written."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        numel = 1
        for s in shape:
            numel *= s
        size = numel * dtype.itemsize
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the package writes it
    expected: Iterator = iter(entries)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, t in tensors:
            want = next(expected, None)
            if want is None or want[0] != name or tuple(t.shape) != tuple(want[2]):
                raise RuntimeError(f"tensor {name} {tuple(t.shape)} does not match {want}")
            if check is not None:
                check(name, t)
            flat = t.detach().to(device="cpu").contiguous().view(-1)
            for piece in flat.split(PIECE):
                piece = piece.to(want[1])
                f.write(memoryview(piece.view(torch.uint8).numpy()))
        if next(expected, None) is not None:
            raise RuntimeError(f"{path}: fewer tensors written than declared")
