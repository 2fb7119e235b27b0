"""A minimal, lazy safetensors reader and writer on numpy (no torch, no pickle).

The format is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw data. Reading maps the file and copies only the
rows asked for, so a 4 GB embedding can be converted block by block.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from deltaship.errors import DeltashipError

_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 on read
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
}
FLOAT_DTYPES = ("F32", "F16", "BF16")


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly, data read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DeltashipError(f"{self.path}: truncated safetensors file ({size} bytes, no header)",
                                     "re-copy or re-download this file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise DeltashipError(f"{self.path}: truncated or corrupt safetensors file (header of {n} bytes "
                                     f"in a {size}-byte file)", "re-copy or re-download this file")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise DeltashipError(f"{self.path}: corrupt safetensors header", "re-copy or re-download this file") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.entries: dict[str, dict] = header
        for name, e in header.items():
            dt = e.get("dtype")
            if dt not in _DTYPES:
                raise DeltashipError(f"{self.path}: tensor {name!r} has unsupported dtype {dt!r}",
                                     "convert the checkpoint to F32, F16 or BF16 safetensors")
            begin, end = e["data_offsets"]
            expected = int(np.prod(e["shape"], dtype=np.int64)) * _DTYPES[dt].itemsize
            if end - begin != expected:
                raise DeltashipError(f"{self.path}: tensor {name!r} has {end - begin} bytes for shape {e['shape']} "
                                     f"({dt})", "the file is corrupt; re-copy or re-download it")
            if self.data_start + end > size:
                raise DeltashipError(
                    f"{self.path}: truncated safetensors file: tensor {name!r} ends at byte {self.data_start + end} "
                    f"but the file has {size} bytes", "re-copy or re-download this file")
        self._map: np.memmap | None = None

    def _mm(self) -> np.memmap:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Read a tensor (or a range of its leading dimension) as float32 (ints stay ints)."""
        e = self.entries[name]
        dt, shape = e["dtype"], list(e["shape"])
        item = _DTYPES[dt].itemsize
        begin = self.data_start + e["data_offsets"][0]
        row_elems = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        if rows is not None and shape:
            start, stop, _ = rows.indices(shape[0])
            begin += start * row_elems * item
            shape[0] = max(0, stop - start)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        raw = self._mm()[begin:begin + count * item]
        arr = np.frombuffer(raw.tobytes(), dtype=_DTYPES[dt]).reshape(shape)
        if dt == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        if dt in ("F16", "F64"):
            return arr.astype(np.float32)
        return arr


def write_safetensors(path: Path, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None,
                      dtype: str = "F32") -> None:
    """Write float tensors as F32, F16 or BF16 (rounded to nearest even)."""
    items = [(name, tuple(arr.shape), (lambda a=arr: a)) for name, arr in tensors]
    write_safetensors_lazy(path, items, metadata, dtype)


def write_safetensors_lazy(path: Path, items: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]],
                           metadata: dict[str, str] | None = None, dtype: str = "F32") -> None:
    """Like write_safetensors, but each tensor is produced only when written: one in memory at a time."""
    itemsize = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    header: dict = {"__metadata__": metadata} if metadata else {}
    off = 0
    for name, shape, _ in items:
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, produce in items:
            arr = np.ascontiguousarray(produce(), dtype=np.float32)
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"{name}: produced {arr.shape}, declared {shape}")
            f.write(_encode(arr, dtype).tobytes())


def _encode(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return a
    if dtype == "F16":
        return a.astype(np.float16)
    u = a.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
