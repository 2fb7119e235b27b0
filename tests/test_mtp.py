"""Speculative decoding with the MTP head (issue 19): the head's parity with a transformers-built reference, the
lossless contract of `generate --speculative mtp` on the trained tiny preset, the sampling rule, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import add_mtp_head, code_prompt, speculative_runs, write_checkpoint

from deltaship.errors import DeltashipError

TINY_CHUNK = 16  # prefill chunk of the tiny bundles here: the long prompt spans several chunks


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    """The trained tiny preset exported for ONNX with its MTP head, by precision (built on first use)."""
    from deltaship.compile import export

    root = tmp_path_factory.mktemp("tiny-mtp")
    cache = {}

    def get(precision: str):
        if precision not in cache:
            out = root / precision
            export(
                "qwen3.5-tiny",
                out,
                target="onnx",
                precision=precision,
                max_context=256,
                prefill_chunk=TINY_CHUNK,
                mtp=True,
                verify=False,
                progress=False,
            )
            cache[precision] = out
        return cache[precision]

    return get


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_speculative_greedy_equals_plain_greedy(tiny_mtp, precision):
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.targets import open_bundle

    bundle = tiny_mtp(precision)
    assert not schema_problems(read_manifest(bundle))
    session = open_bundle(bundle)
    runs = speculative_runs(session, (1, 7, 3 * TINY_CHUNK + 5))
    accepted, drafted = sum(r.accepted for r in runs), sum(r.drafted for r in runs)
    assert accepted / drafted > 0.3  # the trained head drafts well (a random head is accepted ~1/vocab)


def test_generate_cli_reports_acceptance(tiny_mtp):
    from deltaship.commands import generate

    bundle = tiny_mtp("fp32")
    plain = generate(bundle, prompt="import os\n", max_new_tokens=24, stop_at_eos=False)
    res = generate(bundle, prompt="import os\n", max_new_tokens=24, stop_at_eos=False, speculative="mtp:2")
    assert res["output_ids"] == plain["output_ids"]
    sp = res["speculative"]
    assert sp["depth"] == 2 and sp["drafted"] > 0
    assert 0 < sp["acceptance_rate"] <= 1
    assert sp["tokens_per_verify"] == pytest.approx(24 / sp["verify_calls"], rel=0.1)


def test_speculative_sampling_runs_and_is_seeded(tiny_mtp):
    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    session = open_bundle(tiny_mtp("fp32"))
    a, _ = generate_speculative(session, code_prompt(7), 32, 2, temperature=0.8, top_k=20, seed=3, stop_at_eos=False)
    b, _ = generate_speculative(session, code_prompt(7), 32, 2, temperature=0.8, top_k=20, seed=3, stop_at_eos=False)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 32


def test_accept_or_resample_keeps_the_target_distribution():
    """Whatever the draft distribution q, the token that comes out of the accept/reject step is distributed as p."""
    from deltaship.runtimes.speculative import accept_or_resample

    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.1, 0.4, 0.4])
    n = 40000
    counts = np.zeros(4)
    for _ in range(n):
        d = int(rng.choice(4, p=q))
        new = accept_or_resample(p, q, d, rng)
        counts[d if new is None else new] += 1
    assert np.abs(counts / n - p).max() < 0.01
    assert np.abs(q - p).max() > 0.3  # not trivially equal: the rule does the work


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A hidden-shape checkpoint (odd head counts, d_k != d_v) with a random MTP head of the published layout."""
    d = tmp_path_factory.mktemp("mtp-ckpt") / "odd_heads"
    write_checkpoint("odd_heads", d, seed=5, mtp_num_hidden_layers=1)
    return add_mtp_head(d, seed=5)


def test_mtp_head_matches_transformers_reference(mtp_checkpoint, tmp_path):
    """mtp.onnx fed the reference trunk's hidden states (in two calls, so its KV cache carries over) against the
    head built from transformers' Qwen3.5 decoder layer: fp32 logits within 2e-3 of the logit std."""
    import torch

    from deltaship.compile import export
    from deltaship.models.source import load_source
    from deltaship.oracle.reference import reference_mtp
    from deltaship.targets import open_bundle

    out = tmp_path / "b"
    export(str(mtp_checkpoint), out, target="onnx", max_context=64, prefill_chunk=8, mtp=True, progress=False)
    trunk, head = reference_mtp(load_source(str(mtp_checkpoint)))
    ids = torch.tensor([[(7 * i + 3) % 150 for i in range(21)]])
    with torch.no_grad():
        hidden = trunk.model(ids, use_cache=False).last_hidden_state
        ref, _ = head(hidden[:, :-1], ids[:, 1:])
    ref = ref[0].numpy()
    session = open_bundle(out)
    session.reset_draft()
    h = hidden[0].numpy()
    got_a, _ = session.draft(h[:9], ids[0, 1:10].numpy(), 0)
    got_b, _ = session.draft(h[9:20], ids[0, 10:21].numpy(), 9)
    for got, want in ((got_a, ref[8]), (got_b, ref[19])):
        assert np.abs(got - want).max() / want.std() <= 2e-3
    # and the decoder's verify outputs: every row's logits and hidden states as transformers computes them
    session.reset()
    rows, hid = session.verify(ids[0].numpy(), np.arange(21))
    with torch.no_grad():
        logits = trunk(ids, use_cache=False).logits[0].numpy()
    assert np.abs(rows - logits).max() / logits.std() <= 2e-3
    assert np.abs(hid - h).max() / h.std() <= 2e-3


def test_inspect_reports_the_mtp_head(mtp_checkpoint, tiny_mtp):
    from deltaship.check.inspect import describe, inspect

    text = describe(inspect(tiny_mtp("fp32")))
    assert "mtp head    1 layer(s)" in text and "mtp.onnx" in text and "MiB read from the decoder's data file" in text


def test_mtp_onnx_shares_the_embedding_and_lm_head(tiny_mtp):
    """mtp.onnx stores no second copy of the embedding / LM head: its initializers point into model.onnx.data."""
    import onnx

    from deltaship.bundle import read_manifest

    for precision in ("fp32", "int4"):
        bundle = tiny_mtp(precision)
        sp = read_manifest(bundle)["speculative"]
        assert sp["shares_weights"] and sp["duplicated_bytes"] == 0 and sp["shared_tensors"]
        model = onnx.load(str(bundle / "mtp.onnx"), load_external_data=False)
        where = {
            t.name: {e.key: e.value for e in t.external_data}["location"]
            for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
        }
        assert {where[n] for n in sp["shared_tensors"]} == {"model.onnx.data"}
        own = [n for n, loc in where.items() if loc == "mtp.onnx.data"]
        assert own and all(n.startswith("mtp_") for n in own), own  # only the head's own weights


def test_speculative_needs_a_bundle_with_an_mtp_head(bundles):
    from deltaship.commands import generate

    with pytest.raises(DeltashipError) as e:
        generate(bundles("base"), input_ids="1,2,3", max_new_tokens=4, speculative="mtp")
    assert "no multi-token-prediction head" in e.value.message and "--mtp" in e.value.fix


def test_bad_speculative_value():
    from deltaship.runtimes.speculative import parse_speculative

    assert parse_speculative("mtp") == 1 and parse_speculative("mtp:3") == 3
    for bad in ("eagle", "mtp:0", "mtp:x"):
        with pytest.raises(DeltashipError):
            parse_speculative(bad)


def test_export_mtp_without_a_head_names_the_option(checkpoints, tmp_path):
    from deltaship.compile import export

    with pytest.raises(DeltashipError) as e:
        export(str(checkpoints["base"]), tmp_path / "b", mtp=True, max_context=32, progress=False)
    assert "--mtp" in e.value.message and "mtp_num_hidden_layers is 0" in e.value.message


@pytest.mark.parametrize("bad", [("reshape", "mtp.fc.weight"), ("reshape", "mtp.layers.0.self_attn.k_proj.weight")])
def test_misshapen_mtp_tensor_names_it(tmp_path, bad):
    from deltaship.models.source import load_source

    d = tmp_path / "ck"
    write_checkpoint("base", d, mtp_num_hidden_layers=1)
    add_mtp_head(d, **{bad[0]: bad[1]})
    with pytest.raises(DeltashipError) as e:
        load_source(str(d))
    assert bad[1] in e.value.message and "wrong shape" in e.value.message


def test_missing_mtp_tensor_names_it(tmp_path):
    from deltaship.models.source import load_source

    d = tmp_path / "ck"
    write_checkpoint("base", d, mtp_num_hidden_layers=1)
    add_mtp_head(d, drop="mtp.pre_fc_norm_hidden.weight")
    with pytest.raises(DeltashipError) as e:
        load_source(str(d))
    assert "mtp.pre_fc_norm_hidden.weight" in e.value.message


def test_published_presets_carry_a_random_mtp_head():
    from deltaship.models.source import load_source
    from deltaship.models.weights import mtp_tensors

    src = load_source("qwen3.5-0.8b")
    assert src.spec.mtp_num_hidden_layers == 1
    shapes = mtp_tensors(src.spec)
    assert shapes["mtp.fc.weight"] == (1024, 2048)
    assert src.weights.shape("mtp.layers.0.self_attn.q_proj.weight") == (2 * 8 * 256, 1024)
    assert src.weights.read("mtp.norm.weight").shape == (1024,)


def test_eval_reports_mtp_acceptance(tiny_mtp):
    from deltaship.check.evaluate import evaluate

    res = evaluate(tiny_mtp("fp32"), tokens=96)
    m = res["mtp"]
    assert m["positions"] == 94
    assert m["top1_vs_greedy"] > 0.3  # trained: far above chance (1/272)
    assert 0 < m["top1_vs_text"] <= 1


def test_genai_runs_an_mtp_bundle_as_a_plain_one(tiny_mtp):
    """The verify I/O is invisible to a caller that knows nothing of it: onnxruntime-genai's own greedy loop gives
    deltaship's plain greedy tokens on the --mtp bundle (genai feeds num_logits_to_keep [0] by itself: the last row)."""
    og = pytest.importorskip("onnxruntime_genai", reason="optional runtime: pip install onnxruntime-genai==0.18.*")
    from deltaship.targets import open_bundle

    bundle = tiny_mtp("int4")
    ids = code_prompt(20)
    want = open_bundle(bundle).generate(ids, 16, stop_at_eos=False).output_ids
    model = og.Model(str(bundle))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 16, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(ids, dtype=np.int32))
    got: list[int] = []
    while not gen.is_done() and len(got) < 16:
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    assert got == want


@pytest.mark.slow  # a profile in a fresh process: ~40 s with the export on 2 shared cores
def test_profile_speculative_measures_costs_acceptance_and_speed(tiny_mtp, tmp_path):
    """`deltaship profile --speculative mtp`: per-call costs, acceptance and decode speed with and without the head,
    measured in one fresh process, with the projection labelled as one; JSON, text and HTML carry it."""
    import json

    from deltaship.profiling.profile import profile
    from deltaship.profiling.report import format_results

    out, page = tmp_path / "spec.json", tmp_path / "spec.html"
    doc = profile(
        tiny_mtp("fp32"), speculative="mtp", gen=24, warmups=1, reps=3, min_seconds=0, json_out=out, report=page
    )
    assert json.loads(out.read_text())["speculative"] == doc["speculative"]
    s = doc["speculative"]
    assert s["depth"] == 1 and s["context"] == 128 and not s["random_weights"]
    assert set(s["costs_ms"]["verify"]) == {"1", "2", "3"} and set(s["costs_ms"]["draft"]) == {"1", "2"}
    rel = s["relative_to_decode_step"]
    assert all(v > 0 for v in [*rel["verify"].values(), *rel["draft"].values(), rel["snapshot"], rel["restore"]])
    a = s["acceptance"]
    assert a["meaningful"] and a["acceptance_rate"] > 0.3  # the trained head (a random one: ~1/vocab)
    assert a["identical_to_plain"] == a["prompts"] == 8  # fp32: the lossless contract, prompt by prompt
    assert 1 < a["tokens_per_verify"] == pytest.approx(1 + a["mean_accepted_length"])
    d = s["decode_tok_s"]
    assert (
        d["plain"] > 0 and d["speculative"] > 0 and d["speedup"] == pytest.approx(d["speculative"] / d["plain"], 1e-2)
    )
    pr = s["projection"]
    assert pr["label"].startswith("projection") and "0.75" in pr["source"] and pr["acceptance"] == 0.75
    imp = s["decode_tok_s_imposed"]  # the loop timed with drafts accepted at the projection's rate
    assert imp["label"].startswith("timed at an imposed acceptance") and imp["acceptance"] == 0.75
    assert abs(imp["acceptance_rate"] - 0.75) < 0.06 and imp["speculative"] > 0 and imp["speculative_by_snapshot"] > 0
    assert s["rollback"].startswith("first token") and 0 < rel["rollback_to_first"] < rel["verify"]["1"]
    metrics = {(r["metric"], r.get("tokens"), r.get("positions")) for r in doc["results"]}
    assert {("verify_s", 2, None), ("draft_s", None, 1), ("plain_decode_tok_s", None, None)} <= metrics
    text = format_results(doc)
    assert "PROJECTION at acceptance 0.75" in text and "verify  2 tokens" in text
    html = page.read_text()
    assert "id='speculative'" in html and "speculative.png" in html


def test_speculative_projection_from_costs():
    """At acceptance 1 every call emits depth + 1 tokens for a draft over depth + 1 positions, depth - 1 deeper
    drafts, a verify of depth + 1 tokens and a snapshot; at acceptance 0, one token per call."""
    from deltaship.profiling.speculative.projection import project

    costs = {"decode": 10.0, "verify": {1: 10, 2: 11, 3: 12, 4: 14}, "draft": {1: 2, 2: 2.5, 3: 3}, "snapshot": 1}
    costs["restore"] = 0.5
    p = project(costs, 1, 1.0, calls=100)
    assert p["tokens_per_verify"] == 2 and p["speedup"] == pytest.approx(10 * 2 / (2.5 + 11 + 1), 1e-3)
    p = project(costs, 2, 1.0, calls=100)
    assert p["tokens_per_verify"] == 3 and p["speedup"] == pytest.approx(10 * 3 / (3 + 2 + 12 + 1), 1e-3)
    assert project(costs, 1, 0.0, calls=100)["tokens_per_verify"] == 1
    assert project(costs, 1, 0.0)["speedup"] < project(costs, 1, 0.5)["speedup"] < p["speedup"]


def test_profile_speculative_needs_an_mtp_head(bundles):
    from deltaship.profiling.profile import profile

    with pytest.raises(DeltashipError) as e:
        profile(bundles("base"), speculative="mtp")
    assert "no multi-token-prediction head" in e.value.message and "--mtp" in e.value.fix
    with pytest.raises(DeltashipError):
        profile(bundles("base"), speculative="mtp:0")


def test_profile_speculative_bad_input(tiny_mtp):
    from deltaship.profiling.profile import profile

    with pytest.raises(DeltashipError, match="--acceptance"):
        profile(tiny_mtp("fp32"), speculative="mtp", acceptance=1.5)
    with pytest.raises(DeltashipError, match="max context"):
        profile(tiny_mtp("fp32"), speculative="mtp", gen=250)
    with pytest.raises(DeltashipError, match="on this host"):
        profile(tiny_mtp("fp32"), speculative="mtp", runtime="genai")


def test_onnx_rollback_without_copies(tiny_mtp):
    """The ONNX session's snapshot copies nothing: a verify call writes the DeltaNet states out of place, and the
    restore puts the states before it back bit for bit; a restore across other calls is refused."""
    from deltaship.targets import open_bundle

    s = open_bundle(tiny_mtp("fp32"))
    deltanet = [st["name"] for st in s.manifest["states"] if st["kind"].startswith("deltanet")]
    s.prefill(code_prompt(7))
    before = s.state_arrays()
    snap = s.snapshot()
    s.verify(np.array([5, 6, 7], np.int64), np.arange(3, dtype=np.int64))
    assert all(not np.array_equal(before[k], s.state_arrays()[k]) for k in deltanet)
    s.restore(snap)
    after = s.state_arrays()
    assert all(np.array_equal(before[k], after[k]) for k in deltanet) and s.position == 7
    want = s.decode(5)  # the restored session goes on as if the verify call never ran
    s.reset()
    s.prefill(code_prompt(7))
    np.testing.assert_array_equal(s.decode(5), want)
    snap = s.snapshot()
    s.verify(np.array([5, 6], np.int64), np.arange(2, dtype=np.int64))
    s.decode(9)
    with pytest.raises(DeltashipError, match="only the one verify call"):
        s.restore(snap)


def test_rollback_to_first_keeps_the_first_token_of_a_verify_call(tiny_mtp):
    """The --mtp graph's rollback outputs hold every DeltaNet state after the call's first token: made current by
    rollback_to_first (a buffer swap), the session is where decoding that one token would have left it, and goes on
    the same. Refused after any other call, and on a bundle whose manifest lists no rollback outputs; a restore
    across a verify call that ran with no snapshot pending (it updates the states in place) is refused too."""
    from deltaship.targets import open_bundle

    s = open_bundle(tiny_mtp("fp32"))
    deltanet = [st["name"] for st in s.manifest["states"] if st["kind"].startswith("deltanet")]
    assert set(s.manifest["speculative"]["rollback"]["deltanet_outputs"]) == set(deltanet)
    s.prefill(code_prompt(7))
    s.verify(np.array([5, 6, 7], np.int64), np.arange(3, dtype=np.int64))
    s.rollback_to_first()
    s.position += 1
    got = s.state_arrays()
    after = s.decode(9)
    s.reset()
    s.prefill(code_prompt(7))
    s.decode(5)
    want = s.state_arrays()
    for k in deltanet:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(after, s.decode(9), rtol=0, atol=1e-4)
    s.verify(np.array([5, 6], np.int64), np.arange(2, dtype=np.int64))
    s.decode(9)
    with pytest.raises(DeltashipError, match="right after the verify call"):
        s.rollback_to_first()
    # a verify call with no snapshot pending updates the states in place (its first LinearAttention): a restore
    # of an older snapshot across it is refused, not silently wrong
    snap = s.snapshot()
    s.verify(np.array([5, 6], np.int64), np.arange(2, dtype=np.int64))
    s.restore(snap)
    s.verify(np.array([5, 6], np.int64), np.arange(2, dtype=np.int64))
    with pytest.raises(DeltashipError, match="in place"):
        s.restore(snap)
    s.manifest["speculative"]["rollback"].pop("deltanet_outputs")
    s.verify(np.array([5, 6], np.int64), np.arange(2, dtype=np.int64))
    with pytest.raises(DeltashipError, match="no rollback outputs") as e:
        s.rollback_to_first()
    assert "--mtp" in e.value.fix


def test_rollback_outputs_leave_plain_decoding_as_it_was(tiny_mtp, tmp_path):
    """The --mtp graph splits each LinearAttention at the first token: plain prefill and decode give the logits of
    the bundle exported without --mtp, and its recurrent states stay updated in place (no copy per call)."""
    from deltaship.compile import export
    from deltaship.targets import open_bundle

    plain = tmp_path / "plain"
    export("qwen3.5-tiny", plain, target="onnx", precision="fp32", max_context=256, prefill_chunk=TINY_CHUNK,
           verify=False, progress=False)  # fmt: skip
    a, b = open_bundle(tiny_mtp("fp32")), open_bundle(plain)
    assert [st.get("in_place") for st in a.manifest["states"]] == [st.get("in_place") for st in b.manifest["states"]]
    assert any(st.get("in_place") for st in a.manifest["states"] if st["kind"] == "deltanet_recurrent")
    for n in (1, 3 * TINY_CHUNK + 5):
        ga = a.generate(code_prompt(n), 24, stop_at_eos=False, keep_logits=True)
        gb = b.generate(code_prompt(n), 24, stop_at_eos=False, keep_logits=True)
        assert ga.output_ids == gb.output_ids
        np.testing.assert_allclose(np.array(ga.logits), np.array(gb.logits), rtol=0, atol=1e-4)
        a.reset()
        b.reset()


def test_depth_one_rolls_back_without_snapshots(tiny_mtp):
    """At depth 1 every rejection is the first draft's: the driver keeps the call's first token (rollback_to_first)
    and never snapshots, restores or re-feeds; the tokens stay plain greedy's."""
    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    s = open_bundle(tiny_mtp("fp32"))
    calls = {"snapshot": 0, "restore": 0}
    for name in calls:

        def counted(*a, _f=getattr(s, name), _n=name):
            calls[_n] += 1
            return _f(*a)

        setattr(s, name, counted)
    prompt = code_prompt(7)
    plain = s.generate(prompt, 64, stop_at_eos=False).output_ids
    gen, stats = generate_speculative(s, prompt, 64, 1, stop_at_eos=False)
    assert gen.output_ids == plain
    assert stats.rollbacks == stats.drafted - stats.accepted > 0 and stats.commit_calls == 0
    assert calls == {"snapshot": 0, "restore": 0}
    _, stats = generate_speculative(s, prompt, 64, 2, stop_at_eos=False)  # deeper rejections restore a snapshot
    assert stats.rollbacks > 0 and calls["restore"] > 0


def test_projection_with_rollback_to_first():
    """With rollback_to_first's cost given, a rejection at depth 1 costs it instead of a snapshot, a restore and a
    longer next call: at acceptance 0, each token costs one draft, one verify of 2 tokens and the rollback."""
    from deltaship.profiling.speculative.projection import project

    costs = {"decode": 10.0, "verify": {1: 10, 2: 11, 3: 12}, "draft": {1: 2, 2: 2.5}, "snapshot": 1, "restore": 1}
    without = project(costs, 1, 0.0, calls=100)
    p = project({**costs, "rollback_to_first": 0.1}, 1, 0.0, calls=100)
    assert p["ms_per_token"] == pytest.approx(2 + 11 + 0.1) and without["ms_per_token"] > 12 + 2 + 1
    assert project({**costs, "rollback_to_first": 0.1}, 1, 1.0)["ms_per_token"] == pytest.approx((2.5 + 11) / 2, 1e-3)


@pytest.mark.parametrize("rate", [0.0, 0.78, 1.0])
def test_imposed_acceptance_accepts_at_the_rate(tiny_mtp, rate):
    """The profile's imposed acceptance (timing a head that accepts nothing): the driver accepts drafts at the given
    rate, whatever the head drafted."""
    from deltaship.profiling.speculative.imposed import ImposedAcceptance
    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    s = ImposedAcceptance(open_bundle(tiny_mtp("fp32")), rate)
    drafted = accepted = 0
    for n in (1, 7, 20, 33):
        _, st = generate_speculative(s, code_prompt(n), 80, 1, stop_at_eos=False)
        drafted, accepted = drafted + st.drafted, accepted + st.accepted
    assert drafted >= 100 and abs(accepted / drafted - rate) < 0.05


def test_executorch_int4_verification_reference_leaves_the_mtp_head_out():
    """ExecuTorch int4 verifies against transformers with torchao's own rounding of every weight (the lowering's
    `Lowered.rounded`, from `prepare`), which with --mtp includes the head's weights: transformers' model has no MTP
    head, so they are not loaded into it (`export --target executorch --precision int4 --mtp` crashed after
    the whole export with KeyError 'mtp.fc.weight'), and the LM head keeps its own rounding."""
    pytest.importorskip("executorch")
    from helpers import export_context

    from deltaship.lowering.executorch.program import prepare
    from deltaship.models.source import load_source
    from deltaship.oracle.reference import matched_reference_model

    source = load_source("qwen3.5-tiny")
    ctx = export_context("qwen3.5-tiny", "int4", target="executorch", mtp=True)
    rounded = prepare(ctx, source.weights).rounded
    assert "mtp.fc.weight" in rounded
    ref = matched_reference_model(source, ctx.plan, ctx.quant, "int4", rounded=rounded)
    np.testing.assert_array_equal(ref.lm_head.weight.detach().numpy(), rounded["lm_head.weight"])


def test_speculative_sessions_stop_spinning_between_calls(tiny_mtp, bundles):
    """The decoder and the draft head of an --mtp bundle take turns call after call: their ONNX Runtime threads stop
    spinning when a call returns (spinning, each took the cores from the other's call: docs/results/mtp.md); a
    plain bundle keeps ONNX Runtime's default."""
    from deltaship.targets import open_bundle

    def stops(sess) -> bool:
        opts = sess.get_session_options()
        try:
            return opts.get_session_config_entry("session.force_spinning_stop") == "1"
        except Exception:  # ONNX Runtime raises when the entry was never set
            return False

    s = open_bundle(tiny_mtp("fp32"))
    assert stops(s.sess) and stops(s._draft_session())
    assert not stops(open_bundle(bundles("base")).sess)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_opening_an_mtp_bundle_with_onnx_runtime_prints_no_initializer_warning(tiny_mtp, level):
    """Any app embedding ONNX Runtime (JS, Kotlin, genai) logs at its own level: the --mtp decoder has no
    initializer that is also a graph input (ONNX Runtime warned "Initializer logit_rows appears in graph inputs"
    at every session start), and it runs without a feed of its verify input's rows beyond the plain [0]."""
    import subprocess
    import sys

    bundle = tiny_mtp("fp32")
    code = (
        "import sys, numpy as np, onnxruntime as ort\n"
        "so = ort.SessionOptions(); so.log_severity_level = int(sys.argv[2])\n"
        "s = ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])\n"
        "print(sorted(i.name for i in s.get_inputs() if not i.name.startswith('past.')))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(bundle / "model.onnx"), str(level)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert "appears in graph inputs" not in res.stderr + res.stdout
    assert "num_logits_to_keep" in res.stdout and "logit_rows" not in res.stdout
    if level == 0:
        assert "[V:onnxruntime" in res.stderr  # level 0 does log: the absence above is not silence


def test_generate_on_an_mtp_bundle_says_nothing_on_stderr(tiny_mtp):
    """deltaship's sessions log errors only, so `deltaship generate` with --speculative stays quiet."""
    import os
    import subprocess
    import sys

    bundle = tiny_mtp("fp32")
    env = {k: v for k, v in os.environ.items() if k != "DELTASHIP_VERBOSE"}
    for verbose in ([], ["--verbose"]):
        res = subprocess.run(
            [sys.executable, "-m", "deltaship", *verbose, "generate", str(bundle), "--input-ids", "1,2,3"]
            + ["--max-new-tokens", "4", "--speculative", "mtp:2"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert res.returncode == 0, res.stderr
        assert "appears in graph inputs" not in res.stderr, res.stderr
        if not verbose:
            assert res.stderr == ""
