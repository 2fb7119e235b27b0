"""A reduced-vocabulary MTP draft head (export --mtp-draft-vocab N, FR-Spec style; issue 19): the draft's logits over
N frequency-ranked token ids, stored with the bundle; speculative decoding stays lossless; bad input refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import code_prompt, speculative_runs

from deltaship.errors import DeltashipError

CHUNK = 16  # prefill chunk: the long prompt spans several chunks
N = 53  # the smallest N that covers 99% of the ranking text's tokens with the 3 special ids kept (below)


def _export(out, **opts):
    from deltaship.compile import export

    export(
        "qwen3.5-tiny",
        out,
        target="onnx",
        max_context=256,
        prefill_chunk=CHUNK,
        mtp=True,
        verify=False,
        progress=False,
        **opts,
    )
    return out


@pytest.fixture(scope="module")
def tiny_dv(tmp_path_factory):
    """The trained tiny preset for ONNX with its MTP head: `full` (the whole vocabulary) or a precision with an
    N-id draft vocabulary (built on first use)."""
    root = tmp_path_factory.mktemp("tiny-dv")
    cache = {}

    def get(kind: str):
        if kind not in cache:
            if kind == "full":
                cache[kind] = _export(root / kind, precision="fp32")
            else:
                cache[kind] = _export(root / kind, precision=kind, mtp_draft_vocab=str(N))
        return cache[kind]

    return get


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_greedy_with_a_draft_vocab_equals_plain_greedy(tiny_dv, precision):
    from deltaship.runtimes.speculative import draft_token_ids
    from deltaship.targets import open_bundle

    bundle = tiny_dv(precision)
    session = open_bundle(bundle)
    ids = draft_token_ids(bundle, session.manifest)
    assert ids is not None and ids.size == N
    runs = speculative_runs(session, (1, 7, 3 * CHUNK + 5))
    accepted, drafted = sum(r.accepted for r in runs), sum(r.drafted for r in runs)
    assert accepted / drafted > 0.3  # the drafts are mapped to token ids (unmapped indices would be rejected)


def test_draft_logits_are_the_full_heads_at_the_ids(tiny_dv):
    """fp32: the N-id draft's logits equal the full-vocabulary draft's logits at those ids, and its hidden states
    are the same (the head's layer is untouched)."""
    from deltaship.runtimes.speculative import draft_token_ids
    from deltaship.targets import open_bundle

    full, sub = open_bundle(tiny_dv("full")), open_bundle(tiny_dv("fp32"))
    ids = draft_token_ids(sub.bundle, sub.manifest)
    assert draft_token_ids(full.bundle, full.manifest) is None
    prompt = np.asarray(code_prompt(21), np.int64)
    full.reset()
    _, hidden = full.verify(prompt, np.array([20], np.int64))
    for s in (full, sub):
        s.reset_draft()
    want_a, h_full = full.draft(hidden[:9], prompt[1:10], 0)
    got_a, h_sub = sub.draft(hidden[:9], prompt[1:10], 0)
    want_b, _ = full.draft(hidden[9:20], prompt[10:21], 9)  # the KV cache carries over
    got_b, _ = sub.draft(hidden[9:20], prompt[10:21], 9)
    assert got_a.shape == (N,) and want_a.shape == (full.manifest["model"]["vocab_size"],)
    for got, want in ((got_a, want_a), (got_b, want_b)):
        assert np.abs(got - want[ids]).max() <= 1e-5 * want.std()
    np.testing.assert_allclose(h_sub, h_full, rtol=0, atol=1e-6)


def test_manifest_file_and_inspect(tiny_dv):
    import onnx

    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.check.inspect import describe, inspect
    from deltaship.lowering.draft_vocab import DRAFT_VOCAB_FILE

    bundle = tiny_dv("fp32")
    m = read_manifest(bundle)
    assert not schema_problems(m)
    v = m["speculative"]["draft"]["vocab"]
    assert v["file"] == DRAFT_VOCAB_FILE and v["size"] == N and v["vocab_size"] == 272
    assert DRAFT_VOCAB_FILE in m["speculative"]["files"] and DRAFT_VOCAB_FILE in m["files"]
    assert "heldout.txt from character 4096" in v["ranking"] and v["calibration_tokens"] > 10000
    assert 0.99 <= v["coverage"] < 1
    ids = json.loads((bundle / DRAFT_VOCAB_FILE).read_text())["ids"]
    assert ids == sorted(ids) and len(set(ids)) == N
    assert set(v["special_ids"]) <= set(ids) and {256, 257, 258} <= set(v["special_ids"])
    assert {ord(" "), ord("e"), ord("\n")} <= set(ids) and ord("~") + 1 not in ids  # frequent in, DEL out
    logits = [o for o in m["speculative"]["draft"]["outputs"] if o["name"] == "logits"][0]
    assert logits["shape"] == [1, N]
    graph = onnx.load(str(bundle / "mtp.onnx"), load_external_data=False).graph
    out = [o for o in graph.output if o.name == "logits"][0]
    assert [d.dim_value for d in out.type.tensor_type.shape.dim][-1] == N
    # the head's own rows are stored in mtp.onnx.data: the decoder's LM head is still shared, not copied
    assert m["speculative"]["shares_weights"] and m["speculative"]["duplicated_bytes"] == 0
    assert any(t.name.startswith("mtp_draft_head") for t in graph.initializer)
    text = describe(inspect(bundle))
    assert f"draft vocabulary: {N} of 272 token ids ({DRAFT_VOCAB_FILE}, 99." in text


def test_sampling_with_a_draft_vocab_runs_and_is_seeded(tiny_dv):
    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    session = open_bundle(tiny_dv("fp32"))
    kw = dict(temperature=0.8, top_k=40, seed=3, stop_at_eos=False)
    a, st = generate_speculative(session, code_prompt(7), 48, 2, **kw)
    b, _ = generate_speculative(session, code_prompt(7), 48, 2, **kw)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 48
    assert st.accepted > 0


def test_accept_or_resample_is_exact_with_a_draft_outside_part_of_the_vocab():
    """A draft distribution that is zero outside a subset (scattered from the draft vocabulary) still gives tokens
    distributed as p, including tokens the draft can never propose."""
    from deltaship.runtimes.speculative import _scatter, accept_or_resample

    rng = np.random.default_rng(1)
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    ids = np.array([0, 2, 3])
    q = _scatter(np.array([0.2, 0.5, 0.3]), ids, p.size)
    assert q[1] == 0 and q[4] == 0
    n, counts = 40000, np.zeros(p.size)
    for _ in range(n):
        d = int(rng.choice(p.size, p=q))
        new = accept_or_resample(p, q, d, rng)
        counts[d if new is None else new] += 1
    assert np.abs(counts / n - p).max() < 0.01


def test_ranking_without_a_tokenizer_is_ascending_and_says_so():
    from deltaship.lowering.draft_vocab import rank, special_ids

    ids, rec = rank(1000, 10, special_ids({"eos": [999], "bos": None, "pad": 998}, 1000), None)
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 998, 999]
    assert rec["ranking"].startswith("ascending ids") and "costs only" in rec["ranking"]
    assert rec["coverage"] is None and "calibration_tokens" not in rec


def test_ranking_on_a_user_text(tmp_path):
    from deltaship.lowering.draft_vocab import rank
    from deltaship.models.presets import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("zzzz yyy xx w")
    ids, rec = rank(272, 5, [256], tmp_path / "tokenizer.json", text)
    assert ids.tolist() == sorted([ord("z"), ord("y"), ord(" "), ord("x"), 256])  # by count; space (3) beats x (2)
    assert rec["coverage"] == pytest.approx(12 / 13) and "t.txt (user file)" in rec["ranking"]


@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(mtp_draft_vocab="64"), "exported only with --mtp"),
        (dict(mtp=True, mtp_draft_vocab="1"), "at least 2 token ids"),
        (dict(mtp=True, mtp_draft_vocab="lots"), "a number of token ids or 'full'"),
        (dict(mtp=True, mtp_draft_vocab=273), "larger than the checkpoint's vocabulary \\(272"),
        (dict(mtp=True, mtp_draft_vocab=3), "always keeps the 3 special ids"),
        (dict(mtp=True, mtp_draft_vocab_text="x.txt"), "without --mtp-draft-vocab N"),
        (dict(mtp=True, mtp_draft_vocab=64, mtp_draft_vocab_text="/nonexistent.txt"), "no such file"),
    ],
)
def test_bad_draft_vocab_is_refused(tmp_path, opts, match):
    from deltaship.compile import export

    with pytest.raises(DeltashipError, match=match):
        export("qwen3.5-tiny", tmp_path / "b", max_context=32, verify=False, progress=False, **opts)
    assert not (tmp_path / "b").exists()


def test_cli_takes_the_option_for_every_mtp_target():
    from deltaship.cli import build_parser

    a = build_parser().parse_args(
        ["export", "--model", "qwen3.5-tiny", "--mtp", "--mtp-draft-vocab", "64", "--out", "x"]
    )
    assert a.mtp_draft_vocab == "64"
    from deltaship.targets import all_targets

    takers = {t.name for t in all_targets() for f in t.Options.fields() if f.name == "mtp_draft_vocab"}
    assert takers == {t.name for t in all_targets() for f in t.Options.fields() if f.name == "mtp"}


def test_ios_kit_refuses_a_draft_vocab_bundle():
    from deltaship.apps.swift_speculative import speculative_spec

    manifest = {
        "model": {"vocab_size": 272},
        "speculative": {"verify": {}, "draft": {"vocab": {"size": 53, "file": "mtp_draft_vocab.json"}}},
    }
    with pytest.raises(DeltashipError, match="covers 53 of 272 token ids.*full vocabulary only"):
        speculative_spec(manifest, [object()], lambda *a: None)


def test_weight_plan_takes_rows_and_reads_a_block_of_them():
    from deltaship.lowering.weight_plan import PlanError, WeightPlan

    table = np.arange(40, dtype=np.float32).reshape(10, 4)

    class Source:
        reads: list = []

        def read(self, name, rows=None):
            self.reads.append(rows)
            return table if rows is None else table[rows]

    plan = WeightPlan()
    plan.add_source("lm_head.weight", "lm_head.weight", (10, 4))
    plan.take_rows("draft.weight", "lm_head.weight", np.array([1, 4, 5, 9]))
    assert plan.shape("draft.weight") == (4, 4) and "lm_head.weight" in plan.names()
    src = Source()
    np.testing.assert_array_equal(plan.tensor("draft.weight", src), table[[1, 4, 5, 9]])
    np.testing.assert_array_equal(plan.tensor("draft.weight", src, slice(1, 3)), table[[4, 5]])
    assert src.reads[-1] == slice(4, 6)  # only the span of source rows the block needs
    big = np.arange(10000 * 2, dtype=np.float32).reshape(10000, 2)

    class Big(Source):
        def read(self, name, rows=None):
            self.reads.append(rows)
            return big[rows]

    plan.add_source("head.weight", "head.weight", (10000, 2))
    plan.take_rows("few.weight", "head.weight", np.array([0, 1, 2, 9998, 9999]))
    src = Big()
    np.testing.assert_array_equal(plan.tensor("few.weight", src, slice(0, 5)), big[[0, 1, 2, 9998, 9999]])
    assert src.reads[-2:] == [slice(0, 3), slice(9998, 10000)]  # two spans, not the 10,000 rows between
    with pytest.raises(PlanError, match="out of range"):
        plan.take_rows("bad.weight", "lm_head.weight", np.array([3, 10]))
    with pytest.raises(PlanError, match="only source tensors"):
        plan.take_rows("again.weight", "draft.weight", np.array([0]))


@pytest.mark.parametrize("target", ["executorch", "coreml"])
def test_other_targets_draft_over_the_subset_losslessly(tmp_path, target):
    """ExecuTorch (method mtp_draft) and Core ML (function mtp_draft, in the evaluator) take the option too: the
    draft's logits are [1, N] and greedy speculative decoding gives the plain greedy tokens (slow tier). ExecuTorch
    at int4 (its fp32 is tests/test_mtp_executorch.py's), over 64 new tokens."""
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.compile import export
    from deltaship.targets import open_bundle

    out = tmp_path / target
    int4 = target == "executorch"
    export("qwen3.5-tiny", out, target=target, precision="int4" if int4 else "fp32", max_context=128,
           prefill_chunk=CHUNK, mtp=True, mtp_draft_vocab=N, verify=False, progress=False)  # fmt: skip
    m = read_manifest(out)
    assert not schema_problems(m) and m["speculative"]["draft"]["vocab"]["size"] == N
    session = open_bundle(out)
    session.reset_draft()
    logits, _ = session.draft(np.zeros((1, 256), np.float32), np.array([ord("d")]), 0)
    assert logits.shape == (N,)
    runs = speculative_runs(session, (1, 7, 2 * CHUNK + 5), depths=(1,), new_tokens=64 if int4 else 48)
    accepted, drafted = sum(r.accepted for r in runs), sum(r.drafted for r in runs)
    assert accepted / drafted > 0.3
