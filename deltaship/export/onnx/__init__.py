"""The ONNX target: captured program -> model.onnx for ONNX Runtime (CPU, CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from deltaship.export.onnx.builder import GraphBuilder
from deltaship.export.onnx.lowering import LOWERINGS, Lowerer

OPSET = 21
IR_VERSION = 10  # ONNX Runtime 1.31 reads IR <= 13; onnx 1.23 would write 14 by default
EXTERNAL_THRESHOLD = 1_800_000_000  # protobuf cannot hold a model over 2 GB
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# How the DeltaNet ops are written. The recurrence is always ONNX Runtime's LinearAttention. Its CPU
# CausalConvWithState and GatedRMSNorm kernels (ORT 1.31) measured 3x and 14x slower than the same math
# in standard ops on a 512-token prefill at 0.8B sizes (and slower at one token too; bench/onnx_ops.py),
# so "standard" is the default (the onnx_deltanet_ops option, deltaship/targets/onnx.py); "contrib" keeps the
# fused contrib ops, e.g. for an execution provider that implements them better.
DELTANET_OPS = {
    "standard": {"recurrence": "com.microsoft::LinearAttention (gated_delta)",
                 "conv": "K shifted Mul/Add over Concat(state, x); new state = last K-1 rows (Slice)",
                 "output_norm": "SimplifiedLayerNormalization * SiLU(gate)",
                 "l2norm": "SimplifiedLayerNormalization (eps/d, scale d^-1/2)"},
    "contrib": {"recurrence": "com.microsoft::LinearAttention (gated_delta)",
                "conv": "com.microsoft::CausalConvWithState (fused SiLU)",
                "output_norm": "com.microsoft::GatedRMSNorm", "l2norm": "SimplifiedLayerNormalization (eps/d, scale d^-1/2)"},
}


# Kernels that read a state input completely before they write the state output, so past and present
# may share one buffer (no copy of the state per call), by execution provider. GroupQueryAttention is
# built for a shared KV buffer. LinearAttention's CPU kernel (ORT 1.31) copies the past state into the
# present one and updates it there; its CUDA kernel was not checked, so it is not listed.
IN_PLACE_KERNELS = {"GroupQueryAttention": ["CPUExecutionProvider", "CUDAExecutionProvider"],
                    "LinearAttention": ["CPUExecutionProvider"]}


def in_place_states(nodes, states: list[dict]) -> dict[str, list[str]]:
    """{past name: providers} for the states whose past is read by exactly one node, the node that writes
    their present (through Identity renames), and that node's kernel is in IN_PLACE_KERNELS."""
    readers: dict[str, set[int]] = {}
    writer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            readers.setdefault(name, set()).add(i)
        for name in n.output:
            writer[name] = i
    out = {}
    for s in states:
        w = writer.get(s["output"])
        while w is not None and nodes[w].op_type == "Identity":
            w = writer.get(nodes[w].input[0])
        if w is not None and readers.get(s["name"]) == {w} and nodes[w].op_type in IN_PLACE_KERNELS:
            out[s["name"]] = IN_PLACE_KERNELS[nodes[w].op_type]
    return out


def estimate_bytes(ctx) -> int:
    """Weight bytes of the lowered model, from shapes and precision (decides external data)."""
    total = 0
    per = 2 if ctx.dtype == torch.float16 else 4  # float weights and scales are stored in the activation dtype
    for name in ctx.plan.names():
        n = int(np.prod(ctx.plan.shape(name)))
        q = ctx.quant["linear"].get(name) or ctx.quant["embedding"].get(name)
        total += n * q["bits"] // 8 + n // q["block_size"] * per if q else n * per
    return total


def lower(ctx, weights, out_dir: Path, progress=None, tokens: dict | None = None) -> dict:
    """Write model.onnx (and model.onnx.data when large) into out_dir; return the I/O contract."""
    accuracy_level = int(ctx.options["accuracy_level"])  # MatMulNBits: 4 = int8 activation blocks, 0 = float
    external = estimate_bytes(ctx) > EXTERNAL_THRESHOLD or bool(ctx.options.get("external_data"))
    b = GraphBuilder(out_dir / DATA_FILE if external else None)
    inputs = ["input_ids", "position"] + [s["name"] for s in ctx.states]
    outputs = ["logits"] + [s["output"] for s in ctx.states]
    deltanet_ops = ctx.options["onnx_deltanet_ops"]
    lw = Lowerer(ctx.program, ctx.plan, weights, ctx.quant, b, accuracy_level=accuracy_level, progress=progress,
                 deltanet_ops=deltanet_ops)
    lw.run(inputs, outputs)
    b.finish(out_dir / MODEL_FILE, {"": OPSET, "com.microsoft": 1}, IR_VERSION,
             doc=f"deltaship {ctx.spec.num_layers}-layer Qwen3.5, {ctx.precision}")
    ops: dict[str, int] = {}
    for n in b.nodes:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"files": [MODEL_FILE] + ([DATA_FILE] if external else []), "entry": MODEL_FILE, "onnx_ops": ops,
            "external_data": external, "opset": OPSET, "ir_version": IR_VERSION,
            "accuracy_level": accuracy_level, "weight_bytes": b.weight_bytes,
            "state_in_place": in_place_states(b.nodes, ctx.states),
            "deltanet_ops": {"mode": deltanet_ops, **DELTANET_OPS[deltanet_ops]}}


__all__ = ["lower", "LOWERINGS", "MODEL_FILE"]
