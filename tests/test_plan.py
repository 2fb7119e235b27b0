"""`deltaship plan` says in words what its table means: the pick and why, or that nothing fits and by how much."""

from __future__ import annotations

from deltaship.devices.plan import plan, verdicts


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
    from deltaship.export import export

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


def test_plan_prints_the_vision_table_only_for_a_tower(capsys):
    import json

    from deltaship.cli import main

    assert main(["plan", "--model", "qwen3.5-0.8b", "--tier", "phone-4gb"]) == 0
    out = capsys.readouterr().out
    assert "vision tower: 12 blocks x 768" in out and "896x896" in out and "4096x4096" in out
    assert main(["plan", "--model", "qwen3.5-0.8b", "--tier", "phone-4gb", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)  # --json: the rows, as for a text-only model
    assert main(["plan", "--model", "qwen3.5-tiny", "--tier", "phone-4gb"]) == 0
    assert "vision tower" not in capsys.readouterr().out
