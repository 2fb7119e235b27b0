"""Long context: RoPE scaling (YaRN) read from the checkpoint, the context limit it implies, and the memory
arithmetic per context token (KV cache by KV dtype, fixed DeltaNet state) the planner searches over.

The oracle for YaRN is transformers' own Qwen3.5 loaded from the checkpoint directory (from_pretrained), so
deltaship's reading of the config is checked too, not only its lowering.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import reference_greedy, text_config, write_checkpoint

from deltaship.check.verify import compare
from deltaship.errors import DeltashipError
from deltaship.models import qwen3_5 as fam
from deltaship.models.spec import ModelSpec
from deltaship.targets import get_target, target_names, tolerance

# A tiny model pretrained (nominally) on 64 positions, extended 4x by YaRN to 256. partial_rotary_factor 0.5
# gives 4 rotary frequencies, so the ramp keeps some and interpolates others.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
}
YARN_CONTEXT = 256

# rope blocks as checkpoints write them, at the published attention shape (head_dim 256, theta 1e7)
PUBLISHED_ROPE = {
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
ROPE_CASES = {
    "qwen_long_context": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}, 1048576),
    "mscale": (
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32768,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        262144,
    ),
    "explicit_attention_factor_betas_no_truncate": (
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 131072,
            "attention_factor": 1.25,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        262144,
    ),
    "factor_from_context_ratio": (
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 65536},
        262144,
    ),
}


def _published_config(rope: dict | None, max_pos: int, legacy: bool = False) -> dict:
    cfg = dict(
        text_config("base"),
        model_type="qwen3_5_text",
        head_dim=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_pos,
    )
    if legacy:  # old-style: rope_scaling with "type", theta at the top level
        del cfg["rope_parameters"]
        cfg.update(
            rope_theta=1e7,
            partial_rotary_factor=0.25,
            rope_scaling={"type" if k == "rope_type" else k: v for k, v in rope.items()},
        )
    else:
        cfg["rope_parameters"] = dict(PUBLISHED_ROPE, **rope) if rope else dict(PUBLISHED_ROPE, rope_type="default")
    return cfg


def _transformers_rotary(cfg: dict):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    return Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))


def _deltaship_rotary(spec: ModelSpec) -> fam.Rotary:
    rot = fam.Rotary(spec)
    rot.inv_freq = torch.from_numpy(fam.rotary_inv_freq(spec))
    return rot


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_yarn_cos_sin_are_transformers_bits(case, legacy):
    rope, max_pos = ROPE_CASES[case]
    cfg = _published_config(rope, max_pos, legacy)
    spec = ModelSpec.from_config(cfg)
    assert spec.rope_type == "yarn" and spec.max_position_embeddings == max_pos
    theirs = _transformers_rotary(cfg)
    assert np.array_equal(fam.rotary_inv_freq(spec), theirs.inv_freq.numpy())  # bit for bit
    assert fam.rotary_attention_factor(spec) == theirs.attention_scaling
    # cos/sin at positions around the original context and at the far end of the extended one
    for start in (0, spec.rope_original_max_position_embeddings - 3, max_pos - 8):
        ours = _deltaship_rotary(spec)(torch.tensor([start]), 8, torch.float32)
        ref = theirs(torch.zeros(1), torch.arange(start, start + 8)[None])
        for a, b in zip(ours, ref):
            np.testing.assert_array_equal(a[0, :, 0].numpy(), b[0].numpy())


def test_unscaled_rope_keeps_the_default_frequencies_and_no_factor():
    spec = ModelSpec.from_config(_published_config(None, 262144))
    assert spec.rope_type == "default" and fam.rotary_attention_factor(spec) == 1.0
    rot = spec.rotary_dim
    np.testing.assert_allclose(fam.rotary_inv_freq(spec), 1e7 ** -(np.arange(0, rot, 2) / rot), rtol=1e-6)
    assert fam.Rotary(spec).attention_factor == 1.0


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "longrope", "llama3"])
def test_unsupported_rope_type_names_the_config_key(key, rope_type):
    cfg = _published_config(None, 262144)
    cfg[key] = dict(PUBLISHED_ROPE, rope_type=rope_type, factor=2.0)
    with pytest.raises(
        DeltashipError,
        match=rf"{key}\.rope_type '{rope_type}' is not supported; supported: "
        r"default, yarn",
    ) as e:
        ModelSpec.from_config(cfg)
    assert "yarn" in e.value.fix


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"factor": 0.5}, "factor must be at least 1"),
        ({"beta_fast": "fast"}, "beta_fast must be a positive number"),
        ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ({"truncate": "yes"}, "truncate must be true or false"),
    ],
)
def test_bad_yarn_fields_are_named(bad, match):
    cfg = _published_config(dict(ROPE_CASES["qwen_long_context"][0], **bad), 1048576)
    with pytest.raises(DeltashipError, match=match):
        ModelSpec.from_config(cfg)


def test_context_past_max_position_embeddings_says_how_to_extend_it():
    plain = ModelSpec.from_config(_published_config(None, 262144))
    plain.check_context(262144)
    with pytest.raises(DeltashipError, match=r"max_position_embeddings \(262144.*no RoPE scaling.*rope_type") as e:
        plain.check_context(262145)
    assert "rope_parameters.rope_type: yarn" in e.value.fix and "original_max_position_embeddings 262144" in e.value.fix
    yarn = ModelSpec.from_config(_published_config(ROPE_CASES["qwen_long_context"][0], 1048576))
    yarn.check_context(1048576)
    with pytest.raises(DeltashipError, match=r"max_position_embeddings \(1048576.*YaRN.*factor 4") as e:
        yarn.check_context(1048577)
    assert "--max-context 1048576 or less" in e.value.fix


def test_export_refuses_a_context_the_rope_does_not_cover(tmp_path):
    from deltaship.compile import export

    with pytest.raises(
        DeltashipError,
        match=r"--max-context 4097 exceeds the model's max_position_embeddings "
        r"\(4096.*no RoPE scaling",
    ):
        export("qwen3.5-tiny", tmp_path / "b", max_context=4097, progress=False, verify=False)
    assert not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    return write_checkpoint(
        "base",
        tmp_path_factory.mktemp("yarn") / "ckpt",
        seed=7,
        max_position_embeddings=YARN_CONTEXT,
        rope_parameters=dict(YARN),
    )


@pytest.fixture(scope="module")
def yarn_oracle(yarn_checkpoint):
    """transformers reading the checkpoint itself (not deltaship's hf_config), fp32."""
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(yarn_checkpoint, dtype=torch.float32).eval()


def test_reference_model_applies_the_checkpoint_yarn(yarn_checkpoint, yarn_oracle):
    from helpers import reference

    ours = reference(yarn_checkpoint)  # the model export verification compares against
    ids = torch.tensor([np.random.default_rng(0).integers(0, 150, 120).tolist()])
    with torch.no_grad():
        np.testing.assert_allclose(ours(ids).logits.numpy(), yarn_oracle(ids).logits.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", [t for t in target_names() if "fp32" in get_target(t).precisions])
def test_yarn_bundle_matches_transformers_past_the_original_context(target, yarn_checkpoint, yarn_oracle, tmp_path):
    """~100-token prompt + 32 greedy steps reaches position 132, twice the original 64 positions."""
    from deltaship.compile import export
    from deltaship.targets import open_bundle

    out = tmp_path / f"yarn-{target}"
    manifest = export(
        str(yarn_checkpoint),
        out,
        target=target,
        precision="fp32",
        max_context=YARN_CONTEXT,
        prefill_chunk=32,
        verify=False,
        progress=False,
    )
    assert manifest["model"]["rope_type"] == "yarn" and manifest["model"]["rope_factor"] == 4.0
    prompt = np.random.default_rng(1).integers(0, 150, 100).tolist()
    ref_tokens, ref_rows = reference_greedy(yarn_oracle, prompt, 32)
    gen = open_bundle(out).generate(prompt, 32, stop_at_eos=False, keep_logits=True)
    tol = tolerance(target, "fp32")
    res = compare(np.stack(gen.logits), ref_rows, ref_tokens, tol.tie_margin)
    assert res["max_rel_logit_diff"] <= tol.max_rel_logit_diff, res
    assert gen.output_ids == ref_tokens
    # The comparison can tell: the same weights without YaRN give logits outside the tolerance.
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = dict(
        text_config("base"),
        max_position_embeddings=YARN_CONTEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    plain = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).eval()
    plain.load_state_dict(yarn_oracle.state_dict())
    _, plain_rows = reference_greedy(plain, prompt, 32)
    assert compare(plain_rows, ref_rows, ref_tokens, tol.tie_margin)["max_rel_logit_diff"] > tol.max_rel_logit_diff


def test_executorch_layout_applies_the_attention_factor_on_rotary_channels_only():
    """XnnpackRotary's full-width cos/sin (and the rotate-half matmul) equal the canonical partial rotary."""
    from deltaship.lowering.executorch.modules import (
        XnnpackRotary,
        full_width_cos_scale,
        full_width_inv_freq,
        rotate_half_matrix,
    )

    spec = ModelSpec.from_config(_published_config(ROPE_CASES["mscale"][0], 262144))
    assert fam.rotary_attention_factor(spec) != 1.0
    xr = XnnpackRotary(spec)
    assert xr.scaled
    xr.inv_freq_full = torch.from_numpy(full_width_inv_freq(spec))
    xr.cos_scale_full = torch.from_numpy(full_width_cos_scale(spec))
    x = torch.randn(1, 6, 2, spec.head_dim)
    pos = torch.tensor([200000])
    cos, sin = xr(pos, 6, torch.float32)
    rotate_half = torch.from_numpy(rotate_half_matrix(spec.head_dim, spec.rotary_dim))
    got = x * cos + torch.nn.functional.linear(x, rotate_half) * sin
    c, s = _deltaship_rotary(spec)(pos, 6, torch.float32)
    want = fam.rotate(x, c, s, spec.rotary_dim)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., spec.rotary_dim :], x[..., spec.rotary_dim :])  # pass-through channels untouched
    plain = ModelSpec.from_config(_published_config(None, 262144))
    assert not XnnpackRotary(plain).scaled and not hasattr(XnnpackRotary(plain), "cos_scale_full")


# ---- the memory arithmetic and the planner's context axis ------------------------------------------------
def test_kv_bytes_per_token_and_deltanet_state_are_the_state_bytes_arithmetic():
    from deltaship.models.presets import PRESETS
    from deltaship.models.spec import KV_DTYPES

    for name, kib in (("qwen3.5-0.8b", 12), ("qwen3.5-9b", 32)):  # QWEN35.md: KV per token at 16 bits
        spec = PRESETS[name].spec()
        assert spec.kv_bytes_per_token("fp16") == kib * 1024
        for ctx in (1, 1000, 262144):
            st = spec.state_bytes(ctx, kv_bytes_per_elem=2, conv_bytes_per_elem=2)
            assert st["total"] == spec.deltanet_state_bytes(2) + ctx * spec.kv_bytes_per_token("fp16")
            assert st["kv_cache"] == ctx * spec.kv_bytes_per_token("fp16")
        assert spec.kv_bytes_per_token("fp32") == 2 * spec.kv_bytes_per_token("fp16")
        # int8/int4: half / a quarter of the fp16 bytes, plus one 4-byte scale per token, KV head, K and V
        scales = len(spec.attention_layers) * 2 * spec.num_key_value_heads * 4
        assert spec.kv_bytes_per_token("int8") == spec.kv_bytes_per_token("fp16") // 2 + scales
        assert spec.kv_bytes_per_token("int4") == spec.kv_bytes_per_token("fp16") // 4 + scales
        block = spec.memory_arithmetic("fp16", 2)
        assert set(block["kv_bytes_per_token"]) == set(KV_DTYPES)
        assert block["deltanet_state_bytes"] == spec.deltanet_state_bytes(2)
    with pytest.raises(DeltashipError, match="unknown KV dtype 'int2'"):
        spec.kv_bytes_per_token("int2")


@pytest.mark.parametrize("config, precision", [("base", "fp32"), ("grouped_values", "fp16"), ("deltanet_only", "fp32")])
def test_manifest_memory_block_adds_up_to_state_bytes(config, precision, bundles):
    from deltaship.bundle import read_manifest, schema_problems

    m = read_manifest(bundles(config, "onnx", precision))
    mem = m["memory"]
    assert not schema_problems(m)
    assert mem["kv_dtype"] == precision
    assert m["state_bytes"] == mem["deltanet_state_bytes"] + m["max_context"] * mem["kv_bytes_per_token"][precision]
    kv = [s for s in m["states"] if s["kind"].startswith("kv_cache")]
    assert (mem["kv_bytes_per_token"]["fp16"] == 0) == (not kv)  # no attention layer, no KV cache


def test_onnx_fp16_kv_records_and_plans_the_attention_kernels_fp32_scratch(bundles):
    """ONNX Runtime's CPU GroupQueryAttention converts the fp16 K/V rows of a head to fp32, one buffer per thread
    (head_dim x context floats): the manifest says so per token and thread, and the planner counts it."""
    from deltaship.bundle import read_manifest
    from deltaship.devices.plan import activation_bytes, estimate, memory_terms
    from deltaship.models.presets import PRESETS

    m = read_manifest(bundles("grouped_values", "onnx", "fp16"))
    assert m["memory"]["kv_scratch_bytes_per_token_per_thread"] == {"fp16": 4 * m["model"]["head_dim"]}
    fp32 = read_manifest(bundles("base", "onnx", "fp32"))  # keyed by KV dtype, like kv_bytes_per_token
    assert fp32["memory"]["kv_scratch_bytes_per_token_per_thread"] == {"fp16": 4 * fp32["model"]["head_dim"]}

    spec, tier, ctx = PRESETS["qwen3.5-0.8b"].spec(), _tier(64), 262144
    row = estimate(spec, tier, "onnx", "fp16", ctx, "fp16")
    assert row.kv_scratch_bytes == ctx * tier.threads * 4 * spec.head_dim  # 1 GiB at 4 threads
    terms = memory_terms("onnx", "fp16")  # measured per target and precision (devices/memory_terms.toml)
    planned = activation_bytes(spec, "onnx", "fp16", ctx, all_layers=terms.measured)
    assert row.activation_bytes == int(planned * terms.activation_factor) + row.kv_scratch_bytes
    assert estimate(spec, tier, "onnx", "int4", ctx, "int8").kv_scratch_bytes == 0
    assert estimate(spec, tier, "executorch", "fp16", ctx, "fp16").kv_scratch_bytes == 0


def test_default_kv_dtype_keeps_todays_state_bytes():
    from deltaship.devices.plan import default_kv_dtype, state_bytes
    from deltaship.models.presets import PRESETS
    from deltaship.targets import get_target

    spec = PRESETS["qwen3.5-0.8b"].spec()
    for tg in target_names():
        for pr in get_target(tg).precisions:
            act = get_target(tg).storage_format(pr).act
            assert default_kv_dtype(tg, pr) == {4: "fp32", 2: "fp16"}[act]
            today = spec.state_bytes(4096, kv_bytes_per_elem=act, conv_bytes_per_elem=act)["total"]
            assert state_bytes(spec, tg, pr, 4096) == today


def _tier(budget_gib: float):
    from deltaship.devices.catalog import GIB, Tier

    return Tier(
        name=f"t{budget_gib}",
        kind="phone",
        ram_bytes=int(64 * GIB),
        budget_bytes=int(budget_gib * GIB),
        targets=("onnx",),
        precisions=("int4",),
        context=2048,
        threads=4,
    )


@pytest.mark.parametrize("kv", ["fp32", "fp16", "int8", "int4"])
def test_longest_context_fits_and_one_more_token_does_not(kv):
    from deltaship.devices.plan import estimate, longest_context
    from deltaship.models.presets import PRESETS

    spec = PRESETS["qwen3.5-0.8b"].spec()
    previous = 0
    for budget in (0.3, 0.6, 0.9, 1.2, 2.0, 3.0, 6.0, 12.0, 40.0):
        tier = _tier(budget)
        row = longest_context(spec, tier, "onnx", "int4", kv)
        assert row.longest and row.kv_dtype == kv
        assert row.context >= previous  # monotone in the budget
        if not row.fits:  # not even one token: the weights alone are over
            assert row.context == 1 and previous == 0
            continue
        again = estimate(spec, tier, "onnx", "int4", row.context, kv)
        assert again.fits and again.total_bytes == row.total_bytes  # the same arithmetic as estimate()
        if row.context < spec.max_position_embeddings:
            assert not estimate(spec, tier, "onnx", "int4", row.context + 1, kv).fits
        else:
            assert row.capped
        previous = row.context
    assert previous == spec.max_position_embeddings  # 40 GiB holds the whole native context


def test_narrower_kv_cache_gives_a_longer_context():
    from deltaship.devices.plan import longest_context
    from deltaship.models.presets import PRESETS

    spec = PRESETS["qwen3.5-0.8b"].spec()
    tier = _tier(1.2)
    ctx = {kv: longest_context(spec, tier, "onnx", "int4", kv).context for kv in ("fp32", "fp16", "int8", "int4")}
    assert ctx["fp32"] < ctx["fp16"] < ctx["int8"] < ctx["int4"], ctx


def test_plan_at_262144_has_a_row_per_kv_dtype_and_says_why_the_phone_does_not_fit():
    from deltaship.devices.plan import format_table, plan, verdicts

    rows = plan("qwen3.5-0.8b", tier="phone-4gb", context=262144)
    for tg in ("executorch", "onnx"):
        for pr in ("fp32", "int8", "int4"):  # these store fp32 activations: all four KV dtypes
            got = {r["kv_dtype"] for r in rows if (r["target"], r["precision"], r["context"]) == (tg, pr, 262144)}
            assert got == {"fp32", "fp16", "int8", "int4"}, (tg, pr, got)
    int8 = [r for r in rows if r["kv_dtype"] == "int8" and r["context"] == 262144]
    assert int8 and not any(r["fits"] for r in int8)
    # ONNX and ExecuTorch export an int8 cache at fp32 activations (static scales: no bytes per token for them);
    # at fp16 activations it is planned, and counted with a scale per token and head
    exportable = {(r["target"], r["precision"]) for r in int8 if r["kv_exportable"]}
    assert {("onnx", "int4"), ("executorch", "int4"), ("onnx", "fp32")} <= exportable
    assert not any(r["kv_exportable"] for r in int8 if r["precision"] == "fp16")
    per_token = {r["kv_exportable"]: r["kv_bytes"] // 262144 for r in int8}
    assert per_token[False] - per_token[True] == 6 * 2 * 2 * 4  # 6 layers x K,V x 2 KV heads x an fp32 scale
    for r in rows:  # the runtime plus the larger of the loaded session with one prefill chunk, and loading's peak
        assert r["total_bytes"] == r["weights_bytes"] + r["state_bytes"] + r["overhead_bytes"]
        assert (
            r["total_bytes"]
            >= r["runtime_bytes"]
            + r["weights_loaded_bytes"]
            + r["kv_bytes"]
            + r["deltanet_bytes"]
            + r["activation_bytes"]
        )
    # the int8 KV cache alone (0.8B: 6240 bytes a token) is more than the 1.2 GiB budget
    assert all(r["kv_bytes"] > r["budget_bytes"] for r in int8)
    (line,) = verdicts(rows)
    assert line.startswith("phone-4gb: nothing fits at context 262144") and "KV cache" in line
    # why not, in numbers: the smallest exportable row (int4 weights, int4 KV) and its parts
    assert "The smallest, onnx int4 with an int4 KV cache at context 262144" in line and "attention scores" in line
    # a smaller prefill chunk reaches a longer context than the target's own chunk (onnx int4/int4 at 32768 did)
    assert "Recommended instead: onnx int4 with an int4 KV cache at context 131072 with --prefill-chunk 256" in line
    assert "int8*" in format_table(rows)  # fp16 activations with an int8 cache: planned


def test_plan_max_context_per_tier_and_the_9b_on_a_12gb_gpu():
    from deltaship.devices.plan import plan, verdicts

    rows = plan("qwen3.5-9b", tier="gpu-12gb", context="max")
    assert rows and all(r["longest"] for r in rows)
    pick = [r for r in rows if r["recommended"]]
    assert len(pick) == 1 and pick[0]["kv_exportable"] and pick[0]["fits"]
    best = max(r["context"] for r in rows if r["fits"] and r["kv_exportable"])
    assert pick[0]["context"] == best
    by_kv = {r["kv_dtype"]: r["context"] for r in rows if r["precision"] == "int4"}
    assert by_kv["fp32"] < by_kv["fp16"] < by_kv["int8"] < by_kv["int4"]
    (line,) = verdicts(rows)
    assert line.startswith(f"gpu-12gb: onnx int4 with an {pick[0]['kv_dtype']} KV cache at context {best}")
    assert pick[0]["kv_dtype"] == "int4"  # the narrowest exported cache reaches furthest
    rows = plan("qwen3.5-9b", tier="gpu-12gb", context="262144")  # the CLI passes a string
    int4 = [r for r in rows if (r["precision"], r["kv_dtype"]) == ("int4", "int4") and r["context"] == 262144]
    # the whole 262,144 tokens fit at the target's own chunk since ONNX's prefill activations were measured again
    # (bundle/node_order.py: a quarter of before); a smaller chunk is planned where they do not: test_plan_at_262144
    assert len(int4) == 1 and int4[0]["fits"] and int4[0]["recommended"] and int4[0]["prefill_chunk"] == 512


@pytest.mark.parametrize("bad, match", [("lots", "must be a number of tokens or max"), (0, "must be positive")])
def test_plan_context_is_checked(bad, match):
    from deltaship.devices.plan import plan

    with pytest.raises(DeltashipError, match=match):
        plan("qwen3.5-0.8b", tier="phone-4gb", context=bad)
    with pytest.raises(DeltashipError, match="unknown KV dtype 'int2'"):
        plan("qwen3.5-0.8b", tier="phone-4gb", context=4096, kv_dtypes=["int2"])


# ---- export(kv_cache=...): what each target can store today, checked before any work ------------------------
@pytest.mark.parametrize(
    "target, precision, options, kv, ok",
    [
        ("onnx", "fp32", {}, "fp32", True),
        ("onnx", "fp16", {}, "fp16", True),
        ("onnx", "int4", {"onnx_activations": "fp16"}, "fp16", True),
        ("onnx", "int4", {}, "fp16", False),
        ("onnx", "fp32", {}, "int8", True),
        ("onnx", "fp16", {}, "int8", False),
        ("executorch", "int8", {}, "fp32", True),
        ("executorch", "fp32", {}, "int4", True),
        ("executorch", "int4", {}, "fp16", True),
        ("executorch", "fp16", {}, "int4", False),
        ("coreml", "int4", {}, "fp16", True),
    ],
)
def test_kv_cache_option_accepts_what_the_target_stores(target, precision, options, kv, ok):
    from deltaship.compile import check_options
    from deltaship.targets import get_target

    if ok:
        typed = check_options(target, precision, None, 32, False, None, options, kv_cache=kv)
        assert kv in get_target(target).kv_cache_dtypes(precision, typed.as_dict())
    else:
        with pytest.raises(
            DeltashipError,
            match=rf"--kv-cache {kv} is not available for --target {target} at "
            rf"--precision {precision}: its KV cache is stored as",
        ) as e:
            check_options(target, precision, None, 32, False, None, options, kv_cache=kv)
        assert "drop --kv-cache" in e.value.fix


def test_kv_cache_option_is_checked_before_work_and_recorded(tmp_path):
    from deltaship.compile import export

    with pytest.raises(DeltashipError, match="unknown --kv-cache 'int2'"):
        export("qwen3.5-tiny", tmp_path / "a", kv_cache="int2", progress=False, verify=False)
    with pytest.raises(DeltashipError, match="--kv-cache int8 is not available"):
        export("qwen3.5-tiny", tmp_path / "a", precision="fp16", kv_cache="int8", progress=False, verify=False)
    assert not (tmp_path / "a").exists()
    m = export(
        "qwen3.5-tiny", tmp_path / "b", precision="fp16", kv_cache="fp16", max_context=64, progress=False, verify=False
    )
    assert m["memory"]["kv_dtype"] == "fp16"
    assert {s["dtype"] for s in m["states"] if s["kind"].startswith("kv_cache")} == {"float16"}


def test_a_context_past_the_native_one_is_capped_and_said():
    from deltaship.devices.plan import plan, verdicts

    native = plan("qwen3.5-0.8b", tier="laptop-16gb", context=262144)
    beyond = plan("qwen3.5-0.8b", tier="laptop-16gb", context=10**6)
    assert not any(r["capped"] for r in native) and all(r["capped"] for r in beyond)
    assert {r["context"] for r in beyond} == {262144}
    assert "max_position_embeddings" not in verdicts(native)[0]
    assert "stops at the model's max_position_embeddings (longer needs YaRN" in verdicts(beyond)[0]
