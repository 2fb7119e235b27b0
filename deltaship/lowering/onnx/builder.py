"""A small ONNX graph builder that streams initializers to disk.

Initializers are written as they are produced: inline in the model file for small models, or
appended to one external data file (page-aligned, so ONNX Runtime can map it) when the model
would pass protobuf's 2 GB limit. Only one weight is in memory at a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NP_TO_ONNX = {
    np.dtype("float32"): TensorProto.FLOAT,
    np.dtype("float16"): TensorProto.FLOAT16,
    np.dtype("int64"): TensorProto.INT64,
    np.dtype("int32"): TensorProto.INT32,
    np.dtype("uint8"): TensorProto.UINT8,
    np.dtype("bool"): TensorProto.BOOL,
}
ALIGN = 4096


class GraphBuilder:
    def __init__(self, external_data: Path | None = None):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self._counter = 0
        self.external = external_data
        self._ext_file = open(external_data, "wb") if external_data else None
        self.weight_bytes = 0

    def fresh(self, hint: str) -> str:
        self._counter += 1
        name = f"{hint}_{self._counter}"
        while name in self._names:
            self._counter += 1
            name = f"{hint}_{self._counter}"
        self._names.add(name)
        return name

    def node(
        self,
        op: str,
        inputs: list[str],
        n_out: int = 1,
        domain: str = "",
        name_hint: str | None = None,
        outputs: list[str] | None = None,
        **attrs,
    ) -> list[str]:
        outs = outputs or [self.fresh(name_hint or op.lower()) for _ in range(n_out)]
        self._names.update(outs)
        self.nodes.append(
            helper.make_node(op, inputs, outs, name=self.fresh("n_" + op), domain=domain or None, **attrs)
        )
        return outs

    def one(self, op: str, inputs: list[str], domain: str = "", **attrs) -> str:
        return self.node(op, inputs, 1, domain, **attrs)[0]

    def const(self, value, dtype=None) -> str:
        """A small constant (deduplicated), kept inline."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh("const")
            self.initializers.append(numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    def weight(self, name: str, arr: np.ndarray) -> str:
        """A model weight: written to the external data file when there is one."""
        arr = np.ascontiguousarray(arr)
        self._names.add(name)
        self.weight_bytes += arr.nbytes
        if self._ext_file is None or arr.nbytes < 1024:
            self.initializers.append(numpy_helper.from_array(arr, name))
            return name
        f = self._ext_file
        pad = (-f.tell()) % ALIGN
        f.write(b"\0" * pad)
        offset = f.tell()
        f.write(arr.tobytes())
        t = onnx.TensorProto(name=name, data_type=NP_TO_ONNX[arr.dtype], dims=list(arr.shape))
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.external.name), ("offset", str(offset)), ("length", str(arr.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        self.initializers.append(t)
        return name

    def weight_rows(self, name: str, shape: tuple[int, ...], dtype, blocks) -> str:
        """A large weight produced in row blocks (an iterable of arrays), written as it comes: with
        external data only one block is ever in memory."""
        dtype = np.dtype(dtype)
        if self._ext_file is None:
            return self.weight(name, np.concatenate([np.asarray(b, dtype) for b in blocks], axis=0).reshape(shape))
        f = self._ext_file
        f.write(b"\0" * ((-f.tell()) % ALIGN))
        offset, rows = f.tell(), 0
        for b in blocks:
            b = np.ascontiguousarray(b, dtype)
            f.write(b.tobytes())
            rows += b.shape[0]
        length = f.tell() - offset
        if rows != shape[0] or length != int(np.prod(shape)) * dtype.itemsize:
            raise RuntimeError(f"{name}: streamed {rows} rows / {length} bytes for shape {shape}")
        self._names.add(name)
        self.weight_bytes += length
        t = onnx.TensorProto(name=name, data_type=NP_TO_ONNX[dtype], dims=list(shape))
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.external.name), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        self.initializers.append(t)
        return name

    def read(self, name: str) -> np.ndarray:
        """The value of initializer `name` as written so far (inline, or back from the external data file)."""
        t = next(t for t in self.initializers if t.name == name)
        if t.data_location != TensorProto.EXTERNAL:
            return numpy_helper.to_array(t)
        ext = {e.key: e.value for e in t.external_data}
        self._ext_file.flush()
        with open(self.external, "rb") as f:
            f.seek(int(ext["offset"]))
            raw = f.read(int(ext["length"]))
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        return np.frombuffer(raw, dtype).reshape(tuple(t.dims)).copy()

    def add_input(self, name: str, elem: int, shape: list) -> str:
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def add_output(self, name: str, elem: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def finish(self, path: Path, opsets: dict[str, int], ir_version: int, doc: str = "") -> onnx.ModelProto:
        if self._ext_file:
            self._ext_file.close()
        graph = helper.make_graph(self.nodes, "deltaship", self.inputs, self.outputs, self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
            producer_name="deltaship",
            doc_string=doc,
        )
        model.ir_version = ir_version
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        return model
