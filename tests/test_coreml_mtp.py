"""Core ML speculative decoding with the MTP head (issue 19), through the Linux evaluator of the saved ML program:
the lossless contract on the trained tiny preset, the head's parity with the transformers-built reference, the
package's shared weights and its function contract."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import add_mtp_head, write_checkpoint

pytestmark = pytest.mark.slow  # Core ML conversion and op-by-op evaluation

CHUNK = 16  # prefill chunk of the tiny packages: the long prompt spans two chunks and a tail


def _prompt(n: int) -> list[int]:
    text = b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    return list(text[:n])


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_speculative_greedy_equals_plain_greedy(tiny_coreml_mtp, precision):
    from deltaship.runtimes.coreml import CoreMLEvalSession
    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    session = open_bundle(tiny_coreml_mtp(precision))
    assert isinstance(session, CoreMLEvalSession)
    accepted = drafted = 0
    for n, depths in ((1, (1,)), (7, (1, 2)), (2 * CHUNK + 5, (1,))):
        prompt = _prompt(n)
        session.reset()
        plain = session.generate(prompt, 64, stop_at_eos=False).output_ids
        for depth in depths:
            gen, stats = generate_speculative(session, prompt, 64, depth, stop_at_eos=False)
            assert gen.output_ids == plain, (n, depth)
            assert stats.verify_calls < 64  # drafts were accepted: fewer decoder calls than tokens
            accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert accepted / drafted > 0.3  # the trained head drafts well (a random head is accepted ~1/vocab)


def test_package_functions_and_shared_weights(tiny_coreml_mtp):
    """verify_T and mtp_draft beside prefill/decode in one package; the weight blob holds the trunk and the head
    once: the embedding / LM head the draft reads are the decoder's entries, nothing is stored twice."""
    import coremltools as ct

    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.models.source import load_source
    from deltaship.models.weights import mtp_tensors

    bundle = tiny_coreml_mtp("fp32")
    m = read_manifest(bundle)
    assert not schema_problems(m)
    sp = m["speculative"]
    assert sp["draft"]["function"] == "mtp_draft"
    assert sp["verify"]["functions"] == {"1": "verify_1", "2": "verify_2", "3": "verify_3", "16": "verify_16"}
    spec = ct.models.MLModel(str(bundle / "model.mlpackage"), skip_model_load=True).get_spec()
    funcs = {f.name: f for f in spec.description.functions}
    assert set(funcs) == {"prefill", "decode", "mtp_draft", *sp["verify"]["functions"].values()}
    assert [o.name for o in funcs["verify_3"].output][:2] == ["logits", "hidden_states"]
    assert [i.name for i in funcs["mtp_draft"].input][:3] == ["hidden_states", "input_ids", "position"]
    blob = sp["weight_blob"]
    assert sp["shares_weights"] and sp["duplicated_bytes"] == blob["duplicated_bytes"] == 0
    assert blob["entries_read_by_several_functions"] > 0.5 * blob["entries"]
    # the blob against the parameters: the trunk's (tied head once) and the head's own, each once at fp32
    src = load_source("qwen3.5-tiny")
    names = [n for n in src.weights.names() if not n.startswith(("mtp.", "model.visual."))]
    trunk = sum(int(np.prod(src.weights.shape(n))) for n in names) * 4
    head = sum(int(np.prod(s)) for s in mtp_tensors(src.spec).values()) * 4
    assert trunk + head <= blob["blob_bytes"] < (trunk + head) * 1.01 + (1 << 18)
    assert blob["blob_bytes"] < 2 * trunk  # a second copy of the trunk would double it


def test_mtp_head_matches_transformers_reference(tmp_path):
    """The mtp_draft function on a hidden-shape checkpoint (odd head counts, d_k != d_v), fed the reference trunk's
    hidden states, against the head built from transformers' Qwen3.5 decoder layer: fp32 logits within 2e-3 of the
    logit std; and the verify functions' rows and hidden states against transformers' own."""
    import torch

    from deltaship.compile import export
    from deltaship.models.source import load_source
    from deltaship.oracle.reference import reference_mtp
    from deltaship.targets import open_bundle

    ckpt = tmp_path / "odd_heads"
    write_checkpoint("odd_heads", ckpt, seed=5, mtp_num_hidden_layers=1)
    add_mtp_head(ckpt, seed=5)
    out = tmp_path / "b"
    export(str(ckpt), out, target="coreml", max_context=64, prefill_chunk=8, mtp=True, verify=False, progress=False)
    trunk, head = reference_mtp(load_source(str(ckpt)))
    ids = torch.tensor([[(7 * i + 3) % 150 for i in range(21)]])
    with torch.no_grad():
        hidden = trunk.model(ids, use_cache=False).last_hidden_state
        ref, _ = head(hidden[:, :-1], ids[:, 1:])
        logits = trunk(ids, use_cache=False).logits[0].numpy()
    ref = ref[0].numpy()
    session = open_bundle(out)
    session.reset_draft()
    h = hidden[0].numpy()
    got_a, _ = session.draft(h[:9], ids[0, 1:10].numpy(), 0)  # two calls: the head's KV cache carries over
    got_b, _ = session.draft(h[9:20], ids[0, 10:21].numpy(), 9)
    for got, want in ((got_a, ref[8]), (got_b, ref[19])):
        assert np.abs(got - want).max() / want.std() <= 2e-3
    session.reset()
    rows, hid = session.verify(ids[0].numpy(), np.arange(21))  # 21 = 8 + 8 + 3 + 2: four functions
    assert np.abs(rows - logits).max() / logits.std() <= 2e-3
    assert np.abs(hid - h).max() / h.std() <= 2e-3


@pytest.mark.parametrize("build", ["fp32", "fp16-state"])
def test_snapshot_restore_rolls_the_deltanet_states_back(tiny_coreml_mtp, build):
    """A verify call undone by restore leaves the session where it was: the next call gives the same logits
    (io states: host arrays; Core ML states: the state buffers, copied out and back)."""
    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    session = open_bundle(tiny_coreml_mtp(build))
    session.reset()
    prompt = np.asarray(_prompt(7), np.int64)
    session.verify(prompt, np.array([6]))
    session.position = 7
    snap = session.snapshot()
    assert snap["state" if build == "fp16-state" else "io"]  # where this build's DeltaNet states live
    first, _ = session.verify(np.array([40, 41, 42]), np.arange(3))
    session.restore(snap)
    assert session.position == 7
    again, _ = session.verify(np.array([40, 41, 42]), np.arange(3))
    np.testing.assert_array_equal(first, again)
    session.restore(snap)
    other, _ = session.verify(np.array([40, 99]), np.arange(2))
    np.testing.assert_array_equal(other[0], first[0])  # same prefix, same row
    assert np.abs(other[1] - first[1]).max() > 1e-3  # a different token: the states really moved
    if build == "fp16-state":  # and the lossless contract with every state a Core ML state
        session.reset()
        plain = session.generate(_prompt(2 * CHUNK + 5), 32, stop_at_eos=False).output_ids
        gen, stats = generate_speculative(session, _prompt(2 * CHUNK + 5), 32, 1, stop_at_eos=False)
        assert gen.output_ids == plain and stats.accepted < stats.drafted  # rejections: restores happened


def test_generate_cli_reports_acceptance(tiny_coreml_mtp):
    from deltaship.commands import generate

    bundle = tiny_coreml_mtp("fp32")
    plain = generate(bundle, prompt="import os\n", max_new_tokens=16, stop_at_eos=False)
    res = generate(bundle, prompt="import os\n", max_new_tokens=16, stop_at_eos=False, speculative="mtp:2")
    assert res["output_ids"] == plain["output_ids"]
    sp = res["speculative"]
    assert sp["depth"] == 2 and sp["drafted"] > 0 and 0 < sp["acceptance_rate"] <= 1


def test_profile_speculative_through_the_evaluator(tiny_coreml_mtp, tmp_path):
    """`deltaship profile --speculative mtp` on a Core ML bundle (the code that profiles ONNX and ExecuTorch), in the
    Linux evaluator: every cost, acceptance and speed field, the speculative tokens equal to the plain ones on every
    prompt, and the latencies labelled as the evaluator's, not a device's (record, text and HTML)."""
    import json

    from deltaship.profiling.profile import profile
    from deltaship.profiling.report import format_results

    out, page = tmp_path / "spec.json", tmp_path / "spec.html"
    doc = profile(
        tiny_coreml_mtp("fp32"),
        speculative="mtp",
        gen=8,
        contexts=[64],  # the tiny package holds 128 positions
        warmups=0,
        reps=1,
        min_seconds=0,
        json_out=out,
        report=page,
    )
    assert not [r for r in doc["results"] if r.get("status") == "died"], doc["results"]
    assert json.loads(out.read_text())["speculative"] == doc["speculative"]
    assert "not Core ML" in doc["runtime"]
    s = doc["speculative"]
    assert s["device_latencies"] is False and "not a device's" in s["latencies"] and "evaluator" in s["latencies"]
    assert s["depth"] == 1 and s["context"] == 64 and not s["random_weights"]
    assert set(s["costs_ms"]["verify"]) == {"1", "2", "3"} and set(s["costs_ms"]["draft"]) == {"1", "2"}
    rel = s["relative_to_decode_step"]
    assert all(v > 0 for v in [*rel["verify"].values(), *rel["draft"].values(), rel["snapshot"], rel["restore"]])
    a = s["acceptance"]
    assert a["identical_to_plain"] == a["prompts"] == 8  # fp32: the lossless contract, prompt by prompt
    assert a["meaningful"] and a["acceptance_rate"] > 0.3  # the trained head
    assert 1 < a["tokens_per_verify"] == pytest.approx(1 + a["mean_accepted_length"])
    d = s["decode_tok_s"]
    assert d["plain"] > 0 and d["speculative"] > 0 and len(d["speedup_ci95"]) == 2
    assert s["projection"]["label"].startswith("projection") and s["projection_at_measured_acceptance"]["speedup"] > 0
    metrics = {(r["metric"], r.get("tokens"), r.get("positions")) for r in doc["results"]}
    assert {
        ("verify_s", 3, None),
        ("draft_s", None, 2),
        ("snapshot_s", None, None),
        ("restore_s", None, None),
    } <= metrics
    assert {
        ("decode_latency_s", None, None),
        ("plain_decode_tok_s", None, None),
        ("spec_decode_tok_s", None, None),
    } <= metrics
    assert "LATENCIES: the saved ML program evaluated" in format_results(doc)
    assert "evaluator" in page.read_text()
