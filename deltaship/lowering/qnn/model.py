"""decode.onnx and prefill.onnx for the QNN HTP backend, from the programs CaptureStatic captured for a fixed
token count (1 for decode, the prefill chunk for prefill), every shape static; `lower` writes both and describes
them for the manifest (lowering.graphs, lowering.soc, lowering.provider_options, lowering.runtime_requirements)."""

from __future__ import annotations

import dataclasses
from importlib import metadata
from pathlib import Path
from typing import Any

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


def lower_graph(ctx, program, weights, path: Path, tokens: int, progress=None) -> dict[str, Any]:
    """Write one static graph to `path`: input_ids [1, tokens], position [1], past.* -> logits [1, V] (after the
    last token), present.*; return its manifest entry (file, tokens a call, node count, ONNX op counts).

    ctx is an export context after the qnn target's passes; `program` one of its static programs."""
    b = GraphBuilder(None)
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
    graphs = {}
    for key, program in ctx.programs.items():
        count = 1 if key == DECODE else ctx.settings.prefill_chunk
        say = (lambda m, k=key: progress(f"{k}: {m}")) if callable(progress) else None
        graphs[key] = lower_graph(ctx, program, weights, out_dir / FILES[key], count, say)
    s = find_soc(ctx.options.qnn_soc)
    details = {
        "graphs": graphs,
        "soc": dataclasses.asdict(s),  # name, chip, marketing, soc_model, htp_arch
        "backend": "QNN HTP (onnxruntime-qnn execution provider)",
        "provider_options": provider_options(s.name),
        "cpu_fallback": False,
        "runtime_requirements": runtime_requirements(),
        "opset": OPSET,
        "ir_version": IR_VERSION,
    }
    files = [g["file"] for g in graphs.values()]
    if ctx.options.qnn_context:  # EPContext models: the graphs compiled for the SoC, what an app ships
        details["context"] = {}
        for key, g in graphs.items():
            if callable(progress):
                progress(f"{key}: compiling an EPContext model for {s.marketing} ({s.chip})")
            made = compile_context(out_dir / g["file"], s, out_dir)
            details["context"][key] = made
            files += [f["path"] for f in made["files"]]
    return Lowered(files=files, entry=DECODE_FILE, details=details)


__all__ = ["lower", "lower_graph", "DECODE_FILE", "PREFILL_FILE", "DECODE", "PREFILL", "provider_options"]
