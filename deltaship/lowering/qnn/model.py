"""decode.onnx and prefill.onnx for the QNN HTP backend, from the programs CaptureStatic captured for a fixed
token count (1 for decode, the prefill chunk for prefill), every shape static; `lower` writes both and describes
them for the manifest (lowering.graphs, lowering.soc, lowering.provider_options, lowering.runtime_requirements)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from deltaship.lowering.lowered import Lowered
from deltaship.lowering.onnx.builder import GraphBuilder
from deltaship.lowering.onnx.lowering import Lowerer
from deltaship.lowering.onnx.model import IR_VERSION, OPSET, _declare_states
from deltaship.lowering.qnn.context import compile_context
from deltaship.lowering.qnn.lowering import QNN_LOWERINGS
from deltaship.lowering.qnn.passes import DECODE, PREFILL
from deltaship.lowering.qnn.soc import soc as find_soc

DECODE_FILE = "decode.onnx"
PREFILL_FILE = "prefill.onnx"
FILES = {DECODE: DECODE_FILE, PREFILL: PREFILL_FILE}
INPUT_IDS, POSITION, LOGITS = "input_ids", "position", "logits"
# The onnxruntime the QNN plugin asks for (onnxruntime-qnn 2.7.0's requirement).
ONNXRUNTIME_NEEDED = ">=1.24.2"


WEIGHTS_FILE = "weights.data"  # the fp16 weights, one copy, which decode.onnx and prefill.onnx both reference


class SharedWeights(GraphBuilder):
    """A GraphBuilder whose weights go to one external data file shared by the graphs of a bundle: a weight another
    graph already wrote there (same name, same bytes: checked by sha256) is referenced, not written again. `written`
    (name -> (sha256, its TensorProto)) is the record the graphs share."""

    def __init__(self, data: Path, written: dict[str, tuple[str, onnx.TensorProto]]):
        super().__init__(None)
        self.external = data
        self._ext_file = open(data, "ab")
        self._ext_file.seek(0, os.SEEK_END)
        self._written = written

    def _reuse(self, name: str, digest: str, nbytes: int) -> str | None:
        if name not in self._written:
            return None
        if self._written[name][0] != digest:
            raise RuntimeError(f"qnn lowering: weight {name} differs between the graphs of one bundle")
        proto = onnx.TensorProto()
        proto.CopyFrom(self._written[name][1])
        self._names.add(name)
        self.weight_bytes += nbytes
        self.initializers.append(proto)
        return name

    def weight(self, name: str, arr: np.ndarray) -> str:
        arr = np.ascontiguousarray(arr)
        if arr.nbytes < 1024:  # kept inline by the builder
            return super().weight(name, arr)
        digest = hashlib.sha256(arr.tobytes()).hexdigest()
        if self._reuse(name, digest, arr.nbytes):
            return name
        super().weight(name, arr)
        self._written[name] = (digest, self.initializers[-1])
        return name

    def weight_rows(self, name: str, shape: tuple[int, ...], dtype, blocks) -> str:
        h = hashlib.sha256()

        def hashed():
            for b in blocks:
                b = np.ascontiguousarray(b, dtype)
                h.update(b.tobytes())
                yield b

        if name in self._written:  # the blocks are read (and hashed) only to check they are the same bytes
            nbytes = sum(b.nbytes for b in hashed())
            return self._reuse(name, h.hexdigest(), nbytes)
        super().weight_rows(name, shape, dtype, hashed())
        self._written[name] = (h.hexdigest(), self.initializers[-1])
        return name


def lower_graph(ctx, program, weights, path: Path, tokens: int, progress=None, builder=None) -> dict[str, Any]:
    """Write one static graph to `path`: input_ids [1, tokens], position [1], past.* -> logits [1, V] (after the
    last token), present.*; return its manifest entry (file, tokens a call, node count, ONNX op counts).

    ctx is an export context after the qnn target's passes; `program` one of its static programs. builder: where
    the weights go (default: inside the graph's file)."""
    b = builder or GraphBuilder(None)
    lw = Lowerer(program, ctx.plan, weights, ctx.quant, b, progress=progress, lowerings=QNN_LOWERINGS)
    lw.run([INPUT_IDS, POSITION] + [s["name"] for s in ctx.states], [LOGITS] + [s["output"] for s in ctx.states])
    _declare_states(b, ctx.states)
    b.finish(path, {"": OPSET}, IR_VERSION, doc=f"deltaship qnn, {tokens} tokens a call, {ctx.precision}")
    ops: dict[str, int] = {}
    for n in b.nodes:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"file": path.name, "tokens": tokens, "nodes": len(b.nodes), "onnx_ops": ops}


def provider_options(soc_name: str) -> dict[str, str]:
    """onnxruntime-qnn's provider options for the SoC (the session adds backend_path, which is per machine)."""
    s = find_soc(soc_name)
    return {"enable_htp_fp16_precision": "1", "soc_model": str(s.soc_model), "htp_arch": str(s.htp_arch)}


def runtime_requirements() -> dict[str, str]:
    """What runs the graphs: onnxruntime and onnxruntime-qnn (the version that verified them, and its QNN SDK)."""
    out = {"onnxruntime": ONNXRUNTIME_NEEDED}
    try:
        out["onnxruntime-qnn"] = metadata.version("onnxruntime-qnn")
        from onnxruntime_qnn import build_and_package_info  # lazy: onnxruntime_qnn, optional (the qnn extra)

        out["qnn_sdk"] = str(build_and_package_info.qnn_version)
    except (metadata.PackageNotFoundError, ImportError, AttributeError):
        out["onnxruntime-qnn"] = "2.7.0"  # what this lowering was checked with (docs/npu.md)
    return out


def lower(ctx, weights, out_dir: Path, progress=None, tokens: dict | None = None) -> Lowered:
    """decode.onnx (one token a call) and, for a chunk over 1, prefill.onnx (prefill_chunk tokens a call) in
    out_dir; the entry is decode.onnx."""
    graphs, written = {}, {}
    for key, program in ctx.programs.items():
        count = 1 if key == DECODE else ctx.settings.prefill_chunk
        say = (lambda m, k=key: progress(f"{k}: {m}")) if callable(progress) else None
        builder = SharedWeights(out_dir / WEIGHTS_FILE, written)
        graphs[key] = lower_graph(ctx, program, weights, out_dir / FILES[key], count, say, builder)
    s = find_soc(ctx.options.qnn_soc)
    details = {
        "graphs": graphs,
        "soc": dataclasses.asdict(s),  # name, chip, marketing, soc_model, htp_arch
        "backend": "QNN HTP (onnxruntime-qnn execution provider)",
        "provider_options": provider_options(s.name),
        "cpu_fallback": False,
        "runtime_requirements": runtime_requirements(),
        "weights": {"file": WEIGHTS_FILE, "tensors": len(written), "shared_by": list(graphs)},
        "opset": OPSET,
        "ir_version": IR_VERSION,
    }
    files = [g["file"] for g in graphs.values()] + [WEIGHTS_FILE]
    if ctx.options.qnn_context:  # EPContext models: the graphs compiled for the SoC, what an app ships
        details["context"] = {}
        for key, g in graphs.items():
            if callable(progress):
                progress(f"{key}: compiling an EPContext model for {s.marketing} ({s.chip})")
            made = compile_context(out_dir / g["file"], s, out_dir)
            details["context"][key] = made
            files += [f["path"] for f in made["files"]]
    return Lowered(files=files, entry=DECODE_FILE, states=ctx.states, details=details)


__all__ = ["lower", "lower_graph", "DECODE_FILE", "PREFILL_FILE", "DECODE", "PREFILL", "provider_options"]
