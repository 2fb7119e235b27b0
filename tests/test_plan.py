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
