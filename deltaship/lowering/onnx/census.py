"""Nodes per decoder layer of a written ONNX decoder: what a decode step launches, layer by layer.

On a GPU each node is at least one kernel, and a captured decode step costs about the same per kernel whatever its
size (docs/results/gpu.md), so the node count of a layer is what fusions are measured by. The nodes are counted in
the order ONNX Runtime runs them (bundle/node_order.py), whatever their order in the file: a layer is the run of
nodes from the one that reads its input norm's weight
(`model_layers_<i>_input_layernorm_weight`) to the node before the next layer's; the nodes before layer 0
(embedding, rotary tables, position arithmetic) and from the final norm on (LM head) are `outside`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import onnx

from deltaship.bundle.node_order import runtime_order
from deltaship.errors import DeltashipError

_LAYER_WEIGHT = re.compile(r"^model_layers_(\d+)_")
_INPUT_NORM = re.compile(r"^model_layers_(\d+)_input_layernorm_weight(_fp16_\d+)?$")  # fusions.py: the fp16 copy
_FINAL_NORM = "model_norm_weight"
# the op that says what a layer's token mixer is
MIXERS = {"LinearAttention": "deltanet", "GroupQueryAttention": "attention"}


def layer_segments(nodes: Sequence[onnx.NodeProto]) -> tuple[list[list[onnx.NodeProto]], int]:
    """The nodes of each decoder layer, in order, and the number of nodes outside every layer."""
    starts: list[int] = []
    end = None
    for k, n in enumerate(nodes):
        for name in n.input:
            m = _INPUT_NORM.match(name)
            if m and int(m.group(1)) == len(starts):
                starts.append(k)
            elif (name == _FINAL_NORM or name.startswith(_FINAL_NORM + "_fp16_")) and end is None:
                end = k
    if not starts or end is None:
        raise DeltashipError(
            "node census: no input norm of layer 0 or no final norm in this graph (not a deltaship decoder)",
            "count the nodes of a model.onnx that deltaship wrote",
        )
    bounds = starts + [end]
    segments = [list(nodes[a:b]) for a, b in zip(bounds, bounds[1:])]
    for i, seg in enumerate(segments):  # a node reading another layer's weight: the layers are not contiguous
        for n in seg:
            for name in n.input:
                m = _LAYER_WEIGHT.match(name)
                if m and int(m.group(1)) != i and not _INPUT_NORM.match(name):
                    raise DeltashipError(
                        f"node census: node {n.name} ({n.op_type}) in layer {i}'s run reads {name}",
                        "the graph's layers are not written in order; count with onnx's own tools",
                    )
    return segments, len(nodes) - sum(map(len, segments))


def nodes_per_layer(nodes: Sequence[onnx.NodeProto]) -> dict:
    """{"deltanet": nodes per DeltaNet layer, "attention": per attention layer, "shared": nodes some layer's run
    holds beyond that (arithmetic the lowering builds once, on first use: GroupQueryAttention's sequence lengths in
    the first attention layer), "outside": nodes in no layer, "total": all nodes, "layers": [count, ...], "ops":
    {kind: {op: count}} of the last layer of each kind}. `nodes`: a graph's nodes as written
    (model.graph.node), counted in the order ONNX Runtime runs them."""
    segments, outside = layer_segments([nodes[i] for i in runtime_order(nodes)])
    kinds, ops = [], {}
    for i, seg in enumerate(segments):
        mixers = {MIXERS[n.op_type] for n in seg if n.op_type in MIXERS}
        if len(mixers) != 1:
            raise DeltashipError(
                f"node census: layer {i} has token mixers {sorted(mixers) or 'none'}",
                "count the nodes of a deltaship Qwen3.5 decoder",
            )
        kinds.append(mixers.pop())
        ops[kinds[-1]] = {}
        for n in seg:
            ops[kinds[-1]][n.op_type] = ops[kinds[-1]].get(n.op_type, 0) + 1
    counts = [len(seg) for seg in segments]
    per = {k: min(c for c, kk in zip(counts, kinds) if kk == k) for k in dict.fromkeys(kinds)}
    shared = sum(c - per[k] for c, k in zip(counts, kinds))
    return {**per, "shared": shared, "outside": outside, "total": len(nodes), "layers": counts, "ops": ops}
