"""Which nodes of a deltaship ONNX bundle ONNX Runtime's CUDA EP would keep on the CPU, and which tensors would
cross between CPU and GPU memory (Memcpy nodes), read from the graph alone.
Regenerates: the placement notes of docs/results/gpu.md.

    python bench/gpu/placement.py BUNDLE [--json OUT]

No GPU needed. It replays ONNX Runtime's CPU-preferred-node pass (onnxruntime/core/framework/
fallback_cpu_capability.cc, GetCpuPreferredNodes) over the graph, with the memory types of the CUDA kernels this
graph uses written out below (which inputs a kernel takes in CPU memory, which outputs it leaves there): starting
from the consumers of CPU-memory outputs (Shape), a node goes to the CPU when every input is an initializer, a
graph input, or a CPU tensor that the CUDA kernel would not take in CPU memory anyway, and none is fp16. Then every
edge whose producer leaves the tensor in one memory and whose consumer reads it from the other is a Memcpy node.
ORT refuses CUDA graph capture when a graph has a Memcpy node (inference_session.cc: CPU nodes are allowed for
shape computation only). The replay is a model of ORT, not ORT; on an H200 (2026-11-26, ONNX Runtime 1.31.1,
bench/results/gpu/capture-2026-11-26.json) ORT's own placement log matched it on the trained tiny's fp16 bundles:
the plain graph 2 CPU nodes and 3 Memcpy nodes (the call's token count and the query length to the GPU,
total_sequence_length to the host), the --onnx-cuda-graph graph 1 CPU node and none.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import defaultdict
from pathlib import Path

# CUDA kernels' memory types (onnxruntime/core/providers/cuda, contrib_ops/cuda; opset >= 13 forms)
CPU_OUTPUTS = {"Shape": {0}, "Size": {0}}
CPU_INPUTS = {
    "Reshape": {1},
    "Expand": {1},
    "Slice": {1, 2, 3, 4},
    "Squeeze": {1},
    "Unsqueeze": {1},
    "ReduceSum": {1},
    "ReduceMean": {1},
    "ReduceMax": {1},
    "Range": {0, 1, 2},
    "ConstantOfShape": {0},
    "Tile": {1},
    "TopK": {1},
    "Pad": {1, 2, 3},
    "Split": {1},
    "CumSum": {1},
    "Resize": {1, 2, 3},
    "GroupQueryAttention": {6},  # total_sequence_length
}


def _fp16_tensors(model) -> set[str]:
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # contrib ops without schemas stop nothing that matters here; keep what is declared
        inferred = model
    g = inferred.graph
    vis = list(g.value_info) + list(g.input) + list(g.output)
    f16 = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    return {v.name for v in vis if v.type.tensor_type.elem_type in f16} | {
        t.name for t in g.initializer if t.data_type in f16
    }


def placement(model) -> dict:
    """Replay ORT's CPU-preferred-node pass; return the CPU nodes and the predicted Memcpy edges."""
    g = model.graph
    nodes = list(g.node)
    consumers = defaultdict(list)
    for k, n in enumerate(nodes):
        for i in n.input:
            if i:
                consumers[i].append(k)
    initializers = {t.name for t in g.initializer}
    graph_inputs = {i.name for i in g.input}
    fp16 = _fp16_tensors(model)
    producer = {o: (k, s) for k, n in enumerate(nodes) for s, o in enumerate(n.output)}
    cpu_args: set[str] = set()
    todo: list[int] = []
    cpu: set[int] = set()
    for n in nodes:
        for slot in CPU_OUTPUTS.get(n.op_type, ()):
            cpu_args.add(n.output[slot])
            for c in consumers[n.output[slot]]:
                heapq.heappush(todo, c)  # ORT takes candidates in topological order
    seen: set[int] = set()
    while todo:
        k = heapq.heappop(todo)
        if k in seen:
            continue
        seen.add(k)
        n = nodes[k]
        here = True
        for slot, name in enumerate(n.input):
            if not name:
                continue
            if name in fp16:
                here = False
                break
            if name in initializers or name in graph_inputs:
                continue
            if name not in cpu_args or slot in CPU_INPUTS.get(n.op_type, ()):
                here = False
                break
        if here:
            cpu.add(k)
            for o in n.output:
                cpu_args.add(o)
                for c in consumers[o]:
                    heapq.heappush(todo, c)

    def lives_on_cpu(name: str) -> bool:
        k, s = producer[name]
        return k in cpu or s in CPU_OUTPUTS.get(nodes[k].op_type, ())

    edges = []
    for k, n in enumerate(nodes):
        for slot, name in enumerate(n.input):
            if not name or name in initializers or name not in producer:
                continue  # ORT places initializers where they are read; graph inputs are copied as feeds
            wants_cpu = k in cpu or slot in CPU_INPUTS.get(n.op_type, ())
            if lives_on_cpu(name) != wants_cpu:
                edges.append(
                    {
                        "tensor": name,
                        "from": nodes[producer[name][0]].name,
                        "to": n.name,
                        "to_op": n.op_type,
                        "input": slot,
                        "direction": "to_cpu" if wants_cpu else "to_gpu",
                    }
                )
    feeds_to_cpu = sorted({i for k in cpu for i in nodes[k].input if i in graph_inputs})
    return {
        "gqa_nodes": sum(n.op_type == "GroupQueryAttention" for n in nodes),
        "graph_inputs_read_on_cpu": feeds_to_cpu,
        "cpu_nodes": [
            {
                "name": nodes[k].name,
                "op": nodes[k].op_type,
                "inputs": list(nodes[k].input),
                "outputs": list(nodes[k].output),
            }
            for k in sorted(cpu)
        ],
        "predicted_memcpy_edges": edges,
        "memcpy_tensors": sorted({(e["tensor"], e["direction"]) for e in edges}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import onnx

    manifest = json.loads((a.bundle / "manifest.json").read_text())
    res = placement(onnx.load(str(a.bundle / manifest["entry"]), load_external_data=False))
    for n in res["cpu_nodes"]:
        print(f"cpu  {n['op']:10} {n['name']:28} {', '.join(n['inputs'])} -> {', '.join(n['outputs'])}")
    for e in res["predicted_memcpy_edges"]:
        print(f"copy {e['direction']} {e['tensor']} ({e['from']}) -> {e['to_op']} {e['to']} input {e['input']}")
    print(
        f"{len(res['cpu_nodes'])} nodes predicted on the CPU; {len(res['memcpy_tensors'])} tensors copied between "
        f"CPU and GPU (Memcpy nodes); graph inputs read on the CPU: {res['graph_inputs_read_on_cpu'] or 'none'}"
    )
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
