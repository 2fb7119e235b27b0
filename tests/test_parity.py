"""Parity against transformers' Qwen3.5, for every target and precision, over the table of tiny configs.

One runner serves all targets: each bundle runs in its own runtime (onnxruntime, ...). Tolerances
come from deltaship.targets.tolerances, the one table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import ALL_CONFIGS, export_context, reference, reference_greedy

from deltaship.check.verify import compare, teacher_forced
from deltaship.models.source import load_source
from deltaship.oracle.reference import matched_reference_model
from deltaship.targets import get_target, open_bundle, target_names, tolerance

TARGETS = [t for t in target_names() if "fp32" in get_target(t).precisions]  # qnn builds fp16 only: test_qnn.py
CHUNK = 8  # the bundles fixture exports with prefill_chunk=8
# Lower precisions: ONNX over the whole table; the slower toolchains over two configs that between
# them cover tied and untied heads and value heads > key heads (ExecuTorch, whose exports cost most:
# every precision once, int4 on both).
LOW_PRECISION_CASES = (
    [(c, "onnx", p) for c in ALL_CONFIGS for p in ("fp16", "int8", "int4")]
    + [(c, "coreml", p) for c in ("base", "grouped_values") for p in ("fp16", "int8", "int4")]
    + [
        ("grouped_values", "executorch", "fp16"),
        ("base", "executorch", "int8"),
        ("base", "executorch", "int4"),
        ("grouped_values", "executorch", "int4"),
    ]
)


# fp32 rows: every config on every target, but for ExecuTorch and Core ML (minutes an export) `base` is left to
# `multimodal`, its text config wrapped in Qwen3_5ForConditionalGeneration: the same graph, with the wrapper's loading
FP32_CASES = [(c, t) for t in TARGETS for c in ALL_CONFIGS if not (c == "base" and t in ("executorch", "coreml"))]
RESET_CASES = [(c, t) for t in TARGETS for c in ("base" if t == "onnx" else "multimodal", "grouped_values")]


@pytest.fixture(scope="module")
def refs(checkpoints):
    cache = {}

    def get(config):
        if config not in cache:
            cache[config] = reference(checkpoints[config])
        return cache[config]

    return get


def _prompt(n: int, seed: int, vocab: int = 150) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.mark.parametrize("config,target", FP32_CASES)
def test_fp32_greedy_32_steps_identical_to_transformers(config, target, bundles, refs):
    prompt = _prompt(5, seed=1)
    ref_tokens, ref_rows = reference_greedy(refs(config), prompt, 32)
    s = open_bundle(bundles(config, target))
    gen = s.generate(prompt, 32, stop_at_eos=False, keep_logits=True)
    assert gen.output_ids == ref_tokens
    res = compare(np.stack(gen.logits), ref_rows, ref_tokens, tolerance(target, "fp32").tie_margin)
    assert res["max_rel_logit_diff"] <= tolerance(target, "fp32").max_rel_logit_diff, res


@pytest.mark.parametrize("config,target", FP32_CASES)
def test_chunked_prefill_equals_token_by_token(config, target, bundles, refs):
    chunked, stepwise = open_bundle(bundles(config, target)), open_bundle(bundles(config, target))
    assert chunked.prefill_chunk == CHUNK
    for n in (1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 2):
        prompt = _prompt(n, seed=n)
        chunked.reset()
        stepwise.reset()
        a = chunked.prefill(prompt)
        for tok in prompt:
            b = stepwise.decode(tok)
        # Same runtime, different kernels (a GEMM over T rows vs T GEMVs accumulate in different orders):
        # equal within the fp32 row of the tolerance table, in units of the logit row's spread.
        tol = tolerance(target, "fp32").max_rel_logit_diff
        assert np.abs(a - b).max() / b.std() <= tol, (n, np.abs(a - b).max() / b.std())
        assert chunked.position == stepwise.position == n
        ref_last = refs(config)(torch.tensor([prompt]), use_cache=False).logits[0, -1].detach().numpy()
        rel = np.abs(a - ref_last).max() / ref_last.std()
        assert rel <= tol, (n, rel)
        if hasattr(chunked, "state_arrays"):
            sa, sb = chunked.state_arrays(), stepwise.state_arrays()
            for name in sa:
                if "key" in name or "value" in name:  # only the first n positions of a KV cache are defined
                    sa[name], sb[name] = sa[name][:, :, :n], sb[name][:, :, :n]
                np.testing.assert_allclose(sa[name], sb[name], atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("config,target", RESET_CASES)
def test_reset_really_resets(config, target, bundles):
    s = open_bundle(bundles(config, target))
    prompt = _prompt(11, seed=3)
    fresh = s.prefill(prompt)
    s.generate(_prompt(6, seed=4), 10)  # pollute every state
    assert s.position > 0
    s.reset()
    assert s.position == 0
    np.testing.assert_array_equal(s.prefill(prompt), fresh)
    if hasattr(s, "state_arrays"):
        s.reset()
        assert all(not a.any() for a in s.state_arrays().values())


@pytest.mark.parametrize("target", TARGETS)
def test_two_sessions_do_not_share_state(target, bundles):
    path = bundles("grouped_values", target)
    pa, pb = _prompt(9, seed=5), _prompt(4, seed=6)
    solo_a = open_bundle(path).generate(pa, 12, stop_at_eos=False).output_ids
    solo_b = open_bundle(path).generate(pb, 12, stop_at_eos=False).output_ids
    a, b = open_bundle(path), open_bundle(path)
    la, lb = a.prefill(pa), b.prefill(pb)
    out_a, out_b = [], []
    for _ in range(12):  # interleave the two sequences step by step
        out_a.append(int(la.argmax()))
        out_b.append(int(lb.argmax()))
        la, lb = a.decode(out_a[-1]), b.decode(out_b[-1])
    assert out_a == solo_a and out_b == solo_b
    assert solo_a != solo_b


def test_onnx_states_shared_in_place_are_exact(bundles):
    """The manifest lets the KV cache and, on the CPU, the DeltaNet recurrent state share one buffer between
    past and present; a session that does so gives bit-identical logits and states to one that double-buffers."""
    from deltaship.bundle.reader import read_manifest
    from deltaship.runtimes.onnx import OnnxSession

    path = bundles("grouped_values", "onnx")
    manifest = read_manifest(path)
    kinds = {s["kind"]: s.get("in_place") for s in manifest["states"]}
    assert kinds["deltanet_recurrent"] == ["CPUExecutionProvider"]
    assert "CPUExecutionProvider" in kinds["kv_cache_key"] and "CPUExecutionProvider" in kinds["kv_cache_value"]
    assert kinds["deltanet_conv"] is None  # written by a Slice of a Concat that reads it: two buffers
    shared = OnnxSession(path, manifest, prefill_chunk=80)
    double = OnnxSession(path, manifest, prefill_chunk=80, in_place=False)
    assert {n for n, v in shared._vals.items() if len(v) == 1} == {
        s["name"] for s in manifest["states"] if s["kind"] != "deltanet_conv"
    }
    assert all(len(v) == 2 for v in double._vals.values())
    prompt = _prompt(70, seed=11)  # one call, longer than LinearAttention's chunk of 64
    a, b = shared.prefill(prompt), double.prefill(prompt)
    for _ in range(6):
        assert np.array_equal(a, b)
        tok = int(a.argmax())
        a, b = shared.decode(tok), double.decode(tok)
    sa, sb = shared.state_arrays(), double.state_arrays()
    assert all(np.array_equal(sa[n], sb[n]) for n in sa)
    assert any(sa[n].any() for n in sa if "recurrent" in n)


def _matched_parity(bundle, ckpt, precision, tol, target="onnx", **opts) -> dict:
    """Teacher-forced parity of a bundle against transformers with the bundle's own weight rounding
    (recomputed from the export's quantization choices, or read back from what the toolchain did)."""

    ctx = export_context(ckpt, precision, target=target, **opts)
    source = load_source(str(ckpt))
    rounded = None
    if target == "executorch" and precision in ("int8", "int4"):  # torchao's rounding, redone (deterministic)
        from deltaship.lowering.executorch.program import prepare

        rounded = prepare(ctx, source.weights).rounded
    ref = matched_reference_model(source, ctx.plan, ctx.quant, precision, rounded=rounded)
    s = open_bundle(bundle)
    worst, agree = 0.0, 1.0
    for n, seed in ((3, 7), (CHUNK + 5, 8)):
        prompt = _prompt(n, seed)
        toks, ref_rows = reference_greedy(ref, prompt, 16)
        res = compare(teacher_forced(s, prompt, toks), ref_rows, toks, tol.tie_margin)
        worst, agree = max(worst, res["max_rel_logit_diff"]), min(agree, res["tie_aware_agreement"])
    return {"rel": worst, "agree": agree}


@pytest.mark.parametrize("config,target,precision", LOW_PRECISION_CASES)
def test_lower_precision_matches_its_rounded_weights(config, target, precision, bundles, checkpoints):
    tol = tolerance(target, precision)
    got = _matched_parity(bundles(config, target, precision), checkpoints[config], precision, tol, target=target)
    assert got["rel"] <= tol.max_rel_logit_diff and got["agree"] >= tol.min_greedy_agreement, got


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_quantized_onnx_with_float_activations_is_exact(config, precision, bundles, checkpoints):
    """With float activations (accuracy level 0) the only difference left is the weight rounding,
    which the matched reference reproduces: the quantized lowering must then be as exact as fp32."""
    tol = tolerance("onnx", "fp32")
    got = _matched_parity(bundles(config, "onnx", precision, accuracy_level=0), checkpoints[config], precision, tol)
    assert got["rel"] <= tol.max_rel_logit_diff and got["agree"] == 1.0, got


def test_int4_with_int8_deltanet_is_exact(bundles, checkpoints):
    tol = tolerance("onnx", "fp32")
    got = _matched_parity(
        bundles("grouped_values", "onnx", "int4", accuracy_level=0, deltanet_int8=True),
        checkpoints["grouped_values"],
        "int4",
        tol,
        deltanet_int8=True,
    )
    assert got["rel"] <= tol.max_rel_logit_diff and got["agree"] == 1.0, got


def test_onnx_int4_with_fp16_activations(bundles, checkpoints):
    """--onnx-activations fp16 (what ONNX Runtime's CUDA GroupQueryAttention needs): the quantized ops read
    fp16 activations with fp16 scales, the KV cache is fp16, the recurrent state stays fp32, logits are
    fp32; with float activation blocks the bundle is within the fp16 row against the matched reference."""
    import json

    import onnx
    from onnx import TensorProto

    path = bundles("grouped_values", "onnx", "int4", accuracy_level=0, onnx_activations="fp16")
    g = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    inits = {t.name: t.data_type for t in g.initializer}
    nbits = [n for n in g.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")]
    assert nbits and all(inits[n.input[2]] == TensorProto.FLOAT16 for n in nbits)
    manifest = json.loads((path / "manifest.json").read_text())
    dtypes = {s["kind"]: s["dtype"] for s in manifest["states"]}
    assert dtypes["deltanet_recurrent"] == "float32" and dtypes["deltanet_conv"] == "float16"
    assert dtypes["kv_cache_key"] == dtypes["kv_cache_value"] == "float16"
    assert manifest["quantization"]["activations"] == "float16"
    tol = tolerance("onnx", "fp16")
    got = _matched_parity(path, checkpoints["grouped_values"], "int4", tol, onnx_activations="fp16")
    assert got["rel"] <= tol.max_rel_logit_diff and got["agree"] >= tol.min_greedy_agreement, got
    assert got["rel"] > tolerance("onnx", "fp32").max_rel_logit_diff  # fp16 arithmetic really ran


@pytest.mark.parametrize("config", ["grouped_values", "odd_heads"])
def test_onnx_contrib_deltanet_ops_are_as_exact(config, bundles, refs):
    """The alternative ONNX lowering onto ORT's CausalConvWithState and GatedRMSNorm contrib ops: greedy
    tokens identical to transformers, chunked prefill equal to token-by-token feeding."""
    import onnx

    path = bundles(config, "onnx", "fp32", onnx_deltanet_ops="contrib")
    ops = {n.op_type for n in onnx.load(str(path / "model.onnx"), load_external_data=False).graph.node}
    assert {"CausalConvWithState", "GatedRMSNorm", "LinearAttention"} <= ops
    prompt = _prompt(3 * CHUNK + 2, seed=9)
    ref_tokens, ref_rows = reference_greedy(refs(config), prompt, 32)
    s = open_bundle(path)
    gen = s.generate(prompt, 32, stop_at_eos=False, keep_logits=True)
    assert gen.output_ids == ref_tokens
    tol = tolerance("onnx", "fp32")
    assert (
        compare(np.stack(gen.logits), ref_rows, ref_tokens, tol.tie_margin)["max_rel_logit_diff"]
        <= tol.max_rel_logit_diff
    )
    stepwise = open_bundle(path)
    for tok in prompt:
        last = stepwise.decode(tok)
    s.reset()
    chunked = s.prefill(prompt)
    assert np.abs(chunked - last).max() / last.std() <= tol.max_rel_logit_diff


def test_reference_continuation_with_the_cache_is_the_uncached_one():
    """verify's reference continuation decodes with the cache (two passes over the prompt instead of steps + 1):
    the tokens and logit rows are those of the uncached loop, a full pass per token."""
    from deltaship.check.verify import reference_continuation
    from deltaship.oracle.reference import reference_model

    model = reference_model(load_source("qwen3.5-tiny"))
    rng = np.random.default_rng(5)
    for n in (1, 7, 19):
        prompt = rng.integers(0, model.config.vocab_size, n).tolist()
        toks, rows = reference_continuation(model, prompt, 6)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            full = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
        assert toks == ids[n:]
        np.testing.assert_array_equal(rows, full[n - 1 : n + 5])
