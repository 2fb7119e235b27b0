"""Every ONNX bundle runs unmodified in onnxruntime-genai (the runtime apps embed): its own greedy loop
gives deltaship's tokens, its tokenizer gives deltaship's ids.

Needs the optional package: pip install "onnxruntime-genai>=0.18,<0.19" (deltaship[genai]). The tests of
what deltaship says without it run everywhere.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from deltaship.bundle.reader import read_manifest
from deltaship.compile import export
from deltaship.errors import DeltashipError
from deltaship.targets import open_bundle

PROMPT_LENGTHS = (1, 7, 20)  # one token, less than a prefill chunk (8), more than two chunks
NEW_TOKENS = 12
TEXT = (
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n"
    "\n\nclass Cache:\n    def __init__(self):\n        self.items = {}\n"
)


def _og():
    return pytest.importorskip("onnxruntime_genai", reason="optional runtime: pip install onnxruntime-genai==0.18.*")


def _genai_tokens(bundle: Path, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from onnxruntime-genai's own loop, as an app drives it (nothing of deltaship involved)."""
    og = _og()
    model = og.Model(str(bundle))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(ids, dtype=np.int32))
    out: list[int] = []
    while not gen.is_done() and len(out) < n:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def _assert_same_greedy(bundle: Path, prompts: list[list[int]]) -> None:
    from deltaship.runtimes.genai import open_genai

    session = open_genai(bundle)
    for ids in prompts:
        want = open_bundle(bundle).generate(ids, NEW_TOKENS).output_ids
        assert len(want) >= 2
        assert _genai_tokens(bundle, ids, NEW_TOKENS) == want, f"{bundle.name}: prompt of {len(ids)} tokens"
        session.reset()
        assert session.generate(ids, NEW_TOKENS).output_ids == want  # deltaship's genai session, genai's loop


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The trained tiny preset at each precision, prefill chunk 8 (prompts of 20 tokens take three calls)."""
    root = tmp_path_factory.mktemp("genai-tiny")

    def get(precision: str) -> Path:
        out = root / precision
        if not out.exists():
            export(
                "qwen3.5-tiny", out, precision=precision, max_context=256, prefill_chunk=8, verify=False, progress=False
            )
        return out

    return get


def _text_prompts(bundle: Path) -> list[list[int]]:
    from deltaship.runtimes.tokenizer import load_tokenizer

    ids = load_tokenizer(bundle, read_manifest(bundle)).encode(TEXT)
    assert len(ids) > max(PROMPT_LENGTHS)
    return [ids[:n] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_genai_runs_the_tiny_preset_bundle_as_deltaship_does(tiny, precision):
    _og()
    bundle = tiny(precision)
    cfg = json.loads((bundle / "genai_config.json").read_text())
    m = read_manifest(bundle)
    # genai feeds a prompt in the bundle's prefill chunks, and sizes its caches from the bundle
    assert cfg["search"]["chunk_size"] == m["prefill_chunk"] == 8
    assert cfg["model"]["context_length"] == cfg["search"]["max_length"] == m["max_context"]
    assert cfg["model"]["eos_token_id"] in (m["tokens"]["eos"], m["tokens"]["eos"][0])
    _assert_same_greedy(bundle, _text_prompts(bundle))


@pytest.mark.parametrize(
    "config,opts",
    [
        ("odd_heads", {}),
        ("grouped_values", {}),
        ("deltanet_only", {}),
        ("base", {"precision": "int4"}),
        ("multimodal", {}),
        ("odd_heads", {"onnx_deltanet_ops": "contrib"}),
    ],
)
def test_genai_runs_test_checkpoints_of_odd_shapes(bundles, config, opts):
    _og()
    bundle = bundles(config, **opts)
    m = read_manifest(bundle)
    cfg = json.loads((bundle / "genai_config.json").read_text())
    has_kv = any(s["kind"].startswith("kv_cache") for s in m["states"])
    assert ("past_key_names" in cfg["model"]["decoder"]["inputs"]) == has_kv  # deltanet_only: no KV cache
    # shared past/present DeltaNet buffers only where every kernel allows it (not the contrib conv)
    assert cfg["search"]["past_present_share_buffer"] == (opts.get("onnx_deltanet_ops") != "contrib")
    rng = np.random.default_rng(len(config))
    prompts = [[int(t) for t in rng.integers(0, m["model"]["vocab_size"] - 1, n)] for n in PROMPT_LENGTHS]
    _assert_same_greedy(bundle, prompts)


def test_genai_session_logits_and_timings(tiny):
    _og()
    from deltaship.runtimes.genai import open_genai

    bundle = tiny("fp32")
    ids = _text_prompts(bundle)[-1]
    s, ref = open_genai(bundle, threads=1), open_bundle(bundle, threads=1)
    # chunk by chunk through genai: the same logits as deltaship's session (same graph, same chunks)
    np.testing.assert_allclose(s.prefill(ids), ref.prefill(ids), rtol=0, atol=1e-5)
    np.testing.assert_allclose(s.decode(5), ref.decode(5), rtol=0, atol=1e-5)
    gen, times = s.timed_generate(ids, 6)
    assert gen.output_ids == open_bundle(bundle).generate(ids, 6).output_ids
    assert times["prefill_s"] > 0 and len(times["decode_s"]) == len(gen.output_ids) - 1
    with pytest.raises(DeltashipError, match="cannot be continued"):
        s.decode(5)
    s.reset()
    s.seek(30)  # reached by computing filler tokens
    assert s.position == 30 and np.isfinite(s.decode(5)).all()


def test_genai_tokenizer_matches_deltaships(tiny):
    og = _og()
    from deltaship.runtimes.tokenizer import load_tokenizer

    bundle = tiny("int4")
    want = load_tokenizer(bundle, read_manifest(bundle)).encode(TEXT + "héllo 中文")
    tok = og.Tokenizer(og.Model(str(bundle)))
    assert [int(t) for t in tok.encode(TEXT + "héllo 中文")] == want
    assert tok.decode(np.asarray(want, dtype=np.int32)) == TEXT + "héllo 中文"


def test_a_tokenizer_class_genai_refuses_is_rewritten_at_export(tmp_path):
    """transformers 5 checkpoints say Qwen3_5Tokenizer, which genai refuses; the bundle says
    PreTrainedTokenizerFast (same tokenizer.json), which genai, AutoTokenizer and deltaship all load."""
    og = _og()
    from transformers import AutoTokenizer

    from deltaship.models.source import load_source

    ckpt = tmp_path / "ckpt"
    shutil.copytree(load_source("qwen3.5-tiny").path, ckpt)
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(dict(tc, tokenizer_class="Qwen3_5Tokenizer")))
    before = AutoTokenizer.from_pretrained(str(ckpt)).encode(TEXT)
    out = tmp_path / "b"
    export(str(ckpt), out, precision="int4", max_context=128, verify=False, progress=False)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["deltaship_original_tokenizer_class"] == "Qwen3_5Tokenizer"
    assert AutoTokenizer.from_pretrained(str(out)).encode(TEXT) == before
    assert [int(t) for t in og.Tokenizer(og.Model(str(out))).encode(TEXT)] == before
    open_bundle(out)  # the manifest's hashes are those of the rewritten file


def test_genai_session_says_to_export_again_without_genai_config(bundles, tmp_path):
    _og()
    from deltaship.runtimes.genai import open_genai

    old = tmp_path / "old"
    shutil.copytree(bundles("base"), old)
    (old / "genai_config.json").unlink()  # what a bundle from before this version lacks
    m = json.loads((old / "manifest.json").read_text())
    del m["files"]["genai_config.json"]
    del m["lowering"]["genai"]  # nor did its manifest name one
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DeltashipError, match="no genai_config.json") as e:
        open_genai(old)
    assert "export the bundle again" in e.value.fix


def test_genai_session_refuses_an_entry_that_is_no_onnx_graph(bundles):
    """Constructed directly (open_bundle asks the target first), the session reads the bundle's entry: a program of
    another runtime is refused before genai is imported."""
    from deltaship.runtimes.genai import GenaiSession

    m = read_manifest(bundles("base"))
    m["target"], m["entry"] = "executorch", "model.pte"
    with pytest.raises(DeltashipError, match=r"onnxruntime-genai runs ONNX graphs; this bundle's entry is 'model.pte'"):
        GenaiSession(bundles("base"), m)


def test_genai_session_names_the_package_when_it_is_missing(bundles, monkeypatch):
    from deltaship.runtimes.genai import open_genai

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails as if not installed
    with pytest.raises(DeltashipError, match="onnxruntime-genai is not installed") as e:
        open_genai(bundles("base"))
    assert "pip install" in e.value.fix and "onnxruntime-genai" in e.value.fix


_DECODE_ALLOCATIONS = """
import sys
import numpy as np
from deltaship.runtimes.genai import open_genai
s = open_genai(sys.argv[1], threads=1)

s.prefill(list(range(5, 25)))
print("=== DECODE", flush=True)
for t in range(3):
    s.decode(7 + t)
print("=== END", flush=True)
"""


def test_genai_decode_steps_reuse_an_exact_memory_pattern(tiny, tmp_path):
    """ONNX Runtime keys its cached memory patterns by the XOR of all input dims. genai feeds input_ids [1, T] and
    the sequence-length pair ([1], [1, 1]): the key is T, so the first prefill and the decode steps each keep a
    pattern of their own, and no decode step falls back to allocating tensor by tensor (what ORT's verbose log
    says when a call misses the pattern stored under its key: "fall back to default allocation behavior"). With
    position_ids [1, T] in place of the pair, T cancelled and every decode step missed the prefill's pattern."""
    import os
    import subprocess
    import sys

    _og()
    script = tmp_path / "decode.py"
    script.write_text(_DECODE_ALLOCATIONS)
    env = {**os.environ, "ORTGENAI_ORT_VERBOSE_LOGGING": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run(
        [sys.executable, str(script), str(tiny("fp32"))],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream: the markers and ORT's log in order
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    assert "fall back to default allocation behavior" not in run.stdout.split("=== DECODE", 1)[0]  # the prefill
    decode = run.stdout.split("=== DECODE", 1)[1].split("=== END", 1)[0]
    assert "[V:onnxruntime" in run.stdout  # the verbose log is on
    assert decode.count("fall back to default allocation behavior") == 0, decode[:2000]


def test_genai_positions_count_prompts_holding_special_ids(tiny):
    """genai advances current_sequence_length by the appended tokens before the first pad_token_id: a multi-turn
    chat holds the eos ids (<|im_end|>, <|endoftext|>) mid-prompt, and genai must still count every token (the
    bundle's pad id is one no prompt holds)."""
    og = _og()
    bundle = tiny("int4")
    m = read_manifest(bundle)
    cfg = json.loads((bundle / "genai_config.json").read_text())
    vocab = m["model"]["vocab_size"]
    assert not 0 <= cfg["model"]["pad_token_id"] < vocab
    text = _text_prompts(bundle)[-1]
    specials = [int(t) for t in m["tokens"]["eos"]] + [t for t in (m["tokens"].get("pad"),) if t is not None]
    ids = text[:4] + specials + text[4:9] + specials[:1] + text[9:13]  # > one prefill chunk (8)
    want = open_bundle(bundle).generate(ids, NEW_TOKENS, stop_at_eos=False).output_ids
    model = og.Model(str(bundle))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + NEW_TOKENS, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(ids, dtype=np.int32))
    got = []
    while len(got) < NEW_TOKENS and not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    assert got == want[: len(got)] and len(got) >= 2


def test_genai_profile_measures_prefill_and_decode(tiny):
    """deltaship profile --runtime genai: prefill and decode measured in genai; the context sweep (a synthetic fill
    of KV buffers genai keeps to itself) is reported as not measured instead of killing the run."""
    _og()
    from deltaship.profiling.profile import profile

    doc = profile(
        tiny("int4"),
        prompt_lengths=[8],
        gen=4,
        contexts=[16],
        warmups=0,
        reps=2,
        min_seconds=0.0,
        threads=1,
        breakdown=False,
        runtime="genai",
    )
    got = {r["metric"]: r for r in doc["results"]}
    assert "died" not in {r.get("status") for r in doc["results"]}, doc["results"]
    assert got["prefill_tok_s"]["samples"] and got["decode_tok_s"]["samples"]
    sweep = got["decode_latency_s"]
    assert sweep["flags"] == ["not-measured"] and "onnxruntime-genai" in sweep["note"]
