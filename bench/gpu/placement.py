"""Which nodes of a deltaship ONNX bundle ONNX Runtime's CUDA EP would keep on the CPU, read from the graph alone.

    python bench/gpu/placement.py BUNDLE [--json OUT]

No GPU needed. The CUDA GroupQueryAttention kernel takes total_sequence_length (input 6) in CPU memory, so ORT
places the integer nodes that compute it on the CPU (its CPU-preferred-node pass walks back from CPU-memory
inputs through small integer ops). Those nodes also compute seqlens_k (input 5, device memory) and the position
the rotary embedding adds, so their results cross back to the GPU through Memcpy nodes; ORT refuses CUDA graph
capture when a graph has any Memcpy node (inference_session.cc, AreAllComputeNodesAssignedToCudaEp). This
lists that integer subgraph and the CPU -> GPU edges (predicted Memcpy nodes). The 0.8B on an H100 placed 7
nodes on the CPU and added 2 Memcpy nodes (bench/results/gpu/device_log.txt); whether this prediction matches
ORT's placement for today's graph has to be checked on a GPU (ORT verbose log, log_severity_level=0).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

# ops ORT's CPU-preferred-node pass pulls onto the CPU when they compute a CPU-memory input from small int tensors
INT_OPS = {"Slice", "Reshape", "Gather", "Add", "Sub", "Mul", "Cast", "Squeeze", "Unsqueeze", "Concat", "Range"}


def cpu_candidates(model) -> dict:
    """The integer subgraph behind GQA's seqlens_k / total_sequence_length, and its edges into float consumers."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    consumers = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
    graph_inputs = {i.name for i in g.input}
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    seeds = {n.input[i] for n in gqa for i in (5, 6) if len(n.input) > i and n.input[i]}
    # walk back from the seeds through small integer ops; Shape ends the walk (the CUDA EP runs it and leaves its
    # output in CPU memory, reading only its input's dims), as does any other op (a float producer)
    cpu, todo = {}, list(seeds)
    while todo:
        t = todo.pop()
        n = producer.get(t)
        if n is None or n.name in cpu or n.op_type not in INT_OPS:
            continue
        cpu[n.name] = n
        todo += [i for i in n.input if i and i not in graph_inputs]
    names = set(cpu)
    edges = []
    for n in cpu.values():
        for o in n.output:
            for c in consumers[o]:
                if c.name in names:
                    continue
                slot = list(c.input).index(o)
                if c.op_type == "GroupQueryAttention" and slot == 6:
                    continue  # total_sequence_length: a CPU input, no copy
                edges.append({"from": n.name, "tensor": o, "to": c.name, "to_op": c.op_type, "input": slot})
    inputs_used = sorted({i for n in cpu.values() for i in n.input if i in graph_inputs})
    order = {n.name: k for k, n in enumerate(g.node)}
    nodes = sorted(cpu.values(), key=lambda n: order[n.name])
    return {
        "gqa_nodes": len(gqa),
        "graph_inputs_read": inputs_used,
        "cpu_nodes": [
            {"name": n.name, "op": n.op_type, "inputs": list(n.input), "outputs": list(n.output)} for n in nodes
        ],
        "predicted_memcpy_edges": edges,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import onnx

    manifest = json.loads((a.bundle / "manifest.json").read_text())
    res = cpu_candidates(onnx.load(str(a.bundle / manifest["entry"]), load_external_data=False))
    for n in res["cpu_nodes"]:
        print(f"cpu  {n['op']:10} {n['name']:28} {', '.join(n['inputs'])} -> {', '.join(n['outputs'])}")
    for e in res["predicted_memcpy_edges"]:
        print(f"copy {e['tensor']} ({e['from']}) -> {e['to_op']} {e['to']} input {e['input']}")
    print(
        f"{len(res['cpu_nodes'])} nodes predicted on the CPU; "
        f"{len({e['tensor'] for e in res['predicted_memcpy_edges']})} tensors copied to the GPU (Memcpy nodes)"
    )
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
