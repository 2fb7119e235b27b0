"""model.onnx from a captured program: the lowering's entry point and the graph's I/O contract."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import torch

from deltaship.bundle.node_order import order_for_runtime
from deltaship.errors import DeltashipError
from deltaship.lowering.kv_quant import stored_states
from deltaship.lowering.lowered import Lowered
from deltaship.lowering.onnx import mtp
from deltaship.lowering.onnx.builder import NP_TO_ONNX, GraphBuilder
from deltaship.lowering.onnx.census import nodes_per_layer
from deltaship.lowering.onnx.fusions import fuse_skip_norms
from deltaship.lowering.onnx.genai import GENAI_CONFIG, adapt_tokenizer_config, write_genai_config
from deltaship.lowering.onnx.graph_capture import make_capturable
from deltaship.lowering.onnx.lowering import (
    DATA_FILE,
    IR_VERSION,
    LOWERINGS,
    MODEL_FILE,
    OPSET,
    STANDARD_OPSET,
    Lowerer,
)

IR_VERSIONS = {OPSET: IR_VERSION, STANDARD_OPSET: 13}  # the IR each opset was released with (onnx VERSION_TABLE)
# Weights past this go to model.onnx.data (protobuf cannot hold 2 GB anyway): ONNX Runtime maps that file and unmaps
# each weight it prepacks, while weights inside model.onnx stay resident beside their prepacked copies
# (docs/results/memory.md). Small models stay one file.
EXTERNAL_THRESHOLD = 64 << 20
# How the DeltaNet ops are written. The recurrence is always ONNX Runtime's LinearAttention. Its CPU
# CausalConvWithState and GatedRMSNorm kernels (ORT 1.31) measured 3x and 14x slower than the same math
# in standard ops on a 512-token prefill at 0.8B sizes (and slower at one token too; bench/runtimes/onnx_ops.py),
# so "standard" is the default (the onnx_deltanet_ops option, deltaship/targets/onnx.py); "contrib" keeps the
# fused contrib ops, e.g. for an execution provider that implements them better.
DELTANET_OPS = {
    "standard": {
        "recurrence": "com.microsoft::LinearAttention (gated_delta)",
        "conv": "K shifted Mul/Add over Concat(state, x); new state = last K-1 rows (Slice)",
        "output_norm": "SimplifiedLayerNormalization * SiLU(gate)",
        "l2norm": "SimplifiedLayerNormalization (eps/d, scale d^-1/2)",
    },
    "contrib": {
        "recurrence": "com.microsoft::LinearAttention (gated_delta)",
        "conv": "com.microsoft::CausalConvWithState (fused SiLU)",
        "output_norm": "com.microsoft::GatedRMSNorm",
        "l2norm": "SimplifiedLayerNormalization (eps/d, scale d^-1/2)",
    },
    "opset27": {
        "recurrence": "ai.onnx::LinearAttention (gated_delta), opset 27",
        "conv": "ai.onnx::CausalConvWithState (fused SiLU), opset 27, channels first: Transpose in and out",
        "gates": "Softplus/Sigmoid/Mul",
        "output_norm": "RMSNormalization * SiLU(gate)",
        "l2norm": "RMSNormalization (eps/d, scale d^-1/2)",
    },
}
# The DeltaNet conv state's layout, by opset: deltaship's canonical state is channels last; the standard
# CausalConvWithState (opset 27) reads and writes its state channels first.
CONV_STATE_LAYOUT = {OPSET: "channels_last", STANDARD_OPSET: "channels_first"}
# What an opset-27 bundle needs from ONNX Runtime (1.30 and 1.31 refuse opset 27), for the manifest.
STANDARD_RUNTIME = {"onnxruntime": ">=1.32"}
STANDARD_APP_RUNTIMES = {
    "onnxruntime": "1.32.0 (Python, CPU, in an isolated environment): the same logits and greedy tokens as the "
    "default opset-21 bundle (tests/test_onnx_opset27.py); ONNX Runtime 1.30 and 1.31 refuse opset 27",
    "onnxruntime-genai": "0.18.0 over onnxruntime 1.32.0 (Python wheels, isolated environment): same greedy "
    "tokens (tests/test_onnx_opset27.py); genai drives the onnxruntime installed beside it, which must be >= 1.32",
    "onnxruntime-node": "not run: 1.30 refuses opset 27 (needs >= 1.32)",
    "onnxruntime-web": "not run: 1.30 refuses opset 27 (needs >= 1.32)",
    "onnxruntime-android": "not run (no Android device); needs onnxruntime-android >= 1.32",
}


# Kernels that read a state input completely before they write the state output, so past and present
# may share one buffer (no copy of the state per call), by execution provider. GroupQueryAttention is
# built for a shared KV buffer. LinearAttention's CPU kernel (ORT 1.31) copies the past state into the
# present one and updates it there; its CUDA kernel was not checked, so it is not listed.
IN_PLACE_KERNELS = {
    "GroupQueryAttention": ["CPUExecutionProvider", "CUDAExecutionProvider"],
    "LinearAttention": ["CPUExecutionProvider"],
}
IN_PLACE_DOMAINS = ("com.microsoft",)  # the standard (ai.onnx) LinearAttention's kernels were not checked


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
        if w is None or nodes[w].op_type not in IN_PLACE_KERNELS or nodes[w].domain not in IN_PLACE_DOMAINS:
            continue
        first = readers.get(s["name"], set())
        if first == {w}:
            out[s["name"]] = IN_PLACE_KERNELS[nodes[w].op_type]
        elif len(first) == 1 and _split_in_place(nodes, readers, first.pop(), w):
            out[s["name"]] = IN_PLACE_KERNELS[nodes[w].op_type]
    return out


def _split_in_place(nodes, readers: dict[str, set[int]], r: int, w: int) -> bool:
    """--mtp's recurrent state: LinearAttention r (the call's first token) reads past and writes rollback.*, which
    only LinearAttention w (the other tokens) reads, writing present. Past, rollback.* and present may then share
    one buffer (each kernel reads its state before it writes it), as the session binds them outside verify."""
    a, b = nodes[r], nodes[w]
    return (
        a.op_type == b.op_type == "LinearAttention"
        and a.domain == b.domain
        and a.output[1].startswith("rollback.")
        and b.input[3] == a.output[1]
        and readers.get(a.output[1]) == {w}
    )


def estimate_bytes(ctx) -> int:
    """Weight bytes of the lowered model, from shapes and precision (decides external data)."""
    total = 0
    per = 2 if ctx.dtype == torch.float16 else 4  # float weights and scales are stored in the activation dtype
    for name in ctx.plan.names():
        n = int(np.prod(ctx.plan.shape(name)))
        q = ctx.quant["linear"].get(name) or ctx.quant["embedding"].get(name)
        total += n * q["bits"] // 8 + n // q["block_size"] * per if q else n * per
    return total


_PROGRAM_POSITION = "position"  # the captured program's start position [1]: derived from the sequence lengths
_PROGRAM_LOGITS = "logits_last"  # the program's logits [1, V]: unsqueezed to the graph output [1, 1, V]
CURRENT_LENGTH = "current_sequence_length"  # int32 [1]: tokens in the state after this call (p + T)
PAST_LENGTH = "past_sequence_length"  # int32 [1, 1]: p + T - 1; not read (genai feeds the pair or neither)
_LENGTH_NODES = ("seqlen_call_tokens", "seqlen_current")  # the outputs of the start-position nodes, besides it


def _genai_io(b: GraphBuilder, vocab: int) -> None:
    """Swap the program's I/O for the contract onnxruntime-genai drives: inputs current_sequence_length int32 [1]
    and past_sequence_length int32 [1, 1] (genai feeds both whenever the graph has both: after each call the
    tokens consumed so far, and one less), from which the graph derives the start position the program wants
    (p = current_sequence_length - T), and output logits float32 [1, 1, V]. genai trims prefill logits to the
    last token only when the graph declares dim 1 of logits as 1.

    Not position_ids [1, T]: ONNX Runtime keys its cached memory patterns by the XOR of all input dims, in which
    input_ids [1, T] and position_ids [1, T] cancel out, so genai's prefill and decode calls shared one pattern
    and one of them always fell back to allocating tensor by tensor. With the counters the key is T."""
    i = next(k for k, v in enumerate(b.inputs) if v.name == _PROGRAM_POSITION)
    b.inputs[i : i + 1] = [
        onnx.helper.make_tensor_value_info(CURRENT_LENGTH, onnx.TensorProto.INT32, [1]),
        onnx.helper.make_tensor_value_info(PAST_LENGTH, onnx.TensorProto.INT32, [1, 1]),
    ]
    n = len(b.nodes)
    tokens = b.node("Shape", ["input_ids"], outputs=[_LENGTH_NODES[0]], start=1, end=2)[0]  # [T]
    current = b.node("Cast", [CURRENT_LENGTH], outputs=[_LENGTH_NODES[1]], to=onnx.TensorProto.INT64)[0]
    b.node("Sub", [current, tokens], outputs=[_PROGRAM_POSITION])
    b.nodes[:] = b.nodes[n:] + b.nodes[:n]  # keep the node list topologically sorted
    o = next(k for k, v in enumerate(b.outputs) if v.name == _PROGRAM_LOGITS)
    b.node("Unsqueeze", [_PROGRAM_LOGITS, b.const(np.array([1], np.int64))], outputs=["logits"])
    b.outputs[o] = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 1, vocab])


def _replace_length_pair(
    path: Path, head: list, current: onnx.ValueInfoProto, renamed: dict | None = None, initializers=()
) -> None:
    """Rewrite a graph derived from model.onnx in place: drop the sequence-length pair (its input nodes and the
    start-position arithmetic), put the value info `current` where current_sequence_length was, give the graph's
    start position from `head` (nodes computing _PROGRAM_POSITION, run first), and replace each input named in
    `renamed` (old name -> new value info) in the inputs and in every node reading it."""
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    renamed = renamed or {}
    drop = {_PROGRAM_POSITION, *_LENGTH_NODES}
    nodes = [n for n in g.node if not drop & set(n.output)]
    for n in nodes:
        for i, name in enumerate(n.input):
            if name in renamed:
                n.input[i] = renamed[name].name
    g.initializer.extend(initializers)
    del g.node[:]
    g.node.extend(head + nodes)
    inputs = [current if v.name == CURRENT_LENGTH else renamed.get(v.name, v) for v in g.input if v.name != PAST_LENGTH]
    del g.input[:]
    g.input.extend(inputs)
    onnx.save(model, str(path))


def position_ids_io(path: Path) -> None:
    """Rewrite a graph derived from model.onnx back to a position_ids int64 [1, positions]
    input in place of the sequence-length pair: the contract of bundles before it (runtimes/onnx.py binds
    position_ids [[p]]; only element 0 is read); tests make such bundles with it."""
    i64 = onnx.numpy_helper.from_array
    make = onnx.helper.make_node
    head = [
        make(
            "Slice",
            ["position_ids", "position_ids_start", "position_ids_end", "position_ids_end"],
            ["position_ids_first"],
            name="position_ids_first",
        ),
        make("Reshape", ["position_ids_first", "position_ids_end"], [_PROGRAM_POSITION], name="position_ids_flat"),
    ]
    _replace_length_pair(
        path,
        head,
        onnx.helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, "positions"]),
        initializers=[
            i64(np.array([0], np.int64), "position_ids_start"),
            i64(np.array([1], np.int64), "position_ids_end"),
        ],
    )


MM_ATTENTION_MASK = "attention_mask"  # int64 [1, p + T]: only its length is read (p = length - T)
MM_POSITION_IDS = "position_ids"  # int64 [3, 1, T]: the T/H/W M-RoPE rows


def multimodal_io(path: Path, rope_input: str) -> None:
    """Rewrite a graph derived from model.onnx (decoder_mm.onnx) to the multimodal decoder contract of
    onnxruntime-genai's Qwen VL family (src/models/position_inputs.cpp, Qwen2VLPositionInputs): in place of the
    sequence-length pair, attention_mask int64 [1, p + T] (all ones at batch 1; the graph takes the start position
    p = its length - T) and the M-RoPE rows `rope_input` renamed position_ids int64 [3, 1, T]. deltaship's own
    driver (runtimes/vision.py) binds the same two inputs."""
    make = onnx.helper.make_node
    head = [
        make("Shape", [MM_ATTENTION_MASK], ["mm_total_length"], name="mm_total_length", start=1, end=2),
        make("Shape", ["inputs_embeds"], ["mm_call_tokens"], name="mm_call_tokens", start=1, end=2),
        make("Sub", ["mm_total_length", "mm_call_tokens"], [_PROGRAM_POSITION], name="mm_start_position"),
    ]
    vi = onnx.helper.make_tensor_value_info
    _replace_length_pair(
        path,
        head,
        vi(MM_ATTENTION_MASK, onnx.TensorProto.INT64, [1, "total_length"]),
        renamed={rope_input: vi(MM_POSITION_IDS, onnx.TensorProto.INT64, [3, 1, "tokens"])},
    )


def _conv_state_layout(states: list[dict], opset: int) -> None:
    """Record the conv states' layout in the state contract; at opset 27 make them channels first,
    [1, K-1, C] -> [1, C, K-1], the layout the standard CausalConvWithState reads and writes."""
    layout = CONV_STATE_LAYOUT[opset]
    for s in states:
        if s["kind"] != "deltanet_conv":
            continue
        if layout == "channels_first" and s.get("layout") != layout:
            s["shape"] = [s["shape"][0], s["shape"][2], s["shape"][1]]
        s["layout"] = layout


def _rollback_outputs(b: GraphBuilder, states: list[dict], names: dict[str, str]) -> None:
    """--mtp: declare every DeltaNet state's value after the call's first token, outputs rollback.* (after the
    program's outputs, in the states' order; see speculative.rollback in docs/bundle-format.md)."""
    for s in states:
        if not s["kind"].startswith("deltanet"):
            continue
        if s["name"] not in names:
            raise RuntimeError(f"--mtp: the lowering gave no rollback output for DeltaNet state {s['name']}")
        b.add_output(names[s["name"]], NP_TO_ONNX[np.dtype(s["dtype"])], s["shape"])


def _declare_states(b: GraphBuilder, states: list[dict]) -> None:
    """Declare every state input and output with its contract shape (the captured program has the canonical
    channels-last conv state; at opset 27 the lowering reads and writes it channels first)."""
    shapes = {n: s["shape"] for s in states for n in (s["name"], s["output"])}
    for values in (b.inputs, b.outputs):
        for i, v in enumerate(values):
            if v.name in shapes:
                values[i] = onnx.helper.make_tensor_value_info(v.name, v.type.tensor_type.elem_type, shapes[v.name])


def io_inputs(ctx) -> list[dict]:
    """The manifest's `inputs`: the graph inputs other than states."""
    return [
        {
            "name": "input_ids",
            "shape": [1, "tokens"],
            "dtype": "int64",
            "kind": "tokens",
            "doc": "1 to prefill_chunk token ids",
        },
        {
            "name": CURRENT_LENGTH,
            "shape": [1],
            "dtype": "int32",
            "kind": "current_sequence_length",
            "doc": "p + T: the tokens the state holds after this call (p = tokens it held before); the graph's "
            "start position is this minus T",
        },
        {
            "name": PAST_LENGTH,
            "shape": [1, 1],
            "dtype": "int32",
            "kind": "past_sequence_length",
            "doc": "p + T - 1 (onnxruntime-genai's count, which it feeds with current_sequence_length); not read",
        },
    ] + (
        [  # --mtp (export/onnx/mtp.py add_verify_io): verify calls ask for more rows of logits_rows
            {
                "name": "num_logits_to_keep",
                "shape": ["keep"],
                "dtype": "int64",
                "kind": "logits_to_keep",
                "doc": "feed [0] (onnxruntime-genai does by itself); speculative verify calls feed the rows they want",
            }
        ]
        if "mtp" in ctx.programs
        else []
    )


def io_outputs(ctx) -> list[dict]:
    """The manifest's `outputs`: the graph outputs other than states."""
    return [
        {
            "name": "logits",
            "shape": [1, 1, ctx.spec.vocab_size],
            "dtype": "float32",
            "kind": "logits",
            "doc": "logits after the last token of the call",
        }
    ]


def _quantized_state_io(b: GraphBuilder, states: list[dict]) -> None:
    """The program declares the KV caches in the activation dtype; a quantized cache (ctx.kv_scales, which
    GroupQueryAttention's quantized-cache attributes read) is int8, or uint8 holding two int4 values."""
    elem = {"int8": onnx.TensorProto.INT8, "uint8": onnx.TensorProto.UINT8}
    by_name = {n: s for s in states if s["dtype"] in elem for n in (s["name"], s["output"])}
    for vis in (b.inputs, b.outputs):
        for i, v in enumerate(vis):
            if v.name in by_name:
                s = by_name[v.name]
                vis[i] = onnx.helper.make_tensor_value_info(v.name, elem[s["dtype"]], s["shape"])


# the node census the manifest keeps (deltaship/lowering/onnx/census.py): nodes per layer of each kind, the decode
# step's kernel count on a GPU
NODE_CENSUS = ("deltanet", "attention", "shared", "outside", "total")


def _census(nodes) -> dict:
    """The manifest's node census, or why there is none (a graph the census does not know: the bundle is fine)."""
    try:
        return {k: v for k, v in nodes_per_layer(nodes).items() if k in NODE_CENSUS}
    except DeltashipError as e:
        return {"unavailable": str(e).splitlines()[0]}


def lower(ctx, weights, out_dir: Path, progress=None, tokens: dict | None = None) -> Lowered:
    """Write model.onnx (and model.onnx.data when large) into out_dir; return the I/O contract."""
    # the lowering's view of the passes' products: the states as this graph stores them (an int8/int4 KV cache: its
    # codes' dtype and shape; the conv states' layout, recorded below on these copies)
    ctx = replace(ctx, states=[dict(s) for s in stored_states(ctx.states, ctx.kv)])
    accuracy_level = int(ctx.options.accuracy_level)  # MatMulNBits: 4 = int8 activation blocks, 0 = float
    external = estimate_bytes(ctx) > EXTERNAL_THRESHOLD or bool(ctx.options.external_data)
    external = external or "mtp" in ctx.programs  # mtp.onnx reads the shared weights from model.onnx.data
    b = GraphBuilder(out_dir / DATA_FILE if external else None)
    # The program takes position [1] and returns logits [1, V]; the graph's contract is the one
    # onnxruntime-genai drives (current/past_sequence_length, logits [1, 1, V]), adapted around it below.
    speculative = "mtp" in ctx.programs  # --mtp: the decoder also verifies drafts; mtp.onnx drafts them
    inputs = (
        ["input_ids", _PROGRAM_POSITION] + [s["name"] for s in ctx.states] + (["logit_rows"] if speculative else [])
    )
    outputs = [_PROGRAM_LOGITS] + [s["output"] for s in ctx.states]
    outputs += ["logits_rows", "hidden_states"] if speculative else []
    deltanet_ops = ctx.options.onnx_deltanet_ops
    opset = int(ctx.options.onnx_opset or OPSET)
    _conv_state_layout(ctx.states, opset)
    lw = Lowerer(
        ctx.program,
        ctx.plan,
        weights,
        ctx.quant,
        b,
        accuracy_level=accuracy_level,
        progress=progress,
        deltanet_ops=deltanet_ops,
        opset=opset,
        kv_scales=ctx.kv_scales,
        # --mtp: the DeltaNet states after each call's first token as outputs too (the rollback of a rejected
        # draft). Not at opset 27: ONNX Runtime 1.32's standard LinearAttention fails on the empty second call of a
        # one-token step (a Reshape of its function body, checked); those bundles roll back by snapshot only.
        rollback={} if speculative and opset < STANDARD_OPSET else None,
    )
    lw.run(inputs, outputs)
    if lw.rollback is not None:
        _rollback_outputs(b, ctx.states, lw.rollback)
    _declare_states(b, ctx.states)
    _genai_io(b, ctx.spec.vocab_size)
    _quantized_state_io(b, ctx.states)
    capture, fusions = None, None
    if ctx.options.onnx_cuda_graph:  # GQA's lengths and the start position computed on the device
        capture = make_capturable(b, ctx.max_context, CURRENT_LENGTH, _PROGRAM_POSITION, _LENGTH_NODES[0])
        fusions = {
            "skip_norm": {"nodes_removed": fuse_skip_norms(b), "op": "com.microsoft::SkipSimplifiedLayerNormalization"}
        }
    # the order ONNX Runtime runs the graph in: each layer's state outputs written as the walk leaves the layer
    b.nodes[:] = order_for_runtime(b.nodes)
    b.finish(
        out_dir / MODEL_FILE,
        {"": opset, "com.microsoft": 1},
        IR_VERSIONS[opset],
        doc=f"deltaship {ctx.spec.num_layers}-layer Qwen3.5, {ctx.precision}",
    )
    # --mtp: the verify I/O of model.onnx, the draft head's own graph (mtp.onnx), the manifest's `speculative` block
    drafts = (
        _speculative(ctx, weights, out_dir, accuracy_level, deltanet_ops, progress, b, lw.rollback)
        if speculative
        else None
    )
    ops: dict[str, int] = {}
    for n in b.nodes:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    in_place = in_place_states(b.nodes, ctx.states)
    genai = write_genai_config(out_dir, ctx, tokens, MODEL_FILE, b.nodes, in_place)
    standard = opset >= STANDARD_OPSET
    mode = "opset27" if standard else deltanet_ops
    app_runtimes = dict(STANDARD_APP_RUNTIMES) if standard else {}  # entries replacing the target's
    if genai["config"] is None:
        app_runtimes["onnxruntime-genai"] = f"unavailable: {genai['unavailable']}"
        if callable(progress):
            progress(f"no {GENAI_CONFIG}: {genai['unavailable']} (onnxruntime-genai cannot run this bundle)")
    details = {
        **({"cuda_graph": capture} if capture else {}),
        **({"fusions": fusions} if fusions else {}),
        "onnx_ops": ops,
        "nodes_per_layer": _census(b.nodes),
        "external_data": external,
        "opset": opset,
        "ir_version": IR_VERSIONS[opset],
        "conv_state_layout": CONV_STATE_LAYOUT[opset],
        **({"runtime_requirements": dict(STANDARD_RUNTIME)} if standard else {}),
        "accuracy_level": accuracy_level,
        "weight_bytes": b.weight_bytes,
        "genai": genai,
        "deltanet_ops": {"mode": mode, **DELTANET_OPS[mode]},
    }
    return Lowered(
        files=[MODEL_FILE]
        + ([GENAI_CONFIG] if genai["config"] else [])
        + ([DATA_FILE] if external else [])
        + (drafts["files"] if drafts else []),
        entry=MODEL_FILE,
        states=ctx.states,
        details=details,
        state_in_place=in_place,
        app_runtimes=app_runtimes or None,
        speculative=drafts,
    )


__all__ = ["lower", "io_inputs", "io_outputs", "adapt_tokenizer_config", "LOWERINGS", "MODEL_FILE"]


def _speculative(ctx, weights, out_dir: Path, accuracy_level: int, deltanet_ops: str, progress, b, rollback) -> dict:
    mtp.add_verify_io(out_dir / MODEL_FILE, ctx.spec, capture=bool(ctx.options.onnx_cuda_graph))
    return mtp.lower_mtp(ctx, weights, out_dir, accuracy_level, deltanet_ops, progress, b, rollback)
