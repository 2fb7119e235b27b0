"""Export passes, weight fix-ups, lowering coverage, the bundle contract and its safety rules."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import export_context

from deltaship.bundle import SCHEMA_VERSION, read_manifest, schema_problems
from deltaship.compile import build_settings, export
from deltaship.errors import DeltashipError
from deltaship.lowering.passes import ExportContext, PassError, run_pipeline
from deltaship.lowering.weight_plan import PlanError, WeightPlan
from deltaship.models import qwen3_5 as fam
from deltaship.models.ops import CANONICAL_OPS
from deltaship.models.presets import PRESETS
from deltaship.models.weights import RandomWeights
from deltaship.targets import all_targets, get_target, open_bundle

PIPELINE = get_target("onnx").pipeline()


# ---- fix-ups and the plan ------------------------------------------------------------------------
def test_fixups_are_pure_and_correct():
    w = np.array([0.5, -0.25], np.float32)
    assert np.array_equal(fam.fold_zero_centred_norm(w), [1.5, 0.75]) and np.array_equal(w, [0.5, -0.25])
    np.testing.assert_allclose(fam.decay_scale_from_a_log(np.log(np.array([2.0, 4.0]))), [-2.0, -4.0])
    assert fam.squeeze_conv_weight(np.zeros((6, 1, 4))).shape == (6, 4)


def test_applying_a_fixup_twice_is_caught():
    plan = WeightPlan()
    plan.add_source("n.weight", "n.weight", (4,))
    plan.add_fixup("n.weight", "fold_zero_centred_norm", fam.fold_zero_centred_norm)
    with pytest.raises(PlanError, match="already applied"):
        plan.add_fixup("n.weight", "fold_zero_centred_norm", fam.fold_zero_centred_norm)


def test_running_the_fold_pass_twice_fails_naming_the_passes():
    ctx = export_context_only(PIPELINE[:2])
    with pytest.raises(PassError, match="fold_zero_centred_norms.*after: load_structure, fold_zero_centred_norms"):
        run_pipeline(ctx, PIPELINE[1:2])


def export_context_only(passes):
    from deltaship.compile.steps import lowering_settings

    settings = build_settings("qwen3.5-tiny", "unused", max_context=64, verify=False)
    lowering = lowering_settings(settings, PRESETS["qwen3.5-tiny"].spec(), 64, 64, None)
    return run_pipeline(ExportContext(lowering), passes)


# ---- structure after the passes ---------------------------------------------------------------
def test_structure_after_passes():
    ctx = export_context_only(PIPELINE)
    spec = ctx.spec
    kinds = {type(m) for m in ctx.model.modules()}
    assert not kinds & {fam.SourceGatedDeltaNet, fam.SourceAttention, fam.ZeroCentredRMSNorm}
    counts = {r["pass"]: r["counts"] for r in ctx.report}
    assert counts["rewrite_deltanet"]["deltanet_layers_rewritten"] == len(spec.deltanet_layers)
    assert counts["static_kv_cache"]["attention_layers_rewritten"] == len(spec.attention_layers)
    assert counts["fold_zero_centred_norms"]["norms_folded"] == 2 * spec.num_layers + 1 + 2 * len(spec.attention_layers)
    assert counts["capture"]["gated_delta_rule"] == len(spec.deltanet_layers)
    # every state has an input and an output, in the program and in the contract
    sig = ctx.program.graph_signature
    n_user_in = sum(1 for s in sig.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT)
    assert n_user_in == 2 + len(ctx.states) and len(sig.output_specs) == 1 + len(ctx.states)
    assert {s["name"].replace("past.", "") for s in ctx.states} == {
        s["output"].replace("present.", "") for s in ctx.states
    }
    # no token loop: one gated_delta_rule call per DeltaNet layer, whatever the prompt length
    calls = [n for n in ctx.program.graph.nodes if n.target == torch.ops.deltaship.gated_delta_rule.default]
    assert len(calls) == len(spec.deltanet_layers)


def test_every_canonical_op_has_a_lowering_for_every_target():
    from deltaship.lowering.coreml.lowering import MIL_LOWERINGS
    from deltaship.lowering.executorch.lowering import LOWERINGS as ET
    from deltaship.lowering.onnx.lowering import LOWERINGS as ONNX
    from deltaship.lowering.qnn.lowering import QNN_LOWERINGS

    tables = {t.target: t for t in (ONNX, ET, MIL_LOWERINGS, QNN_LOWERINGS)}
    assert set(tables) == {t.name for t in all_targets()}
    for target, table in tables.items():
        missing = table.missing(CANONICAL_OPS.values())
        assert not missing, f"{target} has no lowering for {missing}"
    # and every op the captured program uses has an ONNX lowering
    ctx = export_context_only(PIPELINE)
    used = {n.target for n in ctx.program.graph.nodes if n.op == "call_function"}
    assert not ONNX.missing(used)


def test_unknown_op_fails_naming_it(tmp_path):
    from deltaship.lowering.onnx.lowering import LOWERINGS
    from deltaship.lowering.onnx.model import lower

    ctx = export_context_only(PIPELINE)
    saved = LOWERINGS.pop(torch.ops.aten.sigmoid.default)
    try:
        with pytest.raises(DeltashipError, match="no lowering for op aten.sigmoid"):
            lower(ctx, RandomWeights(ctx.spec), tmp_path)
    finally:
        LOWERINGS.add(torch.ops.aten.sigmoid.default, saved)


def test_eager_canonical_model_matches_transformers(checkpoints):
    """The rewritten model itself (before any lowering) against the oracle."""
    from helpers import reference

    from deltaship.lowering.passes import materialize
    from deltaship.models.source import load_source

    ckpt = checkpoints["grouped_values"]
    ctx = export_context(ckpt, "fp32")
    model = materialize(ctx.model, ctx.plan, load_source(str(ckpt)).weights).eval()
    ids = np.random.default_rng(0).integers(0, 150, 40).tolist()
    ref = reference(ckpt)(torch.tensor([ids]), use_cache=False).logits[0].detach()
    states = [torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"])) for s in model.state_specs(torch.float32)]
    with torch.no_grad():
        logits, states = model(torch.tensor([ids[:30]]), torch.tensor([0]), states)
        torch.testing.assert_close(logits[0], ref[29], atol=1e-4, rtol=1e-4)
        for t in range(30, 40):
            logits, states = model(torch.tensor([[ids[t]]]), torch.tensor([t]), states)
            torch.testing.assert_close(logits[0], ref[t], atol=1e-4, rtol=1e-4)


# ---- the bundle --------------------------------------------------------------------------------
def test_manifest_contract(bundles, checkpoints):
    path = bundles("grouped_values", verify=True)
    m = read_manifest(path)
    assert m["schema"] == "deltaship.bundle" and m["schema_version"] == SCHEMA_VERSION
    assert not schema_problems(m)
    assert m["model_card"] == {
        "source_repo": None,
        "revision": None,
        "license": None,
        "base_model": None,
        "weights": "checkpoint",
    }
    assert m["target"] == "onnx" and m["precision"] == "fp32" and m["max_context"] == 128
    assert m["source"]["kind"] == "checkpoint" and len(m["source"]["sha256"]) == 64
    kinds = [s["kind"] for s in m["states"]]
    assert kinds.count("deltanet_recurrent") == 3 and kinds.count("kv_cache_key") == 2
    for s in m["states"]:
        assert {"name", "output", "shape", "dtype", "layer", "kind", "init", "reset"} <= set(s)
        if s["kind"] == "deltanet_recurrent":
            assert s["shape"] == [1, 6, 8, 8] and s["dtype"] == "float32"
        if s["kind"] == "kv_cache_key":
            assert s["shape"] == [1, 1, 128, 16]
    assert m["tokens"]["eos"] == [159]
    assert set(m["files"]) >= {"model.onnx", "config.json"} - {"config.json"}
    assert all(len(f["sha256"]) == 64 for f in m["files"].values())
    assert [p["pass"] for p in m["passes"]][:3] == ["load_structure", "fold_zero_centred_norms", "rewrite_deltanet"]
    v = m["verification"]
    assert v["status"] == "passed" and v["max_rel_logit_diff"] < 1e-3 and "onnxruntime" in v["runtime"]
    assert {"torch", "onnx", "onnxruntime", "transformers"} <= set(m["tools"])
    # the ONNX graph's inputs/outputs are exactly the manifest's
    import onnx

    g = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    pair = ["current_sequence_length", "past_sequence_length"]
    assert [i.name for i in g.input] == ["input_ids", *pair] + [s["name"] for s in m["states"]]
    assert [o.name for o in g.output] == ["logits"] + [s["output"] for s in m["states"]]
    assert [i["name"] for i in m["inputs"]] == ["input_ids", *pair] and [i["kind"] for i in m["inputs"]][1:] == pair
    # onnxruntime-genai's contract: its sequence-length pair (int32 [1], [1, 1]), logits of the last token [1, 1, V]
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in [*g.input, *g.output]}
    assert dims["current_sequence_length"] == [1] and dims["past_sequence_length"] == [1, 1]
    assert {v.name: v.type.tensor_type.elem_type for v in g.input}["current_sequence_length"] == onnx.TensorProto.INT32
    assert dims["logits"] == [1, 1, 160]
    assert m["outputs"][0]["shape"] == [1, 1, 160]
    ops = {n.op_type for n in g.node}
    assert {"LinearAttention", "LinearAttentionGate", "GroupQueryAttention"} <= ops
    # default lowering: conv and output norm in standard ops (ORT's contrib kernels for them are slower)
    assert not ops & {"CausalConvWithState", "GatedRMSNorm"} and m["lowering"]["deltanet_ops"]["mode"] == "standard"


def test_existing_output_is_not_overwritten_without_force(bundles, tmp_path, checkpoints):
    out = tmp_path / "b"
    shutil.copytree(bundles("base"), out)
    before = (out / "manifest.json").read_text()
    with pytest.raises(DeltashipError, match="already exists.*nothing was written"):
        export(str(checkpoints["base"]), out, max_context=64, progress=False, verify=False)
    assert (out / "manifest.json").read_text() == before
    export(str(checkpoints["base"]), out, max_context=64, progress=False, verify=False, force=True)
    assert read_manifest(out)["max_context"] == 64


def test_failed_export_leaves_nothing(tmp_path, checkpoints, monkeypatch):
    """A wrong fix-up makes the fp32 bundle disagree with transformers: export fails, nothing is left."""
    monkeypatch.setattr(fam, "fold_zero_centred_norm", lambda w: w + 1.01)
    out = tmp_path / "bad"
    with pytest.raises(DeltashipError, match="verification failed"):
        export(str(checkpoints["base"]), out, max_context=64, progress=False)
    assert not out.exists()
    assert not list(tmp_path.iterdir()), "the staging directory must be removed"


def test_tampered_bundle_is_detected(bundles, tmp_path):
    out = tmp_path / "t"
    shutil.copytree(bundles("base"), out)
    data = bytearray((out / "model.onnx").read_bytes())
    data[-10] ^= 0xFF
    (out / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(DeltashipError, match="tampered.*model.onnx: sha256 mismatch"):
        open_bundle(out)
    from deltaship.commands import inspect

    info = inspect(out)
    assert not info["intact"] and "model.onnx" in info["problems"][0]


def test_option_combinations_are_checked_before_work(tmp_path):
    cases = [
        ({"target": "tflite"}, "unknown --target"),
        ({"precision": "int3"}, "unknown --precision"),
        ({"deltanet_int8": True}, "needs --precision int4"),
        ({"block_size": 48}, "power of two"),
        ({"max_context": 10**7}, "exceeds the model's max_position_embeddings"),
        ({"accuracy_level": 0}, "applies to ONNX int8/int4"),
        ({"target": "coreml", "onnx_deltanet_ops": "contrib"}, "applies to --target onnx, not coreml"),
        ({"onnx_deltanet_ops": "fused"}, "must be standard or contrib"),
        ({"onnx_activations": "fp16"}, "applies to int8/int4 weights"),
        ({"onnx_activations": "fp32", "precision": "fp16"}, "applies to int8/int4 weights"),
        ({"onnx_activations": "bf16", "precision": "int4"}, "must be fp32 or fp16"),
        ({"target": "executorch", "precision": "int4", "onnx_activations": "fp16"}, "applies to --target onnx"),
        ({"coreml_statez": "io"}, "unknown export option 'coreml_statez'"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(DeltashipError, match=msg):
            export("qwen3.5-tiny", tmp_path / "x", progress=False, **kwargs)
        assert not (tmp_path / "x").exists()


def test_export_preset_without_checkpoint(tmp_path):
    m = export("qwen3.5-tiny", tmp_path / "tiny", max_context=64, progress=False)
    assert m["source"]["kind"] == "preset" and m["verification"]["status"] == "passed"
    assert "tokenizer.json" in m["files"]
    assert json.loads((tmp_path / "tiny" / "manifest.json").read_text())["files"] == m["files"]


def test_external_data_bundle_runs_and_verifies(tmp_path, checkpoints):
    """Models over 2 GB keep their weights in model.onnx.data; forced here on a tiny one."""
    m = export(str(checkpoints["grouped_values"]), tmp_path / "ext", max_context=64, progress=False, external_data=True)
    assert m["lowering"]["external_data"] and "model.onnx.data" in m["files"]
    assert m["files"]["model.onnx"]["bytes"] < 200_000 < m["files"]["model.onnx.data"]["bytes"]
    assert m["verification"]["status"] == "passed"
    s = open_bundle(tmp_path / "ext")
    assert len(s.generate([1, 2, 3], 4, stop_at_eos=False).output_ids) == 4


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_large_tables_are_streamed_in_row_blocks(tmp_path, checkpoints, monkeypatch, precision):
    """Tables over ROW_BLOCK rows (embedding, LM head) are converted and written a block of rows at a
    time; forced here with small blocks (the untied head and the embedding of `grouped_values`)."""
    from deltaship.lowering.onnx import lowering

    monkeypatch.setattr(lowering, "ROW_BLOCK", 48)
    calls = []
    real = lowering.Lowerer._rows
    monkeypatch.setattr(lowering.Lowerer, "_rows", lambda self, fqn, rows: calls.append(rows) or real(self, fqn, rows))
    m = export(
        str(checkpoints["grouped_values"]),
        tmp_path / "s",
        precision=precision,
        max_context=64,
        progress=False,
        external_data=True,
    )
    assert m["verification"]["status"] == "passed"
    assert len(calls) >= 2 * 4 and all(r.stop - r.start == 48 for r in calls)  # 160 rows -> 4 blocks, 2 tables


def test_a_checkpoint_without_an_eos_id_exports_to_onnx_without_genai(tmp_path):
    """No EOS id in config.json, generation_config.json or the tokenizer: genai_config.json needs one, so it is
    left out (one notice), the manifest's app_runtimes says why, and the bundle runs in deltaship's runtime."""
    from helpers import write_checkpoint

    from deltaship.runtimes.genai import open_genai

    ckpt = write_checkpoint("base", tmp_path / "ckpt", eos_token_id=None)
    gen = ckpt / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g.pop("eos_token_id", None)
        gen.write_text(json.dumps(g))
    # a model card whose widget gives the example prompt: recorded as the manifest's sample_prompt
    (ckpt / "README.md").write_text("---\nlicense: mit\nwidget:\n- text: 'import os'\n---\n# tiny\n")
    said: list[str] = []
    m = export(
        str(ckpt),
        tmp_path / "b",
        target="onnx",
        max_context=64,
        prefill_chunk=8,
        verify=False,
        progress=lambda msg, inline=False: said.append(msg),
    )
    assert m["tokens"]["eos"] == [] and schema_problems(m) == []
    assert m["sample_prompt"] == "import os" and m["model_card"]["license"] == "mit"
    assert not (tmp_path / "b" / "genai_config.json").exists() and "genai_config.json" not in m["files"]
    assert "genai" not in m["lowering"] or m["lowering"]["genai"]["config"] is None
    why = m["app_runtimes"]["onnxruntime-genai"]
    assert why.startswith("unavailable: the checkpoint names no EOS token id") and "eos_token_id" in why
    assert set(m["app_runtimes"]) >= {"onnxruntime", "onnxruntime-web", "onnxruntime-node"}  # the others stay
    notices = [s for s in said if "genai_config.json" in s]
    assert len(notices) == 1 and "\n" not in notices[0], said
    out = open_bundle(tmp_path / "b").generate([1, 2, 3], 5)
    assert len(out.output_ids) == 5
    with pytest.raises(DeltashipError, match="onnxruntime-genai cannot run this bundle: the checkpoint names no EOS"):
        open_genai(tmp_path / "b")
