"""--onnx-opset 27: DeltaNet as the standard ai.onnx LinearAttention and CausalConvWithState ops.

deltaship's own onnxruntime (1.31) refuses opset 27, so the bundles run in ONNX Runtime 1.32 from an isolated
virtual environment (the `ort132` fixture creates it with pip from the package index, once, under
~/.cache/deltaship; DELTASHIP_ORT_PYTHON names an existing one instead) through deltaship's worker
(deltaship/runtimes/ort_worker.py), and are compared with the default opset-21 bundle in ONNX Runtime 1.31
and, through export-time verification, with transformers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from deltaship.bundle import read_manifest, schema_problems
from deltaship.compile import export
from deltaship.errors import DeltashipUnavailable
from deltaship.runtimes.ort_worker import ENV
from deltaship.targets import open_bundle

ORT_VERSION = "1.32.0"
GENAI_VERSION = "0.18.0"  # onnxruntime-genai drives the onnxruntime installed beside it
# pip's words when it cannot reach the package index (the only case in which the ORT 1.32 tests skip)
OFFLINE = (
    "NewConnectionError",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Failed to establish a new connection",
    "No matching distribution found for onnxruntime==",
)


@pytest.fixture(scope="session")
def ort132() -> str:
    """A Python with onnxruntime 1.32, onnxruntime-genai 0.18 and numpy: $DELTASHIP_ORT_PYTHON, or a venv made
    once with pip."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    root = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "deltaship"
        / f"venv-ort{ORT_VERSION}-genai{GENAI_VERSION}"
    )
    python = root / "bin" / "python"
    marker = root / "deltaship-ready"
    if not marker.is_file():
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        r = subprocess.run(
            [
                *(str(python), "-m", "pip", "install", "-q"),
                *(f"onnxruntime=={ORT_VERSION}", f"onnxruntime-genai=={GENAI_VERSION}", "numpy"),
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            tail = (r.stdout + r.stderr)[-800:]
            shutil.rmtree(root, ignore_errors=True)
            if any(s in tail for s in OFFLINE):
                pytest.skip(f"pip cannot reach the package index for onnxruntime=={ORT_VERSION}: {tail}")
            raise AssertionError(f"pip install onnxruntime=={ORT_VERSION} failed:\n{tail}")
        marker.write_text(ORT_VERSION + "\n")
    out = subprocess.run(
        [str(python), "-c", "import onnxruntime; print(onnxruntime.__version__)"], capture_output=True, text=True
    )
    assert out.stdout.strip() == ORT_VERSION, out.stderr
    return str(python)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The trained tiny preset at opset 21 (default) and 27, by precision."""
    root = tmp_path_factory.mktemp("opset27")
    cache: dict[tuple, Path] = {}

    def get(opset: int, precision: str = "fp32", model: str = "qwen3.5-tiny") -> Path:
        key = (opset, precision, model)
        if key not in cache:
            out = root / f"{Path(model).name}-{precision}-{opset}"
            kw = {} if opset == 21 else {"onnx_opset": opset}
            export(
                model, out, precision=precision, max_context=128, prefill_chunk=8, verify=False, progress=False, **kw
            )
            assert not schema_problems(read_manifest(out))
            cache[key] = out
        return cache[key]

    return get


def test_opset27_graph_is_standard_onnx(tiny):
    bundle = tiny(27)
    m = read_manifest(bundle)
    model = onnx.load(bundle / "model.onnx")
    # onnx 1.23's checker and strict shape inference accept the graph (they skip com.microsoft's GQA only; the
    # fp16, int4 and odd-shaped graphs are checked in the test below)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 27), ("com.microsoft", 1)}
    ops = {(n.domain or "", n.op_type) for n in model.graph.node}
    assert ("", "LinearAttention") in ops and ("", "CausalConvWithState") in ops
    assert not ops & {(d, o) for d in ("com.microsoft",) for o in ("LinearAttention", "CausalConvWithState")}
    assert all(d == "" for d, o in ops if o not in ("GroupQueryAttention",)), ops
    # the conv state contract is channels first, [1, C, K-1], in the manifest and the graph alike
    spec = m["model"]
    conv = [s for s in m["states"] if s["kind"] == "deltanet_conv"]
    channels = 2 * spec["linear_num_key_heads"] * spec["linear_key_head_dim"] + (
        spec["linear_num_value_heads"] * spec["linear_value_head_dim"]
    )
    assert conv and all(s["layout"] == "channels_first" for s in conv)
    assert all(s["shape"] == [1, channels, spec["linear_conv_kernel_dim"] - 1] for s in conv)
    graph_in = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.input}
    assert all(graph_in[s["name"]] == s["shape"] for s in m["states"])
    assert m["lowering"]["opset"] == 27 and m["lowering"]["runtime_requirements"] == {"onnxruntime": ">=1.32"}
    assert m["lowering"]["conv_state_layout"] == "channels_first"
    assert "1.32" in m["app_runtimes"]["onnxruntime"] and "1.32" in m["app_runtimes"]["onnxruntime-genai"]
    assert m["app_runtimes"]["onnxruntime-node"].startswith("not run")
    from deltaship.check.inspect import describe, inspect

    text = describe(inspect(bundle))
    assert "runtime     opset 27: needs onnxruntime >=1.32" in text and "zeros/zeros channels_first" in text
    # the default bundle keeps deltaship's channels-last state and opset 21
    m21 = read_manifest(tiny(21))
    assert m21["lowering"]["opset"] == 21 and "runtime_requirements" not in m21["lowering"]
    assert all(s["layout"] == "channels_last" for s in m21["states"] if s["kind"] == "deltanet_conv")


def test_opset27_refused_by_older_onnxruntime_and_verification_says_so(tiny, tmp_path, monkeypatch):
    import onnxruntime

    monkeypatch.delenv(ENV, raising=False)
    if tuple(int(x) for x in onnxruntime.__version__.split(".")[:2]) >= (1, 32):
        pytest.skip(f"onnxruntime {onnxruntime.__version__} runs opset 27 itself")
    with pytest.raises(DeltashipUnavailable, match=r"needs onnxruntime >= 1\.32") as e:
        open_bundle(tiny(27))
    assert "DELTASHIP_ORT_PYTHON" in e.value.fix
    m = export("qwen3.5-tiny", tmp_path / "b", max_context=64, prefill_chunk=8, progress=False, onnx_opset=27)
    assert m["verification"]["status"] == "skipped"
    assert "onnxruntime >= 1.32" in m["verification"]["reason"] and "fidelity" not in m


def test_opset27_contrib_conflict_is_refused(tmp_path):
    from deltaship.errors import DeltashipError

    with pytest.raises(DeltashipError, match="--onnx-deltanet-ops contrib"):
        export("qwen3.5-tiny", tmp_path / "b", progress=False, onnx_opset=27, onnx_deltanet_ops="contrib")


def _run(session, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Logits rows [steps, V] after the prompt and each fed token (forced tokens, else its own greedy ones)."""
    session.reset()
    rows, toks = [session.prefill(prompt)], []
    for i in range(steps - 1):
        toks.append(int(rows[-1].argmax()))
        rows.append(session.decode(forced[i] if forced else toks[-1]))
    toks.append(int(rows[-1].argmax()))
    return np.stack(rows), toks


# (model, precision, max |logit difference| / logit std against the opset-21 bundle)
CASES = [
    ("qwen3.5-tiny", "fp32", 1e-4),
    ("qwen3.5-tiny", "fp16", 0.05),
    ("qwen3.5-tiny", "int4", 0.05),
    ("odd_heads", "fp32", 1e-4),  # d_k != d_v, 3 heads
    ("grouped_values", "fp32", 1e-4),  # value heads = 3 x key heads
]


@pytest.mark.slow
@pytest.mark.parametrize("model,precision,tol", CASES, ids=[f"{m}-{p}" for m, p, _ in CASES])
def test_opset27_in_onnxruntime_132_matches_default_bundle(
    tiny, checkpoints, ort132, monkeypatch, model, precision, tol
):
    monkeypatch.setenv(ENV, ort132)
    name = str(checkpoints[model]) if model in checkpoints else model
    graph = onnx.load(tiny(27, precision, name) / "model.onnx")  # com.microsoft's MatMulNBits etc. are skipped
    onnx.checker.check_model(graph, full_check=True)
    onnx.shape_inference.infer_shapes(graph, strict_mode=True)
    ref, new = open_bundle(tiny(21, precision, name)), open_bundle(tiny(27, precision, name))
    assert ref.runtime_name().startswith("onnxruntime 1.31")
    assert new.runtime_name().startswith(f"onnxruntime {ORT_VERSION}")
    rng = np.random.default_rng(7)
    for n in (1, 7, 19):  # 19 > the prefill chunk of 8: three prefill calls
        prompt = rng.integers(0, ref.vocab_size, n).tolist()
        want, want_toks = _run(ref, prompt, 8)
        got, got_toks = _run(new, prompt, 8, forced=want_toks)
        rel = np.abs(got - want).max() / want.std(-1).min()
        assert rel <= tol, (n, rel)
        assert got_toks == want_toks, n  # the same greedy tokens
        own, own_toks = _run(new, prompt, 8)  # and its own greedy continuation is the same text
        assert own_toks == want_toks, n


@pytest.mark.slow
def test_opset27_export_verifies_against_transformers_in_onnxruntime_132(tmp_path, ort132, monkeypatch):
    monkeypatch.setenv(ENV, ort132)
    m = export("qwen3.5-tiny", tmp_path / "b", max_context=64, prefill_chunk=8, progress=False, onnx_opset=27)
    v = m["verification"]
    assert v["status"] == "passed", v
    assert v["runtime"].startswith(f"onnxruntime {ORT_VERSION}") and ort132 in v["runtime"]
    assert v["max_rel_logit_diff"] <= 1e-3 and v["greedy_agreement"] == 1.0
    assert {p["prompt_length"] for p in v["prompts"]} == {1, 7, 11}


GENAI_SCRIPT = """
import json, sys
import onnxruntime_genai as og
model = og.Model(sys.argv[1])
out = []
for prompt in json.loads(sys.argv[2]):
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 8, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens([prompt])
    toks = []
    while not gen.is_done():
        gen.generate_next_token()
        toks.append(int(gen.get_next_tokens()[0]))
    out.append(toks)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_opset27_in_onnxruntime_genai_on_onnxruntime_132(tiny, ort132, monkeypatch):
    """onnxruntime-genai 0.18 over onnxruntime 1.32 runs the opset-27 bundle as it is: deltaship's greedy tokens."""
    monkeypatch.setenv(ENV, ort132)
    bundle = tiny(27)
    if subprocess.run([ort132, "-c", "import onnxruntime_genai"], capture_output=True).returncode:
        pytest.skip(f"{ENV}={ort132} has no onnxruntime_genai")
    rng = np.random.default_rng(11)
    session = open_bundle(bundle)
    prompts = [rng.integers(0, session.vocab_size, n).tolist() for n in (1, 7, 19)]
    want = []
    for prompt in prompts:
        session.reset()
        logits, toks = session.prefill(prompt), []
        for _ in range(8):
            toks.append(int(logits.argmax()))
            logits = session.decode(toks[-1])
        want.append(toks)
    import json

    r = subprocess.run([ort132, "-c", GENAI_SCRIPT, str(bundle), json.dumps(prompts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == want


def test_app_kits_refuse_an_opset27_bundle_their_runtime_cannot_load(tiny, tmp_path):
    from deltaship.apps import write_kit
    from deltaship.errors import DeltashipError

    for platform, runtime in (("web", "onnxruntime-web 1.30"), ("android", "onnxruntime-android 1.31")):
        with pytest.raises(DeltashipError, match=f"needs onnxruntime >= 1.32.*pins {runtime}") as e:
            write_kit(tiny(27), tmp_path / platform, platform)
        assert "without --onnx-opset 27" in e.value.fix
        assert not (tmp_path / platform).exists()
