"""An ExecuTorch bundle's program against its manifest, read before executorch.runtime loads it.

The .pte is a flatbuffer (executorch/schema/program.fbs) followed by its data segments. The check reads the
program's tables only, bounds-checked field by field (no executorch, no torch, the weights never touched): each
method the manifest names (`forward`; `verify` and `mtp_draft` with --mtp) must exist, its inputs and outputs must
have the manifest's count, dtypes and static dims in order (a program names no inputs), and every state's `buffer`
must be a mutable buffer of `forward` with the state's dtype and shape, so a manifest edited after export fails
here, naming the field, and not as an ExecuTorch error in the middle of a call.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from deltaship.bundle.paths import require_entry
from deltaship.errors import DeltashipError

# executorch/schema/scalar_type.fbs, by the manifest's dtype names
_DTYPES = {0: "uint8", 1: "int8", 3: "int32", 4: "int64", 5: "float16", 6: "float32", 11: "bool", 15: "bfloat16"}

# Field slots of program.fbs's tables (a union takes two: its type, then its value)
_PROGRAM_PLANS = 1
_PLAN_NAME, _PLAN_VALUES, _PLAN_INPUTS, _PLAN_OUTPUTS = 0, 2, 3, 4
_EVALUE_TYPE, _EVALUE_VAL, _KERNEL_TENSOR = 0, 1, 5
_TENSOR_DTYPE, _TENSOR_SIZES, _TENSOR_EXTRA = 0, 2, 9
_EXTRA_NAME = 1


class _Buf:
    """Little-endian reads of a flatbuffer that refuse any offset outside it (the file is untrusted)."""

    def __init__(self, data) -> None:
        self.data, self.size = data, len(data)

    def read(self, fmt: str, at: int):
        if at < 0 or at + struct.calcsize(fmt) > self.size:
            raise ValueError(f"offset {at} outside the {self.size}-byte program")
        return struct.unpack_from("<" + fmt, self.data, at)[0]

    def table(self, at: int) -> "_Table":
        return _Table(self, at)


class _Table:
    def __init__(self, buf: _Buf, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.vtable = pos - buf.read("i", pos)
        self.vsize = buf.read("H", self.vtable)

    def _field(self, slot: int) -> int | None:
        at = 4 + 2 * slot
        off = self.buf.read("H", self.vtable + at) if at + 2 <= self.vsize else 0
        return self.pos + off if off else None

    def scalar(self, slot: int, fmt: str, default: int = 0) -> int:
        at = self._field(slot)
        return default if at is None else self.buf.read(fmt, at)

    def _ref(self, slot: int) -> int | None:
        at = self._field(slot)
        return None if at is None else at + self.buf.read("I", at)

    def table(self, slot: int) -> "_Table | None":
        at = self._ref(slot)
        return None if at is None else _Table(self.buf, at)

    def string(self, slot: int) -> str | None:
        at = self._ref(slot)
        if at is None:
            return None
        n = self.buf.read("I", at)
        self.buf.read(f"{n}s", at + 4)  # bounds
        return bytes(self.buf.data[at + 4 : at + 4 + n]).decode("utf-8", "replace")

    def vector(self, slot: int, fmt: str) -> list:
        """A vector of scalars (fmt) or, with fmt "T", of tables."""
        at = self._ref(slot)
        if at is None:
            return []
        n, width = self.buf.read("I", at), 4 if fmt == "T" else struct.calcsize(fmt)
        self.buf.read(f"{n * width}s", at + 4)  # bounds, before a length from the file drives a loop
        items = [at + 4 + i * width for i in range(n)]
        if fmt == "T":
            return [_Table(self.buf, p + self.buf.read("I", p)) for p in items]
        return [self.buf.read(fmt, p) for p in items]


def _tensor(values: list[_Table], index: int) -> _Table | None:
    """The Tensor table of EValue `index`, or None for a value of another kind."""
    if not 0 <= index < len(values):
        raise ValueError(f"value index {index} outside the method's {len(values)} values")
    value = values[index]
    return value.table(_EVALUE_VAL) if value.scalar(_EVALUE_TYPE, "B") == _KERNEL_TENSOR else None


def _describe(tensor: _Table | None) -> tuple[str, list[int]]:
    if tensor is None:
        return "not a tensor", []
    code = tensor.scalar(_TENSOR_DTYPE, "b")
    return _DTYPES.get(code, f"ExecuTorch scalar type {code}"), tensor.vector(_TENSOR_SIZES, "i")


def program_io(path: Path) -> dict[str, dict[str, Any]]:
    """Method name -> {"inputs": [(dtype, sizes)], "outputs": [...], "buffers": {name: (dtype, sizes)}} of a .pte
    (sizes of a dynamic dim: its upper bound). Raises ValueError for a file that is not a readable program."""

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        buf = _Buf(data)
        if buf.size < 8 or bytes(data[4:8])[:2] != b"ET":
            raise ValueError("no ExecuTorch file identifier")
        methods = {}
        for plan in buf.table(buf.read("I", 0)).vector(_PROGRAM_PLANS, "T"):
            values = plan.vector(_PLAN_VALUES, "T")
            buffers = {}
            for v in values:
                t = v.table(_EVALUE_VAL) if v.scalar(_EVALUE_TYPE, "B") == _KERNEL_TENSOR else None
                extra = t.table(_TENSOR_EXTRA) if t is not None else None
                name = extra.string(_EXTRA_NAME) if extra is not None else None
                if name:
                    buffers[name] = _describe(t)
            methods[plan.string(_PLAN_NAME) or ""] = {
                "inputs": [_describe(_tensor(values, i)) for i in plan.vector(_PLAN_INPUTS, "i")],
                "outputs": [_describe(_tensor(values, i)) for i in plan.vector(_PLAN_OUTPUTS, "i")],
                "buffers": buffers,
            }
        return methods


def _compare(field: str, spec: dict, have: tuple[str, list[int]], where: str, chunk: int | None = None) -> list[str]:
    dtype, sizes = have
    label = f"{field} {spec.get('name')!r}"
    if spec["dtype"] != dtype:
        return [f"{label}: dtype {spec['dtype']} in the manifest, {dtype} in {where}"]
    shape = spec["shape"]
    if len(shape) != len(sizes) or any(isinstance(a, int) and a != b for a, b in zip(shape, sizes)):
        return [f"{label}: shape {shape} in the manifest, {sizes} in {where}"]
    # a dynamic dim's size is its upper bound: the session feeds up to prefill_chunk tokens a call
    bound = [b for a, b in zip(shape, sizes) if a == "tokens"]
    if chunk is not None and bound and isinstance(chunk, int) and chunk > bound[0]:
        return [f"prefill_chunk: {chunk} in the manifest, but {where} takes at most {bound[0]} tokens a call"]
    return []


def _compare_list(field: str, specs: list[dict], have: list, where: str, chunk: int | None = None) -> list[str]:
    if len(specs) != len(have):
        return [f"{field}: {len(specs)} in the manifest, {where} has {len(have)}"]
    return [p for spec, got in zip(specs, have) for p in _compare(field, spec, got, where, chunk)]


def _methods(manifest: dict[str, Any]) -> list[tuple[str, str, dict, list | None]]:
    """(method, manifest field prefix, block with its inputs and outputs, the states whose buffers are the method's
    own, None: shared with forward) of every method of the entry program the manifest describes: `forward`, and with
    --mtp `verify` (forward's buffers) and `mtp_draft` (its own KV cache)."""
    out = [("forward", "", manifest, manifest["states"])]
    spec = manifest.get("speculative") or {}
    for key, own in (("verify", False), ("draft", True)):
        block = spec.get(key) or {}
        method = block.get("program_method")
        if method and block.get("file", manifest["entry"]) == manifest["entry"]:
            out.append((method, f"speculative.{key}.", block, (block.get("states") or []) if own else None))
    return out


def program_problems(bundle: Path, manifest: dict[str, Any]) -> list[str]:
    """Where the bundle's entry program disagrees with the manifest's inputs, outputs and states (empty when
    they agree)."""
    entry = manifest["entry"]
    # the program is all the runtime opens: deltaship's session and the runner load it with no named-data file
    path = require_entry(bundle, manifest, ".pte", "an ExecuTorch program")
    try:
        methods = program_io(path)
    except (ValueError, OSError, struct.error) as e:  # a truncated or foreign file
        raise DeltashipError(f"{path}: not a readable ExecuTorch program ({e})", "export the bundle again") from None
    problems: list[str] = []
    for method, prefix, block, states in _methods(manifest):
        if method not in methods:
            problems.append(
                f"{prefix + 'program_method' if prefix else 'entry'} {method!r}: {entry} has no such method"
            )
            continue
        got, where = methods[method], f"{entry} method {method!r}"
        chunk = manifest.get("prefill_chunk") if method == "forward" else None
        problems += _compare_list(prefix + "inputs", block.get("inputs", []), got["inputs"], where, chunk)
        problems += _compare_list(prefix + "outputs", block.get("outputs", []), got["outputs"], where)
        if states is None:
            continue
        named = set()
        for s in states:
            buffer = s.get("buffer", s["name"].replace(".", "_"))
            named.add(buffer)
            if buffer not in got["buffers"]:
                problems.append(f"{prefix}states {s['name']!r}: buffer {buffer!r} is not a mutable buffer of {where}")
            else:
                problems += _compare(prefix + "states", s, got["buffers"][buffer], where)
        extra = sorted(set(got["buffers"]) - named)
        if extra:
            problems.append(f"{prefix}states: {where} holds {', '.join(extra[:8])}, which the manifest does not name")
    return problems
