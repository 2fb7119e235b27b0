"""decode.onnx and prefill.onnx for the QNN HTP backend: the canonical model captured for a fixed token count
(1 for decode, the prefill chunk for prefill), every shape static."""

from __future__ import annotations

from pathlib import Path

from deltaship.lowering.onnx.builder import GraphBuilder
from deltaship.lowering.onnx.lowering import Lowerer
from deltaship.lowering.onnx.model import IR_VERSION, OPSET, _declare_states
from deltaship.lowering.passes import capture
from deltaship.lowering.qnn.lowering import QNN_LOWERINGS

DECODE_FILE = "decode.onnx"
PREFILL_FILE = "prefill.onnx"
INPUT_IDS, POSITION, LOGITS = "input_ids", "position", "logits"


def lower_graph(ctx, weights, path: Path, tokens: int, progress=None) -> dict:
    """Write one static graph to `path`: input_ids [1, tokens], position [1], past.* -> logits [1, V] (after the
    last token), present.*.

    ctx is an export context after the ONNX target's passes up to capture (weights planned, precision
    assigned); the program is captured here for exactly `tokens` tokens."""
    states = ctx.model.state_specs(ctx.dtype)
    program = capture(ctx.model, states, ctx.max_context, static=tokens)
    b = GraphBuilder(None)
    lw = Lowerer(program, ctx.plan, weights, ctx.quant, b, progress=progress, lowerings=QNN_LOWERINGS)
    lw.run([INPUT_IDS, POSITION] + [s["name"] for s in states], [LOGITS] + [s["output"] for s in states])
    _declare_states(b, states)
    b.finish(path, {"": OPSET}, IR_VERSION, doc=f"deltaship qnn, {tokens} tokens a call, {ctx.precision}")
    ops: dict[str, int] = {}
    for n in b.nodes:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"file": path.name, "tokens": tokens, "onnx_ops": ops, "states": states}


def lower_decode(ctx, weights, out_dir: Path, progress=None) -> dict:
    """decode.onnx (one token a call) in out_dir."""
    return lower_graph(ctx, weights, out_dir / DECODE_FILE, 1, progress)


def lower_prefill(ctx, weights, out_dir: Path, chunk: int, progress=None) -> dict:
    """prefill.onnx (`chunk` tokens a call) in out_dir."""
    return lower_graph(ctx, weights, out_dir / PREFILL_FILE, chunk, progress)
