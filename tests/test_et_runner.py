"""ExecuTorch's own C++ LLM runner (TextLLMRunner, the Android/iOS LLM runner) on deltaship .pte files, unmodified:
the same greedy text as `deltaship generate` for prompts shorter and longer than a prefill chunk, a clear failure
past the context, and the kernel libraries the manifest tells an app to link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltaship.commands import generate
from deltaship.errors import DeltashipError
from deltaship.runtimes.et_runner import generate_with_runner, profile_with_runner
from deltaship.runtimes.tokenizer import load_tokenizer

CONTEXT, CHUNK = 128, 16
HELDOUT = Path(__file__).parents[1] / "deltaship" / "models" / "data" / "qwen3.5-tiny" / "heldout.txt"
SHORT = "def "


def long_prompt() -> str:
    """Real source text, cut mid-line (60 characters: 60 tokens of the tiny byte-level vocabulary, 4 chunks)."""
    text = HELDOUT.read_text()
    return text[text.index("class Chunk:") :][:60]


@pytest.fixture(scope="module")
def ptes(tiny_pte):
    """The trained tiny preset as fp32 and int4 programs, prefill chunk 16 over a 128-token context (conftest)."""
    return {precision: tiny_pte(precision) for precision in ("fp32", "int4")}


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_metadata_splits_prompts_by_the_prefill_chunk(ptes):
    from executorch.runtime import Runtime

    prog = Runtime.get().load_program(str(ptes["fp32"] / "model.pte"))
    meta = {n: prog.load_method(n).execute([])[0] for n in ("get_max_seq_len", "get_max_context_len")}
    assert meta == {"get_max_seq_len": CHUNK, "get_max_context_len": CONTEXT}


@pytest.mark.parametrize("precision", ["fp32", "int4"])
@pytest.mark.parametrize("which", ["short", "long"])
def test_runner_greedy_text_equals_deltaship_generate(ptes, precision, which):
    path = ptes[precision]
    prompt = SHORT if which == "short" else long_prompt()
    n_prompt = len(load_tokenizer(path, manifest(path)).encode(prompt))
    assert (n_prompt < CHUNK) if which == "short" else (CHUNK * 2 < n_prompt < CONTEXT - 40), n_prompt
    ours = generate(path, prompt=prompt, max_new_tokens=24)
    theirs = generate_with_runner(path, prompt, max_new_tokens=24)
    assert theirs["prompt_tokens"] == theirs["stats"]["prompt_tokens"] == n_prompt  # no BOS added by either
    assert theirs["text"] == ours["text"], (theirs["text"], ours["text"])
    assert theirs["new_tokens"] == len(ours["output_ids"]) and theirs["stopped"] == ours["stopped"]
    assert len(ours["text"].strip()) >= 8  # real text, not one repeated token
    assert theirs["stats"]["decode_s"] >= 0 and theirs["stats"]["prefill_s"] >= 0


def test_runner_stops_at_the_context_like_deltaship(ptes):
    """Asked for more tokens than the context holds, the driver stops where deltaship's session does."""
    path, prompt = ptes["fp32"], long_prompt()
    ours = generate(path, prompt=prompt, max_new_tokens=500, stop_at_eos=False)
    if ours["stopped"] != "context":
        pytest.fail(f"expected the session to reach the context, it stopped at {ours['stopped']}")
    theirs = generate_with_runner(path, prompt, max_new_tokens=500)
    if theirs["stopped"] == "eos":  # the runner always stops at EOS; compare up to there
        assert ours["text"].startswith(theirs["text"])
    else:
        assert theirs["stopped"] == "context" and theirs["text"] == ours["text"]
        assert theirs["prompt_tokens"] + theirs["new_tokens"] - 1 == CONTEXT


def test_program_refuses_positions_past_the_context(ptes, capfd):
    """With get_max_seq_len < get_max_context_len the runner checks only prompt < context; asked for more new
    tokens than fit, the program itself fails (llama::update_cache's bound) instead of writing past the cache."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    path = ptes["fp32"]
    runner = TextLLMRunner(str(path / "model.pte"), str(path / "tokenizer.json"))
    config = GenerationConfig(echo=False, max_new_tokens=CONTEXT + 50, temperature=0.0)
    with pytest.raises(RuntimeError):
        runner.generate(long_prompt(), config)
    err = capfd.readouterr().err
    assert f"start_pos: {CONTEXT} must be less than cache size at dim 1: {CONTEXT}" in err, err[-2000:]
    assert "llama::update_cache" in err
    # the prompt alone past the context is the runner's own check
    with pytest.raises(DeltashipError, match="fewer than the bundle's max context"):
        generate_with_runner(path, long_prompt() * 8, max_new_tokens=4)


def test_cli_generate_with_the_runner_keeps_stderr_quiet(tiny_pte):
    """`deltaship generate --runtime et-runner` prints the text and nothing on stderr: the runner's stats report and
    cpuinfo's probe are caught (`deltaship --verbose` shows them, which proves this test would see them)."""
    env = {k: v for k, v in os.environ.items() if k != "DELTASHIP_VERBOSE"}
    args = ["generate", str(tiny_pte("fp32")), "--prompt", SHORT, "--max-new-tokens", "8", "--runtime", "et-runner"]
    runs = {
        flag: subprocess.run(
            [sys.executable, "-m", "deltaship", *flag, *args], capture_output=True, text=True, env=env, timeout=300
        )
        for flag in ((), ("--verbose",))
    }
    quiet, loud = runs[()], runs[("--verbose",)]
    assert quiet.returncode == 0 and quiet.stdout.startswith(SHORT) and len(quiet.stdout.strip()) > len(SHORT), quiet
    assert quiet.stderr == "", quiet.stderr
    assert loud.returncode == 0 and loud.stdout == quiet.stdout and loud.stderr.strip(), loud


def test_driver_refuses_other_bundles(bundles):
    """Called directly (not through the target's text_runtime), the runner reads the bundle's entry: an ONNX graph is
    refused before anything is loaded (no ExecuTorch export needed)."""
    with pytest.raises(DeltashipError, match=r"runs ExecuTorch programs \(.pte\); this bundle's entry is 'model.onnx'"):
        generate_with_runner(bundles("base"), SHORT)


def test_manifest_names_the_kernel_libraries_the_program_needs(ptes):
    fp32, int4 = (manifest(ptes[p])["lowering"] for p in ("fp32", "int4"))
    assert any(op.startswith("quantized_decomposed::embedding_4bit") for op in int4["operators"])
    assert not any(op.startswith("quantized_decomposed::") for op in fp32["operators"])
    r32, r4 = fp32["runtime_requirements"], int4["runtime_requirements"]
    for r in (r32, r4):
        assert {"custom_ops", "xnnpack_backend", "optimized_native_cpu_ops_lib"} <= set(r["cpp_link"])
        assert {"kernels_llm", "backend_xnnpack", "executorch_llm"} <= set(r["ios"]["frameworks"])
        assert "executorch.extension.llm.custom_ops.custom_ops" in r["python"]
    assert "quantized_ops_lib" in r4["cpp_whole_archive"] and "kernels_quantized" in r4["ios"]["frameworks"]
    assert "executorch.kernels.quantized" in r4["python"]
    assert "quantized_ops_lib" not in r32["cpp_link"] and "kernels_quantized" not in r32["ios"]["frameworks"]
    assert "executorch.kernels.quantized" not in r32["python"]


LOAD = """
import importlib, json, sys
path, modules = sys.argv[1], json.loads(sys.argv[2])
for m in modules:
    importlib.import_module(m)
from executorch.runtime import Runtime
Runtime.get().load_program(path).load_method("forward")
print("loaded")
"""


@pytest.mark.parametrize(
    "precision,drop,loads",
    [("fp32", None, True), ("int4", None, True), ("int4", "executorch.kernels.quantized", False)],
)
def test_the_listed_python_imports_are_what_loading_needs(ptes, precision, drop, loads):
    """In a fresh process, importing exactly the manifest's list loads the program; without the quantized
    kernels the int4 program does not load (so the list is both sufficient and not padded)."""
    path = ptes[precision]
    modules = [m for m in manifest(path)["lowering"]["runtime_requirements"]["python"] if m != drop]
    r = subprocess.run(
        [sys.executable, "-c", LOAD, str(path / "model.pte"), json.dumps(modules)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if loads:
        assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-2000:]
    else:
        assert r.returncode != 0 and "embedding_4bit" in r.stderr, r.stderr[-2000:]


def test_profile_with_runner_reports_the_runners_own_rates(ptes):
    out = profile_with_runner(ptes["int4"], prompt_length=48, gen=32, reps=2)
    assert all(run["prompt_tokens"] == 48 and run["decode_calls"] == 31 for run in out["runs"])
    by = {r["metric"]: r for r in out["results"]}
    assert set(by) == {"prefill_tok_s", "decode_tok_s", "ttft_s"}
    for metric in ("prefill_tok_s", "decode_tok_s"):
        rec = by[metric]
        assert rec["prompt_length"] == 48 and rec["gen"] == 32
        assert rec["samples"] and all(s > 0 for s in rec["samples"]) and rec["median"] > 0
