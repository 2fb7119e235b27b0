"""Speculative decoding with the MTP head on ExecuTorch (issue 19): export --target executorch --mtp puts the head in
model.pte as the method 'mtp_draft' and the decoder's verify call as the method 'verify', over the very state
buffers 'forward' uses; greedy speculative output equals plain greedy output."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import code_prompt, speculative_runs

TINY_CHUNK = 16  # the long prompt spans several chunks (and the head's first call too)


@pytest.fixture(scope="module")
def tiny_mtp_pte(shared_export):
    """The trained tiny preset as an fp32 .pte with its MTP head (one export per test run, ~3-5 min on 2 cores)."""
    return shared_export(
        "tiny-mtp-pte-fp32",
        "qwen3.5-tiny",
        target="executorch",
        precision="fp32",
        max_context=256,
        prefill_chunk=TINY_CHUNK,
        mtp=True,
        verify=False,
    )


@pytest.mark.slow
def test_et_speculative_greedy_equals_plain_greedy(tiny_mtp_pte):
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.targets import open_bundle

    manifest = read_manifest(tiny_mtp_pte)
    assert not schema_problems(manifest)
    sp = manifest["speculative"]
    assert (sp["draft"]["program_method"], sp["verify"]["program_method"]) == ("mtp_draft", "verify")
    assert sp["draft"]["file"] == manifest["entry"] == "model.pte"
    # one program stores the weights once: 'verify' (the whole trunk again) and the head's embedding / LM head
    # add no second copy (measured: the head's own 3.9 MB and 53 KB more than the plain fp32 .pte)
    assert manifest["files"]["model.pte"]["bytes"] < 1.25 * 4 * manifest["model"]["parameters"]["total"]
    session = open_bundle(tiny_mtp_pte)
    assert set(session.program.method_names) >= {"forward", "verify", "mtp_draft"}
    runs = speculative_runs(session, (1, 7, 3 * TINY_CHUNK + 5))
    accepted, drafted = sum(r.accepted for r in runs), sum(r.drafted for r in runs)
    rejected_calls = sum(1 for r in runs for e in r.emitted_per_verify if e <= r.depth)
    assert accepted / drafted > 0.3  # the trained head drafts well
    assert rejected_calls > 0  # the rollback (restore of the DeltaNet buffers) was exercised


@pytest.mark.slow
def test_et_verify_writes_the_state_forward_reads(tiny_mtp_pte):
    """'verify' and 'forward' share their buffers: a prompt consumed by verify continues under forward exactly as
    one consumed by forward, and a snapshot/restore puts the DeltaNet buffers back bit for bit."""
    from deltaship.targets import open_bundle

    session = open_bundle(tiny_mtp_pte)
    prompt = np.array(code_prompt(20), np.int64)
    session.reset()
    plain = session.prefill(prompt)
    plain_next = session.decode(int(np.argmax(plain)))
    session.reset()
    rows, hidden = session.verify(prompt, np.arange(prompt.size, dtype=np.int64))  # spans two calls of 16
    assert rows.shape == (prompt.size, session.vocab_size) and hidden.shape[0] == prompt.size
    np.testing.assert_allclose(rows[-1], plain, atol=1e-4)
    session.position += prompt.size
    snap = session.snapshot()
    before = session.state_arrays()
    session.verify(np.array([5, 6, 7], np.int64), np.array([2], np.int64))  # a verify call to undo
    assert any(not np.array_equal(before[k], v) for k, v in session.state_arrays().items() if "past" in k)
    session.restore(snap)
    after = session.state_arrays()
    for s in session.manifest["states"]:
        if s["kind"].startswith("deltanet"):
            np.testing.assert_array_equal(after[s["name"]], before[s["name"]])
    np.testing.assert_allclose(session.decode(int(np.argmax(plain))), plain_next, atol=1e-4)


@pytest.mark.slow
def test_et_generate_cli_reports_acceptance(tiny_mtp_pte):
    from deltaship.commands import generate

    plain = generate(tiny_mtp_pte, prompt="import os\n", max_new_tokens=24, stop_at_eos=False)
    res = generate(tiny_mtp_pte, prompt="import os\n", max_new_tokens=24, stop_at_eos=False, speculative="mtp:2")
    assert res["output_ids"] == plain["output_ids"]
    assert res["speculative"]["drafted"] > 0 and 0 < res["speculative"]["acceptance_rate"] <= 1
    # ExecuTorch's C++ LLM runner still runs 'forward' of the three-method program (shared state arena) as before
    runner = generate(tiny_mtp_pte, prompt="import os\n", max_new_tokens=24, runtime="et-runner")
    assert runner["text"] == generate(tiny_mtp_pte, prompt="import os\n", max_new_tokens=24)["text"]


def test_every_target_takes_mtp():
    from deltaship.compile import check_options

    for target in ("onnx", "executorch", "coreml"):  # Core ML: tests/test_coreml_mtp.py
        assert check_options(target, "fp32", 256, 32, False, None, {"mtp": True}).mtp
