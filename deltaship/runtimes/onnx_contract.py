"""An ONNX bundle's graphs against its manifest, read before onnxruntime sees them.

Two checks, from one pass over each graph's protobuf fields (the weights are skipped unread): every
external-data file a graph names is a file of the bundle (relative, inside, listed in `files`: onnxruntime
opens them itself), and the entry graph's inputs and outputs are the manifest's `inputs`, `outputs` and
`states` (names, dtypes, static dims), so a manifest edited after export fails here, naming the field, and
not as an onnxruntime traceback.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from deltaship.bundle.paths import beside, bundle_path, named_paths, require_entry
from deltaship.bundle.protobuf import messages, varints
from deltaship.errors import DeltashipError
from deltaship.files import read_json_object

# onnx.TensorProto data types by the manifest's dtype names
_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 10: "float16", 16: "bfloat16"}


# ONNX protobuf field numbers (onnx/onnx.proto) of what the check reads; everything else is skipped unread
_MODEL_GRAPH, _MODEL_FUNCTIONS, _FUNCTION_NODES = 7, 25, 7
_GRAPH_NODES, _GRAPH_INITIALIZERS, _GRAPH_INPUTS, _GRAPH_OUTPUTS, _GRAPH_SPARSE = 1, 5, 11, 12, 15
_NODE_ATTRIBUTES, _ATTR_TENSOR, _ATTR_GRAPH, _ATTR_TENSORS, _ATTR_GRAPHS, _ATTR_SPARSE = 5, 5, 6, 10, 11, 22
_TENSOR_NAME, _TENSOR_EXTERNAL, _SPARSE_VALUES = 8, 13, 1


class _Graph:
    """What the check needs of an ONNX file, read field by field from a memory map: the weights (raw_data) are
    skipped, never parsed or copied, so a 1.8 GB single-file model costs what its graph structure does."""

    def __init__(self, buf) -> None:
        self.buf = buf
        self.inputs: list[bytes] = []
        self.outputs: list[bytes] = []
        self.initializers: set[str] = set()
        self.external: list[tuple[str, str | None]] = []  # (tensor name, location)
        for f, a, b in messages(buf, 0, len(buf)):
            if f == _MODEL_GRAPH:
                self._graph(a, b, top=True)
            elif f == _MODEL_FUNCTIONS:
                for g, c, d in messages(buf, a, b):
                    if g == _FUNCTION_NODES:
                        self._node(c, d)

    def _graph(self, a: int, b: int, top: bool = False) -> None:
        for f, c, d in messages(self.buf, a, b):
            if f == _GRAPH_NODES:
                self._node(c, d)
            elif f == _GRAPH_INITIALIZERS:
                name = self._tensor(c, d)
                if top:
                    self.initializers.add(name)
            elif f == _GRAPH_SPARSE:
                self._sparse(c, d)
            elif top and f == _GRAPH_INPUTS:
                self.inputs.append(bytes(self.buf[c:d]))
            elif top and f == _GRAPH_OUTPUTS:
                self.outputs.append(bytes(self.buf[c:d]))

    def _node(self, a: int, b: int) -> None:
        for f, c, d in messages(self.buf, a, b):
            if f != _NODE_ATTRIBUTES:
                continue
            for g, e, h in messages(self.buf, c, d):
                if g in (_ATTR_TENSOR, _ATTR_TENSORS):
                    self._tensor(e, h)
                elif g in (_ATTR_GRAPH, _ATTR_GRAPHS):
                    self._graph(e, h)
                elif g == _ATTR_SPARSE:
                    self._sparse(e, h)

    def _sparse(self, a: int, b: int) -> None:
        for f, c, d in messages(self.buf, a, b):
            if f in (1, 2):  # values, indices
                self._tensor(c, d)

    def _tensor(self, a: int, b: int) -> str:
        name, location, external = "", None, False
        for f, c, d in messages(self.buf, a, b):
            if f == _TENSOR_NAME:
                name = bytes(self.buf[c:d]).decode("utf-8", "replace")
            elif f == _TENSOR_EXTERNAL:
                external = True
                key = value = None
                for g, e, h in messages(self.buf, c, d):
                    text = bytes(self.buf[e:h]).decode("utf-8", "replace")
                    key, value = (text, value) if g == 1 else (key, text)
                if key == "location":
                    location = value
        if external:
            self.external.append((name, location))
        return name


def _read(bundle: Path, manifest: dict[str, Any], name: str, field: str) -> _Graph:
    return _read_path(bundle_path(bundle, manifest, name, field))


def external_locations(path: Path) -> list[tuple[str, str | None]]:
    """(tensor, location) of every tensor of the ONNX file at `path` whose data is external, read field by field."""
    return _read_path(Path(path)).external


def _read_path(path: Path) -> _Graph:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Graph(buf)
    except (ValueError, IndexError, OSError) as e:  # a truncated or foreign file
        raise DeltashipError(f"{path}: not a readable ONNX model ({e})", "export the bundle again") from None


def _value_info(raw: bytes) -> tuple[str, str, list]:
    """ValueInfoProto -> (name, dtype, dims): name 1, type 2 -> tensor_type 1 -> elem_type 1, shape 2 -> dim 1 ->
    dim_value 1 | dim_param 2."""
    name, elem, dims = "", 0, []
    for f, a, b in messages(raw, 0, len(raw)):
        if f == 1:
            name = raw[a:b].decode("utf-8", "replace")
        elif f == 2:
            for g, c, d in messages(raw, a, b):
                if g != 1:
                    continue
                elem = dict(varints(raw, c, d)).get(1, 0)
                for h, e, k in messages(raw, c, d):
                    if h != 2:
                        continue
                    for _, m, n in messages(raw, e, k):  # each dim
                        value = dict(varints(raw, m, n)).get(1)
                        params = [raw[x:y].decode("utf-8", "replace") for q, x, y in messages(raw, m, n) if q == 2]
                        param = params[0] if params else ""
                        dims.append(value if value is not None else param)
    return name, _DTYPES.get(elem, f"onnx type {elem}"), dims


def _io(value_infos: list[bytes]) -> dict[str, tuple[str, list]]:
    try:
        infos = [_value_info(raw) for raw in value_infos]
    except (ValueError, IndexError) as e:
        raise DeltashipError(f"a graph input or output does not parse ({e})", "export the bundle again") from None
    return {name: (dtype, dims) for name, dtype, dims in infos}


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


# the manifest fields (bundle/paths.py named_paths) that name a graph file a runtime of an ONNX bundle opens
_GRAPH_FIELD = re.compile(
    r"entry|lowering\.graphs\.[^.]+\.file|lowering\.context\.[^.]+\.model|speculative\.(draft|verify)\.file"
    r"|vision\.graphs\..+"
)
_GENAI_CONFIGS = ("lowering.genai.config", "vision.genai.config")
GENAI_CONFIG = "genai_config.json"  # the config onnxruntime-genai reads from the bundle's directory (runtimes/genai.py)


def graph_files(bundle: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """name -> field of every ONNX graph file a runtime of this bundle opens, whatever its name: the entry, the
    MTP draft and verify graphs, the vision graphs, the qnn graphs and context models, the model files that
    onnxruntime-genai's configs name (resolved beside the config, as genai does), and every listed *.onnx."""
    graphs: dict[str, str] = {}
    configs = {GENAI_CONFIG: "files"} if GENAI_CONFIG in manifest["files"] else {}  # genai opens it by this name
    for field, name in named_paths(manifest):
        if _GRAPH_FIELD.fullmatch(field):
            graphs.setdefault(name, field)
        elif field in _GENAI_CONFIGS:
            configs[name] = field
    for name, field in configs.items():
        config = read_json_object(bundle_path(bundle, manifest, name, field), "genai config", "export again")
        model = config.get("model")
        for part, spec in (model if isinstance(model, dict) else {}).items():
            if isinstance(spec, dict) and "filename" in spec:
                where = f"{name} model.{part}.filename"
                path = beside(bundle, manifest, name, spec["filename"], where)
                graphs.setdefault(path.relative_to(bundle).as_posix(), where)
    for name in manifest["files"]:
        if name.endswith(".onnx"):
            graphs.setdefault(name, "files")
    return graphs


def graph_problems(bundle: Path, manifest: dict[str, Any], entries: Collection[str] | None = None) -> list[str]:
    """Where the bundle's ONNX graphs disagree with the manifest (empty when they agree). Raises a
    DeltashipError for a graph file that is not an ONNX model (the entry among them), or an external-data
    location that, resolved as ONNX Runtime resolves it (beside the graph file), is outside the bundle or not
    listed in `files`. entries: the graphs whose inputs, outputs and states are compared (default: the
    manifest's `entry`; the qnn target's decode and prefill graphs both take the manifest's states), each graph
    file read once."""
    bundle = Path(bundle)
    entries = [manifest["entry"]] if entries is None else list(entries)
    problems: list[str] = []
    require_entry(bundle, manifest, ".onnx", "an ONNX graph")
    for name, field in graph_files(bundle, manifest).items():
        graph = _read(bundle, manifest, name, field)
        for tensor, location in graph.external:  # onnxruntime opens these itself, relative to the graph's file
            beside(bundle, manifest, name, location, f"{name} (external data of tensor {tensor!r})")
        if name not in entries:
            continue
        entry = name
        ins, outs = _io(graph.inputs), _io(graph.outputs)
        for t in manifest["inputs"]:
            problems += _compare("inputs", t, ins, entry)
        for t in manifest["outputs"]:
            problems += _compare("outputs", t, outs, entry)
        for s in manifest["states"]:
            problems += _compare("states", s, ins, entry)
            problems += _compare("states (output)", dict(s, name=s["output"]), outs, entry)
        named = {t["name"] for t in manifest["inputs"]} | {s["name"] for s in manifest["states"]}
        named |= {t.get("name") for t in ((manifest.get("speculative") or {}).get("verify") or {}).get("inputs", [])}
        extra = sorted(set(ins) - named - graph.initializers)
        if extra:
            problems.append(f"inputs: {entry} takes {', '.join(extra)}, which the manifest does not name")
    for entry in entries:
        if entry not in manifest["files"]:
            problems.append(f"entry {entry!r}: not listed in files")
    return problems
