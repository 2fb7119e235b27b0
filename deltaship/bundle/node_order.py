"""The order of a graph's nodes in the file, chosen for the order ONNX Runtime runs them in.

ONNX Runtime runs a graph in its default execution order (GraphViewer's ExecutionOrder::DEFAULT): a depth-first walk
back from the leaf nodes (nodes no other node reads), the leaves taken from the last in the file to the first, each
node's producers from the last to the first, every node placed once all its producers are. In the order the lowering
emits, the nodes that write each layer's state outputs are leaves that the walk reaches only after the logits' whole
cone. So every layer's chunk-sized tensors that feed them (a DeltaNet layer's conv window with the chunk's inputs)
stay alive to the end of the call: 0.3 GiB of the 0.8B's peak for a 512-token prefill (docs/results/memory.md).

Written in the order that walk gives for the lowering's order (the order ONNX Runtime itself saves a graph in),
the file has those leaves last, layer 0's last of all. The runtime's own walk then starts from layer 0's state
outputs and goes layer by layer, freeing each layer's tensors as it leaves it. Every runtime built on ONNX Runtime
runs it so: deltaship's session, onnxruntime-genai, onnxruntime-node and -web. The nodes, their inputs and outputs
are unchanged; only their order is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# onnx.AttributeProto's GRAPH and GRAPHS types (this module reads nodes without importing onnx: the runtime's prepack
# cache orders the graph it saves too, runtimes/onnx_prepack.py)
_SUBGRAPH_TYPES = (5, 10)


def runtime_order(nodes: Sequence[Any]) -> list[int]:
    """The positions of `nodes` (onnx NodeProtos of a topologically sorted graph, position = ONNX Runtime's node
    index) in the order ONNX Runtime's default execution order visits them: Graph::ReverseDFSFrom over the leaf
    nodes with its stack and NodeCompare (inputs sorted by index), as in onnxruntime/core/graph/graph_viewer.cc. The
    result is a topological order too. Each walk of the walk's own order gives another order (saved and loaded
    again, a graph alternates between a layer-by-layer run and the late one): a file is written in the order one
    walk of a layer-by-layer order gives, so that the runtime's walk of it runs layer by layer."""
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for name in n.output:
            if name:
                producer[name] = i
    inputs = [sorted({producer[x] for x in n.input if x in producer}) for n in nodes]
    read = [False] * len(nodes)
    for ins in inputs:
        for p in ins:
            read[p] = True
    visited = [False] * len(nodes)
    stack = [(i, False) for i in range(len(nodes)) if not read[i]]  # the leaves, the last one on top
    order: list[int] = []
    while stack:
        i, leaving = stack.pop()
        if leaving:
            order.append(i)
            continue
        if visited[i]:
            continue
        visited[i] = True
        stack.append((i, True))
        stack.extend((p, False) for p in inputs[i] if not visited[p])  # the producer last in the file on top
    return order


def order_for_runtime(nodes: Sequence[Any]) -> list[Any]:
    """`nodes` in the order ONNX Runtime's walk gives them (see the module's doc). A graph with subgraphs (If,
    Loop, Scan: nodes reading outer values the walk would have to follow) is returned as it is."""
    if any(a.type in _SUBGRAPH_TYPES for n in nodes for a in n.attribute):
        return list(nodes)
    return [nodes[i] for i in runtime_order(nodes)]
