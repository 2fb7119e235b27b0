"""An ONNX bundle's graphs against its manifest, read with `onnx` before onnxruntime sees them.

Two checks, from one parse of each graph without its weights: every external-data file a graph names is a
file of the bundle (relative, inside, listed in `files`: onnxruntime opens them itself), and the entry
graph's inputs and outputs are the manifest's `inputs`, `outputs` and `states` (names, dtypes, static dims),
so a manifest edited after export fails here, naming the field, and not as an onnxruntime traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError

# onnx.TensorProto data types by the manifest's dtype names
_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 10: "float16", 16: "bfloat16"}


def _load(bundle: Path, manifest: dict[str, Any], name: str, field: str):
    import onnx

    path = bundle_path(bundle, manifest, name, field)
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and onnx's own: the file is not an ONNX model
        raise DeltashipError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})", "export again") from None


def _external(bundle: Path, manifest: dict[str, Any], model, name: str) -> None:
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    for t in _get_all_tensors(model):
        if uses_external_data(t):
            location = next((e.value for e in t.external_data if e.key == "location"), None)
            bundle_path(bundle, manifest, location, f"{name} (external data of tensor {t.name!r})")


def _io(value_infos) -> dict[str, tuple[str, list]]:
    out = {}
    for v in value_infos:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
        out[v.name] = (_DTYPES.get(t.elem_type, f"onnx type {t.elem_type}"), dims)
    return out


def _compare(field: str, spec: dict, have: dict[str, tuple[str, list]], graph: str) -> list[str]:
    name = spec["name"]
    if name not in have:
        return [f"{field} {name!r}: {graph} has no such tensor (it has {', '.join(sorted(have)[:8])}...)"]
    dtype, dims = have[name]
    if spec["dtype"] != dtype:
        return [f"{field} {name!r}: dtype {spec['dtype']} in the manifest, {dtype} in {graph}"]
    shape = spec["shape"]
    if len(shape) != len(dims) or any(
        isinstance(a, int) and isinstance(b, int) and b > 0 and a != b for a, b in zip(shape, dims)
    ):
        return [f"{field} {name!r}: shape {shape} in the manifest, {dims} in {graph}"]
    return []


def graph_problems(bundle: Path, manifest: dict[str, Any]) -> list[str]:
    """Where the bundle's ONNX graphs disagree with the manifest (empty when they agree). Raises a
    DeltashipError for an external-data path outside the bundle or not listed in `files`."""
    bundle = Path(bundle)
    entry = manifest["entry"]
    problems: list[str] = []
    for name in [n for n in manifest["files"] if n.endswith(".onnx")]:
        model = _load(bundle, manifest, name, "files")
        _external(bundle, manifest, model, name)
        if name != entry:
            continue
        ins, outs = _io(model.graph.input), _io(model.graph.output)
        for t in manifest["inputs"]:
            problems += _compare("inputs", t, ins, entry)
        for t in manifest["outputs"]:
            problems += _compare("outputs", t, outs, entry)
        for s in manifest["states"]:
            problems += _compare("states", s, ins, entry)
            problems += _compare("states (output)", dict(s, name=s["output"]), outs, entry)
        named = {t["name"] for t in manifest["inputs"]} | {s["name"] for s in manifest["states"]}
        named |= {t.get("name") for t in ((manifest.get("speculative") or {}).get("verify") or {}).get("inputs", [])}
        extra = sorted(set(ins) - named - {i.name for i in model.graph.initializer})
        if extra:
            problems.append(f"inputs: {entry} takes {', '.join(extra)}, which the manifest does not name")
    if entry not in manifest["files"]:
        problems.append(f"entry {entry!r}: not listed in files")
    return problems
