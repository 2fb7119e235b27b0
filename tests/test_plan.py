"""`deltaship plan` says in words what its table means: the pick and why, or that nothing fits and by how much."""

from __future__ import annotations

import re

import pytest

from deltaship.devices.plan import plan, verdicts
from deltaship.errors import DeltashipError


def test_nothing_fits_is_said_with_numbers():
    (line,) = verdicts(plan("qwen3.5-9b", tier="phone-4gb"))
    assert line.startswith("phone-4gb: nothing fits") and "GiB of a 1.20 GiB budget" in line


def test_the_pick_names_the_preference_and_the_smaller_fits():
    rows = plan("qwen3.5-0.8b", tier="phone-8gb")
    (line,) = verdicts(rows)
    pick = next(r for r in rows if r["recommended"])
    assert line.startswith(f"phone-8gb: {pick['target']} {pick['precision']}")
    assert "fp16 > int8 > int4" in line and "int4 also fits" in line


def test_a_device_tier_picks_what_fits_or_refuses_with_the_plan():
    from deltaship.devices.plan import choose_for_tier
    from deltaship.errors import DeltashipError
    from deltaship.models.presets import PRESETS

    pick = choose_for_tier(PRESETS["qwen3.5-0.8b"].spec(), "phone-8gb")
    rows = plan("qwen3.5-0.8b", tier="phone-8gb")
    rec = next(r for r in rows if r["recommended"])
    assert (pick.target, pick.precision, pick.context) == (rec["target"], rec["precision"], rec["context"])
    fixed = choose_for_tier(PRESETS["qwen3.5-0.8b"].spec(), "phone-8gb", target="onnx", precision="int4")
    assert (fixed.target, fixed.precision) == ("onnx", "int4") and fixed.fits
    try:
        choose_for_tier(PRESETS["qwen3.5-9b"].spec(), "phone-4gb")
    except DeltashipError as e:
        assert "nothing fits tier phone-4gb" in e.message and "GiB" in e.message and "deltaship plan" in e.fix
    else:
        raise AssertionError("the 9B fitted a 4 GB phone")


def test_export_for_a_device_uses_the_pick(tmp_path):
    from deltaship.compile import export

    m = export("qwen3.5-tiny", tmp_path / "b", device="laptop-16gb", target="onnx", verify=False, progress=False)
    assert m["target"] == "onnx" and m["precision"] == "fp16" and m["max_context"] == 4096


def test_vision_tower_in_the_plan():
    import math

    from deltaship.devices.plan import format_vision, vision_plan
    from deltaship.models.presets import PRESETS
    from deltaship.models.vision import VisionSpec, vision_tensors

    assert vision_plan("qwen3.5-tiny") is None  # text only: `plan` prints the text table alone
    vp = vision_plan("qwen3.5-0.8b")
    vs = VisionSpec.from_config(PRESETS["qwen3.5-0.8b"].multimodal_config())
    assert vp["weights_bytes"] == 4 * sum(math.prod(s) for s in vision_tensors(vs).values())
    by = {r["image"]: r for r in vp["images"]}
    # 224 px is below min_pixels (256 x 256): upscaled; 896 px: 56 x 56 patches, 784 tokens; max: 4096 x 4096
    assert by["224"]["resized"] == [256, 256] and by["896"]["patches"] == 3136 and by["896"]["tokens"] == 784
    assert by["max"]["resized"] == [4096, 4096]
    peaks = [r["activation_peak_bytes"] for r in vp["images"]]
    assert peaks == sorted(peaks) and by["896"]["attention_scores_bytes"] == 2 * 12 * 3136**2 * 4
    assert "100.6M parameters" in format_vision(vp)


def test_plan_prints_the_vision_table_only_when_asked_for_a_tower(capsys):
    import json

    from deltaship.cli import main

    assert main(["plan", "--model", "qwen3.5-0.8b", "--tier", "phone-4gb"]) == 0
    out = capsys.readouterr().out  # a text-only user sees the text plan and a one-line pointer
    assert "vision tower:" not in out and "4096x4096" not in out and "--vision adds its vision tower's memory" in out
    assert main(["plan", "--model", "qwen3.5-0.8b", "--tier", "phone-4gb", "--vision"]) == 0
    out = capsys.readouterr().out
    assert "vision tower: 12 blocks x 768" in out and "896x896" in out and "4096x4096" in out
    assert main(["plan", "--model", "qwen3.5-tiny", "--tier", "phone-4gb", "--vision"]) == 2
    assert "--vision: qwen3.5-tiny has no vision tower" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen3.5-0.8b", "--tier", "phone-4gb", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)  # --json: the rows, as for a text-only model
    assert main(["plan", "--model", "qwen3.5-tiny", "--tier", "phone-4gb"]) == 0
    assert "vision tower" not in capsys.readouterr().out


def _tiers_file(tmp_path, budget_bytes: int, context: int, targets=("onnx",), precisions=("int4",)) -> str:
    f = tmp_path / "tiers.toml"
    f.write_text(
        f'[tiers.t]\nkind = "phone"\nram_gib = 64\nbudget_gib = {budget_bytes / 2**30!r}\n'
        f"targets = {list(targets)!r}\nprecisions = {list(precisions)!r}\ncontext = {context}\nthreads = 2\n".replace(
            "'", '"'
        )
    )
    return str(f)


def test_a_device_tier_takes_a_quantized_kv_cache_only_when_the_own_one_does_not_fit(tmp_path):
    from deltaship.devices.catalog import get_tier
    from deltaship.devices.plan import choose_for_tier, estimate
    from deltaship.models.presets import PRESETS

    spec = PRESETS["qwen3.5-0.8b"].spec()
    probe = get_tier("phone-4gb")
    own = estimate(spec, probe, "onnx", "int4", 65536).total_bytes  # fp32 KV: ONNX int4 keeps fp32 activations
    int8 = estimate(spec, probe, "onnx", "int4", 65536, "int8").total_bytes
    int4 = estimate(spec, probe, "onnx", "int4", 65536, "int4").total_bytes
    own_128 = estimate(spec, probe, "onnx", "int4", 65536, None, 128).total_bytes  # the smallest measured chunk
    assert int4 < int8 < own_128 < own
    tight = _tiers_file(tmp_path, (int8 + own_128) // 2, 65536)
    pick = choose_for_tier(spec, "t", tight)
    assert (pick.target, pick.precision, pick.context, pick.kv_dtype) == ("onnx", "int4", 65536, "int8")
    assert pick.fits and pick.kv_exportable
    roomy = _tiers_file(tmp_path, own + 2**30, 65536)
    assert choose_for_tier(spec, "t", roomy).kv_dtype == "fp32"  # the own cache, when it fits
    # the user's --kv-cache is kept, and one the tier's targets cannot store is refused naming the flag
    assert choose_for_tier(spec, "t", roomy, kv_dtype="int4").kv_dtype == "int4"
    try:
        choose_for_tier(spec, "phone-8gb", target="coreml", kv_dtype="int8")
    except DeltashipError as e:
        assert "--kv-cache int8" in e.message and "drop --kv-cache" in e.fix
    else:
        raise AssertionError("Core ML took an int8 KV cache")


def test_device_max_context_is_the_longest_that_fits(tmp_path):
    from deltaship.devices.catalog import get_tier
    from deltaship.devices.plan import choose_for_tier, estimate
    from deltaship.models.presets import PRESETS

    spec = PRESETS["qwen3.5-0.8b"].spec()
    pick = choose_for_tier(spec, "gpu-12gb", context="max")
    rec = next(r for r in plan("qwen3.5-0.8b", tier="gpu-12gb", context="max") if r["recommended"])
    assert (pick.target, pick.precision, pick.context, pick.kv_dtype) == (
        rec["target"],
        rec["precision"],
        rec["context"],
        rec["kv_dtype"],
    )
    tier = get_tier("gpu-12gb")
    assert pick.fits and (
        pick.context == spec.max_position_embeddings
        or not estimate(spec, tier, pick.target, pick.precision, pick.context + 1, pick.kv_dtype).fits
    )


def test_export_for_a_device_writes_the_kv_cache_and_chunk_the_plan_picked(tmp_path, monkeypatch):
    import dataclasses

    from deltaship.compile import export
    from deltaship.devices.catalog import get_tier
    from deltaship.devices.plan import estimate, memory
    from deltaship.models.presets import PRESETS

    # The mechanism under test is export's use of the plan's pick. With ONNX's measured prefill activations (a
    # quarter of the program-order graph's since bundle/node_order.py) the tiny's loading peak hides every chunk, so
    # the test plans with the activation factor measured before, at which the chunk decides (as on a larger model).
    real = memory.memory_terms
    monkeypatch.setattr(
        memory, "memory_terms", lambda *a, **k: dataclasses.replace(real(*a, **k), activation_factor=0.2539)
    )

    spec = PRESETS["qwen3.5-tiny"].spec()
    ctx = spec.max_position_embeddings
    probe = get_tier("phone-4gb")
    # a budget at which the own cache fits at no chunk of 128 or more, an int8 one at 128 but not at 256 (under 128
    # the prefill cost is unmeasured)
    own = estimate(spec, probe, "onnx", "fp32", ctx, None, 128).total_bytes
    int8 = estimate(spec, probe, "onnx", "fp32", ctx, "int8", 128).total_bytes
    int8_256 = estimate(spec, probe, "onnx", "fp32", ctx, "int8", 256).total_bytes
    assert int8 < own and int8 < int8_256
    tiers = _tiers_file(tmp_path, (int8 + min(own, int8_256)) // 2, ctx, precisions=("fp32",))
    m = export("qwen3.5-tiny", tmp_path / "b", device="t", tiers_file=tiers, verify=False, progress=False)
    assert (m["target"], m["precision"], m["max_context"], m["memory"]["kv_dtype"]) == ("onnx", "fp32", ctx, "int8")
    assert m["prefill_chunk"] == 128  # the chunk the plan picked, not the target's 512


def test_max_context_max_needs_a_device(tmp_path):
    from deltaship.cli import main

    with pytest.raises(DeltashipError, match="--max-context max needs --device"):
        from deltaship.compile import export

        export("qwen3.5-tiny", tmp_path / "b", max_context="max", verify=False, progress=False)
    assert not (tmp_path / "b").exists()
    with pytest.raises(SystemExit):  # argparse: neither a number nor max
        main(["export", "--model", "qwen3.5-tiny", "--out", str(tmp_path / "c"), "--max-context", "long"])


def test_plan_table_says_gib_once_and_no_g_suffix():
    from deltaship.devices.plan import format_table

    table = format_table(plan("qwen3.5-0.8b", tier="phone-4gb"))
    lines = table.splitlines()
    assert lines[0] == "memory in GiB" and lines[1].startswith("tier ")
    row = next(ln for ln in lines if ln.startswith("phone-4gb"))
    assert not re.search(r"\d+\.\d\dG\b", table), row  # numbers in the unit the text uses (GiB), no bare G
    assert re.search(r"\s\d+\.\d\d\s+\d+\.\d\d", row)
    widths = {len(ln) for ln in lines[1:] if ln.startswith(("tier ", "phone-4gb"))}
    assert len(lines[2]) == len(lines[1]) and max(widths) - min(widths) <= len("  <- recommended") + 1


def test_the_plan_reaches_the_asked_context_with_a_smaller_prefill_chunk():
    # reported: at 262,144 tokens a 512-token chunk's attention scores are 4 GiB, and the plan halved the context
    from deltaship.devices.catalog import get_tier
    from deltaship.devices.plan import choose_for_tier, estimate
    from deltaship.models.presets import PRESETS
    from deltaship.targets import get_target

    rows = plan("qwen3.5-0.8b", tier="phone-8gb", context=262144)
    pick = next(r for r in rows if r["recommended"])
    default = get_target(pick["target"]).default_prefill_chunk
    assert pick["context"] == 262144 and pick["fits"] and pick["kv_exportable"]
    assert pick["prefill_chunk"] < default
    spec, tier = PRESETS["qwen3.5-0.8b"].spec(), get_tier("phone-8gb")
    args = (spec, tier, pick["target"], pick["precision"], 262144, pick["kv_dtype"])
    assert not estimate(*args, default).fits and estimate(*args, pick["prefill_chunk"]).fits  # the chunk made it fit
    # the largest chunk that fits: twice it does not
    assert not estimate(*args, 2 * pick["prefill_chunk"]).fits
    (line,) = verdicts(rows)
    assert (
        f"at context 262144 with --prefill-chunk {pick['prefill_chunk']} " in line and "Recommended instead" not in line
    )
    assert f"not the target's {default}" in line and "docs/results/executorch.md" in line  # the prefill-speed cost
    chosen = choose_for_tier(spec, "phone-8gb", context=262144)  # export --device picks the same
    assert (chosen.target, chosen.precision, chosen.kv_dtype, chosen.context, chosen.prefill_chunk) == (
        pick["target"],
        pick["precision"],
        pick["kv_dtype"],
        262144,
        pick["prefill_chunk"],
    )
    from deltaship.devices.plan import format_table

    header, row = (
        ln
        for ln in format_table(rows).splitlines()
        if ln.startswith(("tier ", "phone-8gb")) and (ln.startswith("tier ") or "recommended" in ln)
    )
    assert header.split()[5] == "chunk" and row.split()[5] == str(pick["prefill_chunk"])  # the table shows it


def test_a_chunk_below_the_measured_range_comes_after_a_quantized_kv_cache(tmp_path):
    # own KV fits only at a chunk under 128 (unmeasured prefill cost); an int8 KV fits at the default 512: int8 KV
    from deltaship.devices.catalog import get_tier
    from deltaship.devices.plan import choose_for_tier, estimate
    from deltaship.models.presets import PRESETS

    spec, probe, ctx = PRESETS["qwen3.5-0.8b"].spec(), get_tier("phone-4gb"), 65536
    own_64 = estimate(spec, probe, "onnx", "int4", ctx, None, 64).total_bytes
    own_128 = estimate(spec, probe, "onnx", "int4", ctx, None, 128).total_bytes
    int8_512 = estimate(spec, probe, "onnx", "int4", ctx, "int8").total_bytes
    assert int8_512 < own_64 < own_128
    tiers = _tiers_file(tmp_path, (own_64 + own_128) // 2, ctx)
    pick = choose_for_tier(spec, "t", tiers)
    assert (pick.kv_dtype, pick.prefill_chunk, pick.context) == ("int8", 512, ctx)
    # a chunk of 128 or more (measured: a few percent slower) keeps the own KV cache
    tiers = _tiers_file(tmp_path, own_128 + 1, ctx)
    pick = choose_for_tier(spec, "t", tiers)
    assert (pick.kv_dtype, pick.prefill_chunk, pick.context) == ("fp32", 128, ctx)


def test_export_device_options_carry_the_planned_chunk(tmp_path):
    from deltaship.compile.steps import plan_device
    from deltaship.models.presets import PRESETS

    spec = PRESETS["qwen3.5-0.8b"].spec()
    o = plan_device(spec, "phone-8gb", None, None, None, 262144, None, None)
    rec = next(r for r in plan("qwen3.5-0.8b", tier="phone-8gb", context=262144) if r["recommended"])
    assert (o.target, o.precision, o.max_context, o.prefill_chunk) == (
        rec["target"],
        rec["precision"],
        262144,
        rec["prefill_chunk"],
    )
    assert o.kv_cache == rec["kv_dtype"] and f"prefill chunk {rec['prefill_chunk']}" in o.say
    # the target's default chunk fits: left to the target (None); the user's chunk is kept as given
    roomy = plan_device(spec, "gpu-80gb", None, None, None, 4096, None, None)
    assert roomy.prefill_chunk is None and roomy.max_context == 4096
    fixed = plan_device(spec, "phone-8gb", None, None, None, 262144, None, 16)
    assert fixed.prefill_chunk == 16 and fixed.max_context == 262144


def test_the_plan_takes_the_quantization_block():
    """plan --block-size / export --device with --block-size: a block-128 int4 bundle stores a quarter of the scales
    and ONNX Runtime packs fewer bytes per weight (memory_terms.toml's onnx.int4.block128), so its rows plan less;
    rows without blocks (fp32) do not move; the block is checked as export checks it."""
    from deltaship.devices.plan import choose_for_tier
    from deltaship.models.presets import PRESETS

    def rows(block):
        out = plan("qwen3.5-0.8b", tier="phone-4gb", context=1024, targets=["onnx"], block_size=block)
        return {(r["precision"], r["kv_dtype"]): r for r in out}

    b32, b128 = rows(None), rows(128)
    own = ("int4", "fp32")
    assert b128[own]["block_size"] == 128 and "block 128:" in b128[own]["terms"]
    assert b128[own]["weights_bytes"] < b32[own]["weights_bytes"] and b128[own]["total_bytes"] < b32[own]["total_bytes"]
    assert b128[("int8", "int8")]["weights_bytes"] < b32[("int8", "int8")]["weights_bytes"]  # block 128's scales too
    assert b128[("fp32", "fp32")]["total_bytes"] == b32[("fp32", "fp32")]["total_bytes"]
    spec = PRESETS["qwen3.5-0.8b"].spec()
    fixed = dict(target="onnx", precision="int4", context=1024)
    assert choose_for_tier(spec, "phone-4gb", **fixed, block_size=128).total_bytes == b128[own]["total_bytes"]
    for bad in (48, 8):
        with pytest.raises(DeltashipError, match="--block-size must be"):
            plan("qwen3.5-0.8b", tier="phone-4gb", block_size=bad)
        with pytest.raises(DeltashipError, match="--block-size must be"):
            choose_for_tier(spec, "phone-4gb", block_size=bad)
