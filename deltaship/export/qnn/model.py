"""decode.onnx for the QNN HTP backend: the canonical model captured for one token, every shape static."""

from __future__ import annotations

from pathlib import Path

from deltaship.export.onnx.builder import GraphBuilder
from deltaship.export.onnx.lowering import Lowerer
from deltaship.export.onnx.model import IR_VERSION, OPSET, _declare_states
from deltaship.export.passes import capture
from deltaship.export.qnn.lowering import QNN_LOWERINGS

DECODE_FILE = "decode.onnx"
INPUT_IDS, POSITION, LOGITS = "input_ids", "position", "logits"


def lower_decode(ctx, weights, out_dir: Path, progress=None) -> dict:
    """Write decode.onnx (input_ids [1, 1], position [1], states -> logits [1, V], states) into out_dir.

    ctx is an export context after the ONNX target's passes up to capture (weights planned, precision
    assigned); the program is captured here for exactly one token."""
    states = ctx.model.state_specs(ctx.dtype)
    program = capture(ctx.model, states, ctx.max_context, static=1)
    b = GraphBuilder(None)
    lw = Lowerer(program, ctx.plan, weights, ctx.quant, b, progress=progress, lowerings=QNN_LOWERINGS)
    lw.run([INPUT_IDS, POSITION] + [s["name"] for s in states], [LOGITS] + [s["output"] for s in states])
    _declare_states(b, states)
    b.finish(out_dir / DECODE_FILE, {"": OPSET}, IR_VERSION, doc=f"deltaship qnn decode, {ctx.precision}")
    ops: dict[str, int] = {}
    for n in b.nodes:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"files": [DECODE_FILE], "entry": DECODE_FILE, "onnx_ops": ops, "states": states}
