"""Hostile input: every command and the Python API refuse it with exit 2/3 (a DeltashipError), never exit 1.

The corpus (issue 45): deeply nested JSON, a 5000-digit integer, floats where integers belong, NaN/Infinity,
duplicate keys, a max_context beyond the graph's KV cache, a vocabulary beyond the graph's logits, hosts that are
ssh options, bad tier values, wrong API types. Commands run in-process through `deltaship.cli.main` (the exit
code) and the API; the readers of compare files, tiers files and JSON metadata are fuzzed with hypothesis.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_manifest_fuzz import values  # the manifest fuzz's values: NaN, inf, 2**70, text, nested lists and objects

import deltaship
from deltaship import cli
from deltaship.devices.catalog import load_catalog
from deltaship.devices.discovery import check_device, parse_ssh, ssh_base
from deltaship.errors import DeltashipError
from deltaship.files import MAX_INT_DIGITS, MAX_JSON_DEPTH, parse_json

BAD_DEVICES = [
    "ssh://-oProxyCommand=touch /tmp/pwned",
    "ssh://-oProxyCommand=x",
    "ssh://user@-oProxyCommand=x",
    "ssh://-l@host",
    "ssh://host name",
    "ssh://host\nname",
    "ssh://ho\x00st",
    "ssh://host:0",
    "ssh://host:70000",
    "ssh://[not-ipv6]",
    "ssh://[::1 -x]",
    "ssh://a..b",
    "ssh://" + "a" * 300,
    "adb:-s",
    "adb:--help",
    "adb:emu 5554",
    "adb:emu\t5554",
    "adb:",
    "telnet://host",
]


@pytest.mark.parametrize("device", BAD_DEVICES)
def test_a_host_or_serial_that_is_no_host_is_refused_before_any_process(device, bundles, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a) or pytest.fail(f"ran {a}"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail(f"started {a}"))
    with pytest.raises(DeltashipError):
        check_device(device)
    code = cli.main(["profile", str(bundles("base")), "--device", device])
    assert code == 2 and not started, capsys.readouterr().err
    assert "device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "device, user, host, port",
    [
        ("ssh://me@example.com", "me", "example.com", 22),
        ("ssh://10.0.0.7:2222", None, "10.0.0.7", 2222),
        ("ssh://me@[::1]:2200", "me", "::1", 2200),
        ("ssh://build-box.local/", None, "build-box.local", 22),
    ],
)
def test_hosts_and_serials_that_are_hosts_pass_and_ssh_gets_a_double_dash(device, user, host, port):
    target = parse_ssh(device)
    assert (target["user"], target["host"], target["port"]) == (user, host, port)
    argv = ssh_base(target, ["-o", "StrictHostKeyChecking=no"])
    assert argv[-2:] == ["--", f"{user}@{host}" if user else host]  # nothing after `--` is an ssh option
    for serial in ("emulator-5554", "192.168.1.5:5555", "R58M123ABC", "adb-R58M._adb-tls-connect._tcp"):
        assert check_device(f"adb:{serial}") == f"adb:{serial}"


# ---- the corpus: a bundle's manifest, JSON files, tiers files -------------------------------------------------
def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _set(text: str, key: str, raw: str) -> str:
    """The manifest's text with the top-level `key`'s value replaced by the raw JSON `raw`."""
    doc = json.loads(text)
    doc[key] = "@@RAW@@"
    return json.dumps(doc, indent=1).replace('"@@RAW@@"', raw, 1)


def _with(m: dict, path: tuple, value) -> str:
    doc = copy.deepcopy(m)
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return json.dumps(doc, indent=1)  # NaN and inf as the literals json writes


MANIFESTS = {  # name -> the manifest's text from the valid manifest m
    "nested 100 deep": lambda m: _set(json.dumps(m), "notes", _deep(100)),
    "nested 100000 deep": lambda m: _set(json.dumps(m), "notes", _deep(100_000)),
    "a 5000-digit integer": lambda m: _set(json.dumps(m), "max_context", "1" + "0" * 4999),
    "a 101-digit integer": lambda m: _set(json.dumps(m), "prefill_chunk", "9" * 101),
    "NaN": lambda m: _with(m, ("model", "rms_norm_eps"), float("nan")),
    "Infinity": lambda m: _with(m, ("max_context",), float("inf")),
    "-Infinity in a shape": lambda m: _with(m, ("states", 0, "shape", 1), float("-inf")),
    "1e400": lambda m: _set(json.dumps(m), "prefill_chunk", "1e400"),
    "duplicate keys": lambda m: json.dumps(m).replace('"max_context": ', '"max_context": 1, "max_context": ', 1),
    "max_context beyond the KV cache": lambda m: _with(m, ("max_context",), m["max_context"] * 2),
    "max_context below the KV cache": lambda m: _with(m, ("max_context",), m["max_context"] // 2),
    "vocabulary beyond the logits": lambda m: _with(m, ("model", "vocab_size"), 99_999),
    "vocabulary below the tokenizer's": lambda m: _with(m, ("model", "vocab_size"), 100),
    "a float where an integer belongs": lambda m: _with(m, ("prefill_chunk",), 8.5),
    "an integral float in a shape": lambda m: _with(m, ("states", 0, "shape", 1), 3.0),
}
MANIFEST_CASES = list(MANIFESTS)


@pytest.fixture(scope="module")
def hostile(shared_export, tmp_path_factory):
    """(bundle, its valid manifest, write(text)): a copy of the tiny preset's ONNX bundle (test_trust_reader's
    export, with its tokenizer and chat template) whose manifest each case rewrites."""
    b = tmp_path_factory.mktemp("hostile") / "bundle"
    shutil.copytree(shared_export("trust-tiny-onnx", "qwen3.5-tiny", target="onnx", precision="fp32", verify=False), b)
    path = b / "manifest.json"
    m = json.loads(path.read_text())

    def write(text: str) -> None:
        path.write_text(text)

    yield b, m, write
    path.write_text(json.dumps(m))


def _commands(b: Path, out: Path) -> dict[str, list[str]]:
    return {
        "generate ids": ["generate", str(b), "--input-ids", "1,2", "--max-new-tokens", "2"],
        "generate text": ["generate", str(b), "--prompt", "hi", "--max-new-tokens", "2"],
        "inspect": ["inspect", str(b)],
        "inspect --json": ["inspect", str(b), "--json"],
        "profile": ["profile", str(b), "--prompt-lengths", "2", "--gen", "2", "--contexts", "4", "--reps", "1"],
        "eval": ["eval", str(b), "--tokens", "8"],
        "app": ["app", str(b), "--platform", "android", "--out", str(out)],
        "chat": ["chat", str(b), "--max-new-tokens", "2"],
    }


def _run(argv: list[str], capsys, monkeypatch, stdin: str = "hi\n") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_every_command_refuses_a_hostile_manifest_with_exit_2(case, hostile, tmp_path, capsys, monkeypatch):
    b, m, write = hostile
    write(MANIFESTS[case](m))
    for name, argv in _commands(b, tmp_path / "kit").items():
        code, out, err = _run(argv, capsys, monkeypatch)
        assert code == 2, (name, code, err[-600:])
        assert "internal error" not in err and "Traceback" not in err, (name, err[-600:])
        assert err.count("\n") <= 3, (name, err)  # one line of what, one of the fix (inspect: its report on stdout)
        if name == "inspect --json" and out:
            json.loads(out, parse_constant=lambda c: pytest.fail(f"inspect --json printed {c}"))
    assert not (tmp_path / "kit").exists()


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_the_python_api_refuses_a_hostile_manifest_with_a_deltaship_error(case, hostile):
    b, m, write = hostile
    write(MANIFESTS[case](m))
    with pytest.raises(DeltashipError):
        deltaship.load(b).generate([1, 2], max_new_tokens=2)


@pytest.mark.parametrize(
    "call",
    [
        lambda b: deltaship.load(None),
        lambda b: deltaship.load(5),
        lambda b: deltaship.load(b"x"),
        lambda b: deltaship.load(str(b), threads="2"),
        lambda b: deltaship.load(str(b), prefill_chunk=2.5),
        lambda b: deltaship.load(str(b), check_hashes="no"),
        lambda b: deltaship.load(str(b), bogus=1),
        lambda b: deltaship.load(str(b), provider=5),
        lambda b: deltaship.load(str(b)).generate(b"x"),
        lambda b: deltaship.load(str(b)).generate(5),
        lambda b: deltaship.load(str(b)).generate([1, "a"]),
        lambda b: deltaship.load(str(b)).generate([1, -2]),
        lambda b: deltaship.load(str(b)).generate((1, 2)),
        lambda b: deltaship.load(str(b)).generate([1, 2], max_new_tokens="3"),
        lambda b: deltaship.load(str(b)).generate([1, 2], temperature="hot"),
        lambda b: deltaship.load(str(b)).generate([1, 2], temperature=1.0, top_k=1.5),
        lambda b: deltaship.load(str(b)).generate([1, 2], temperature=1.0, top_p="x"),
        lambda b: deltaship.load(str(b)).generate([1, 2], temperature=1.0, seed="x"),
        lambda b: deltaship.load(str(b)).generate([1, 2], stop_at_eos="no"),
        lambda b: deltaship.load(str(b)).generate("hi", max_new_tokens=-1),
    ],
)
def test_the_python_api_names_a_wrong_typed_argument(call, hostile):
    b, m, write = hostile
    write(json.dumps(m))
    with pytest.raises(DeltashipError) as e:
        call(b)
    assert type(e.value) is DeltashipError and e.value.exit_code == 2 and e.value.fix


# ---- a runtime's failure in the middle of a run ------------------------------------------------------------
@pytest.mark.parametrize(
    "error, code",
    [
        (RuntimeError("Error in execution: Non-zero status code returned while running GroupQueryAttention\nnode"), 2),
        (
            RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for requested buffer"),
            3,
        ),
        (OSError(28, "No space left on device"), 3),
        (ImportError("libonnxruntime_providers_shared.so: cannot open shared object file"), 3),
        (TypeError("a deltaship bug"), 1),  # not the runtime's: it stays a bug
    ],
)
def test_a_runtime_error_mid_run_prints_the_tokens_so_far_then_one_error(error, code, hostile, capsys, monkeypatch):
    from deltaship.runtimes.onnx import OnnxSession

    b, m, write = hostile
    write(json.dumps(m))
    decode, calls = OnnxSession.decode, []

    def failing(self, token):
        calls.append(token)
        if len(calls) == 3:
            raise error
        return decode(self, token)

    monkeypatch.setattr(OnnxSession, "decode", failing)
    got, out, err = _run(["generate", str(b), "--input-ids", "1,2", "--max-new-tokens", "9", "--no-stop-at-eos"],
                         capsys, monkeypatch)  # fmt: skip
    assert got == code, err
    if code == 1:
        assert "internal error: TypeError" in err
        return
    assert out.split() == [str(t) for t in calls], out  # the three tokens sampled before the failing decode
    assert "after 3 new tokens" in err and err.count("\n") == 2 and "internal error" not in err, err
    calls.clear()
    got, out, err = _run(["generate", str(b), "--prompt", "hi", "--max-new-tokens", "9", "--no-stop-at-eos"],
                         capsys, monkeypatch)  # fmt: skip
    assert got == code and out.startswith("hi") and len(out) > len("hi\n"), (out, err)
    calls.clear()
    with pytest.raises(DeltashipError) as e:  # the API: the same error, the tokens on it
        deltaship.load(b).generate([1, 2], max_new_tokens=9, stop_at_eos=False)
    assert e.value.exit_code == code and e.value.output_ids == calls


def test_a_runtime_error_mid_chat_turn_is_one_error_and_the_chat_goes_on(hostile, capsys, monkeypatch):
    """Chat's own loop maps the runtime's failure as generate's does (exit 2, the reply so far on the error), and the
    conversation is left as before the turn: the next turn prefills the history again."""
    from deltaship.chat import Chat
    from deltaship.runtimes.onnx import OnnxSession

    b, m, write = hostile
    write(json.dumps(m))
    decode, calls = OnnxSession.decode, []

    def failing(self, token):
        calls.append(token)
        if len(calls) == 3:
            raise RuntimeError("Error in execution: Non-zero status code returned while running MatMul node")
        return decode(self, token)

    monkeypatch.setattr(OnnxSession, "decode", failing)
    got, out, err = _run(["chat", str(b), "--max-new-tokens", "9"], capsys, monkeypatch)
    assert got == 2 and "after 3 new tokens" in err and "internal error" not in err, err
    calls.clear()
    conv = Chat(b)
    with pytest.raises(DeltashipError) as e:
        conv.send("hi", max_new_tokens=9)
    assert e.value.exit_code == 2 and e.value.output_ids == calls and e.value.text is not None
    assert conv.messages == [] and conv.ids == []  # the failed turn left nothing behind
    monkeypatch.setattr(OnnxSession, "decode", decode)
    assert conv.send("hi", max_new_tokens=2).ids  # and the next turn runs


# ---- hostile JSON and TOML files: compare files, tiers, kit.json, tokenizer files, a checkpoint's config ----------
HOSTILE_JSON = {
    "nested 100 deep": '{"schema_version": 1, "results": ' + _deep(100) + "}",
    "nested 100000 deep": '{"results": ' + _deep(100_000) + "}",
    "a 5000-digit integer": '{"schema_version": 1' + "0" * 5000 + ', "results": []}',
    "NaN": '{"schema_version": NaN, "results": []}',
    "Infinity": '{"schema_version": 1, "results": [{"metric": "m", "samples": [Infinity], "unit": "s"}]}',
    "duplicate keys": '{"schema_version": 1, "results": [], "results": []}',
    "not an object": "[1, 2]",
    "not UTF-8": b'{"a": "\xff"}',
    "empty": "",
}


def _profile_doc(**record) -> dict:
    from deltaship.profiling.worker import SCHEMA_VERSION

    r = {"metric": "decode_latency_s", "unit": "s", "samples": [0.1, 0.2, 0.3], "median": 0.2, "prompt_length": 8}
    return {"schema_version": SCHEMA_VERSION, "results": [{**r, **record}]}


COMPARE_RECORDS = {  # records a compare file may not hold: each was a TypeError or KeyError in compare (exit 1)
    "samples of text": {"samples": ["a", "b"]},
    "a sample that is a list": {"samples": [[1]]},
    "no unit": {"unit": None},
    "a list as a key": {"prompt_length": [8]},
    "a median of text": {"median": "fast"},
    "samples that are no list": {"samples": {"a": 1}},
    "too many samples": {"samples": [0.1] * 5000},
}


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("case", [*HOSTILE_JSON, *COMPARE_RECORDS])
def test_profile_compare_refuses_a_hostile_file_with_exit_2(case, tmp_path, capsys, monkeypatch):
    good = _write(tmp_path / "a.json", json.dumps(_profile_doc()))
    bad = tmp_path / "b.json"
    _write(bad, HOSTILE_JSON[case] if case in HOSTILE_JSON else json.dumps(_profile_doc(**COMPARE_RECORDS[case])))
    for pair in ((good, bad), (bad, good)):
        code, out, err = _run(["profile", "--compare", *map(str, pair)], capsys, monkeypatch)
        assert code == 2 and str(bad) in err and "internal error" not in err, err
    code, out, err = _run(["profile", "--compare", str(good), str(good)], capsys, monkeypatch)
    assert code == 0 and "decode" in out  # the good file compares


TIERS = {  # a tier's value -> what the refusal names
    "threads = -3": "threads",
    "threads = 2.5": "threads",
    "threads = true": "threads",
    "threads = 100000": "threads",
    "context = 2048.0": "context",
    "context = 0": "context",
    "context = " + "9" * 5000: "not valid TOML",
    "ram_gib = nan": "ram_gib",
    "ram_gib = inf": "ram_gib",
    "ram_gib = 1e300": "ram_gib",
    'ram_gib = "4"': "ram_gib",
    "targets = 5": "targets",
    "targets = [1]": "targets",
    'precisions = [["int4"]]': "precisions",
    "kind = 5": "kind",
    "notes = " + "[" * 3000 + "]" * 3000: "nested too deep",
}
TIER = 'kind = "phone"\nram_gib = 4\nbudget_gib = 2\ntargets = ["onnx"]\nprecisions = ["int4"]\ncontext = 2048\n'


def _tier_file(tmp_path: Path, line: str) -> Path:
    key = line.split(" =")[0]
    body = "\n".join(x for x in TIER.splitlines() if not x.startswith(key + " ")) + "\n" + line + "\n"
    return _write(tmp_path / "tiers.toml", "[tiers.mine]\n" + body)


@pytest.mark.parametrize("line", list(TIERS), ids=[line[:24] for line in TIERS])
def test_a_tiers_file_value_is_checked_naming_the_tier_and_key(line, tmp_path, hostile, capsys, monkeypatch):
    b, m, write = hostile
    write(json.dumps(m))
    tiers = _tier_file(tmp_path, line)
    for argv in (
        ["plan", "--model", "qwen3.5-tiny", "--tiers", str(tiers), "--tier", "mine"],
        ["profile", str(b), "--tiers", str(tiers), "--tier", "mine", "--prompt-lengths", "2", "--gen", "2"],
    ):
        code, out, err = _run(argv, capsys, monkeypatch)
        assert code == 2 and TIERS[line] in err and "internal error" not in err, (argv[0], err)
        if TIERS[line] not in ("not valid TOML", "nested too deep"):
            assert "tier 'mine'" in err, err
    code, out, err = _run(["plan", "--model", "qwen3.5-tiny", "--tiers", str(_tier_file(tmp_path, "threads = 3"))],
                          capsys, monkeypatch)  # fmt: skip
    assert code == 0 and "mine" in out, err  # the same file with a good value plans


def _add_file(b: Path, m: dict, name: str, data: bytes) -> dict:
    """The manifest `m` with the bundle file `name` (written with `data`) listed and hashed: the hostile file passes
    the integrity check, so what refuses it is its reader."""
    (b / name).write_bytes(data)
    doc = copy.deepcopy(m)
    doc["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if name not in doc["tokenizer"]["files"]:
        doc["tokenizer"]["files"].append(name)
    return doc


TOKENIZERS = {  # tokenizer.json -> what it does to the tiny one
    "nested 100 deep": lambda t: {**t, "normalizer": json.loads(_deep(100))},
    "duplicate keys": lambda t: json.dumps(t).replace('"version":', '"version": "1.0", "version":', 1),
    "NaN": lambda t: {**t, "truncation": float("nan")},
    "more added tokens than the bound": lambda t: {**t, "added_tokens": t["added_tokens"] * 40},
    "a 5000-character token": lambda t: {**t, "model": {**t["model"], "vocab": {**t["model"]["vocab"], "x" * 5000: 7}}},
    "ids beyond the model's vocabulary": lambda t: {
        **t,
        "added_tokens": [*t["added_tokens"], {**t["added_tokens"][0], "id": 5000, "content": "<|far|>"}],
    },
}


@pytest.mark.parametrize("case", list(TOKENIZERS))
def test_a_hostile_tokenizer_is_refused_before_tokenizers_builds_it(case, hostile, capsys, monkeypatch):
    from deltaship.runtimes import tokenizer

    monkeypatch.setattr(tokenizer, "MAX_ADDED_TOKENS", 100)  # the bound's code path at a fraction of 65,536 tokens
    b, m, write = hostile
    original = (b / "tokenizer.json").read_bytes()
    made = TOKENIZERS[case](json.loads(original))
    data = (made if isinstance(made, str) else json.dumps(made)).encode()
    try:
        write(json.dumps(_add_file(b, m, "tokenizer.json", data)))
        for argv in (["generate", str(b), "--prompt", "hi", "--max-new-tokens", "2"], ["chat", str(b)]):
            code, out, err = _run(argv, capsys, monkeypatch)
            assert code == 2 and "tokenizer.json" in err and "internal error" not in err, (argv[0], err[-500:])
        with pytest.raises(DeltashipError, match="tokenizer.json"):
            deltaship.load(b).generate("hi", max_new_tokens=2)
    finally:
        (b / "tokenizer.json").write_bytes(original)


@pytest.mark.parametrize("case", ["nested 100 deep", "nested 100000 deep", "NaN", "duplicate keys", "not UTF-8"])
def test_a_hostile_kit_json_or_manifest_in_out_is_not_taken_for_deltaships(case, hostile, tmp_path, capsys,
                                                                             monkeypatch):  # fmt: skip
    b, m, write = hostile
    write(json.dumps(m))
    for name in ("kit.json", "manifest.json"):
        out_dir = tmp_path / name
        out_dir.mkdir()
        _write(out_dir / name, HOSTILE_JSON[case])
        code, out, err = _run(["app", str(b), "--platform", "android", "--out", str(out_dir), "--force"],
                              capsys, monkeypatch)  # fmt: skip
        assert code == 2 and "internal error" not in err, err  # refused as a directory deltaship did not write
        assert (out_dir / name).read_bytes() == (HOSTILE_JSON[case] if isinstance(HOSTILE_JSON[case], bytes)
                                                  else HOSTILE_JSON[case].encode())  # fmt: skip


@pytest.mark.parametrize("case", ["nested 100 deep", "a 5000-digit integer", "NaN", "duplicate keys"])
def test_export_refuses_a_checkpoint_with_a_hostile_config(case, checkpoints, tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["base"], ckpt)
    text = (ckpt / "config.json").read_text()
    hostile_text = {
        "nested 100 deep": text.replace("{", '{"deltaship_test": ' + _deep(100) + ",", 1),
        "a 5000-digit integer": text.replace("{", '{"deltaship_test": 1' + "0" * 4999 + ",", 1),
        "NaN": text.replace("{", '{"deltaship_test": NaN,', 1),
        "duplicate keys": text.replace("{", '{"model_type": "llama",', 1),
    }[case]
    (ckpt / "config.json").write_text(hostile_text)
    code, out, err = _run(["export", "--model", str(ckpt), "--out", str(tmp_path / "out"), "--no-verify"],
                          capsys, monkeypatch)  # fmt: skip
    assert code == 2 and "config.json" in err and "internal error" not in err, err
    assert not (tmp_path / "out").exists()


def test_the_tokenizers_cost_bounds_are_counts_of_the_parsed_json(tmp_path, monkeypatch):
    from deltaship.runtimes import tokenizer
    from deltaship.runtimes.tokenizer import MAX_TOKEN_CHARS, check_cost

    assert tokenizer.MAX_TOKENS == 1 << 20 and tokenizer.MAX_ADDED_TOKENS == 1 << 16  # docs/reliability.md's numbers
    MAX_TOKENS = 1000
    monkeypatch.setattr(tokenizer, "MAX_TOKENS", MAX_TOKENS)  # the same counts, cheaper to build
    path = tmp_path / "tokenizer.json"
    check_cost(
        {"model": {"vocab": dict.fromkeys(map(str, range(MAX_TOKENS)), 0), "merges": [["a", "b"]] * MAX_TOKENS}}, path
    )
    for doc, what in (
        ({"model": {"vocab": dict.fromkeys(map(str, range(MAX_TOKENS + 1)), 0)}}, "vocabulary entries"),
        ({"model": {"vocab": [["a", 0.0]] * (MAX_TOKENS + 1)}}, "vocabulary entries"),  # a Unigram's list
        ({"model": {"vocab": {}, "merges": ["a b"] * (MAX_TOKENS + 1)}}, "merges"),
        ({"model": {"vocab": {"x" * (MAX_TOKEN_CHARS + 1): 0}}}, "a token of"),
        ({"model": {"vocab": [["x" * (MAX_TOKEN_CHARS + 1), 0.0]]}}, "a token of"),
        ({"model": {"vocab": {"a": 272}}}, "beyond the model's vocabulary"),
        ([1, 2], "not a tokenizer"),
    ):
        with pytest.raises(DeltashipError, match=what):
            check_cost(doc, path, vocab_size=272)


# ---- fuzzed, in-process: the readers of compare files, tiers files and JSON metadata, 500 examples each ----------
FUZZ = settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)
big_numbers = st.one_of(
    st.integers(1, 6000).map(lambda n: "9" * n),  # digits: past MAX_INT_DIGITS and Python's own 4300
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E+999", "1e-400", "0.5", "-0", "1.0"]),
)


@st.composite
def json_texts(draw) -> str:
    """JSON-ish text: a value of the manifest fuzz's strategy (NaN, inf, 2**70, text, nesting) written by json, then
    perhaps nested deep, given a raw big number or a duplicate key."""
    text = json.dumps(draw(values))
    how = draw(st.sampled_from(["as is", "deep", "number", "duplicate", "deep object"]))
    if how == "deep":
        d = draw(st.integers(1, 3000))
        text = "[" * d + text + "]" * d
    elif how == "deep object":
        d = draw(st.integers(1, 200))
        text = '{"k": ' * d + text + "}" * d
    elif how == "number":
        text = f'{{"n": {draw(big_numbers)}, "v": {text}}}'
    elif how == "duplicate":
        text = f'{{"k": {text}, "k": 1}}'
    return text


def _depth(v) -> int:
    return (
        1 + max(map(_depth, v.values() if isinstance(v, dict) else v), default=0) if isinstance(v, (dict, list)) else 0
    )


def _bounded(v) -> bool:
    """What parse_json promises of what it returns: finite floats, integers of at most 100 digits."""
    if isinstance(v, dict):
        return all(map(_bounded, v.values()))
    if isinstance(v, list):
        return all(map(_bounded, v))
    if isinstance(v, float):
        return math.isfinite(v)
    return not isinstance(v, int) or len(str(abs(v))) <= MAX_INT_DIGITS


def test_fuzzed_json_metadata_is_parsed_bounded_or_refused_naming_the_field():
    @FUZZ
    @given(json_texts())
    def check(text):
        try:
            v = parse_json(text, "session.safetensors (__metadata__)", "chat session's metadata", "save it again")
        except DeltashipError as e:
            assert e.message.startswith("session.safetensors (__metadata__): ") and "\n" not in e.message
            return
        assert _depth(v) <= MAX_JSON_DEPTH and _bounded(v), text[:200]

    check()


@st.composite
def profile_docs(draw) -> dict:
    doc = _profile_doc()
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["doc", "results", "record", "samples", "add"]))
        if where == "doc":
            doc[draw(st.sampled_from(["schema_version", "results", "device"]))] = draw(values)
        elif where == "results":
            doc["results"] = [draw(values) for _ in range(draw(st.integers(0, 3)))]
        elif where == "add" and isinstance(doc["results"], list):
            first = doc["results"][0] if doc["results"] else None
            doc["results"].append(dict(first) if isinstance(first, dict) else {})
        elif isinstance(doc["results"], list) and doc["results"] and isinstance(doc["results"][0], dict):
            record = doc["results"][0]
            if where == "samples" and isinstance(record.get("samples"), list) and record["samples"]:
                record["samples"][0] = draw(values)
            else:
                keys = ["metric", "unit", "samples", "median", "prompt_length", "context", "op_kind", "tokens"]
                record[draw(st.sampled_from(keys))] = draw(values)
    return doc


def test_fuzzed_compare_files_compare_or_are_refused(tmp_path):
    from deltaship.profiling.profile import compare
    from deltaship.profiling.report import format_compare

    good = _write(tmp_path / "good.json", json.dumps(_profile_doc()))
    bad = tmp_path / "fuzzed.json"
    seen = {"refused": 0, "compared": 0}

    @FUZZ
    @given(profile_docs(), st.booleans())
    def check(doc, raw):
        _write(bad, json.dumps(doc) if not raw else json.dumps(doc)[:-1] + ', "results": []}')  # raw: a duplicate key
        for a, b in ((good, bad), (bad, good)):
            try:
                rows = compare(a, b)
            except DeltashipError as e:
                assert str(bad) in e.message
                seen["refused"] += 1
                continue
            format_compare(rows, str(a), str(b))  # what the CLI prints
            seen["compared"] += 1

    check()
    assert seen["refused"] > 200 and seen["compared"] > 50, seen


def _toml(v) -> str:
    """A value as a TOML literal (None: the key is left out)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, (int, str)):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v if x is not None) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items() if x is not None) + "}"


TIER_VALUES = {"kind": "phone", "ram_gib": 4, "budget_gib": 2, "targets": ["onnx"], "precisions": ["int4"],
               "context": 2048, "threads": 4, "notes": ""}  # fmt: skip


def test_fuzzed_tiers_files_give_typed_tiers_or_are_refused(tmp_path):
    path = tmp_path / "tiers.toml"
    seen = {"refused": 0, "loaded": 0}

    @FUZZ
    @given(st.dictionaries(st.sampled_from([*TIER_VALUES, "npu"]), values | big_numbers, max_size=3), st.booleans())
    def check(changes, raw):
        tier = {**TIER_VALUES, **changes}
        lines = [f"{k} = {v if isinstance(v, str) and raw and k not in ('kind', 'notes') else _toml(v)}"
                 for k, v in tier.items() if v is not None]  # fmt: skip
        _write(path, "[tiers.fz]\n" + "\n".join(lines) + "\n")
        try:
            tiers, _ = load_catalog(path)
        except DeltashipError as e:
            assert str(path) in e.message and "\n" not in e.message
            seen["refused"] += 1
            return
        t = tiers["fz"]
        assert type(t.threads) is int and 1 <= t.threads <= 1024 and type(t.context) is int and t.context >= 1
        assert type(t.ram_bytes) is int and 0 < t.budget_bytes <= t.ram_bytes and all(map(str.isprintable, t.targets))
        seen["loaded"] += 1

    check()
    assert seen["refused"] > 200 and seen["loaded"] > 20, seen


TEMPLATE_CONFIGS = {  # tokenizer_config.json (the chat template's reader, deltaship/chat/template.py) -> its text
    "nested 100 deep": '{"chat_template": "x", "deltaship_test": ' + _deep(100) + "}",
    "nested 100000 deep": '{"chat_template": "x", "deltaship_test": ' + _deep(100_000) + "}",
    "a 5000-digit integer": '{"chat_template": "x", "model_max_length": 1' + "0" * 4999 + "}",
    "NaN": '{"chat_template": "x", "model_max_length": NaN}',
    "duplicate keys": '{"chat_template": "x", "chat_template": "y"}',
}


@pytest.mark.parametrize(
    "case",
    list(TEMPLATE_CONFIGS),
)
def test_chat_refuses_a_hostile_tokenizer_config(case, hostile, capsys, monkeypatch):
    b, m, write = hostile
    name = "tokenizer_config.json"
    original = (b / name).read_bytes() if (b / name).exists() else None
    try:
        write(json.dumps(_add_file(b, m, name, TEMPLATE_CONFIGS[case].encode())))
        code, out, err = _run(["chat", str(b), "--max-new-tokens", "2"], capsys, monkeypatch)
        assert code == 2 and name in err and "internal error" not in err, err[-400:]
    finally:
        if original is None:
            (b / name).unlink()
        else:
            (b / name).write_bytes(original)


SESSION_METADATA = {  # a chat session's __metadata__ text (its sha256 beside it, as an attacker computes it)
    "nested 100000 deep": _deep(100_000),
    "a 5000-digit integer": '{"format": "x", "version": 1' + "0" * 4999 + "}",
}
PROMPT_CACHE_FILES = {  # export --prompt-cache FILE.json
    "nested 100000 deep": '{"system": "s", "template_kwargs": {"k": ' + _deep(100_000) + "}}",
    "a 5000-digit integer": '{"system": "s", "template_kwargs": {"k": 1' + "0" * 4999 + "}}",
}


@pytest.mark.parametrize("case", list(SESSION_METADATA))
def test_a_session_file_with_hostile_metadata_is_refused(case, tmp_path):
    from safetensors.numpy import save_file

    from deltaship.chat.store import META_KEY, META_SHA_KEY, read_session_file

    text = SESSION_METADATA[case]
    path = tmp_path / "s.safetensors"
    meta = {META_KEY: text, META_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()}
    save_file({"t": np.zeros(1, np.float32)}, str(path), metadata=meta)
    with pytest.raises(DeltashipError):
        read_session_file(path)


@pytest.mark.parametrize("case", list(PROMPT_CACHE_FILES))
def test_an_export_prompt_cache_file_with_hostile_json_is_refused(case, tmp_path):
    from deltaship.chat.store import prompt_cache_settings

    with pytest.raises(DeltashipError):
        prompt_cache_settings(_write(tmp_path / "cache.json", PROMPT_CACHE_FILES[case]))


def test_a_runtime_error_in_a_driver_without_its_tokens_is_still_one_error(hostile, capsys, monkeypatch):
    """The speculative and image drivers run their own loops: their runtime errors map as the session's do."""
    from deltaship.runtimes.onnx import OnnxSession

    b, m, write = hostile
    write(json.dumps(m))
    for error, code in ((RuntimeError("Error in execution: a shape"), 2), (MemoryError(), 3), (KeyError("bug"), 1)):
        monkeypatch.setattr(OnnxSession, "generate", lambda self, *a, error=error, **k: (_ for _ in ()).throw(error))
        got, out, err = _run(["generate", str(b), "--input-ids", "1,2"], capsys, monkeypatch)
        assert got == code and ("internal error" in err) == (code == 1), err
        assert "new token" not in err  # no count it does not know


@pytest.mark.parametrize(
    "line",
    [
        "PyTorchObserver {" + '"a": ' * 100 + "1" + "}" * 100,
        'PyTorchObserver {"model_load_start_ms": NaN}',
        'PyTorchObserver {"model_load_start_ms": "0", "model_load_end_ms": 1}',
        'PyTorchObserver {"prompt_tokens": 1' + "0" * 5000 + "}",
        "PyTorchObserver {not json}",
    ],
    ids=["deep", "NaN", "text", "digits", "not JSON"],
)
def test_an_android_runners_hostile_observer_line_is_one_error(line):
    from deltaship.devices.android import parse_runner_output

    with pytest.raises(DeltashipError, match="PyTorchObserver"):
        parse_runner_output("llama_main started\n" + line + "\n")
    times = dict.fromkeys(["model_load_start_ms", "inference_start_ms"], 0)
    good = {**times, "model_load_end_ms": 500, "prompt_eval_end_ms": 100, "first_token_ms": 120}
    good |= {"inference_end_ms": 1120, "prompt_tokens": 10, "generated_tokens": "11"}  # a text count: left out
    assert parse_runner_output("PyTorchObserver " + json.dumps(good)) == pytest.approx(
        {"load_cold_s": 0.5, "prefill_tok_s": 100.0, "ttft_s": 0.12}
    )


def test_export_refuses_a_checkpoint_with_a_hostile_tokenizer(checkpoints, tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["base"], ckpt)
    _write(ckpt / "tokenizer.json", '{"added_tokens": ' + _deep(100_000) + "}")
    code, out, err = _run(["export", "--model", str(ckpt), "--out", str(tmp_path / "out"), "--no-verify"],
                          capsys, monkeypatch)  # fmt: skip
    assert code == 2 and "tokenizer.json" in err and "internal error" not in err, err
    assert not (tmp_path / "out").exists()
