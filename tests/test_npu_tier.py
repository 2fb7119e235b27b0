"""`plan` on an NPU tier: the qnn target's compiled context binaries (one per graph, each with the weights) against
the tier's budget and its NPU's per-context limit (deltaship/devices/tiers.toml phone-8elite-npu, docs/npu.md)."""

from __future__ import annotations

import pytest

from deltaship.devices.catalog import GIB, load_catalog
from deltaship.devices.plan import plan, verdicts
from deltaship.errors import DeltashipError


def _npu_tier(tmp_path, npu: str | None, targets: str = '["qnn"]') -> str:
    f = tmp_path / "tiers.toml"
    text = (
        '[tiers.npu-small]\nkind = "phone"\nram_gib = 12\nbudget_gib = 6.0\n'
        f'targets = {targets}\nprecisions = ["fp16"]\ncontext = 256\nthreads = 4\n'
    )
    f.write_text(text + (f"[tiers.npu-small.npu]\n{npu}\n" if npu is not None else ""))
    return str(f)


def test_the_npu_tier_plans_the_tiny_preset_on_its_htp_with_a_context_binary_per_graph():
    tier = load_catalog()[0]["phone-8elite-npu"]
    assert (tier.npu.soc, tier.npu.context_binary_bytes) == ("8elite", int(3.5 * GIB))
    rows = plan("qwen3.5-tiny", tier="phone-8elite-npu")
    (pick,) = [r for r in rows if r["recommended"]]
    assert (pick["target"], pick["precision"], pick["npu_problem"]) == ("qnn", "fp16", "")
    assert pick["context_binary_bytes"] > pick["weights_bytes"]  # the weights plus the HTP's schedule
    assert pick["weights_loaded_bytes"] == 2 * pick["context_binary_bytes"]  # decode and prefill, each its own copy
    (line,) = verdicts(rows)
    assert line.startswith("phone-8elite-npu: qnn fp16 at context 4096")


def test_a_context_binary_over_the_npus_limit_fits_no_budget(tmp_path):
    """The tiny preset on an NPU whose per-context limit is 0.01 GiB; the 2B's fp16 binary (3.9 GiB) on the 8 Elite's
    3.5 GiB: neither fits, though both budgets would hold them, and the verdict names the limit, not a bigger tier."""
    tiers = _npu_tier(tmp_path, 'soc = "8elite"\ncontext_binary_gib = 0.01')
    rows = plan("qwen3.5-tiny", tier="npu-small", tiers_file=tiers)
    assert rows and not any(r["fits"] for r in rows) and all(r["total_bytes"] < r["budget_bytes"] for r in rows)
    (line,) = verdicts(rows, tiers)
    assert "over the 8elite NPU's 0.01 GiB per context" in line and "would fit a tier with" not in line
    big = plan("qwen3.5-2b", tier="phone-8elite-npu")
    assert not any(r["fits"] for r in big) and "over the 8elite NPU's 3.50 GiB per context" in big[0]["npu_problem"]


def test_the_qnn_target_on_a_tier_without_an_npu_does_not_fit():
    rows = plan("qwen3.5-tiny", tier="phone-8gb", targets=["qnn"])
    assert rows and not any(r["fits"] for r in rows)
    assert "tier phone-8gb has no NPU for qnn" in rows[0]["npu_problem"]


def test_an_npu_tier_needs_its_npu_table_and_a_known_soc(tmp_path):
    with pytest.raises(DeltashipError, match=r"lists the NPU target\(s\) \['qnn'\] but has no \[tiers.npu-small.npu\]"):
        load_catalog(_npu_tier(tmp_path, None))
    with pytest.raises(DeltashipError, match="tier 'npu-small': npu.soc: unknown Snapdragon SoC 'sm9999'"):
        load_catalog(_npu_tier(tmp_path, 'soc = "sm9999"\ncontext_binary_gib = 3.5'))
    with pytest.raises(DeltashipError, match="npu.context_binary_gib must be positive"):
        load_catalog(_npu_tier(tmp_path, 'soc = "8gen3"\ncontext_binary_gib = 0'))
