"""One typed path from option to artifact: ExportSettings built once (from export()'s arguments; the CLI passes
its flags as those arguments), frozen; the lowering's LoweringSettings frozen behind ExportContext; the KV cache's
plan in one form from parse to manifest; a caller can leave the fidelity eval out."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from deltaship.compile import ExportOptions, UnknownExportOption, build_settings, export, export_options
from deltaship.compile.settings import EXPORT_OPTIONS
from deltaship.compile.steps import lowering_settings
from deltaship.errors import DeltashipError
from deltaship.lowering.settings import STATIC_SCALES, KvCachePlan
from deltaship.models.presets import PRESETS
from deltaship.targets import get_target


@pytest.mark.parametrize(
    "dtype,activations,narrower,scheme",
    [
        ("fp32", "float32", False, None),
        ("fp16", "float32", True, None),  # ExecuTorch's fp16 cache under fp32 activations
        ("fp16", "float16", False, None),
        ("fp32", "float16", False, None),  # wider than the activations is not narrower
        ("int8", "float32", True, STATIC_SCALES),
        ("int4", "float32", True, STATIC_SCALES),
    ],
)
def test_kv_cache_plan_says_once_whether_the_cache_is_narrower(dtype, activations, narrower, scheme):
    plan = KvCachePlan.plan(dtype, activations)
    assert (plan.dtype, plan.narrower, plan.scheme, plan.quantized) == (dtype, narrower, scheme, scheme is not None)


def test_settings_are_typed_frozen_and_checked_when_built():
    s = build_settings("qwen3.5-tiny", "out", target="onnx", precision="int4", kv_cache=None, onnx_activations="fp16")
    assert isinstance(s.options, get_target("onnx").Options) and s.options.onnx_activations == "fp16"
    assert s.activation_dtype == "float16" and s.kv == KvCachePlan("fp16", False)  # the target's own cache
    assert s.checks.verify and s.checks.fidelity
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.precision = "fp32"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.options.onnx_activations = "fp32"
    with pytest.raises(DeltashipError, match="--kv-cache int8 is not available for --target coreml"):
        build_settings("qwen3.5-tiny", "out", target="coreml", kv_cache="int8")
    with pytest.raises(DeltashipError, match="--mtp-draft-vocab shapes the multi-token-prediction draft head"):
        build_settings("qwen3.5-tiny", "out", mtp_draft_vocab="64")
    plan = build_settings("qwen3.5-tiny", "out", mtp=True, mtp_draft_vocab="64").draft_vocab
    assert (plan.size, plan.text) == (64, None)


def test_the_context_takes_no_setting_after_it_is_built():
    from deltaship.lowering.passes import ExportContext

    s = build_settings("qwen3.5-tiny", "out", kv_cache="int8", max_context=64, verify=False)
    lowering = lowering_settings(s, PRESETS["qwen3.5-tiny"].spec(), 64, 64, None)
    ctx = ExportContext(lowering)
    assert (ctx.kv, str(ctx.dtype), ctx.options) == (s.kv, "torch.float32", s.options)
    for name, value in (("precision", "fp16"), ("kv", None), ("draft_ids", None), ("options", None)):
        with pytest.raises(AttributeError):
            setattr(ctx, name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lowering.prefill_chunk = 8


def test_the_cli_passes_its_flags_as_exports_arguments():
    from deltaship.cli import build_parser, export_arguments

    a = build_parser().parse_args(
        ["export", "--model", "qwen3.5-tiny", "--out", "o", "--no-fidelity", "--tiers", "t.toml", "--onnx-opset", "27"]
    )
    args = export_arguments(a)
    params = {n for n, p in inspect.signature(export).parameters.items() if p.kind is not p.VAR_KEYWORD}
    # every keyword of export() and every ExportOptions field (its **options), and only the target option given
    assert set(args) == params | set(EXPORT_OPTIONS) | {"onnx_opset"}
    assert (args["fidelity"], args["verify"], args["progress"], args["tiers_file"]) == (False, True, True, "t.toml")
    assert args["onnx_opset"] == 27
    # the flags the user did not give are ExportOptions' defaults: one list of defaults for the API and the CLI
    assert {k: args[k] for k in EXPORT_OPTIONS if k != "fidelity"} == {
        f.name: f.default for f in dataclasses.fields(ExportOptions) if f.name != "fidelity"
    }


def test_export_and_build_settings_take_the_one_list_of_options():
    """export() and build_settings() declare no option of their own: both take ExportOptions' fields (and the
    targets' options) as keyword arguments, so their names and defaults are written once; an unknown name is one
    typed error (a DeltashipError, and the TypeError a Python caller expects) naming both lists, before any work."""
    for fn in (export, build_settings):
        declared = set(inspect.signature(fn).parameters) - {"model", "out", "options", "device", "tiers_file"}
        assert declared <= {"progress"}, (fn.__name__, declared)
        assert not declared & set(EXPORT_OPTIONS)
    s = build_settings("qwen3.5-tiny", "out", precision="int4", block_size=64, verify=False, onnx_opset=27)
    assert (s.precision, s.block_size, s.checks.verify, s.options.onnx_opset) == ("int4", 64, False, 27)
    for fn, args in ((build_settings, ("qwen3.5-tiny", "out")), (export, ("qwen3.5-tiny", "never-written"))):
        with pytest.raises(UnknownExportOption, match="unknown export option 'precison'.*options: target, precision"):
            fn(*args, precison="int4", progress=False) if fn is export else fn(*args, precison="int4")
    assert issubclass(UnknownExportOption, TypeError) and issubclass(UnknownExportOption, DeltashipError)
    opts, target = export_options({"kv_cache": "int8", "mtp": True})
    assert (opts, target) == (ExportOptions(kv_cache="int8"), {"mtp": True})


def test_the_kv_plan_reaches_the_manifest_in_one_form(tmp_path):
    m = export("qwen3.5-tiny", tmp_path / "b", kv_cache="int8", max_context=64, verify=False, progress=False)
    plan = KvCachePlan.plan("int8", "float32")
    kv = [s for s in m["states"] if s["kind"].startswith("kv_cache")]
    assert kv and all(s["quantization"]["scheme"] == plan.scheme and s["dtype"] == "int8" for s in kv)
    assert m["memory"]["kv_dtype"] == plan.dtype and m["lowering"]["kv_quantization"]["kv_dtype"] == plan.dtype


def test_fidelity_false_verifies_without_the_fidelity_eval(tmp_path):
    m = export("qwen3.5-tiny", tmp_path / "b", max_context=64, fidelity=False, progress=False)
    assert m["verification"]["status"] == "passed" and "fidelity" not in m


def test_the_manifest_names_the_float_kv_dtype_the_lowering_stored():
    """ExecuTorch at fp16 keeps its KV states in fp32 while its plan's default is fp16: the memory block's kv_dtype is
    what the states hold (a plan is only taken at its word for a quantized cache, whose states are integer codes)."""
    from types import SimpleNamespace

    from deltaship.compile.manifest import memory
    from deltaship.lowering.settings import KvCachePlan
    from deltaship.models.presets import get_preset
    from deltaship.targets import get_target

    spec = get_preset("qwen3.5-tiny").spec()
    states = [
        {"kind": "deltanet_conv", "dtype": "float16"},
        {"kind": "kv_cache_key", "dtype": "float32"},
        {"kind": "kv_cache_value", "dtype": "float32"},
    ]
    fp16_plan = SimpleNamespace(spec=spec, kv=KvCachePlan.plan("fp16", "float16"))
    assert memory(fp16_plan, states, get_target("executorch"))["kv_dtype"] == "fp32"
    int8 = [dict(s, dtype="int8") if s["kind"].startswith("kv") else s for s in states]
    int8_plan = SimpleNamespace(spec=spec, kv=KvCachePlan.plan("int8", "float32"))
    assert memory(int8_plan, int8, get_target("executorch"))["kv_dtype"] == "int8"
