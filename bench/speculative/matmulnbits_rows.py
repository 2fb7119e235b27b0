"""ONNX Runtime's MatMulNBits (int4, block 32) alone, at the 0.8B's shapes: ms per call at M = 1..4 rows (a verify
call of M tokens), accuracy levels 0 (fp32 compute) and 4 (int8 compute, what deltaship's int4 bundles use).

    python bench/speculative/matmulnbits_rows.py

Random weights; only the LM head (127 MB of int4) is too large for the cache, so only its row is a streaming
(bandwidth-bound) measurement; the two MLP shapes run from the cache and show the compute side.
"""

import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def model(K, N, acc, block=32):
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 255, (N, K // block, block // 2), dtype=np.uint8)
    scales = (rng.random((N * (K // block),)) * 0.01).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales"],
        ["Y"],
        domain="com.microsoft",
        K=K,
        N=N,
        bits=4,
        block_size=block,
        accuracy_level=acc,
    )
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, "M", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, "M", N])],
        [numpy_helper.from_array(blob, "B"), numpy_helper.from_array(scales, "scales")],
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    o = ort.SessionOptions()
    o.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])


for K, N, name in [
    (1024, 7168, "gate_up 1024x7168"),
    (3584, 1024, "down 3584x1024"),
    (1024, 248320, "lm_head 1024x248320"),
]:
    for acc in (0, 4):
        s = model(K, N, acc)
        row = []
        for M in (1, 2, 3, 4):
            a = np.random.default_rng(1).standard_normal((1, M, K)).astype(np.float32)
            s.run(None, {"A": a})
            ts = []
            for _ in range(15 if N < 100000 else 7):
                t = time.perf_counter()
                s.run(None, {"A": a})
                ts.append(time.perf_counter() - t)
            row.append(1e3 * statistics.median(ts))
        print(
            f"{name:<22} acc {acc}: "
            + "  ".join(f"M={m} {v:7.2f} ms (x{v / row[0]:.2f})" for m, v in zip((1, 2, 3, 4), row)),
            flush=True,
        )
