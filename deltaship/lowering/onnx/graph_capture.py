"""--onnx-cuda-graph: a decoder whose one-token call ONNX Runtime's CUDA execution provider can capture as a CUDA
graph (`enable_cuda_graph`) and replay.

A captured graph replays the GPU kernels it recorded and nothing else: a value computed on the CPU is the one seen
at capture time, and ORT refuses to capture a graph with Memcpy nodes (a CPU-computed tensor that a GPU kernel
reads at an input it takes in device memory). The plain graph has both problems in its position arithmetic
(docs/results/gpu.md, 'CUDA graphs'): GroupQueryAttention's total_sequence_length (input 6, a CPU-memory input)
and seqlens_k (input 5), and the start position the rotary embedding adds, are computed from
current_sequence_length with the call's token count T, which is a Shape output and lives in CPU memory.

This rewrite keeps the bundle's inputs and outputs (onnxruntime-genai's contract) and moves that arithmetic:
- seqlens_k = current_sequence_length - 1, one int32 Sub on the device;
- total_sequence_length = the KV cache's length (max_context), a constant: the KV states are static buffers of
  max_context positions, past and present in one (GroupQueryAttention's shared-buffer mode), and the kernels take
  each sequence's length from seqlens_k; this is onnxruntime-genai's own CUDA-graph setting (the attention mask at
  its maximum length);
- T for the start position (p = current_sequence_length - T) is ReduceSum(Expand(1.0, Shape(input_ids))) on the
  device: Expand takes its shape in CPU memory, so the Shape output crosses no device boundary.
The other shape arithmetic (Range for the rotary positions, Reshape targets) reads Shape outputs only at inputs
the CUDA kernels take in CPU memory, which ORT allows in a captured graph (constant for every one-token call).
bench/gpu/placement.py replays ORT's CPU-placement rule on a graph and lists what would still be copied.
"""

from __future__ import annotations

import numpy as np
import onnx

from deltaship.errors import DeltashipError
from deltaship.lowering.onnx.builder import GraphBuilder

TOKENS_ON_DEVICE = "capture_call_tokens"  # int64 [1]: T, computed on the device
SEQLENS_ON_DEVICE = "capture_seqlens_k"  # int32 [1]: current_sequence_length - 1


def make_capturable(
    b: GraphBuilder, max_context: int, current: str, position: str, call_tokens: str, input_ids: str = "input_ids"
) -> dict:
    """Rewrite the decoder graph in `b` in place (see the module doc); return the manifest's `cuda_graph` block.
    `position` is the node output p = Cast(current) - T, `call_tokens` the Shape output T it subtracts."""
    gqa = [n for n in b.nodes if n.op_type == "GroupQueryAttention"]
    n0 = len(b.nodes)
    one_f = b.const(np.array([1.0], np.float32))
    ones = b.one("Expand", [one_f, b.one("Shape", [input_ids])])  # [1, T] on the device
    total_f = b.one("ReduceSum", [ones, b.const(np.array([1], np.int64))], keepdims=0)  # [1]
    b.node("Cast", [total_f], outputs=[TOKENS_ON_DEVICE], to=onnx.TensorProto.INT64)
    b.node("Sub", [current, b.const(np.array([1], np.int32))], outputs=[SEQLENS_ON_DEVICE])
    total = b.const(np.array(max_context, np.int32))
    b.nodes[:] = b.nodes[n0:] + b.nodes[:n0]  # the new nodes read graph inputs only: first keeps the order sorted
    subs = [n for n in b.nodes if position in n.output]
    if len(subs) != 1 or subs[0].op_type != "Sub" or list(subs[0].input[1:]) != [call_tokens]:
        raise DeltashipError(
            "--onnx-cuda-graph: the decoder's start position is not Cast(current_sequence_length) - T here",
            "export without --onnx-cuda-graph (and report the model: the capture rewrite does not know its graph)",
        )
    subs[0].input[1] = TOKENS_ON_DEVICE
    for n in gqa:
        n.input[5] = SEQLENS_ON_DEVICE
        n.input[6] = total
    _drop_dead(b)
    return {
        "total_sequence_length": max_context,
        "graph_ids": "decode (T = 1) only; one graph per parity of the alternating state buffers",
        "doc": "ONNX Runtime's CUDA EP (enable_cuda_graph): bind every input, state and logits at fixed device "
        "addresses, write input_ids and the sequence lengths in place; run prefill with gpu_graph_id -1",
    }


def _drop_dead(b: GraphBuilder) -> None:
    """Remove nodes none of whose outputs is read (the old length arithmetic), until none is left, and the inline
    constants no node reads any more."""
    outputs = {o.name for o in b.outputs}
    while True:
        read = {i for n in b.nodes for i in n.input} | outputs
        keep = [n for n in b.nodes if any(o in read for o in n.output)]
        if len(keep) == len(b.nodes):
            break
        b.nodes[:] = keep
    read = {i for n in b.nodes for i in n.input}
    dead = {name for name in b._consts.values() if name not in read}
    b.initializers[:] = [t for t in b.initializers if t.name not in dead]
    b._consts = {k: v for k, v in b._consts.items() if v not in dead}


def make_draft_capturable(
    b: GraphBuilder, max_context: int, position: str = "position", input_ids: str = "input_ids"
) -> dict:
    """The same rewrite for mtp.onnx (--mtp --onnx-cuda-graph), whose calls take their start position q as the int64
    input `position`: GroupQueryAttention's seqlens_k = q + T - 1 on the device (T from ReduceSum(Expand(1,
    Shape(input_ids))), as above), total_sequence_length the head's KV length. Returns the draft's `cuda_graph`
    block."""
    gqa = [n for n in b.nodes if n.op_type == "GroupQueryAttention"]
    if not gqa:
        raise DeltashipError(
            "--onnx-cuda-graph: the MTP head's graph has no GroupQueryAttention to rewrite",
            "export without --onnx-cuda-graph (and report the model)",
        )
    n0 = len(b.nodes)
    ones = b.one("Expand", [b.const(np.array([1.0], np.float32)), b.one("Shape", [input_ids])])
    tokens = b.one(
        "Cast", [b.one("ReduceSum", [ones, b.const(np.array([1], np.int64))], keepdims=0)], to=onnx.TensorProto.INT64
    )
    last = b.one("Sub", [b.one("Add", [position, tokens]), b.const(np.array([1], np.int64))])
    seqlens = b.one("Cast", [last], to=onnx.TensorProto.INT32)
    total = b.const(np.array(max_context, np.int32))
    b.nodes[:] = b.nodes[n0:] + b.nodes[:n0]  # they read graph inputs only
    for n in gqa:
        n.input[5] = seqlens
        n.input[6] = total
    _drop_dead(b)
    return {
        "total_sequence_length": max_context,
        "graph_ids": "one per call length T (T <= 4) and buffer set; the call over the prompt runs uncaptured",
        "doc": "bind hidden_states, input_ids, position, logits and mtp_hidden_states at fixed device addresses per T",
    }
