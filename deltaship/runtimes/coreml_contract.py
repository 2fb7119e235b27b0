"""A Core ML bundle's packages against its manifest, read before the evaluator or Core ML loads them.

Each `.mlpackage` of `lowering.parts` names its model spec in its Manifest.json (`rootModelIdentifier`); the
check reads that protobuf's ModelDescription only (coremltools' Model.proto, field by field: no coremltools, whose
import takes most of a minute, and the ML program and weights are skipped unread). Every function a session calls
(`prefill`, `decode`) must take the part's input, `position` and each io state (`coreml_input`), return the part's
output and each io state (`coreml_output`), and hold each Core ML state, with the manifest's dtypes and shapes; so a
manifest edited after export fails here, naming the field, and not as an evaluator or Core ML traceback.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

from deltaship.bundle.paths import bundle_path, require_entry
from deltaship.bundle.protobuf import fields, varint
from deltaship.errors import DeltashipError
from deltaship.files import read_json_object

# ArrayFeatureType.ArrayDataType (FeatureTypes.proto), by the manifest's dtype names
_DTYPES = {65568: "float32", 65600: "float64", 65552: "float16", 131104: "int32", 131080: "int8"}

# Field numbers (coremltools/mlmodel/format: Model.proto, FeatureTypes.proto) of what the check reads
_MODEL_DESCRIPTION = 2
_DESC_INPUT, _DESC_OUTPUT, _DESC_STATE, _DESC_FUNCTIONS = 1, 10, 13, 20
_FUNC_NAME, _FUNC_INPUT, _FUNC_OUTPUT, _FUNC_STATE = 1, 2, 3, 6
_FEATURE_NAME, _FEATURE_TYPE = 1, 3
_TYPE_ARRAY, _TYPE_STATE, _STATE_ARRAY = 5, 8, 1
_ARRAY_SHAPE, _ARRAY_DTYPE = 1, 2
_RUNTIME_FUNCTIONS = ("prefill", "decode")  # what runtimes/coreml.py calls
HIDDEN = "lowering.hidden_states"


def _feature(buf, a: int, b: int) -> tuple[str, tuple[str, list[int]]]:
    """FeatureDescription -> (name, (dtype, shape)) of a multi-array or a state's array ("not an array" else)."""
    name, have = "", ("not an array", [])
    for f, kind, v in fields(buf, a, b):
        if f == _FEATURE_NAME and kind == 2:
            name = bytes(buf[v[0] : v[1]]).decode("utf-8", "replace")
        elif f == _FEATURE_TYPE and kind == 2:
            for g, kind2, w in fields(buf, *v):
                if g == _TYPE_ARRAY and kind2 == 2:
                    have = _array(buf, *w)
                elif g == _TYPE_STATE and kind2 == 2:
                    arrays = [x for h, k, x in fields(buf, *w) if h == _STATE_ARRAY and k == 2]
                    have = _array(buf, *arrays[0]) if arrays else have
    return name, have


def _array(buf, a: int, b: int) -> tuple[str, list[int]]:
    shape, code = [], 0
    for f, kind, v in fields(buf, a, b):
        if f == _ARRAY_SHAPE and kind == 0:
            shape.append(v)
        elif f == _ARRAY_SHAPE and kind == 2:  # packed
            i = v[0]
            while i < v[1]:
                d, i = varint(buf, i)
                shape.append(d)
        elif f == _ARRAY_DTYPE and kind == 0:
            code = v
    return _DTYPES.get(code, f"Core ML array type {code}"), shape


def _function(buf, a: int, b: int) -> tuple[str, dict[str, dict]]:
    name, io = "", {"inputs": {}, "outputs": {}, "states": {}}
    for f, kind, v in fields(buf, a, b):
        if f == _FUNC_NAME and kind == 2:
            name = bytes(buf[v[0] : v[1]]).decode("utf-8", "replace")
        elif kind == 2 and f in (_FUNC_INPUT, _FUNC_OUTPUT, _FUNC_STATE):
            key = {_FUNC_INPUT: "inputs", _FUNC_OUTPUT: "outputs", _FUNC_STATE: "states"}[f]
            feature, have = _feature(buf, *v)
            io[key][feature] = have
    return name, io


def package_functions(path: Path) -> dict[str, dict[str, dict[str, tuple[str, list[int]]]]]:
    """Function name -> {"inputs", "outputs", "states": {name: (dtype, shape)}} of a model spec (a single-function
    model: its description, under the name ""). Raises ValueError for a file that is not a readable spec."""

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for field, kind, v in fields(buf):
            if field != _MODEL_DESCRIPTION or kind != 2:
                continue  # the ML program and the rest: skipped unread
            functions, single = {}, {"inputs": {}, "outputs": {}, "states": {}}
            for g, kind2, w in fields(buf, *v):
                if g == _DESC_FUNCTIONS and kind2 == 2:
                    name, io = _function(buf, *w)
                    functions[name] = io
                elif kind2 == 2 and g in (_DESC_INPUT, _DESC_OUTPUT, _DESC_STATE):
                    key = {_DESC_INPUT: "inputs", _DESC_OUTPUT: "outputs", _DESC_STATE: "states"}[g]
                    feature, have = _feature(buf, *w)
                    single[key][feature] = have
            return functions or {"": single}
    raise ValueError("no model description")


def _spec_path(bundle: Path, manifest: dict[str, Any], package: str) -> Path:
    """The model spec a package's Manifest.json names as its root model (Data/<path>), inside the bundle."""
    index = bundle_path(bundle, manifest, f"{package}/Manifest.json", "lowering.parts[].package")
    fix = "export the bundle again"
    info = read_json_object(index, "Core ML package manifest", fix)
    try:
        rel = info["itemInfoEntries"][info["rootModelIdentifier"]]["path"]
    except (KeyError, TypeError):
        raise DeltashipError(f"{index}: names no root model (rootModelIdentifier)", fix) from None
    return bundle_path(bundle, manifest, f"{package}/Data/{rel}", f"{package}/Manifest.json root model")


def _compare(field: str, spec: dict, have: tuple[str, list[int]], where: str, tokens: int) -> list[str]:
    dtype, shape_have = have
    label = f"{field} {spec.get('name')!r}"
    if spec.get("dtype") != dtype:
        return [f"{label}: dtype {spec.get('dtype')} in the manifest, {dtype} in {where}"]
    shape = [tokens if d in ("T", "tokens") else d for d in spec.get("shape", [])]
    if len(shape) != len(shape_have) or any(isinstance(a, int) and a != b for a, b in zip(shape, shape_have)):
        return [f"{label}: shape {spec.get('shape')} in the manifest, {shape_have} in {where}"]
    return []


def _one(have: dict, field: str, spec: dict, name: str, where: str, tokens: int) -> list[str]:
    if name not in have:
        return [f"{field} {spec.get('name')!r}: {where} has no {name!r} (it has {', '.join(sorted(have)) or 'none'})"]
    return _compare(field, spec, have[name], where, tokens)


def package_problems(bundle: Path, manifest: dict[str, Any]) -> list[str]:
    """Where the bundle's Core ML packages disagree with the manifest's inputs, outputs and states (empty when
    they agree)."""
    bundle = Path(bundle)
    lowering = manifest.get("lowering") or {}
    states = {s["name"]: s for s in manifest["states"]}
    inputs = {t["name"]: t for t in manifest["inputs"]}
    outputs = {t["name"]: t for t in manifest["outputs"]}
    hidden = dict(lowering.get("hidden_states") or {})
    tokens_of = {"prefill": manifest.get("prefill_chunk"), "decode": 1}  # what the session feeds each function
    draft = ((manifest.get("speculative") or {}).get("draft") or {}).get("states") or []
    draft = {s.get("coreml_input") for s in draft if isinstance(s, dict)}  # the MTP head's own Core ML states
    problems: list[str] = []
    # the entry is a package directory; that every file under it is listed: bundle/reader.py check_files
    require_entry(bundle, manifest, ".mlpackage", "a Core ML package", directory=True)
    for part in lowering.get("parts") or []:
        package = part["package"]
        path = _spec_path(bundle, manifest, package)
        try:
            functions = package_functions(path)
        except (ValueError, OSError, IndexError) as e:  # a truncated or foreign file
            raise DeltashipError(
                f"{path}: not a readable Core ML model spec ({e})", "export the bundle again"
            ) from None
        named = part.get("functions") or {}
        missing = sorted(f for f in named if isinstance(f, str) and f not in functions)
        if missing:  # the verify and draft functions are only looked up by name (their io is not compared yet)
            problems.append(f"lowering.parts[].functions: {package} has no {', '.join(missing)}")
        for fname in _RUNTIME_FUNCTIONS:
            where = f"{package} function {fname!r}"
            if fname not in functions:
                problems.append(f"lowering.functions {fname!r}: {package} has no such function")
                continue
            have, tokens = functions[fname], tokens_of.get(fname)
            named_in = {part["input"], "position"}
            held = set(draft)
            # a part after the first takes, and one before the last returns, lowering.hidden_states
            field, first = ("inputs", inputs[part["input"]]) if part["input"] in inputs else (HIDDEN, hidden)
            problems += _one(have["inputs"], field, dict(first, name=part["input"]), part["input"], where, tokens)
            problems += _one(have["inputs"], "inputs", inputs.get("position", {}), "position", where, tokens)
            field, last = ("outputs", outputs[part["output"]]) if part["output"] in outputs else (HIDDEN, hidden)
            problems += _one(have["outputs"], field, dict(last, name=part["output"]), part["output"], where, tokens)
            for name in part["states"]:
                s = states.get(name)
                if s is None:
                    problems.append(f"lowering.parts[].states {name!r}: not a state of the manifest")
                elif s.get("mode") == "state":
                    held.add(s["coreml_input"])
                    problems += _one(have["states"], "states", s, s["coreml_input"], where, tokens)
                else:  # an io state: fed and returned as float32 by the session
                    named_in.add(s["coreml_input"])
                    problems += _one(have["inputs"], "states", s, s["coreml_input"], where, tokens)
                    problems += _one(have["outputs"], "states (output)", s, s["coreml_output"], where, tokens)
            extra = sorted(set(have["inputs"]) - named_in)
            if extra:
                problems.append(f"inputs: {where} takes {', '.join(extra)}, which the manifest does not name")
            extra = sorted(set(have["states"]) - held)
            if extra:
                problems.append(f"states: {where} holds {', '.join(extra[:8])}, which the manifest does not name")
    return problems
