"""Quantized KV caches (`export --kv-cache int8|int4`): ONNX Runtime's GroupQueryAttention stores the cache
as int8 (int4: two values a byte) with static per-channel scales calibrated on the fp32 reference
(deltaship/lowering/kv_quant.py). Parity against transformers (whose cache is fp32) within the tolerance
table's fp32+kv-int8 row, greedy tokens equal to the fp32-KV bundle, drift by depth, the manifest's
state contract and memory block, and the targets that refuse a quantized cache."""

from __future__ import annotations

import numpy as np
import pytest

from deltaship.errors import DeltashipError

CTX, CHUNK = 128, 16


def _tiny_kv_bundles(shared_export, target: str, **opts):
    """A get(kv) that exports the trained tiny preset once per test run and KV dtype (context CTX, chunk CHUNK)."""

    def get(kv: str):
        tag = "-".join(f"{k}{v}" for k, v in sorted(opts.items()))
        return shared_export(
            f"tiny-{target}-kv-{kv}{'-' + tag if tag else ''}",
            "qwen3.5-tiny",
            target=target,
            max_context=CTX,
            prefill_chunk=CHUNK,
            kv_cache=kv,
            fidelity=False,  # no test here reads it
            **opts,
        )

    return get


@pytest.fixture(scope="module")
def tiny_kv(shared_export):
    """The trained tiny preset as ONNX bundles with fp32, int8 and int4 KV caches (context 128, chunk 16)."""
    return _tiny_kv_bundles(shared_export, "onnx", verify=False)


def _text_ids(bundle, n: int) -> list[int]:
    from deltaship.bundle import read_manifest
    from deltaship.check.evaluate import eval_tokens

    ids, _ = eval_tokens(bundle, read_manifest(bundle), n)
    return ids


def test_int8_kv_bundle_states_memory_and_graph(tiny_kv):
    import onnx

    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.models.presets import PRESETS

    bundle = tiny_kv("int8")
    m = read_manifest(bundle)
    assert not schema_problems(m)
    spec = PRESETS["qwen3.5-tiny"].spec()
    kv = [s for s in m["states"] if s["kind"].startswith("kv_cache")]
    assert kv and all(s["dtype"] == "int8" and s["quantization"]["bits"] == 8 for s in kv)
    assert all(s["shape"] == [1, spec.num_key_value_heads, CTX, spec.head_dim] for s in kv)
    mem = m["memory"]
    assert mem["kv_dtype"] == "int8"
    # static scales live in the graph: one byte an element, nothing per token besides
    per_token = len(spec.attention_layers) * 2 * spec.num_key_value_heads * spec.head_dim
    assert mem["kv_bytes_per_token"]["int8"] == per_token
    assert m["state_bytes"] == mem["deltanet_state_bytes"] + CTX * mem["kv_bytes_per_token"]["int8"]
    assert mem["kv_bytes_per_token"]["int8"] * 4 == mem["kv_bytes_per_token"]["fp32"]
    assert "heldout.txt" in m["lowering"]["kv_quantization"]["calibration"]

    g = onnx.load(bundle / "model.onnx", load_external_data=False).graph
    elem = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.output)}
    for s in kv:
        assert elem[s["name"]] == elem[s["output"]] == onnx.TensorProto.INT8
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == len(spec.attention_layers)
    for n in gqa:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL" and attrs["kv_cache_bit_width"] == 8
        scales = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer if i.name in n.input[12:14]}
        shape = (1, spec.num_key_value_heads, 1, spec.head_dim)
        assert all(a.shape == shape and (a > 0).all() for a in scales.values())
        assert len(scales) == 2


def _graph_scales(bundle) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{layer: (key scale, value scale)}: GroupQueryAttention's k_scale/v_scale initializers, by the layer of
    the past key it reads."""
    import onnx

    g = onnx.load(bundle / "model.onnx").graph
    init = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer}
    return {
        int(n.input[3].split(".")[1]): (init[n.input[12]], init[n.input[13]])
        for n in g.node
        if n.op_type == "GroupQueryAttention"
    }


# What rounding the cache the same way in transformers leaves: float order and the odd element whose
# rounding flips with it, far below what the rounding itself costs (the fp32+kv-int8 row).
ROUNDED_REFERENCE_REL = 0.01


def test_int8_kv_bundle_matches_transformers_within_its_tolerance_row(tiny_kv):
    """Against the fp32 reference (whose cache is fp32) the int8 cache's rounding is all that differs: inside
    the fp32+kv-int8 row, on prompts of 1, 7 and more than one prefill chunk. Against the reference whose
    attention sees keys and values rounded with the bundle's own scales, it is close to exact."""
    from deltaship.check.verify import compare, reference_continuation, teacher_forced
    from deltaship.lowering.kv_quant import rounded_cache_attention
    from deltaship.models.source import load_source
    from deltaship.oracle.reference import reference_model
    from deltaship.targets import open_bundle, tolerance

    tol = tolerance("onnx", "fp32", "int8")
    assert tol.max_rel_logit_diff > tolerance("onnx", "fp32").max_rel_logit_diff and tol.fails_export
    ref = reference_model(load_source("qwen3.5-tiny"))
    text = _text_ids(tiny_kv("int8"), 40)
    prompts = [text[:1], text[:7], text[: CHUNK + 9]]
    worst = {}
    for kv in ("int8", "fp32"):
        s = open_bundle(tiny_kv(kv))
        rows = []
        for prompt in prompts:
            toks, want = reference_continuation(ref, prompt, 8)
            rows.append(compare(teacher_forced(s, prompt, toks), want, toks, tol.tie_margin))
        worst[kv] = max(r["max_rel_logit_diff"] for r in rows)
        assert min(r["tie_aware_agreement"] for r in rows) >= tol.min_greedy_agreement, (kv, rows)
    assert worst["int8"] <= tol.max_rel_logit_diff, worst
    assert worst["fp32"] <= tolerance("onnx", "fp32").max_rel_logit_diff
    assert worst["int8"] > 10 * worst["fp32"]  # the int8 cache really ran
    s = open_bundle(tiny_kv("int8"))
    with rounded_cache_attention(ref, _graph_scales(tiny_kv("int8"))) as rounded:
        for prompt in prompts:
            toks, want = reference_continuation(rounded, prompt, 8)
            got = compare(teacher_forced(s, prompt, toks), want, toks, tol.tie_margin)
            assert got["max_rel_logit_diff"] <= ROUNDED_REFERENCE_REL < worst["int8"] / 5, (len(prompt), got)


@pytest.mark.parametrize("config", ["grouped_values", "odd_heads"])
def test_int8_kv_bundles_of_other_shapes_verify_and_match_the_rounded_reference(config, bundles, checkpoints):
    """Checkpoints of other shapes (value heads > key heads, untied head; odd head counts, d_k != d_v,
    attention first): export-time verification, against transformers rounding the cache with the bundle's
    scales, passes within the fp32+kv-int8 row; the KV cache's cost is recorded as fidelity."""
    from helpers import reference

    from deltaship.bundle import read_manifest
    from deltaship.check.verify import compare, default_prompts, reference_continuation, teacher_forced
    from deltaship.lowering.kv_quant import rounded_cache_attention
    from deltaship.targets import open_bundle, tolerance

    bundle = bundles(config, "onnx", "fp32", kv_cache="int8", verify=True)
    m = read_manifest(bundle)
    v = m["verification"]
    assert v["status"] == "passed" and "rounded as the int8 KV cache" in v["reference"], v
    assert v["tolerance"] == tolerance("onnx", "fp32", "int8").__dict__
    assert all("kl_divergence" in r for r in v["prompts"])  # the cache's cost, against the unrounded reference
    assert m["memory"]["kv_dtype"] == "int8"
    # against transformers' fp32 cache the rounding shows (the int8 cache really ran); rounded, it is gone
    s, ref = open_bundle(bundle), reference(checkpoints[config])
    prompt = default_prompts(m["model"]["vocab_size"], m["prefill_chunk"], m["max_context"], 8)[-1]
    toks, want = reference_continuation(ref, prompt, 8)
    plain = compare(teacher_forced(s, prompt, toks), want, toks, 0.05)["max_rel_logit_diff"]
    with rounded_cache_attention(ref, _graph_scales(bundle)) as rounded:
        toks, want = reference_continuation(rounded, prompt, 8)
        assert compare(teacher_forced(s, prompt, toks), want, toks, 0.05)["max_rel_logit_diff"] < plain / 5


def test_int8_kv_greedy_tokens_equal_the_fp32_kv_bundle(tiny_kv):
    from deltaship.targets import open_bundle

    fp, q8 = open_bundle(tiny_kv("fp32")), open_bundle(tiny_kv("int8"))
    text = _text_ids(tiny_kv("fp32"), 60)
    for n in (1, 7, 2 * CHUNK + 5):
        want = fp.generate(text[:n], 24).output_ids
        assert len(want) >= 8
        assert q8.generate(text[:n], 24).output_ids == want, f"prompt of {n} tokens"


def test_kv_cache_drift_by_depth(tiny_kv):
    """Logit drift of the int8 and int4 caches against the fp32 cache, teacher-forced through held-out text,
    at several depths: both stay inside their tolerance rows, and int4's is the larger on average."""
    from deltaship.check.verify import compare
    from deltaship.targets import open_bundle, tolerance

    text = _text_ids(tiny_kv("fp32"), CTX)
    base = open_bundle(tiny_kv("fp32")).prefill(text[:1])
    rows = {}
    for kv in ("fp32", "int8", "int4"):
        s = open_bundle(tiny_kv(kv))
        out = [s.prefill(text[:1])] + [s.decode(t) for t in text[1:-1]]
        rows[kv] = np.stack(out)
    assert np.allclose(rows["fp32"][0], base)
    drift = {}
    for kv in ("int8", "int4"):
        tol = tolerance("onnx", "fp32", kv)
        for lo, hi in ((0, 16), (16, 64), (64, CTX - 1)):
            d = compare(rows[kv][lo:hi], rows["fp32"][lo:hi], rows["fp32"][lo:hi].argmax(-1).tolist(), tol.tie_margin)
            drift[kv, hi] = d["max_rel_logit_diff"]
            assert d["max_rel_logit_diff"] <= tol.max_rel_logit_diff, (kv, lo, hi, d)
            assert d["tie_aware_agreement"] >= tol.min_greedy_agreement, (kv, lo, hi, d)
    std = rows["fp32"].std(-1, keepdims=True)
    mean = {kv: float((np.abs(rows[kv] - rows["fp32"]) / std).max(-1).mean()) for kv in ("int8", "int4")}
    assert mean["int4"] > 2 * mean["int8"] > 0, (mean, drift)


def test_eval_reports_what_the_kv_cache_costs_by_depth(tiny_kv):
    """`deltaship eval` of an int8/int4-KV bundle is the KV cache's cost (fp32 weights): perplexity, KL and
    KL by depth against the fp32 reference, int4 costing more than int8 and fp32 next to nothing."""
    from deltaship.check.evaluate import evaluate

    res = {kv: evaluate(tiny_kv(kv), tokens=CTX) for kv in ("fp32", "int8", "int4")}
    for kv, r in res.items():
        assert r["kv_dtype"] == kv and len(r["kl_by_depth"]) == 4
        assert list(r["kl_by_depth"])[-1] == str(r["tokens"])
        assert np.isclose(np.mean(list(r["kl_by_depth"].values())), r["kl_divergence"], rtol=0.05)
    assert res["fp32"]["kl_divergence"] < 1e-6 < res["int8"]["kl_divergence"] < res["int4"]["kl_divergence"]
    assert res["int8"]["kl_divergence"] < 0.01 and res["int8"]["top1_agreement"] >= 0.95


def test_int4_kv_bundle_packs_two_values_a_byte(tiny_kv):
    from deltaship.bundle import read_manifest, schema_problems

    m = read_manifest(tiny_kv("int4"))
    assert not schema_problems(m)
    kv = [s for s in m["states"] if s["kind"].startswith("kv_cache")]
    assert all(s["dtype"] == "uint8" and s["shape"][-1] * 2 == m["model"]["head_dim"] for s in kv)
    assert m["memory"]["kv_bytes_per_token"]["int4"] * 8 == m["memory"]["kv_bytes_per_token"]["fp32"]


def test_genai_runs_the_int8_kv_bundle_as_deltaship_does(tiny_kv):
    og = pytest.importorskip("onnxruntime_genai", reason="optional runtime: pip install onnxruntime-genai==0.18.*")
    from deltaship.targets import open_bundle

    bundle = tiny_kv("int8")
    ids = _text_ids(bundle, 20)
    want = open_bundle(bundle).generate(ids, 12).output_ids
    model = og.Model(str(bundle))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 12, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(ids, dtype=np.int32))
    got = []
    while not gen.is_done() and len(got) < 12:
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    assert got == want


@pytest.mark.parametrize(
    "tgt, precision, options, why",  # not "target": instant checks, not the slow tier's target exports
    [
        ("coreml", "fp16", {}, "Core ML states"),
        ("executorch", "fp16", {}, "custom_quantized_sdpa"),
        ("onnx", "fp16", {}, "fp32 activations only"),
        ("onnx", "int4", {"onnx_activations": "fp16"}, "fp32 activations only"),
    ],
)
def test_targets_without_a_quantized_cache_refuse_it_and_say_why(tgt, precision, options, why):
    from deltaship.compile import check_options

    for kv in ("int8", "int4"):
        with pytest.raises(DeltashipError, match=f"--kv-cache {kv} is not available for --target {tgt}") as e:
            check_options(tgt, precision, None, 32, False, None, options, kv_cache=kv)
        assert why in e.value.message and "drop --kv-cache" in e.value.fix


def test_onnx_offers_quantized_caches_with_fp32_activations():
    from deltaship.compile import check_options
    from deltaship.targets import get_target

    for precision in ("fp32", "int8", "int4"):
        typed = check_options("onnx", precision, None, 32, False, None, {}, kv_cache="int8")
        assert get_target("onnx").kv_cache_dtypes(precision, typed.as_dict()) == ("fp32", "int8", "int4")


def test_static_scales_bound_every_rope_angle():
    """A key channel's scale covers its RoPE pair's norm, so rotating the calibrated keys to any position
    never exceeds it: no clipping past the calibration prompt."""
    import torch

    from deltaship.lowering.kv_quant import QMAX, key_bound, scales

    rng = np.random.default_rng(0)
    d, rot, half = 8, 4, 2
    k = torch.tensor(rng.standard_normal((1, 50, d)), dtype=torch.float32)
    s = scales(key_bound(k, rot), 8)[0, :, 0, :]
    assert np.allclose(s[:, rot:] * QMAX[8], k[..., rot:].abs().amax(1).numpy())  # unrotated: |k| max
    assert (s[:, :rot] * QMAX[8] > k[..., :rot].abs().amax(1).numpy()).any()  # rotated: the pair's norm
    for angle in np.linspace(0, 2 * np.pi, 17):
        c, si = np.cos(angle), np.sin(angle)
        x1, x2 = k[..., :half].numpy(), k[..., half:rot].numpy()
        rotated = np.concatenate([x1 * c - x2 * si, x2 * c + x1 * si, k[..., rot:].numpy()], -1)
        assert (np.abs(rotated) <= s * QMAX[8] + 1e-5).all()


# ---- ExecuTorch: fp16, int8 and int4 caches (int8/int4 with the same static scales; slow: ExecuTorch exports) ---
@pytest.fixture(scope="module")
def tiny_pte_kv(shared_export):
    """The trained tiny preset as ExecuTorch bundles with a narrower KV cache (fp32 activations), verified at
    export, one per KV dtype asked for."""
    return _tiny_kv_bundles(shared_export, "executorch")


@pytest.fixture(scope="module")
def tiny_pte_int8_kv(tiny_pte_kv):
    return tiny_pte_kv("int8")


def test_executorch_stored_kv_round_trips_and_packs_int4_two_codes_a_byte():
    """The ExecuTorch lowering's store/load of a narrower cache (eager, as the program runs them): int8/int4 give
    the symmetric rounding with the static scales back exactly, int4 packs channel 2i + 8 in the low nibble and
    2i + 1 + 8 in the high one, fp16 rounds to nearest; the error is within the tolerance table's stated bounds."""
    import torch

    from deltaship.lowering.executorch.lowering import load_kv, store_kv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 2, 8, generator=g) * 3
    bound = x.abs().amax(1, keepdim=True) * 0.8  # some values clip
    for dtype, qmax in ((torch.int8, 127), (torch.uint8, 7)):
        scale = bound / qmax
        c = store_kv(x, dtype, scale)
        assert c.dtype == dtype and c.shape[-1] == (8 if dtype == torch.int8 else 4)
        q = torch.clamp(torch.round(x / scale), -qmax, qmax)
        assert torch.equal(load_kv(c, 8, scale), q * scale)
        inside = x.abs() <= bound
        assert ((load_kv(c, 8, scale) - x).abs()[inside] <= (scale / 2).expand_as(x)[inside] + 1e-6).all()
        if dtype == torch.uint8:
            assert torch.equal(c & 15, (q[..., 0::2] + 8).to(torch.uint8))
            assert torch.equal(c >> 4, (q[..., 1::2] + 8).to(torch.uint8))
    c = store_kv(x, torch.float16, None)
    assert c.dtype == torch.float16 and ((load_kv(c, 8, None) - x).abs() <= x.abs() * 2**-11).all()


@pytest.mark.slow
def test_executorch_int4_kv_bundle_packs_verifies_and_matches_onnx_int4(tiny_pte_kv, tiny_kv):
    """An int4 cache, two codes a byte, with the same calibration as ONNX's: verified at export against the
    reference rounding the cache the same way (its own row), the manifest's arithmetic, and ONNX's logits."""
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.targets import open_bundle, tolerance

    bundle = tiny_pte_kv("int4")
    m = read_manifest(bundle)
    assert not schema_problems(m)
    v = m["verification"]
    assert v["status"] == "passed" and v["tolerance"] == tolerance("executorch", "fp32", "int4").__dict__
    assert "rounded as the int4 KV cache" in v["reference"] and v["max_rel_logit_diff"] <= ROUNDED_REFERENCE_REL
    kv = [s for s in m["states"] if s["kind"].startswith("kv_cache")]
    assert kv and all(s["dtype"] == "uint8" and s["shape"][1:] == [CTX, 2, m["model"]["head_dim"] // 2] for s in kv)
    mem = m["memory"]
    assert mem["kv_dtype"] == "int4" and mem["kv_bytes_per_token"]["int4"] * 8 == mem["kv_bytes_per_token"]["fp32"]
    assert m["state_bytes"] == mem["deltanet_state_bytes"] + CTX * mem["kv_bytes_per_token"]["int4"]
    # ONNX Runtime's int4 cache is not the same-rounding reference to float order (its logits sit 0.025 logit
    # standard deviations from this program's, a near-uniform shift; measured 2026-11-23), but close to it
    et, ox = open_bundle(bundle), open_bundle(tiny_kv("int4"))
    text = _text_ids(tiny_kv("int4"), 60)
    for n in (1, 2 * CHUNK + 5):
        a = np.stack([et.prefill(text[:n])] + [et.decode(t) for t in text[n : n + 8]])
        b = np.stack([ox.prefill(text[:n])] + [ox.decode(t) for t in text[n : n + 8]])
        assert (np.abs(a - b) / b.std(-1, keepdims=True)).max() <= 5 * ROUNDED_REFERENCE_REL, n


@pytest.mark.slow
def test_executorch_fp16_kv_bundle_verifies_and_runs_in_the_text_runner(tiny_pte_kv, tiny_kv):
    """An fp16 cache under fp32 activations: verified within the fp32+kv-fp16 row against the reference whose keys
    and values are rounded to fp16; half the fp32 cache's bytes; greedy tokens equal the fp32-KV (ONNX) bundle's;
    and ExecuTorch's own TextLLMRunner gives deltaship's greedy text for the fp16 and the int4 cache."""
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.commands import generate
    from deltaship.runtimes.et_runner import generate_with_runner
    from deltaship.targets import open_bundle, tolerance

    bundle = tiny_pte_kv("fp16")
    m = read_manifest(bundle)
    assert not schema_problems(m)
    v = m["verification"]
    assert v["status"] == "passed" and v["tolerance"] == tolerance("executorch", "fp32", "fp16").__dict__
    assert "rounded to fp16" in v["reference"] and all("kl_divergence" in r for r in v["prompts"])
    kv = [s for s in m["states"] if s["kind"].startswith("kv_cache")]
    assert kv and all(s["dtype"] == "float16" and s["shape"][1] == CTX for s in kv)
    mem = m["memory"]
    assert mem["kv_dtype"] == "fp16" and mem["kv_bytes_per_token"]["fp16"] * 2 == mem["kv_bytes_per_token"]["fp32"]
    assert m["state_bytes"] == mem["deltanet_state_bytes"] + CTX * mem["kv_bytes_per_token"]["fp16"]
    fp, half = open_bundle(tiny_kv("fp32")), open_bundle(bundle)
    text = _text_ids(bundle, 60)
    for n in (1, 2 * CHUNK + 5):
        assert half.generate(text[:n], 24).output_ids == fp.generate(text[:n], 24).output_ids, n
    prompt = "def "
    for b in (bundle, tiny_pte_kv("int4")):
        ours, theirs = generate(b, prompt=prompt, max_new_tokens=16), generate_with_runner(b, prompt, max_new_tokens=16)
        assert theirs["text"] == ours["text"] and len(ours["text"].strip()) >= 8, (b.name, theirs["text"], ours["text"])


@pytest.mark.slow
def test_executorch_int8_kv_bundle_verifies_and_matches_onnx_int8(tiny_pte_int8_kv, tiny_kv):
    """Verified at export within the fp32+kv-int8 row; the cache is int8 in the manifest; and with the same
    calibration (same reference, same prompt, so the same scales) it gives the ONNX int8 bundle's logits."""
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.targets import open_bundle, tolerance

    m = read_manifest(tiny_pte_int8_kv)
    assert not schema_problems(m)
    v = m["verification"]
    assert v["status"] == "passed" and v["tolerance"] == tolerance("executorch", "fp32", "int8").__dict__
    kv = [s for s in m["states"] if s["kind"].startswith("kv_cache")]
    assert kv and all(s["dtype"] == "int8" and s["shape"][1] == CTX for s in kv)  # ExecuTorch's [1, S, Hkv, D]
    assert m["memory"]["kv_dtype"] == "int8"
    assert m["state_bytes"] == m["memory"]["deltanet_state_bytes"] + CTX * m["memory"]["kv_bytes_per_token"]["int8"]
    et, ox = open_bundle(tiny_pte_int8_kv), open_bundle(tiny_kv("int8"))
    text = _text_ids(tiny_kv("int8"), 60)
    for n in (1, 7, 2 * CHUNK + 5):
        a = np.stack([et.prefill(text[:n])] + [et.decode(t) for t in text[n : n + 8]])
        b = np.stack([ox.prefill(text[:n])] + [ox.decode(t) for t in text[n : n + 8]])
        assert (np.abs(a - b) / b.std(-1, keepdims=True)).max() <= ROUNDED_REFERENCE_REL, n


@pytest.mark.slow
def test_executorch_int8_kv_greedy_tokens_equal_the_fp32_kv_bundle(tiny_pte_int8_kv, tiny_pte):
    from deltaship.targets import open_bundle

    fp, q8 = open_bundle(tiny_pte("fp32")), open_bundle(tiny_pte_int8_kv)
    from deltaship.bundle import read_manifest
    from deltaship.check.evaluate import eval_tokens

    text, _ = eval_tokens(tiny_pte_int8_kv, read_manifest(tiny_pte_int8_kv), 60)
    for n in (1, 7, 2 * CHUNK + 5):
        want = fp.generate(text[:n], 24).output_ids
        assert len(want) >= 8
        assert q8.generate(text[:n], 24).output_ids == want, f"prompt of {n} tokens"
