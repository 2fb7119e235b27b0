"""The Android kit for a qnn bundle: DeltashipQnnModel.kt over onnxruntime-android's QNN build.

Nothing Kotlin is compiled here (no Android SDK, no Snapdragon phone). What is checked: every name, shape and dtype
the generated Kotlin uses against each graph of a tiny qnn bundle, the QNN provider options and SoC numbers against
the manifest, and the driver's loop (whole prefill chunks, then one token a call through decode, the position fed
and advanced, present -> past across both graphs) replayed in Python on the HTP simulator, where it must give the
tokens of deltaship's QnnSession; a wrong position after a chunk must fail both the check and the replay.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from test_app_kits import _kotlin_sources, onnx_io, unbalanced

from deltaship.apps.kotlin import (
    CPU_FALLBACK_KEY,
    QNN_AAR,
    QNN_HTP_LIBRARY,
    identifier_literals,
    kit_spec,
    parse_kit_spec,
    render_kit_spec,
)
from deltaship.cli import main

needs_qnn = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime_qnn") is None,
    reason="onnxruntime-qnn (the QNN HTP simulator) is not installed: pip install onnxruntime-qnn==2.7.0 --no-deps",
)
DRIVER = "DeltashipQnnModel.kt"
# The statements of DeltashipQnnModel.kt that the Python replay below mirrors, one for one: which graph a call goes
# to, the context bound, the position fed and how it advances, whole chunks then single tokens.
LOOP = (
    "1 -> decodeGraph",
    "KitSpec.PREFILL_CHUNK -> prefillGraph",
    "check(position + tokens.size <= KitSpec.MAX_CONTEXT)",
    "val pos = int64(KitSpec.POSITION, tokens.size) { position.toLong() }",
    "position += tokens.size",
    "val whole = tokens.size / chunk * chunk",
    "for (i in 0 until whole step chunk) logits = forward(tokens.copyOfRange(i, i + chunk))",
    "for (i in whole until tokens.size) logits = forward(intArrayOf(tokens[i]))",
    'so.addConfigEntry(KitSpec.DISABLE_CPU_FALLBACK, "1")',
    "so.addQnn(KitSpec.QNN_OPTIONS)",
    "val next = argmax(logits)",
)
# 22 byte tokens: 2 prefill chunks of 8, then 6 decode calls; the tiny preset continues it with varied tokens (random
# ids gave one token repeated, which a wrong loop could match by chance)
PROMPT = list(b"def fib(n):\n    return")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def qnn_kit(shared_export, tmp_path_factory) -> tuple[Path, Path]:
    """(bundle, kit): the tiny preset as a qnn bundle (fp16, SoC 8elite, prefill chunk 8, max context 64) and its
    Android kit (`deltaship app B --platform android`)."""
    bundle = shared_export("qnn-kit-tiny-64", "qwen3.5-tiny", target="qnn", max_context=64, verify=False)
    kit = tmp_path_factory.mktemp("qnn-kit") / "kit"
    assert main(["app", str(bundle), "--platform", "android", "--out", str(kit)]) == 0  # as a user runs it
    return bundle, kit


def check_qnn_kit(kit: Path, bundle: Path) -> list[str]:
    """Every name, shape, dtype, file, option and SoC number the Kotlin uses against the bundle; [] when they agree."""
    texts = _kotlin_sources(kit)
    spec = parse_kit_spec(texts["KitSpec.kt"])
    record = json.loads((kit / "kit.json").read_text())["kotlin"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    low = manifest["lowering"]
    problems = [f"KitSpec.kt {k} differs from kit.json" for k in spec if spec[k] != record.get(k)]
    problems += [f"bundle has no {f}" for f in spec["files"].values() if not (bundle / f).is_file()]
    problems += [f"{f} is not a file the manifest lists" for f in spec["files"].values() if f not in manifest["files"]]
    if spec["max_context"] != manifest["max_context"] or spec["prefill_chunk"] != low["graphs"]["prefill"]["tokens"]:
        problems.append(f"MAX_CONTEXT / PREFILL_CHUNK {spec['max_context']} / {spec['prefill_chunk']} not the bundle's")
    names = set(spec["files"].values())
    for key, tokens in (("model", 1), ("prefill", spec["prefill_chunk"])):  # the decode and prefill graphs
        ins, outs = onnx_io(bundle / spec["files"][key])

        def static(f: dict, t: int = tokens) -> tuple[list[int], str]:
            return [t if d < 0 else d for d in f["shape"]], f["dtype"]

        kin = [spec["tokens"], spec["position"]] + [dict(s, name=s["input"]) for s in spec["states"]]
        kout = [spec["logits"]] + [dict(s, name=s["output"]) for s in spec["states"]]
        for kind, have, feats in (("input", ins, kin), ("output", outs, kout)):
            problems += [
                f"{spec['files'][key]} {kind} {f['name']}: kotlin {static(f)}, graph {have.get(f['name'])}"
                for f in feats
                if have.get(f["name"]) != static(f)
            ]
            if missing := set(have) - {f["name"] for f in feats}:
                problems.append(f"{spec['files'][key]} {kind}s the kotlin never names: {sorted(missing)}")
        if spec["vocab_size"] != outs.get(spec["logits"]["name"], ([0], ""))[0][-1]:
            problems.append(f"VOCAB_SIZE {spec['vocab_size']} is not the logits' last dimension")
        names |= {f["name"] for f in kin + kout}
    q, soc = spec["qnn"], low["soc"]
    want = {**low["provider_options"], "backend_path": QNN_HTP_LIBRARY}
    if q["provider_options"] != want:
        problems.append(f"QNN_OPTIONS {q['provider_options']} are not the bundle's provider options {want}")
    if (q["provider_options"].get("soc_model"), q["provider_options"].get("htp_arch")) != (
        str(soc["soc_model"]),
        str(soc["htp_arch"]),
    ):
        problems.append(f"QNN_OPTIONS name another SoC than lowering.soc {soc['soc_model']} / v{soc['htp_arch']}")
    if q["cpu_fallback_key"] != "session.disable_cpu_ep_fallback" or low["cpu_fallback"] is not False:
        problems.append(f"DISABLE_CPU_FALLBACK {q['cpu_fallback_key']} is not ONNX Runtime's key")
    names |= set(q["provider_options"]) | {QNN_HTP_LIBRARY, q["cpu_fallback_key"]} | set(q["context_binaries"])
    driver = texts.get(DRIVER, "")
    problems += [f"{DRIVER} lacks the statement the replay mirrors: {s}" for s in LOOP if s not in driver]
    stray = set().union(*(identifier_literals(t) for f, t in texts.items() if f != "ChatPieces.kt")) - names
    if stray:
        problems.append(f"names in the kotlin sources that are not in the bundle: {sorted(stray)}")
    problems += [f"{f}: {p}" for f, t in texts.items() for p in unbalanced(t)]
    gradle = (kit / "build.gradle.kts").read_text()
    problems += [f"build.gradle.kts: {p}" for p in unbalanced(gradle)]
    if f'implementation("{QNN_AAR}")' not in gradle:
        problems.append(f"build.gradle.kts does not depend on {QNN_AAR}")
    return problems


def open_kit_graphs(kit: Path, bundle: Path) -> dict[int, object]:
    """The graphs as DeltashipQnnModel opens them, from KitSpec.kt: tokens a call -> a session on the HTP simulator
    with QNN_OPTIONS' SoC and fp16 setting, CPU fallback disabled (backend_path is the phone's library name: here
    onnxruntime-qnn's own HTP library)."""
    from deltaship.runtimes.qnn import open_htp

    spec = parse_kit_spec(_kotlin_sources(kit)["KitSpec.kt"])
    opts = spec["qnn"]["provider_options"]
    fp16 = opts["enable_htp_fp16_precision"] == "1"
    htp = {"soc_model": opts["soc_model"], "htp_arch": opts["htp_arch"], "fp16": fp16}
    graphs = {1: open_htp(bundle / spec["files"]["model"], **htp).session}
    if "prefill" in spec["files"]:
        graphs[spec["prefill_chunk"]] = open_htp(bundle / spec["files"]["prefill"], **htp).session
    return graphs


def replay(kit: Path, graphs: dict, prompt: list[int], new_tokens: int, mutation: str | None = None) -> list[int]:
    """DeltashipQnnModel's generate, statement for statement (LOOP), from KitSpec.kt alone, on the kit's `graphs`.
    mutation "position after chunk": a prefill call advances the position by 1 instead of its tokens."""
    spec = parse_kit_spec(_kotlin_sources(kit)["KitSpec.kt"])
    np_type = {"int64": np.int64, "float32": np.float32, "float16": np.float16}
    carried = {s["input"]: np.zeros(s["shape"], np_type[s["dtype"]]) for s in spec["states"]}
    position = 0

    def shaped(f: dict, t: int, values) -> np.ndarray:
        return np.array(values, np.int64).reshape([t if d < 0 else d for d in f["shape"]])

    def forward(tokens: list[int]) -> np.ndarray:
        nonlocal position
        session = graphs[len(tokens)]  # 1 -> decode, PREFILL_CHUNK -> prefill, anything else refused
        assert position + len(tokens) <= spec["max_context"]
        feeds = {
            spec["tokens"]["name"]: shaped(spec["tokens"], len(tokens), tokens),
            spec["position"]["name"]: shaped(spec["position"], len(tokens), [position]),
            **carried,
        }
        names = [spec["logits"]["name"]] + [s["output"] for s in spec["states"]]
        out = dict(zip(names, session.run(names, feeds)))
        carried.update({s["input"]: out[s["output"]] for s in spec["states"]})
        position += 1 if mutation == "position after chunk" and len(tokens) > 1 else len(tokens)
        return out[spec["logits"]["name"]].reshape(-1)[: spec["vocab_size"]]

    chunk = spec["prefill_chunk"] if spec["prefill_chunk"] in graphs else 1
    whole = len(prompt) // chunk * chunk
    logits = None
    for i in range(0, whole, chunk):
        logits = forward(prompt[i : i + chunk])
    for i in range(whole, len(prompt)):
        logits = forward([prompt[i]])
    got: list[int] = []
    while len(got) < new_tokens:
        got.append(int(np.argmax(logits)))
        if got[-1] in spec["eos_token_ids"] or len(got) == new_tokens:
            break
        logits = forward([got[-1]])
    return got


@pytest.fixture(scope="module")
def kit_graphs(qnn_kit) -> dict:
    return open_kit_graphs(qnn_kit[1], qnn_kit[0])


@pytest.fixture(scope="module")
def session_tokens(qnn_kit) -> list[int]:
    """deltaship's own QnnSession on the same bundle and prompt: the tokens the kit must give."""
    from deltaship.targets import open_bundle

    return open_bundle(qnn_kit[0]).generate(PROMPT, NEW_TOKENS).output_ids


@needs_qnn
def test_qnn_kit_names_match_the_graphs_and_the_manifest(qnn_kit):
    from deltaship.bundle.validate import schema_problems

    bundle, kit = qnn_kit
    assert check_qnn_kit(kit, bundle) == []
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert not schema_problems(manifest)  # with the kit's runtime in app_runtimes
    assert "tests/test_qnn_kit.py" in manifest["app_runtimes"]["onnxruntime-android-qnn"]
    record = json.loads((kit / "kit.json").read_text())
    assert record["drivers"] == [DRIVER, "ChatPieces.kt"] and record["gradle"] == [QNN_AAR]
    spec = record["kotlin"]
    assert spec["files"] == {
        "model": "decode.onnx",
        "prefill": "prefill.onnx",
        "tokenizer": "tokenizer.json",
        "weights": "weights.data",
    }
    assert (spec["qnn"]["provider_options"]["soc_model"], spec["qnn"]["provider_options"]["htp_arch"]) == ("69", "79")
    readme = (kit / "README.md").read_text()
    assert "not compiled or run by deltaship" in readme.lower() and QNN_AAR in readme and "addQnn" in readme


@needs_qnn
def test_qnn_kit_loop_replayed_gives_qnn_session_tokens(qnn_kit, kit_graphs, session_tokens):
    """The Kotlin loop (2 prefill chunks of 8, 6 decode calls for the prompt, then greedy steps) on the HTP simulator
    gives QnnSession's tokens on the same bundle."""
    _, kit = qnn_kit
    assert len(session_tokens) == NEW_TOKENS and len(set(session_tokens)) > 2
    assert replay(kit, kit_graphs, PROMPT, NEW_TOKENS) == session_tokens


@needs_qnn
def test_qnn_kit_wrong_position_after_a_chunk_is_caught(qnn_kit, kit_graphs, session_tokens, tmp_path):
    """A driver that advances the position by 1 after a prefill chunk: the check names the changed statement, and the
    loop so replayed gives other tokens than QnnSession."""
    import shutil

    bundle, kit = qnn_kit
    mutated = tmp_path / "kit"
    shutil.copytree(kit, mutated)
    driver = next(mutated.rglob(DRIVER))
    text = driver.read_text()
    driver.write_text(text.replace("position += tokens.size", "position += 1"))
    assert any("position += tokens.size" in p for p in check_qnn_kit(mutated, bundle))
    assert replay(kit, kit_graphs, PROMPT, NEW_TOKENS, mutation="position after chunk") != session_tokens


@needs_qnn
@pytest.mark.parametrize("mutation", ["soc", "fallback key", "state dtype", "prefill shape"])
def test_qnn_kit_check_catches_a_changed_option_or_name(qnn_kit, tmp_path, mutation):
    import shutil

    bundle, kit = qnn_kit
    mutated = tmp_path / "kit"
    shutil.copytree(kit, mutated)
    spec_file = next(mutated.rglob("KitSpec.kt"))
    text = spec_file.read_text()
    edits = {
        "soc": ('"soc_model" to "69"', '"soc_model" to "57"'),
        "fallback key": ('"session.disable_cpu_ep_fallback"', '"session.disable_cpu_fallback"'),
        "state dtype": ("DType.FLOAT16)", "DType.FLOAT32)"),
        "prefill shape": ("const val PREFILL_CHUNK = 8", "const val PREFILL_CHUNK = 16"),
    }
    old, new = edits[mutation]
    assert old in text
    spec_file.write_text(text.replace(old, new, 1))
    problems = check_qnn_kit(mutated, bundle)
    assert any("kit.json" not in p for p in problems), problems


def _manifest(context: bool) -> dict:
    """A qnn manifest as the exporter writes it (the tiny preset's names, one layer of each kind), with or without
    the EPContext models of --qnn-context."""
    low = {
        "graphs": {"decode": {"file": "decode.onnx", "tokens": 1}, "prefill": {"file": "prefill.onnx", "tokens": 8}},
        "weights": {"file": "weights.data"},
        "soc": {"name": "8gen3", "chip": "SM8650", "marketing": "Snapdragon 8 Gen 3", "soc_model": 57, "htp_arch": 75},
        "provider_options": {"enable_htp_fp16_precision": "1", "soc_model": "57", "htp_arch": "75"},
        "cpu_fallback": False,
        "runtime_requirements": {"onnxruntime": ">=1.24.2", "onnxruntime-qnn": "2.7.0", "qnn_sdk": "2.51.0"},
    }
    if context:
        low["context"] = {
            g: {
                "model": f"{g}_8gen3_ctx.onnx",
                "files": [{"path": f"{g}_8gen3_ctx.onnx"}, {"path": f"{g}_8gen3_ctx_qnn.bin"}],
                "qnn_sdk": "2.51.0",
            }
            for g in ("decode", "prefill")
        }
    return {
        "target": "qnn",
        "entry": "decode.onnx",
        "max_context": 64,
        "prefill_chunk": 8,
        "precision": "fp16",
        "source": {"model": "qwen3.5-tiny"},
        "tokens": {"eos": [2]},
        "tools": {"onnxruntime": "1.31.1"},
        "inputs": [
            {"name": "input_ids", "shape": [1, "tokens"], "dtype": "int64", "kind": "tokens"},
            {"name": "position", "shape": [1], "dtype": "int64", "kind": "position"},
        ],
        "outputs": [{"name": "logits", "shape": [1, 256], "dtype": "float32", "kind": "logits"}],
        "states": [
            {
                "name": "past.0.conv",
                "output": "present.0.conv",
                "shape": [1, 192, 3],
                "dtype": "float16",
                "kind": "deltanet_conv",
            },
            {
                "name": "past.3.key",
                "output": "present.3.key",
                "shape": [1, 2, 64, 32],
                "dtype": "float16",
                "kind": "kv_key",
            },
        ],  # fmt: skip
        "lowering": low,
    }


@pytest.mark.parametrize("context", [False, True])
def test_qnn_kit_spec_round_trips_and_opens_compiled_contexts(context):
    """KitSpec.kt from a qnn manifest reads back as the kit's record; with --qnn-context the driver opens the EPContext
    models (their binaries checked as bundle files) and no weights file, and the README names the QNN they need."""
    from deltaship.apps.kotlin import readme

    manifest = _manifest(context)
    spec = kit_spec(Path("unused"), manifest)  # no tokenizer files listed: nothing is read from the bundle
    parsed = parse_kit_spec(render_kit_spec(spec))
    assert {k: spec.get(k) for k in parsed} == parsed
    assert parsed["qnn"]["provider_options"] == {
        "backend_path": "libQnnHtp.so",
        "enable_htp_fp16_precision": "1",
        "soc_model": "57",
        "htp_arch": "75",
    }
    assert parsed["qnn"]["cpu_fallback_key"] == CPU_FALLBACK_KEY
    assert parsed["tokens"] == {"name": "input_ids", "shape": [1, -1], "dtype": "int64"}
    assert parsed["position"] == {"name": "position", "shape": [1], "dtype": "int64"}
    text = readme("Qwen35Tiny", manifest, spec, [DRIVER], [QNN_AAR])
    if context:
        assert parsed["files"] == {
            "model": "decode_8gen3_ctx.onnx",
            "prefill": "prefill_8gen3_ctx.onnx",
            "tokenizer": "tokenizer.json",
        }
        assert parsed["qnn"]["context_binaries"] == ["decode_8gen3_ctx_qnn.bin", "prefill_8gen3_ctx_qnn.bin"]
        assert "compiled with QNN 2.51.0" in text
    else:
        assert parsed["files"]["model"] == "decode.onnx" and parsed["files"]["weights"] == "weights.data"
        assert parsed["qnn"]["context_binaries"] == [] and "--qnn-context" in text
