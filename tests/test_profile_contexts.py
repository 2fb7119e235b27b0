"""`deltaship profile --contexts` at depth without a prefill (deltaship/profiling/longctx.py): the synthetic fill
reaches the depth the decode step sees, draws its rows from the real prefix's values channel by channel, and the
resident memory recorded per depth grows as the manifest's bytes-per-token arithmetic says."""

from __future__ import annotations

import numpy as np
import pytest

CTX = 4096


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The trained tiny preset as an ONNX bundle (fp32 KV cache, 2 KiB a token) at a context of 4096."""
    from deltaship.compile import export

    out = tmp_path_factory.mktemp("longctx") / "tiny"
    export("qwen3.5-tiny", out, target="onnx", max_context=CTX, prefill_chunk=32, verify=False, progress=False)
    return out


def _kv(manifest):
    return [s for s in manifest["states"] if s["kind"].startswith("kv_cache")]


def test_fill_reaches_the_depth_the_decode_step_sees(tiny_long):
    _fill_reaches_the_depth(tiny_long, 3000)


def test_fill_reaches_the_depth_in_executorch(tiny_pte):
    """The ExecuTorch session: the fill writes the program's own KV buffers (ExecuTorch's [1, S, Hkv, D] layout)."""
    _fill_reaches_the_depth(tiny_pte("fp32"), 100)


def _fill_reaches_the_depth(bundle, depth: int, prefix: int = 16) -> None:
    from deltaship.profiling.longctx import SyntheticFill
    from deltaship.targets import open_bundle

    session = open_bundle(bundle, threads=1, check_hashes=False)
    fill = SyntheticFill(session, prefix)
    real = {k: v[:, :, :prefix].copy() for k, v in session.state_arrays().items() if ".key" in k or ".value" in k}
    assert fill.fill_to(depth) == depth - prefix
    session.seek(depth)
    logits = session.decode(1)
    assert session.position == depth + 1
    states = session.state_arrays()
    for s in _kv(session.manifest):
        kv = states[s["name"]]  # [1, Hkv, S, D]
        written = np.abs(kv).sum(axis=(0, 1, 3)) > 0
        assert written[: depth + 1].all(), s["name"]  # the prefix, the synthetic rows and the decoded row `depth`
        assert not written[depth + 1 :].any(), s["name"]  # nothing past the step's own row
        # every synthetic element comes from the same head and channel of the real prefix
        synth = kv[:, :, prefix:depth]
        src = real[s["name"]]
        for h in range(kv.shape[1]):
            for d in (0, kv.shape[3] - 1):
                assert np.isin(synth[0, h, :, d], src[0, h, :, d]).all(), (s["name"], h, d)
    # attention reads the filled rows: another draw of the fill changes the logits at the same depth
    other = open_bundle(bundle, threads=1, check_hashes=False)
    SyntheticFill(other, prefix, seed=1).fill_to(depth)
    other.seek(depth)
    assert np.abs(other.decode(1) - logits).max() > 1e-4


@pytest.mark.slow  # profiles (load, warm loads, decode, the sweep): ~20 s on 2 shared cores
def test_worker_records_latency_and_memory_per_depth(tiny_long):
    """The worker's context sweep: the synthetic fill is said, and the resident set grows with the depth as the
    manifest's bytes per token say (the KV buffers' pages are released first, so only written rows count)."""
    from deltaship.bundle.reader import read_manifest
    from deltaship.profiling import worker

    cfg = dict(bundle=str(tiny_long), threads=1, prompt_lengths=[], gen=4, contexts=[64, CTX - 1, CTX + 5])
    doc = worker.run(dict(cfg, reps=3, warmups=1, min_seconds=0.05))
    lat = {r["context"]: r for r in doc["results"] if r["metric"] == "decode_latency_s"}
    mem = {r["context"]: r for r in doc["results"] if r["metric"] == "rss_bytes"}
    assert lat[CTX + 5]["flags"] == ["skipped_over_max_context"] and CTX + 5 not in mem
    for c in (64, CTX - 1):
        assert lat[c]["fill"] == "synthetic" and "synthetic" in lat[c]["note"]
        assert lat[c]["position_seen"] == c and len(lat[c]["samples"]) >= 3
        assert mem[c]["kv_pages_released"] is True
    per_token = read_manifest(tiny_long)["memory"]["kv_bytes_per_token"]["fp32"]
    assert mem[CTX - 1]["manifest_kv_bytes"] == CTX * per_token
    grew = mem[CTX - 1]["median"] - mem[64]["median"]
    expect = (CTX - 1 - 64) * per_token  # 7.9 MiB
    assert 0.9 * expect < grew < 1.3 * expect, (grew, expect)

    # the HTML report plots both against the context and says the fill is synthetic
    from deltaship.profiling.profile import bundle_summary
    from deltaship.profiling.report import plots, write_html

    report = {"bundle": bundle_summary(read_manifest(tiny_long), tiny_long), "results": doc["results"]}
    assert plots(report)["memory_vs_context.png"].startswith(b"\x89PNG")
    page = write_html(report, tiny_long.parent / "report.html").read_text()
    assert "id='fill'" in page and "synthetic fill, not a prefill" in page
