"""A compiled QNN context (an EPContext model) and what it needs to run, read from its compatibility record.

ONNX Runtime's QNN execution provider writes, into every `*_ctx.onnx` it compiles, the metadata entry
`ep_compatibility_info.QNNExecutionProvider`:

    v2:<backend id>:<QNN SDK version>:<HTP backend API version>:<HTP archs>:<SoC models>:<VTCM MBs>:<user driver>

e.g. `v2:6:2.51.0:5.51.0:75:57:0:0` (backend 6 = HTP, QNN 2.51.0, compiled for HTP v75 on SoC 57 = SM8650,
VTCM unset). The format and the rule below are onnxruntime-qnn's own (qnn_cache_compatibility_manager.cc): a
context runs where the device's HTP backend API version is at least the context's and its HTP arch at least the
context's (equal: optimal; newer: runs, "prefer recompilation"; older: unsupported). That check is skipped on
x86-64, where the HTP is a simulator that opens any context with any SoC options, so deltaship applies it
itself before opening one. Pure functions: no toolchain.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deltaship.bundle.protobuf import fields, messages
from deltaship.errors import DeltashipError

COMPAT_KEY = "ep_compatibility_info.QNNExecutionProvider"
HTP_BACKEND_ID = 6  # QNN's backend id of the HTP (QNN_BACKEND_ID_HTP)
MAX_CONTEXT_MODEL_BYTES = 16 << 20  # a context model is a few KB of nodes: its graph lives in the .bin


@dataclass(frozen=True)
class ContextCompat:
    """What a compiled QNN context was built for and with."""

    qnn_sdk: str  # the QNN (QAIRT) SDK that compiled it, "2.51.0": a runtime needs this one or newer
    htp_backend_api: str  # the HTP backend API version, "5.51.0" (bumped with the SDK)
    htp_archs: tuple[int, ...]  # one per SoC it was compiled for (several only for a multi-SoC context)
    soc_models: tuple[int, ...]
    vtcm_mbs: tuple[int, ...]  # 0: unset (the SoC's default)
    record: str  # the metadata value as written


def _version(text: str) -> tuple[int, int, int]:
    parts = text.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(text)
    return int(parts[0]), int(parts[1]), int(parts[2])


def _numbers(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.isdigit())
    if not values or len(values) != len(text.split(",")):
        raise ValueError(text)
    return values


def parse_compat(text: str | None, where: str) -> ContextCompat:
    """The compatibility record `text` (the metadata value above) of the context model at `where`."""
    fix = "compile the graph again with deltaship (onnxruntime-qnn >= 2.7 writes this record into every context model)"
    if not text:
        raise DeltashipError(
            f"{where}: no {COMPAT_KEY} metadata: not a QNN context model onnxruntime-qnn compiled", fix
        )
    fields = text.split(":")
    try:
        if len(fields) != 8 or fields[0] != "v2":
            raise ValueError(text)
        if int(fields[1]) != HTP_BACKEND_ID:
            raise DeltashipError(
                f"{where}: compiled for QNN backend {fields[1]}, not the HTP ({HTP_BACKEND_ID})",
                "compile the graph for the HTP backend",
            )
        _version(fields[2]), _version(fields[3])
        compat = ContextCompat(
            fields[2], fields[3], _numbers(fields[4]), _numbers(fields[5]), _numbers(fields[6]), text
        )
    except ValueError:
        raise DeltashipError(f"{where}: unreadable {COMPAT_KEY} {text[:120]!r} (expected v2:6:...)", fix) from None
    if not len(compat.htp_archs) == len(compat.soc_models) == len(compat.vtcm_mbs):
        raise DeltashipError(f"{where}: {COMPAT_KEY} {text!r} lists unequal numbers of archs, SoCs and VTCM sizes", fix)
    return compat


def soc_refusal(compat: ContextCompat, soc_model: int, htp_arch: int) -> str | None:
    """Why the context cannot be opened for the SoC `soc_model` (HTP `htp_arch`), or None when it was compiled for
    it. deltaship opens a context only on the SoC it was compiled for: an older HTP cannot run it, and a newer one
    runs it only as QNN's fallback (its rule: "prefer recompilation") with the older arch's schedule."""
    built = ", ".join(f"SoC {s} (HTP v{a})" for s, a in zip(compat.soc_models, compat.htp_archs))
    if any(s == soc_model and a == htp_arch for s, a in zip(compat.soc_models, compat.htp_archs)):
        return None
    if all(a > htp_arch for a in compat.htp_archs):
        why = "an HTP cannot run a context compiled for a newer HTP"
    elif htp_arch in compat.htp_archs:
        why = "the HTP arch matches but the SoC (its VTCM and cores) does not"
    else:
        why = (
            "a newer HTP would run it only as QNN's fallback, scheduled for the older arch (QNN: prefer recompilation)"
        )
    return f"compiled for {built}, opened for SoC {soc_model} (HTP v{htp_arch}): {why}"


def version_refusal(compat: ContextCompat, runtime_qnn_sdk: str) -> str | None:
    """Why a runtime shipping QNN `runtime_qnn_sdk` ("2.51.0") cannot open the context, or None when it can."""
    try:
        older = _version(runtime_qnn_sdk) < _version(compat.qnn_sdk)
    except ValueError:
        return f"the runtime's QNN version {runtime_qnn_sdk!r} is not major.minor.patch"
    if older:
        return f"compiled with QNN {compat.qnn_sdk}: it needs that QNN or newer, and this runtime has {runtime_qnn_sdk}"
    return None


@dataclass(frozen=True)
class ContextModel:
    """The parts of an EPContext model (`*_ctx.onnx`) a reader checks before opening it."""

    compat: ContextCompat
    binaries: tuple[str, ...]  # the context binaries its EPContext nodes name, relative to its directory
    other_ops: tuple[str, ...]  # op types of nodes that are not EPContext (left to another provider)
    qnn_builds: tuple[str, ...]  # the EPContext nodes' ep_sdk_version: the QAIRT build, "v2.51.0.260929181845"


def _text(buf, start: int, end: int) -> str:
    return bytes(buf[start:end]).decode("utf-8", "replace")


def _attribute(buf, start: int, end: int) -> tuple[str, object]:
    """(name, value) of an AttributeProto: name = 1, i = 3 (varint), s = 4 (bytes, read as text)."""
    name, value = "", None
    for f, kind, v in fields(buf, start, end):
        if f == 1 and kind == 2:
            name = _text(buf, *v)
        elif f == 3 and kind == 0:
            value = v
        elif f == 4 and kind == 2:
            value = _text(buf, *v)
    return name, value


def read_context_model(path: Path) -> ContextModel:
    """Read the context model at `path` (protobuf wire format, no onnx import): its compatibility record, the
    binaries its EPContext nodes name (each must be a plain file name beside it) and any node that is not an
    EPContext."""
    where, fix = str(path), "compile the graph again (deltaship.lowering.qnn.context.compile_context)"
    size = path.stat().st_size
    if size > MAX_CONTEXT_MODEL_BYTES:
        raise DeltashipError(f"{where}: {size} bytes, more than a context model's {MAX_CONTEXT_MODEL_BYTES}", fix)
    buf = path.read_bytes()
    meta: dict[str, str] = {}
    binaries: list[str] = []
    others: list[str] = []
    builds: list[str] = []
    try:
        for field, start, end in messages(buf):
            if field == 14:  # ModelProto.metadata_props: StringStringEntryProto {key = 1, value = 2}
                entry = {f: _text(buf, s, e) for f, s, e in messages(buf, start, end)}
                meta[entry.get(1, "")] = entry.get(2, "")
            elif field == 7:  # ModelProto.graph: GraphProto.node = 1
                for nf, ns, ne in messages(buf, start, end):
                    if nf != 1:
                        continue
                    node = list(messages(buf, ns, ne))
                    op = next((_text(buf, s, e) for f, s, e in node if f == 4), "")  # NodeProto.op_type
                    if op != "EPContext":
                        others.append(op)
                        continue
                    attrs = dict(_attribute(buf, s, e) for f, s, e in node if f == 5)  # NodeProto.attribute
                    if attrs.get("embed_mode") == 1:
                        raise DeltashipError(f"{where}: the context binary is embedded in the model", fix)
                    if isinstance(attrs.get("ep_cache_context"), str):
                        binaries.append(attrs["ep_cache_context"])
                    if isinstance(attrs.get("ep_sdk_version"), str):
                        builds.append(attrs["ep_sdk_version"])
    except ValueError as e:
        raise DeltashipError(f"{where}: not an ONNX model ({e})", fix) from None
    for name in binaries:
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise DeltashipError(f"{where}: names the context binary {name[:80]!r}, not a file beside it", fix)
    if not binaries:
        raise DeltashipError(
            f"{where}: no EPContext node names a context binary (embedded or not a context model)", fix
        )
    compat = parse_compat(meta.get(COMPAT_KEY), where)
    return ContextModel(compat, tuple(dict.fromkeys(binaries)), tuple(others), tuple(dict.fromkeys(builds)))
