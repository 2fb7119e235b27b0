"""No traceback reaches a user, and options mean what they say: every failure of the `deltaship` command is what
went wrong + the fix with a documented exit code (2 bad input, 3 the machine, 1 a deltaship bug, 130/143 signals,
141 stdout closed), option values are range-checked as they are parsed, and the Python API raises DeltashipError
on the same values, never SystemExit."""

from __future__ import annotations

import argparse
import errno
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import deltaship
from deltaship.cli import Terminated, build_parser, main
from deltaship.commands import generate
from deltaship.errors import DeltashipError


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from deltaship.compile import export

    out = tmp_path_factory.mktemp("trust-cli") / "tiny"
    export("qwen3.5-tiny", out, target="onnx", precision="fp32", max_context=96, verify=False, progress=False)
    return out


def _fails(argv: list[str], capsys, code: int, *needles: str) -> str:
    """main(argv) exits with `code` (returned, or argparse's SystemExit) and stderr names every needle, no traceback."""
    try:
        got = main(argv)
    except SystemExit as e:
        got = e.code
    err = capsys.readouterr().err
    assert got == code, err
    for needle in needles:
        assert needle in err, err
    assert "Traceback" not in err, err
    return err


def _replace_file(bundle: Path, copy: Path, name: str, data: bytes) -> Path:
    """A copy of the bundle with `name` replaced and the manifest's size and hash updated: damaged content that
    the integrity check cannot see, as a checkpoint with a broken file would give."""
    shutil.copytree(bundle, copy)
    (copy / name).write_bytes(data)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


# --- help on every option ---------------------------------------------------------------------------------------


def test_every_option_of_every_subcommand_has_help():
    parser = build_parser()
    missing = [f"deltaship {a.option_strings}" for a in parser._actions if not a.help and a.dest != "help"]
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        for a in p._actions:
            if a.dest != "help" and not (a.help or "").strip():
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, f"options without help: {missing}"


# --- option values refused as they are parsed (argparse: exit 2, one line) --------------------------------------

GEN = ["generate", "/nonexistent/bundle", "--input-ids", "1,2"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (GEN + ["--temperature", "inf"], "argument --temperature: must be a finite number >= 0, got inf"),
        (GEN + ["--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got nan"),
        (GEN + ["--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
        (GEN + ["--temperature", "warm"], "argument --temperature: expected a number, got 'warm'"),
        (GEN + ["--top-p", "0"], "argument --top-p: must be in (0, 1]"),
        (GEN + ["--top-p", "1.5"], "argument --top-p: must be in (0, 1]"),
        (GEN + ["--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
        (GEN + ["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (GEN + ["--threads", "-3"], "argument --threads: must be >= 1, got -3"),
        (GEN + ["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
        (["generate", "B", "--input-ids", "1,,2"], "argument --input-ids: '1,,2': item 2 of 3 is empty"),
        (["generate", "B", "--input-ids", "1,-2"], "item 2 of 2 is '-2', not an integer >= 0"),
        (["generate", "B", "--input-ids", ""], "item 1 of 1 is empty"),
        (
            ["generate", "B", "--prompt", "a\udcffb"],
            "argument --prompt: is not valid UTF-8 text (bytes ff at character 1)",
        ),
        (GEN + ["--dump-logits", "/nonexistent/dir/x.npy"], "the directory /nonexistent/dir does not exist"),
        (GEN + ["--dump-logits", "/tmp/" + "x" * 300 + ".npy"], "File name too long\n  fix: pass a shorter path"),
        (GEN + ["--dump-logits", "/etc/passwd/x.npy"], "Not a directory\n  fix: "),
        (["profile", "B", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["profile", "B", "--contexts", "128,,4096"], "argument --contexts: '128,,4096': item 2 of 3 is empty"),
        (["profile", "B", "--gen", "0"], "argument --gen: must be >= 1"),
        (["profile", "B", "--min-seconds", "inf"], "argument --min-seconds: must be a finite number >= 0, got inf"),
        (["profile", "B", "--acceptance", "1.5"], "argument --acceptance: must be a finite number > 0 and <= 1"),
        (GEN + ["--fps", "-2"], "argument --fps: must be a finite number > 0, got -2.0"),
        (["eval", "B", "--threads", "-1"], "argument --threads: must be >= 1, got -1"),
        (["export", "--model", "m", "--out", "o", "--threads", "0"], "argument --threads: must be >= 1"),
        (["export", "--model", "m", "--out", "o", "--max-context", "0"], "argument --max-context: expected a number"),
        (["export", "--model", "m", "--out", "o", "--prefill-chunk", "0"], "argument --prefill-chunk: must be >= 1"),
        (["plan", "--model", "m", "--prefill-chunk", "-8"], "argument --prefill-chunk: must be >= 1"),
    ],
)
def test_option_values_are_refused_as_they_are_parsed(argv, needle, capsys):
    err = _fails(argv, capsys, 2, needle)
    assert "fix" in err or "expected" in err


def test_dump_logits_into_a_missing_directory_is_refused_before_generating(bundle, tmp_path, capsys, monkeypatch):
    command = importlib.import_module("deltaship.commands.generate")  # the module (the package exports the function)
    opened = []
    monkeypatch.setattr(command, "open_bundle", lambda *a, **k: opened.append(a))
    out = tmp_path / "missing" / "logits.npy"
    _fails(["generate", str(bundle), "--input-ids", "1", "--dump-logits", str(out)], capsys, 2, "does not exist")
    assert not opened and not out.parent.exists()


def test_sampling_options_without_temperature_are_refused(bundle, capsys):
    err = _fails(
        ["generate", str(bundle), "--input-ids", "1,2", "--top-k", "5", "--seed", "1"],
        capsys,
        2,
        "--top-k, --seed without --temperature",
        "fix: add --temperature T to sample (greedy ignores them)",
    )
    assert err.startswith("deltaship generate: error:")
    assert main(["generate", str(bundle), "--input-ids", "1,2", "--temperature", "0.7", "--top-k", "5", "--seed", "1",
                 "--max-new-tokens", "3"]) == 0  # fmt: skip


def test_profile_contexts_past_the_max_context_are_refused_as_the_help_says(bundle, capsys):
    """Depths the user gives are measured as given (only the default ones are clipped), so 262143 is refused."""
    help_text = " ".join(next(a.help for a in _subparser("profile")._actions if a.dest == "contexts").split())
    assert "each clipped to the bundle's max context - 1" in help_text and "is refused" in help_text
    argv = ["profile", str(bundle), "--contexts", "64,262143", "--prompt-lengths", "16", "--gen", "8", "--quiet"]
    err = _fails(argv, capsys, 2, "--contexts 262143 (a depth must be below it)", "max context of 96")
    assert "--prompt-lengths" not in err.splitlines()[0]


def _subparser(name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


# --- what reaches main(): one line of what + fix, a documented exit code ----------------------------------------


def test_a_tokenizer_that_does_not_parse_names_the_file(bundle, tmp_path, capsys):
    copy = _replace_file(bundle, tmp_path / "b", "tokenizer.json", b'{"model": ')
    _fails(["generate", str(copy), "--prompt", "hi"], capsys, 2, f"{copy / 'tokenizer.json'}: not a tokenizer")


def test_an_onnx_model_that_does_not_load_is_one_line(bundle, tmp_path, capsys):
    copy = _replace_file(bundle, tmp_path / "b", "model.onnx", b"not a protobuf")
    # the bundle's artifact check (runtimes/onnx_contract.py) reads the graph before ONNX Runtime sees it
    _fails(["generate", str(copy), "--input-ids", "1"], capsys, 2, "model.onnx: not a readable ONNX model")


def test_disk_full_while_writing_logits_is_exit_3_and_leaves_nothing(bundle, tmp_path, capsys, monkeypatch):
    command = importlib.import_module("deltaship.commands.generate")  # the module (the package exports the function)

    def full(path, arr):
        Path(path).write_bytes(b"\x93NUMPY partial")  # what a write cut short leaves
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(command.np, "save", full)
    out = tmp_path / "logits.npy"
    err = _fails(
        ["generate", str(bundle), "--input-ids", "1,2", "--max-new-tokens", "2", "--dump-logits", str(out)],
        capsys,
        3,
        "No space left on device",
        "fix: free space",
    )
    assert str(tmp_path) in err and len(err.strip().splitlines()) == 2
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial


def _inspect_raises(monkeypatch, exc: BaseException) -> None:
    module = importlib.import_module("deltaship.check.inspect")

    def boom(bundle):
        raise exc

    monkeypatch.setattr(module, "inspect", boom)


@pytest.mark.parametrize(
    "exc,code,needles",
    [
        (OSError(errno.ENOSPC, "No space left on device", "/b/x"), 3, ["/b/x: No space left on device", "free space"]),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "/b/x"), 3, ["/b/x: Disk quota exceeded", "quota"]),
        (OSError(errno.EROFS, "Read-only file system", "/b/x"), 3, ["/b/x: Read-only", "write somewhere else"]),
        (PermissionError(errno.EACCES, "Permission denied", "/b/x"), 3, ["/b/x: Permission denied", "permissions"]),
        (PermissionError(errno.EPERM, "Operation not permitted", "/b"), 3, ["/b: Operation not permitted", "owner"]),
        (OSError(errno.EBUSY, "Device or resource busy", "/b/x"), 3, ["/b/x: Device or resource busy", "another"]),
        (OSError(errno.ENAMETOOLONG, "File name too long", "/b/x"), 3, ["/b/x: File name too long", "shorter path"]),
        (OSError(errno.EMFILE, "Too many open files", "/b/x"), 3, ["Too many open files", "ulimit -n"]),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "/b/x"), 2, ["/b/x: No such file", "check"]),
        (MemoryError(), 3, ["ran out of memory", "fix: close other programs", "deltaship plan"]),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GB"), 3, ["out of memory"]),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), 2, ["not valid UTF-8", "fix:"]),
        (DeltashipError("bad thing in X", "do Y"), 2, ["error: bad thing in X", "fix: do Y"]),
        (RuntimeError("kaboom"), 1, ["internal error: RuntimeError: kaboom", "this is a deltaship bug", "--debug"]),
        (KeyboardInterrupt(), 130, ["interrupted; nothing was written"]),
        (Terminated(), 143, ["terminated; nothing was written"]),
    ],
)
def test_every_failure_is_one_line_with_its_exit_code(exc, code, needles, capsys, monkeypatch):
    monkeypatch.delenv("DELTASHIP_DEBUG", raising=False)
    _inspect_raises(monkeypatch, exc)
    err = _fails(["inspect", "B"], capsys, code, *needles)
    assert len(err.strip().splitlines()) <= 2


def test_an_onnxruntime_error_while_running_is_exit_2(capsys, monkeypatch):
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    _inspect_raises(monkeypatch, Fail("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code"))
    _fails(["inspect", "B"], capsys, 2, "ONNX Runtime could not run the bundle: Fail:", "deltaship inspect")
    _inspect_raises(monkeypatch, Fail("[ONNXRuntimeError] : 1 : FAIL : Failed to allocate memory for requested buffer"))
    _fails(["inspect", "B"], capsys, 3, "ran out of memory (Fail:", "fix: close other programs")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_prints_the_traceback(how, capsys, monkeypatch):
    _inspect_raises(monkeypatch, RuntimeError("kaboom"))
    if how == "env":
        monkeypatch.setenv("DELTASHIP_DEBUG", "1")
    assert main(["--debug", "inspect", "B"] if how == "flag" else ["inspect", "B"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in boom" in err and "internal error: RuntimeError: kaboom" in err


SHORT_INSPECT = (  # inspect with a one-line description: it stays in stdout's buffer until the last flush
    "import importlib, sys; m = importlib.import_module('deltaship.check.inspect'); "
    "m.describe = lambda info: 'one line'; from deltaship.cli import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "cmd,args",
    [(["-m", "deltaship.cli"], ["inspect"]), (["-c", SHORT_INSPECT], ["inspect"]), (["-m", "deltaship.cli"], ["-h"])],
    ids=["long", "short", "help"],
)
def test_stdout_closed_by_its_reader_exits_quietly(bundle, cmd, args):
    """`deltaship inspect B | head -1`: the reader went away before the output was written (a long output fails
    in print, a short one at the last flush, argparse's help as it exits: all exit 141 without a word)."""
    env = dict(os.environ, PYTHONPATH=str(Path(deltaship.__file__).parents[1]))
    env.pop("PYTHONUNBUFFERED", None)  # stdout buffered, as in a user's shell
    proc = subprocess.Popen(
        [sys.executable, *cmd, *args, str(bundle)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    proc.stdout.close()  # before the child (still importing) writes a byte
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


def test_stdout_closed_in_a_shell_pipe(bundle):
    env = dict(os.environ, PYTHONPATH=str(Path(deltaship.__file__).parents[1]))
    shell = subprocess.run(
        f"{sys.executable} -m deltaship.cli inspect --json {bundle} | head -c 1",
        shell=True,
        capture_output=True,
        text=True,
        env=env,
    )
    assert shell.stdout == "{" and "Traceback" not in shell.stderr and "Broken pipe" not in shell.stderr


# --- the Python API: DeltashipError on the same values, never SystemExit ----------------------------------------


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"temperature": -1}, "--temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "--temperature must be a finite number >= 0"),
        ({"threads": 0}, "--threads must be >= 1"),
        ({"seed": -1, "temperature": 0.5}, "--seed must be >= 0"),
        ({"top_k": 0, "temperature": 0.5}, "--top-k must be >= 1"),
        ({"top_p": 0.0, "temperature": 0.5}, "--top-p must be in (0, 1]"),
        ({"top_k": 5}, "--top-k without --temperature"),
        ({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
        ({"input_ids": [1, -2]}, "--input-ids item 2 must be >= 0"),
        ({"input_ids": "1,,2"}, "item 2 of 3 is empty"),
        ({"input_ids": None, "prompt": "a\udcffb"}, "--prompt is not valid UTF-8"),
        ({"dump_logits": "/nonexistent/dir/x.npy"}, "the directory /nonexistent/dir does not exist"),
    ],
)
def test_api_generate_refuses_what_the_cli_refuses(bundle, kwargs, needle):
    args = {"input_ids": [1, 2], **kwargs}
    with pytest.raises(DeltashipError) as e:
        generate(bundle, **args)
    assert needle in e.value.message


def test_api_load_export_profile_raise_deltaship_errors(bundle, tmp_path):
    from deltaship.commands import evaluate, profile
    from deltaship.targets import open_bundle

    with pytest.raises(DeltashipError, match="no manifest.json"):
        deltaship.load(tmp_path / "missing")
    with pytest.raises(DeltashipError, match="--threads must be >= 1, got 0"):
        open_bundle(bundle, threads=0)
    with pytest.raises(DeltashipError, match="--threads must be >= 1, got -2"):
        profile(bundle, threads=-2)
    with pytest.raises(DeltashipError, match="--threads must be >= 1, got 0"):
        evaluate(bundle, threads=0)
    with pytest.raises(DeltashipError, match="--threads must be >= 1, got 0"):
        deltaship.export("qwen3.5-tiny", tmp_path / "o", threads=0, progress=False)
    assert not (tmp_path / "o").exists()
    with pytest.raises(DeltashipError, match="--temperature must be a finite number >= 0, got inf"):
        open_bundle(bundle).generate([1, 2], 3, temperature=float("inf"))  # a session checks them too
    with pytest.raises(DeltashipError, match="--threads must be >= 1, got 0"):
        deltaship.load(bundle, threads=0)
