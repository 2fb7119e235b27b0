"""mtp.onnx, the MTP head as a draft model, and the verify I/O of the decoder graph (export option --mtp).

The contract (the manifest's `speculative` block) is described in docs/speculative.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from deltaship.export.onnx.builder import GraphBuilder
from deltaship.export.onnx.lowering import Lowerer

MTP_FILE = "mtp.onnx"
MTP_DATA_FILE = "mtp.onnx.data"
# The tensors both graphs read: written into mtp.onnx again (ONNX Runtime sessions do not share initializers
# across model files by themselves), so the bundle holds them twice; the manifest says how many bytes that is.
MTP_SHARED = ("model.embed_tokens.weight", "lm_head.weight")


def verify_io(b: GraphBuilder, spec) -> None:
    """Name the verify I/O's dims and give logit_rows a default ([-1]: the last row) as an overridable
    initializer, so a caller that does not know about speculation (onnxruntime-genai) runs the graph as before."""
    i = next(k for k, v in enumerate(b.inputs) if v.name == "logit_rows")
    b.inputs[i] = onnx.helper.make_tensor_value_info("logit_rows", onnx.TensorProto.INT64, ["rows"])
    b.initializers.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "logit_rows"))
    for name, shape in (
        ("logits_rows", [1, "rows", spec.vocab_size]),
        ("hidden_states", [1, "tokens", spec.hidden_size]),
    ):
        o = next(k for k, v in enumerate(b.outputs) if v.name == name)
        b.outputs[o] = onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)


def lower_mtp(ctx, weights, out_dir: Path, accuracy_level: int, deltanet_ops: str, progress) -> dict:
    """Write mtp.onnx (the MTP head: draft logits from the trunk's hidden states and the next tokens); return its
    manifest's `speculative` block (its `files` are mtp.onnx's)."""
    from deltaship.export.onnx.model import EXTERNAL_THRESHOLD, IR_VERSION, MODEL_FILE, OPSET, estimate_bytes

    program, states = ctx.programs["mtp"]
    external = estimate_bytes(ctx) > EXTERNAL_THRESHOLD or bool(ctx.options.get("external_data"))
    b = GraphBuilder(out_dir / MTP_DATA_FILE if external else None)
    lw = Lowerer(
        program,
        ctx.plan,
        weights,
        ctx.quant,
        b,
        accuracy_level=accuracy_level,
        progress=progress,
        deltanet_ops=deltanet_ops,
    )
    lw.run(
        ["hidden_states", "input_ids", "position"] + [s["name"] for s in states],
        ["logits", "mtp_hidden_states"] + [s["output"] for s in states],
    )
    b.finish(out_dir / MTP_FILE, {"": OPSET, "com.microsoft": 1}, IR_VERSION, doc="deltaship Qwen3.5 MTP head")
    shared = sorted({fqn for (fqn, _form) in lw._weights if set(ctx.plan.aliases(fqn)) & set(MTP_SHARED)})
    duplicated = sum(_initializer_bytes(b, fqn) for fqn in shared)
    block = {
        "method": "mtp",
        "mtp_layers": ctx.spec.mtp_num_hidden_layers,
        "draft": {
            "file": MTP_FILE,
            "inputs": [
                {
                    "name": "hidden_states",
                    "shape": [1, "tokens", ctx.spec.hidden_size],
                    "dtype": "float32",
                    "doc": "the decoder's hidden_states at positions q .. q+T-1",
                },
                {
                    "name": "input_ids",
                    "shape": [1, "tokens"],
                    "dtype": "int64",
                    "doc": "the tokens at positions q+1 .. q+T (each one after its hidden state)",
                },
                {"name": "position", "shape": [1], "dtype": "int64", "doc": "q"},
            ],
            "outputs": [
                {
                    "name": "logits",
                    "shape": [1, ctx.spec.vocab_size],
                    "dtype": "float32",
                    "doc": "draft logits for the token at q+T+1",
                },
                {
                    "name": "mtp_hidden_states",
                    "shape": [1, "tokens", ctx.spec.hidden_size],
                    "dtype": "float32",
                    "doc": "the head's hidden states; the last row, with the drafted token, drafts one more",
                },
            ],
            "states": [dict(s, init="zeros", reset="zeros") for s in states],
        },
        "verify": {
            "file": MODEL_FILE,
            "inputs": [
                {
                    "name": "logit_rows",
                    "shape": ["rows"],
                    "dtype": "int64",
                    "doc": "rows of this call whose logits come back in logits_rows; default [-1] (the last)",
                }
            ],
            "outputs": [
                {
                    "name": "logits_rows",
                    "shape": [1, "rows", ctx.spec.vocab_size],
                    "dtype": "float32",
                    "doc": "logits after each row in logit_rows (one LM-head matmul; `logits` is its last row)",
                },
                {
                    "name": "hidden_states",
                    "shape": [1, "tokens", ctx.spec.hidden_size],
                    "dtype": "float32",
                    "doc": "final-normed hidden state of every position of the call (the MTP head's input)",
                },
            ],
        },
        "rollback": {
            "kv_cache": "keep the length pointer: positions past the accepted ones are overwritten by later calls",
            "deltanet": "snapshot: copy the DeltaNet conv and recurrent states before a verify call; when a draft is "
            "rejected, restore the copy and feed the accepted tokens again at the start of the next verify call "
            "(no per-position states are output yet)",
        },
        "shares_weights": False,
        "duplicated_tensors": shared,
        "duplicated_bytes": duplicated,
        "files": [MTP_FILE] + ([MTP_DATA_FILE] if external else []),
    }
    for part in (block["draft"], block["verify"]):
        for t in part["inputs"] + part["outputs"]:
            t["kind"] = _SPECULATIVE_KINDS[t["name"]]
    return block


_SPECULATIVE_KINDS = {
    "hidden_states": "hidden_states",
    "mtp_hidden_states": "hidden_states",
    "input_ids": "tokens",
    "position": "position",
    "logits": "logits",
    "logit_rows": "logit_rows",
    "logits_rows": "logits",
}


def _initializer_bytes(b: GraphBuilder, fqn: str) -> int:
    base = fqn.replace(".", "_")
    total = 0
    for t in b.initializers:
        if t.name == base or t.name.startswith(base + "_"):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                total += int(next(e.value for e in t.external_data if e.key == "length"))
            else:
                total += len(t.raw_data) if t.raw_data else onnx.numpy_helper.to_array(t).nbytes
    return total
