"""Safetensors in and out: reading through the safetensors library, writing one tensor at a time.

Reading (`SafetensorsFile`) is `safetensors.safe_open`: lazy, memory-mapped, no pickle. Writing stays
here because the library's `save_file` needs every tensor in memory at once, and the published-shape
checkpoints deltaship writes for benchmarks (bench/tools/make_checkpoint.py: 9B in bf16 is 18 GB) do not fit;
`write_safetensors_lazy` produces and writes one tensor at a time (the format: an 8-byte header length,
a JSON header of dtypes, shapes and byte ranges, then the raw data).
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
    """One .safetensors file, read lazily through the safetensors library (memory-mapped; a slice of rows
    reads only those rows, so a 4 GB embedding can be converted block by block)."""

    def __init__(self, path: Path):
        from safetensors import safe_open  # lazy: safetensors

        self.path = Path(path)
        try:  # the library checks the header and that every tensor's bytes are in the file
            self._file = safe_open(str(self.path), framework="pt")  # torch: bf16 (numpy has none)
        except Exception as e:  # SafetensorError, or an OSError for an unreadable file
            raise DeltashipError(
                f"{self.path}: truncated safetensors file, or a corrupt one (safetensors: {e})",
                "re-copy or re-download this file",
            ) from None
        self.metadata = self._file.metadata() or {}
        self.entries: dict[str, dict] = {}
        for name in self._file.keys():
            sl = self._file.get_slice(name)
            dt = sl.get_dtype()
            if dt not in _DTYPES:
                raise DeltashipError(
                    f"{self.path}: tensor {name!r} has unsupported dtype {dt!r}",
                    "convert the checkpoint to F32, F16 or BF16 safetensors",
                )
            self.entries[name] = {"dtype": dt, "shape": list(sl.get_shape())}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Read a tensor (or a range of its leading dimension) as float32 (ints stay ints). A float tensor holding
        NaN or inf is refused here, as it is read: every checkpoint tensor (text, MTP head, vision tower, every
        target, with or without verification) passes through this one method."""
        import torch  # lazy: torch; safetensors' numpy backend has no bfloat16, the dtype of the published checkpoints

        sl = self._file.get_slice(name)
        sliced = rows is not None and bool(self.entries[name]["shape"])
        t = sl[rows] if sliced else sl[:]
        if not t.is_floating_point():
            return t.to(copy=True).numpy()
        # a copy: the slice may be a view of the file's mapping, which must not outlive a rewrite of the file
        out = t.to(dtype=torch.float32, copy=True).numpy()
        check_finite(out, name, self.path, rows if sliced else None)
        return out


def check_finite(a: np.ndarray, name: str, path: Path, rows: slice | None = None) -> None:
    """Refuse a float32 array that holds NaN or inf, naming its tensor, its file and the count of each.

    The test is one NumPy sum (a single read-only pass, no allocation, no thread pool; several times cheaper than
    isfinite().all()): any NaN or inf makes it non-finite. A sum of finite values that overflows does too, so
    only then are the values counted."""
    if np.isfinite(a.sum()):
        return
    nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    if nan == 0 and inf == 0:  # the sum overflowed; every value is finite
        return
    where = f" (rows {rows.start or 0}:{'' if rows.stop is None else rows.stop})" if rows is not None else ""
    raise DeltashipError(
        f"{path}: tensor {name!r}{where} holds {nan} NaN and {inf} inf value(s) among its {a.size}",
        "this checkpoint's weights are corrupt or diverged in training: re-save it from a good copy",
    )


def write_safetensors(
    path: Path, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None, dtype: str = "F32"
) -> None:
    """Write float tensors as F32, F16 or BF16 (rounded to nearest even)."""
    items = [(name, tuple(arr.shape), (lambda a=arr: a)) for name, arr in tensors]
    write_safetensors_lazy(path, items, metadata, dtype)


def write_safetensors_lazy(
    path: Path,
    items: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
    dtype: str = "F32",
) -> None:
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
