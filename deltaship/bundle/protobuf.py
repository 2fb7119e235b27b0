"""A minimal protobuf wire-format reader, for checking a bundle's graphs against its manifest without a toolchain.

The ONNX and Core ML artifact checks (runtimes/onnx_contract.py, runtimes/coreml_contract.py) read a few fields of
large files from a memory map: no `onnx` or `coremltools` import, and the weights are skipped unread. Every reader
raises ValueError for bytes that are not a protobuf message (a truncated or foreign file).
"""

from __future__ import annotations

from typing import Iterator


def varint(buf, i: int) -> tuple[int, int]:
    """The varint at buf[i], and the index after it."""
    shift = value = 0
    while True:
        if i >= len(buf):
            raise ValueError("a varint runs past the end")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def fields(buf, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of each field of the message buf[start:end]: a varint's value, the
    (start, end) of a length-delimited field, None for a fixed 32- or 64-bit one."""
    i, end = start, len(buf) if end is None else end
    while i < end:
        tag, i = varint(buf, i)
        kind = tag & 7
        if kind == 0:
            value, i = varint(buf, i)
        elif kind in (1, 5):
            value, i = None, i + (8 if kind == 1 else 4)
        elif kind == 2:
            n, i = varint(buf, i)
            if i + n > end:
                raise ValueError("a field runs past its message")
            value, i = (i, i + n), i + n
        else:
            raise ValueError(f"wire type {kind}")
        yield tag >> 3, kind, value


def messages(buf, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field of the message buf[start:end]."""
    for f, kind, v in fields(buf, start, end):
        if kind == 2:
            yield f, v[0], v[1]


def varints(buf, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
    """(field number, value) of each varint field of the message buf[start:end]."""
    for f, kind, v in fields(buf, start, end):
        if kind == 0:
            yield f, v
