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
# The HTP computes in fp16 (enable_htp_fp16_precision): max abs logit difference against the fp32 ONNX bundle on the
# tiny preset after a 7-token prompt (chunk of 4 + 3 steps): measured 0.016; the prefill recurrence reading the first
# token's decay for every token gave 0.072.
QNN_FP16_LOGITS_TOL = 0.04


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


@pytest.fixture(scope="module")
def tiny_decode(tmp_path_factory):
    """The tiny preset's QNN graphs at max context 32, prefill chunk 4: (lower_decode's result, decode.onnx,
    prefill.onnx)."""
    return _tiny_graphs(tmp_path_factory.mktemp("qnn"), max_context=32, chunk=4)


def _tiny_graphs(tmp_path, max_context: int, chunk: int):
    """The tiny preset's QNN decode and prefill graphs (fp16), lowered from the ONNX target's passes."""
    from helpers import export_context

    from deltaship.lowering.qnn.model import lower_decode, lower_prefill
    from deltaship.models.source import load_source

    ctx = export_context("qwen3.5-tiny", "fp16", max_context=max_context)
    weights = load_source("qwen3.5-tiny").weights
    lowered = lower_decode(ctx, weights, tmp_path)
    lower_prefill(ctx, weights, tmp_path, chunk)
    return lowered, tmp_path / "decode.onnx", tmp_path / "prefill.onnx"


def _fp32_greedy(tmp_path, prompts: list[list[int]], new_tokens: int, max_context: int, logits_after=None):
    """Greedy tokens of the tiny preset's fp32 ONNX bundle (the ONNX target, CPU); each prompt's logits after its
    last token are appended to `logits_after` when given."""
    from deltaship.compile import export
    from deltaship.targets import open_bundle

    bundle = tmp_path / "fp32"
    export("qwen3.5-tiny", bundle, target="onnx", precision="fp32", max_context=max_context, progress=False)
    session = open_bundle(bundle)
    out = []
    for prompt in prompts:
        session.reset()
        logits, tokens = session.prefill(prompt), []
        if logits_after is not None:
            logits_after.append(np.asarray(logits, np.float32).reshape(-1))
        for _ in range(new_tokens):
            tokens.append(int(np.argmax(logits)))
            logits = session.decode(tokens[-1])
        out.append(tokens)
    return out


def test_qnn_decode_graph_is_static_and_standard(tiny_decode):
    """What QNN asks of a graph: every input and output shape static, no contrib (com.microsoft) op, no Split
    (zeros on the HTP simulator inside the graph) and no Range."""
    import onnx

    lowered, path, _ = tiny_decode
    m = onnx.load(path)
    for v in [*m.graph.input, *m.graph.output]:
        dims = v.type.tensor_type.shape.dim
        assert dims and all(d.HasField("dim_value") for d in dims), f"{v.name} has a dynamic dimension"
    assert {n.domain for n in m.graph.node} <= {"", "ai.onnx"}
    assert not {"Split", "Range", "LinearAttention", "GroupQueryAttention"} & set(lowered["onnx_ops"])
    assert lowered["onnx_ops"]["Where"] == 4  # key and value rows written at the position, 2 attention layers


def test_qnn_lowering_table_covers_every_canonical_op():
    from deltaship.lowering.onnx.lowering import LOWERINGS
    from deltaship.lowering.qnn.lowering import QNN_LOWERINGS
    from deltaship.models.ops import CANONICAL_OPS

    assert not QNN_LOWERINGS.missing(CANONICAL_OPS.values())
    assert not QNN_LOWERINGS.missing(LOWERINGS)  # every op the ONNX target lowers, rewritten or as it is


@needs_qnn
def test_qnn_decode_graph_runs_on_htp_and_matches_fp32_greedy(tiny_decode, tmp_path):
    """Every node of the tiny decode and prefill graphs on the HTP (CPU fallback disabled); greedy tokens equal the
    fp32 ONNX bundle's over a 7-token prompt (one prefill chunk of 4, then 3 decode steps)."""
    from deltaship.runtimes.qnn import QnnDecoder

    decoder = QnnDecoder(tiny_decode[1], prefill=tiny_decode[2])
    for opened in (decoder.opened, decoder.prefill_opened):
        assert opened.checks and all(c.passed for c in opened.checks)
    assert decoder.chunk == 4 and decoder.max_context == 32
    prompt = list(b"def fib")
    want_logits: list = []
    assert decoder.greedy(prompt, 8) == _fp32_greedy(tmp_path, [prompt], 8, 32, want_logits)[0]
    decoder.reset()
    diff = np.abs(decoder.prefill(prompt) - want_logits[0]).max()
    assert diff < QNN_FP16_LOGITS_TOL, diff
    decoder.reset()
    decoder.position = 31  # the static KV buffers hold 32 positions: a 2-token call would write past them
    with pytest.raises(DeltashipError, match="past the graph's static KV buffers of 32 positions"):
        decoder.prefill([1, 2])


@pytest.mark.slow
@needs_qnn
def test_qnn_greedy_16_tokens_for_prompts_of_1_7_and_200(tmp_path):
    """Prefill chunk 8 (the 200-token prompt: 25 chunks), max context 256. (At chunk 16 the HTP simulator
    miscomputes the unrolled graph: docs/npu.md.)"""
    from helpers import code_prompt

    from deltaship.runtimes.qnn import QnnDecoder

    prompts = [list(b"d"), list(b"def fib"), (code_prompt(100) * 3)[:200]]  # code_prompt is ~100 bytes long
    _, decode, prefill = _tiny_graphs(tmp_path, max_context=256, chunk=8)
    decoder = QnnDecoder(decode, prefill=prefill)
    got = [decoder.greedy(p, 16) for p in prompts]
    assert got == _fp32_greedy(tmp_path, prompts, 16, max_context=256)


# What onnxruntime-qnn 2.7.0 wrote into a context model compiled for the Snapdragon 8 Gen 3 (SM8650 = SoC 57, HTP v75).
V75_RECORD = "v2:6:2.51.0:5.51.0:75:57:0:0"


def test_context_record_reads_what_a_context_needs_and_refuses_another_soc():
    from deltaship.bundle.qnn_context import parse_compat, soc_refusal, version_refusal

    compat = parse_compat(V75_RECORD, "decode_8gen3_ctx.onnx")
    assert (compat.qnn_sdk, compat.htp_backend_api, compat.htp_archs, compat.soc_models) == (
        "2.51.0",
        "5.51.0",
        (75,),
        (57,),
    )
    assert soc_refusal(compat, 57, 75) is None
    assert "a newer HTP would run it only as QNN's fallback" in soc_refusal(compat, 69, 79)
    assert "cannot run a context compiled for a newer HTP" in soc_refusal(compat, 43, 73)
    assert version_refusal(compat, "2.51.0") is None and version_refusal(compat, "2.52.1") is None
    assert "needs that QNN or newer, and this runtime has 2.45.0" in version_refusal(compat, "2.45.0")
    for bad in (None, "", "v2:6:2.51.0:5.51.0:75:57:0", "v3:6:2.51.0:5.51.0:75:57:0:0", "v2:6:2.51:5.51.0:75:57:0:0"):
        with pytest.raises(DeltashipError, match="decode_8gen3_ctx.onnx"):
            parse_compat(bad, "decode_8gen3_ctx.onnx")
    with pytest.raises(DeltashipError, match="not the HTP"):
        parse_compat(V75_RECORD.replace("v2:6:", "v2:2:"), "x_ctx.onnx")


def _feed(session, seed: int = 0) -> dict:
    """One decode call's inputs: a token at position 3 over random states (so every state path is exercised)."""
    rng = np.random.default_rng(seed)
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    feed = {"input_ids": np.array([[65]], np.int64), "position": np.array([3], np.int64)}
    for i in session.get_inputs()[2:]:
        feed[i.name] = (rng.standard_normal(i.shape) * 0.1).astype(dtypes[i.type])
    return feed


@needs_qnn
def test_compiled_context_runs_on_htp_like_its_graph_and_only_for_its_soc(tiny_decode, tmp_path):
    """The tiny decode graph compiled for the 8 Gen 3 (v75): the manifest facts come back from what was written, the
    context's outputs equal the uncompiled graph's on the simulator (same SoC options), and opening it with the
    8 Elite's options (v79), which the simulator itself would accept, is refused."""
    import hashlib

    import onnxruntime_qnn

    from deltaship.lowering.qnn.context import compile_context
    from deltaship.lowering.qnn.soc import soc
    from deltaship.runtimes.qnn import open_context

    out = tmp_path / "ctx"
    out.mkdir()
    made = compile_context(tiny_decode[1], soc("8gen3"), out)
    assert made["model"] == "decode_8gen3_ctx.onnx" and (made["soc_model"], made["htp_arch"]) == (57, 75)
    assert [f["path"] for f in made["files"]] == ["decode_8gen3_ctx.onnx", "decode_8gen3_ctx_qnn.bin"]
    for f in made["files"]:
        data = (out / f["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (f["bytes"], f["sha256"])
    assert made["files"][1]["bytes"] > 1_000_000  # the graph's fp16 weights live in the binary
    assert made["qnn_sdk"] == onnxruntime_qnn.build_and_package_info.qnn_version
    assert made["compatibility"].split(":")[4:6] == ["75", "57"]
    assert made["qnn_build"].startswith(f"v{made['qnn_sdk']}.")

    compiled = open_context(out / made["model"], soc_model="57", htp_arch="75").session
    assert compiled.get_providers()[0] == "QNNExecutionProvider"
    graph = open_htp(tiny_decode[1], soc_model="57", htp_arch="75").session
    feed = _feed(graph)
    for name, want, got in zip([o.name for o in graph.get_outputs()], graph.run(None, feed), compiled.run(None, feed)):
        assert got.shape == want.shape and np.abs(got.astype(np.float32) - want.astype(np.float32)).max() <= 1e-3, name

    with pytest.raises(DeltashipError, match=r"compiled for SoC 57 \(HTP v75\), opened for SoC 69 \(HTP v79\)"):
        open_context(out / made["model"], soc_model="69", htp_arch="79")
    with pytest.raises(DeltashipError, match="already exists"):
        compile_context(tiny_decode[1], soc("8gen3"), out)
    (out / "decode_8gen3_ctx_qnn.bin").rename(out / "moved.bin")
    with pytest.raises(DeltashipError, match="decode_8gen3_ctx_qnn.bin, which is not beside it"):
        open_context(out / made["model"], soc_model="57", htp_arch="75")


@needs_qnn
def test_compile_refuses_a_graph_the_htp_cannot_take_and_leaves_nothing(tmp_path):
    from deltaship.lowering.qnn.context import compile_context
    from deltaship.lowering.qnn.soc import soc

    model, _ = _matmul_relu(tokens="T")  # a dynamic token dimension: QNN wants static shapes
    (tmp_path / "dyn.onnx").write_bytes(model)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DeltashipError, match=r"QNN could not compile dyn.onnx for Snapdragon 8 Elite \(SM8750"):
        compile_context(tmp_path / "dyn.onnx", soc("8elite"), out)
    assert not list(out.iterdir())
