"""The command line as a user runs it: real subprocesses, exit codes, messages, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deltaship.targets import open_bundle

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deltaship.cli", *args], capture_output=True, text=True, env=ENV, timeout=600
    )


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    r = run(
        "export",
        "--model",
        "qwen3.5-tiny",
        "--target",
        "onnx",
        "--precision",
        "fp32",
        "--max-context",
        "96",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "verification passed" in r.stderr and "pass rewrite_deltanet" in r.stderr
    return out


def test_generate_json_and_dump_logits(tiny_bundle, tmp_path):
    dump = tmp_path / "logits.npy"
    r = run(
        "generate",
        str(tiny_bundle),
        "--input-ids",
        "1,2,3",
        "--max-new-tokens",
        "6",
        "--json",
        "--dump-logits",
        str(dump),
        "--no-stop-at-eos",
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["input_ids"] == [1, 2, 3] and len(res["output_ids"]) == 6
    logits = np.load(dump)
    assert logits.shape == (6, 272) and logits.dtype == np.float32
    assert logits.argmax(-1).tolist() == res["output_ids"]  # row i is what chose token i
    # the same logits as the Python API, step by step
    s = open_bundle(tiny_bundle)
    np.testing.assert_allclose(s.prefill([1, 2, 3]), logits[0], atol=1e-6)
    np.testing.assert_allclose(s.decode(res["output_ids"][0]), logits[1], atol=1e-6)
    r = run("generate", str(tiny_bundle), "--input-ids", "1", "--dump-logits", str(dump))
    assert r.returncode == 2 and "already exists" in r.stderr


def test_generate_prompt_text(tiny_bundle):
    r = run("generate", str(tiny_bundle), "--prompt", "def ", "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["input_ids"] == [100, 101, 102, 32]  # the byte-level tokenizer: 'd' 'e' 'f' ' '
    assert isinstance(res["text"], str)


def test_inspect_human_and_tamper(tiny_bundle, tmp_path):
    r = run("inspect", str(tiny_bundle))
    assert r.returncode == 0, r.stderr
    for text in (
        "onnx / fp32",
        "past.0.recurrent",
        "deltanet_recurrent",
        "rewrite_deltanet",
        "all file hashes match",
        "verified    passed",
    ):
        assert text in r.stdout
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_bundle, copy)
    (copy / "tokenizer.json").write_text("{}")
    r = run("inspect", str(copy))
    # a bundle that fails its checks is bad input (2), not a deltaship bug (1)
    assert r.returncode == 2 and "FAILED" in r.stdout and "tokenizer.json" in r.stdout
    r = run("generate", str(copy), "--input-ids", "1")
    assert r.returncode == 2 and "tampered" in r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--input-ids", ",".join(["5"] * 97)], "exceed the bundle's max context of 96"),
        (["--input-ids", "1,999"], "outside the vocabulary"),
        (["--input-ids", "1,x"], "argument --input-ids: '1,x': item 2 of 2 is 'x'"),
        (["--input-ids", "1", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
        (["--input-ids", "1", "--top-p", "2"], "argument --top-p: must be in (0, 1]"),
        (["--input-ids", "1", "--top-k", "-5"], "argument --top-k: must be >= 1"),
    ],
)
def test_generate_bad_input(tiny_bundle, args, message):
    r = run("generate", str(tiny_bundle), *args)
    assert r.returncode == 2 and message in r.stderr and "fix:" in r.stderr and "Traceback" not in r.stderr


def test_export_bad_input(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = run("export", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "model_type 'llama' is not supported" in r.stderr and "qwen3_5" in r.stderr
    assert not (tmp_path / "o").exists()
    r = run("inspect", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "not a bundle directory" in r.stderr


def test_onnx_runtime_does_not_import_torch(tiny_bundle):
    code = (
        "import sys; from deltaship.commands import generate; "
        f"r = generate({str(tiny_bundle)!r}, input_ids=[1, 2], max_new_tokens=3, threads=1); "
        "assert len(r['output_ids']) >= 1; "
        "bad = [m for m in ('torch', 'transformers', 'executorch', 'coremltools') if m in sys.modules]; "
        "assert not bad, bad; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_cuda_provider_without_a_gpu_is_a_clear_error(tiny_bundle):
    """The GPU tier runs ONNX bundles on ONNX Runtime's CUDA provider; where this onnxruntime has none (the CPU
    package, as here), generate and profile say so and what to install, instead of quietly using the CPU."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has a CUDA provider: the error path cannot be shown here")
    for args in (
        ("generate", str(tiny_bundle), "--input-ids", "1,2", "--provider", "cuda"),
        ("profile", str(tiny_bundle), "--provider", "cuda", "--prompt-lengths", "8", "--gen", "4", "--contexts", "16"),
    ):
        r = run(*args)
        assert r.returncode == 2 and "no CUDA execution provider" in r.stderr and "onnxruntime-gpu" in r.stderr, (
            r.stderr
        )
    r = run("profile", str(tiny_bundle), "--provider", "cuda", "--device", "ssh://nobody@127.0.0.1:1")
    assert r.returncode == 2 and "is for --device host" in r.stderr


def test_generate_says_when_the_context_is_full(tiny_bundle):
    r = run(
        "generate", str(tiny_bundle), "--input-ids", ",".join(["5"] * 90), "--max-new-tokens", "20", "--no-stop-at-eos"
    )
    assert r.returncode == 0 and "max context is full" in r.stderr


def test_sigterm_during_export_leaves_nothing_and_stale_partials_are_swept(tmp_path):
    import signal
    import time

    out, mark = tmp_path / "b", tmp_path.parent / f"{tmp_path.name}.staged"
    # the child stops in its staging directory (as it writes the manifest) until the signal comes: without the pause a
    # tiny export can finish between the test's seeing the staging directory and its signal (a flaky race)
    pause = (
        "import pathlib, sys, time\nimport deltaship.bundle.writer as w\n"
        f"def stop(*a):\n    pathlib.Path({str(mark)!r}).touch()\n    time.sleep(600)\n"
        "w.write_manifest = stop\nfrom deltaship.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", pause, "export", "--model", "qwen3.5-tiny", "--max-context", "96", "--out", str(out)],
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not mark.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert mark.exists() and list(tmp_path.glob(".b.partial-*")), "the export never reached its staging directory"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "terminated; nothing was written" in err
    assert not list(tmp_path.iterdir())
    # a staging directory whose process is gone is swept by the next export to the same --out; a live one is kept
    stale, live = tmp_path / ".b.partial-999999999-x", tmp_path / ".b.partial-1-x"
    stale.mkdir()
    live.mkdir()
    r = run("export", "--model", "qwen3.5-tiny", "--max-context", "96", "--no-verify", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and live.exists()


def test_profile_options_become_one_profile_settings():
    """`deltaship profile`'s parsed options are one typed ProfileSettings, each field from its option, and the
    CLI's defaults are profile()'s."""
    from deltaship.cli import build_parser
    from deltaship.profiling.settings import ProfileSettings

    argv = ["profile", "b", "--device", "adb:X", "--prompt-lengths", "16,32", "--gen", "8", "--contexts", "64"]
    argv += ["--threads", "2", "--warmups", "0", "--reps", "3", "--min-seconds", "0.5", "--tier", "phone-4gb"]
    argv += ["--tiers", "t.toml", "--no-breakdown", "--json", "-", "--report", "r.html", "--ssh-option=-v"]
    argv += ["--remote-deltaship", "ds", "--runner", "run", "--runner-args", "{model}", "--provider", "cuda"]
    argv += ["--runtime", "genai", "--speculative", "mtp:2", "--acceptance", "0.5", "--image-sizes", "224"]
    assert ProfileSettings.from_args(build_parser().parse_args(argv)) == ProfileSettings(
        device="adb:X",
        prompt_lengths=[16, 32],
        gen=8,
        contexts=[64],
        threads=2,
        warmups=0,
        reps=3,
        min_seconds=0.5,
        tier="phone-4gb",
        tiers_file="t.toml",
        breakdown=False,
        json_out="-",
        report="r.html",
        ssh_options=["-v"],
        remote_deltaship="ds",
        runner="run",
        runner_args="{model}",
        provider="cuda",
        runtime="genai",
        speculative="mtp:2",
        acceptance=0.5,
        image_sizes="224",
    )
    assert ProfileSettings.from_args(build_parser().parse_args(["profile", "b"])) == ProfileSettings()
