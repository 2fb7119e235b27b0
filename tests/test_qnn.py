"""The QNN HTP backend (onnxruntime-qnn's x86-64 simulator): what runs on it, and how a refusal reads.

Every session here is opened with CPU fallback disabled, so a node the HTP does not take fails the
session instead of running on the CPU. The QNN tests skip, naming why, only without onnxruntime-qnn.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from deltaship.errors import DeltashipError
from deltaship.runtimes.qnn import NodeCheck, open_htp, parse_validation

needs_qnn = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime_qnn") is None,
    reason="onnxruntime-qnn (the QNN HTP simulator) is not installed: pip install onnxruntime-qnn==2.7.0 --no-deps",
)
F16 = TensorProto.FLOAT16


def _matmul_relu(tokens: int | str = 4) -> tuple[bytes, np.ndarray]:
    w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float16)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="relu")],
        "matmul_relu",
        [helper.make_tensor_value_info("x", F16, [tokens, 8])],
        [helper.make_tensor_value_info("y", F16, [tokens, 16])],
        [numpy_helper.from_array(w, "w")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m.SerializeToString(), w


def test_parse_validation_reads_passes_and_refusals():
    log = (
        "[V:onnxruntime:, qnn_execution_provider.cc:1713 LogNodeSupport] Validation PASSED for 1 nodes in "
        "OrtNodeUnit (MatMul) :\n"
        "[V:onnxruntime:, qnn_execution_provider.cc:1713 LogNodeSupport] Validation FAILED for 1 nodes in "
        "OrtNodeUnit (MatMul) :\n\tOperator type: MatMul Node name: mm Node index: 0\n\tREASON : Cannot get shape\n"
    )
    assert parse_validation(log) == (
        NodeCheck(op="MatMul", passed=True, node="", reason=""),
        NodeCheck(op="MatMul", passed=False, node="mm", reason="Cannot get shape"),
    )


@needs_qnn
def test_htp_simulator_runs_matmul_relu_with_cpu_fallback_disabled():
    model, w = _matmul_relu()
    opened = open_htp(model)
    assert opened.session.get_providers()[0] == "QNNExecutionProvider"
    assert {c.op for c in opened.checks} == {"MatMul", "Relu"} and all(c.passed for c in opened.checks)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float16)
    got = opened.session.run(None, {"x": x})[0].astype(np.float32)
    want = np.maximum(x.astype(np.float32) @ w.astype(np.float32), 0)
    assert np.abs(got - want).max() < 0.02  # fp16 on the HTP


@needs_qnn
def test_htp_refusal_names_the_op_and_qnns_reason():
    model, _ = _matmul_relu(tokens="T")  # a dynamic token dimension: QNN wants static shapes
    with pytest.raises(DeltashipError, match=r"MatMul node 'mm' \(Cannot get shape\)"):
        open_htp(model)
