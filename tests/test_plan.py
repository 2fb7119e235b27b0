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
