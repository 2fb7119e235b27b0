"""The Hugging Face way in: Hub ids from the local cache, the transformers-style model class, optimum-cli."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import write_checkpoint

from deltaship.errors import DeltashipError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return write_checkpoint("base", tmp_path_factory.mktemp("hub-src") / "ckpt", seed=3)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache of our own: HF_HOME and HF_HUB_CACHE point into tmp_path."""
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return cache


def put_in_cache(cache: Path, repo_id: str, ckpt: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """Lay a checkpoint out as huggingface_hub does: models--org--name/snapshots/<commit>/, refs/<ref> = commit."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    shutil.copytree(ckpt, snapshot)
    if ref is not None:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def export_tiny(model: str, out: Path) -> dict:
    from deltaship.compile import export

    return export(
        model, out, target="onnx", precision="fp32", max_context=64, prefill_chunk=8, verify=False, progress=False
    )


def test_hub_id_exports_from_the_cache_with_repo_and_commit(hf_cache, tiny_ckpt, tmp_path):
    put_in_cache(hf_cache, "acme/tiny-qwen", tiny_ckpt)
    manifest = export_tiny("acme/tiny-qwen", tmp_path / "b")
    assert manifest["model_card"]["source_repo"] == "acme/tiny-qwen"
    assert manifest["model_card"]["revision"] == COMMIT
    assert manifest["source"]["model"] == f"acme/tiny-qwen@{COMMIT}"  # loadable again, pinned to the commit
    on_disk = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert on_disk["model_card"]["revision"] == COMMIT


def test_hub_id_at_a_commit_picks_that_snapshot(hf_cache, tiny_ckpt, tmp_path):
    put_in_cache(hf_cache, "acme/tiny-qwen", tiny_ckpt, commit=COMMIT)
    other = write_checkpoint("base", tmp_path / "other", seed=11)
    put_in_cache(hf_cache, "acme/tiny-qwen", other, commit=OTHER_COMMIT, ref=None)  # not main
    from deltaship.models.source import load_source

    pinned, main = load_source(f"acme/tiny-qwen@{OTHER_COMMIT}"), load_source("acme/tiny-qwen")
    assert pinned.model_card()["revision"] == OTHER_COMMIT and main.model_card()["revision"] == COMMIT
    assert pinned.fingerprint() != main.fingerprint()  # different weights, not the same snapshot twice
    manifest = export_tiny(f"acme/tiny-qwen@{OTHER_COMMIT}", tmp_path / "b")
    assert (manifest["model_card"]["source_repo"], manifest["model_card"]["revision"]) == (
        "acme/tiny-qwen",
        OTHER_COMMIT,
    )


def test_hub_id_at_a_branch_resolves_to_its_commit(hf_cache, tiny_ckpt):
    put_in_cache(hf_cache, "acme/tiny-qwen", tiny_ckpt, commit=OTHER_COMMIT, ref="dev")
    from deltaship.models.source import load_source

    assert load_source("acme/tiny-qwen@dev").model_card()["revision"] == OTHER_COMMIT


def test_unknown_hub_id_offline_names_cache_and_command(hf_cache, tmp_path):
    with pytest.raises(DeltashipError) as e:
        export_tiny("acme/not-there", tmp_path / "b")
    assert "acme/not-there" in e.value.message and str(hf_cache) in e.value.message
    assert "download acme/not-there" in e.value.fix and "--allow-download" in e.value.fix
    assert not (tmp_path / "b").exists()


def test_absent_revision_lists_the_cached_ones(hf_cache, tiny_ckpt, tmp_path):
    put_in_cache(hf_cache, "acme/tiny-qwen", tiny_ckpt)
    with pytest.raises(DeltashipError) as e:
        export_tiny("acme/tiny-qwen@v9", tmp_path / "b")
    assert "'v9'" in e.value.message and COMMIT in e.value.message and "main" in e.value.message
    assert "download acme/tiny-qwen --revision v9" in e.value.fix


def test_hub_checkpoint_of_another_architecture_is_refused(hf_cache, tmp_path):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "vocab_size": 100,
            }
        )
    )
    put_in_cache(hf_cache, "acme/tiny-llama", llama)
    with pytest.raises(DeltashipError) as e:
        export_tiny("acme/tiny-llama", tmp_path / "b")
    assert "acme/tiny-llama" in e.value.message and "'llama'" in e.value.message and "qwen3_5" in e.value.message
    assert "Qwen3.5" in e.value.fix


def test_download_is_refused_when_hf_hub_offline_is_set(hf_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from deltaship.models.source import load_source

    with pytest.raises(DeltashipError) as e:
        load_source("acme/not-there", allow_download=True)
    assert "HF_HUB_OFFLINE" in e.value.message and "download acme/not-there" in e.value.fix


def test_a_local_directory_wins_over_a_hub_id_and_nonsense_is_named(tmp_path, monkeypatch, tiny_ckpt):
    from deltaship.models.source import load_source

    monkeypatch.chdir(tiny_ckpt.parent.parent)
    src = load_source(f"{tiny_ckpt.parent.name}/{tiny_ckpt.name}")  # relative path shaped like org/name
    assert src.kind == "checkpoint" and src.model_card()["source_repo"] is None
    with pytest.raises(DeltashipError) as e:
        load_source("not a/model id!")
    assert "Hub id" in e.value.message


# ---- the model class: generate(), pipeline(), streamers over a bundle ------------------------------------------

PROMPTS = ["import os\nimport ", "class Foo:\n    def __init__(self"]  # greedy continuations that vary


def export_preset(out: Path, target: str, **opts) -> Path:
    from deltaship.compile import export

    export("qwen3.5-tiny", out, target=target, precision="fp32", verify=False, progress=False, **opts)
    return out


@pytest.fixture(scope="module")
def onnx_bundle(tmp_path_factory) -> Path:
    return export_preset(tmp_path_factory.mktemp("hf-onnx") / "b", "onnx", max_context=256, prefill_chunk=16)


@pytest.fixture(scope="module")
def et_bundle(tiny_pte) -> Path:
    return tiny_pte("fp32")


def check_generation_matches_deltaship(bundle: Path) -> None:
    """generate() and pipeline() (greedy, 16 tokens) give `deltaship generate`'s tokens, prompt after prompt."""
    from transformers import AutoTokenizer, pipeline

    from deltaship import load
    from deltaship.commands import generate

    model, tok = load(bundle), AutoTokenizer.from_pretrained(bundle)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    for prompt in PROMPTS:
        want = generate(bundle, prompt=prompt, max_new_tokens=16)
        enc = tok(prompt, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == want["input_ids"]  # AutoTokenizer reads the bundle's tokenizer
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
        assert out[0, enc["input_ids"].shape[1] :].tolist() == want["output_ids"]
        res = pipe(prompt, max_new_tokens=16, do_sample=False, return_tensors=True)
        assert res[0]["generated_token_ids"] == want["input_ids"] + want["output_ids"]
        assert pipe(prompt, max_new_tokens=16, do_sample=False)[0]["generated_text"] == prompt + want["text"]
    assert len({tuple(generate(bundle, prompt=p, max_new_tokens=4)["output_ids"]) for p in PROMPTS}) == 2


def test_generate_and_pipeline_match_deltaship_generate_onnx(onnx_bundle):
    check_generation_matches_deltaship(onnx_bundle)


@pytest.mark.slow
def test_generate_and_pipeline_match_deltaship_generate_executorch(et_bundle):
    check_generation_matches_deltaship(et_bundle)


def test_eos_stops_both_the_same_way(onnx_bundle):
    """An end-of-sequence token ends generate() where the session's stop_at_eos does, and is kept in the output."""
    from transformers import AutoTokenizer

    from deltaship import load
    from deltaship.targets import open_bundle

    model, tok = load(onnx_bundle), AutoTokenizer.from_pretrained(onnx_bundle)
    ids = tok(PROMPTS[0])["input_ids"]
    newline = tok("\n")["input_ids"][0]
    session = open_bundle(onnx_bundle)
    session.eos_ids = {newline}  # '\n' comes 4th in this continuation: stop there
    want = session.generate(ids, 16, stop_at_eos=True)
    assert want.stopped == "eos" and 1 < len(want.output_ids) < 16 and want.output_ids[-1] == newline
    out = model.generate(
        **tok(PROMPTS[0], return_tensors="pt"), max_new_tokens=16, do_sample=False, eos_token_id=newline
    )
    assert out[0, len(ids) :].tolist() == want.output_ids


def test_streamer_receives_the_text(onnx_bundle):
    from transformers import AutoTokenizer, TextStreamer

    from deltaship import load
    from deltaship.commands import generate

    class Collect(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            pieces.append(text)

    pieces: list[str] = []
    model, tok = load(onnx_bundle), AutoTokenizer.from_pretrained(onnx_bundle)
    model.generate(
        **tok(PROMPTS[1], return_tensors="pt"),
        max_new_tokens=16,
        do_sample=False,
        streamer=Collect(tok, skip_prompt=True),
    )
    assert "".join(pieces) == generate(onnx_bundle, prompt=PROMPTS[1], max_new_tokens=16)["text"]
    assert len(pieces) > 1  # streamed in pieces, not once at the end


def test_sampling_is_seeded_and_continuing_a_cache_equals_one_call(onnx_bundle):
    import torch
    from transformers import AutoTokenizer

    from deltaship import load
    from deltaship.oracle.compat import CACHE_NAME, output_cache

    model, tok = load(onnx_bundle), AutoTokenizer.from_pretrained(onnx_bundle)
    enc = tok(PROMPTS[0], return_tensors="pt")
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(model.generate(**enc, max_new_tokens=12, do_sample=True, temperature=1.5, top_k=20)[0].tolist())
    assert runs[0] == runs[1]
    # generate() with the cache a previous call returned continues the session instead of starting over: under the
    # name this transformers gives it (`cache` from 5.24) and under 5.23's `past_key_values` (5.24 still takes it)
    whole = model.generate(**enc, max_new_tokens=12, do_sample=False)[0].tolist()
    for name in dict.fromkeys([CACHE_NAME, "past_key_values"]):
        first = model.generate(**enc, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        more = model.generate(
            first.sequences,
            attention_mask=torch.ones_like(first.sequences),
            max_new_tokens=6,
            do_sample=False,
            **{name: output_cache(first)},
        )
        assert more[0].tolist() == whole, name
        # and the session consumed the sequence once: all of it but the last token, which no call has fed yet (a
        # continuation fed whole again would leave the greedy tokens of this repetitive prompt unchanged)
        assert model.session.position == more.shape[1] - 1, name


def test_batches_and_padding_are_refused_clearly(onnx_bundle):
    from transformers import AutoTokenizer

    from deltaship import load
    from deltaship.oracle.compat import CACHE_NAME

    model, tok = load(onnx_bundle), AutoTokenizer.from_pretrained(onnx_bundle)
    enc = tok(PROMPTS[0], return_tensors="pt")
    with pytest.raises(DeltashipError) as e:
        model.generate(**enc, max_new_tokens=2, do_sample=False, num_beams=2)
    assert "batch size 1" in e.value.message and "num_beams=1" in e.value.fix
    with pytest.raises(DeltashipError) as e:  # a cache the session did not fill (here: not even a cache)
        model(enc["input_ids"], **{CACHE_NAME: object()})
    assert "got a object" in e.value.message and CACHE_NAME in e.value.fix
    with pytest.raises(DeltashipError, match="bundle"):
        load(onnx_bundle.parent)  # not a bundle directory


def test_load_and_generate_of_an_onnx_bundle_import_no_torch(onnx_bundle):
    """deltaship.load() of an ONNX bundle and generate() on text or ids run on onnxruntime and tokenizers alone: no
    torch, transformers, executorch or coremltools (each costs seconds to import), and say nothing on stderr.
    `import deltaship` + load() take under 2 s: measured as the process's CPU seconds (about 0.45 s here), which
    other jobs on a shared machine do not inflate as they do wall time."""
    import subprocess
    import sys

    from deltaship.commands import generate

    code = (
        "import time; t = time.process_time(); import sys, json, deltaship; m = deltaship.load(sys.argv[1]); "
        "t = time.process_time() - t; assert not isinstance(m, str); "
        "print(json.dumps([m.generate(sys.argv[2], max_new_tokens=8), m.generate([1, 2, 3], max_new_tokens=4), "
        "sorted(k for k in ('torch', 'transformers', 'executorch', 'coremltools') if k in sys.modules), t]))"
    )
    res = subprocess.run([sys.executable, "-c", code, str(onnx_bundle), PROMPTS[0]], capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    text, ids, heavy, load_cpu_s = json.loads(res.stdout)
    assert heavy == []
    assert load_cpu_s < 2.0, f"import deltaship + load() took {load_cpu_s:.2f} s of CPU (the promise: under 2 s)"
    assert text == generate(onnx_bundle, prompt=PROMPTS[0], max_new_tokens=8)["text"]
    assert ids == generate(onnx_bundle, input_ids=[1, 2, 3], max_new_tokens=4)["output_ids"]


def test_pipeline_takes_the_loaded_model_without_complaint(onnx_bundle, caplog):
    """pipeline() accepts what load() returns as a causal LM it supports: no "is not supported for text-generation"
    error with ~200 model names; native and transformers generation interleave on the one session."""
    from transformers import AutoTokenizer, PreTrainedModel, pipeline

    from deltaship import load

    model, tok = load(onnx_bundle), AutoTokenizer.from_pretrained(onnx_bundle)
    assert isinstance(model, PreTrainedModel)
    with caplog.at_level("WARNING", logger="transformers"):
        text = pipeline("text-generation", model=model, tokenizer=tok)(PROMPTS[1], max_new_tokens=8, do_sample=False)
    assert "not supported" not in caplog.text
    assert text[0]["generated_text"] == PROMPTS[1] + model.generate(PROMPTS[1], max_new_tokens=8)
    enc = tok(PROMPTS[1], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, enc["input_ids"].shape[1] :]) == model.generate(PROMPTS[1], max_new_tokens=8)
    with pytest.raises(DeltashipError, match="num_beams"):
        model.generate(PROMPTS[1], num_beams=2)


def test_import_deltaship_is_thin_and_export_is_callable():
    import subprocess
    import sys

    code = (
        "import sys, deltaship; from deltaship import export, load; import deltaship.compile, deltaship.lowering; "
        "assert deltaship.export is export is deltaship.compile.export and callable(export), deltaship.export; "
        "assert 'torch' not in sys.modules, sorted(sys.modules); "
        "print(deltaship.__version__)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cli = subprocess.run([sys.executable, "-m", "deltaship", "--version"], capture_output=True, text=True)
    assert cli.returncode == 0 and cli.stdout.strip() == f"deltaship {res.stdout.strip()}"


# ---- optimum-cli export deltaship ------------------------------------------------------------------------------


def _optimum_cli() -> str:
    """The optimum-cli beside this interpreter; the test skips (saying why) when optimum is not installed."""
    import importlib.util
    import sys

    if importlib.util.find_spec("optimum.commands.optimum_cli") is None:
        pytest.skip("optimum is not installed: pip install 'deltaship[optimum]' to test `optimum-cli export deltaship`")
    exe = Path(sys.executable).parent / "optimum-cli"
    if not exe.exists():
        pytest.skip(f"optimum is installed but {exe} is missing: reinstall optimum")
    return str(exe)


def test_optimum_cli_export_deltaship_writes_the_same_bundle(tmp_path, hf_cache):
    import os
    import subprocess

    from deltaship.cli import main

    root = Path(__file__).resolve().parents[1]  # where optimum/commands/register/ lives in a source checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    cli = _optimum_cli()
    helped = subprocess.run([cli, "export", "deltaship", "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0, helped.stderr
    for flag in ("--model", "--target", "--precision", "--allow-download", "--onnx-deltanet-ops", "OUT"):
        assert flag in helped.stdout
    common = [
        "--model",
        "qwen3.5-tiny",
        "--target",
        "onnx",
        "--precision",
        "int4",
        "--max-context",
        "64",
        "--no-verify",
        "--quiet",
    ]
    res = subprocess.run(
        [cli, "export", "deltaship", *common, str(tmp_path / "via-optimum")], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    assert main(["export", *common, "--out", str(tmp_path / "via-deltaship")]) == 0
    ours, theirs = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("via-optimum", "via-deltaship"))
    assert ours["precision"] == "int4" and ours["files"] and ours["files"] == theirs["files"]  # same sha256 per file
    bad = subprocess.run(
        [cli, "export", "deltaship", "--model", "acme/not-there", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "Hugging Face cache" in bad.stderr and "fix: fetch it with" in bad.stderr
