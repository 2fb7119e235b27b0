"""Conversations, templates and sessions as untrusted input (docs/reliability.md, "Conversations, templates and
sessions"): a piped line never names where a chat writes, Chat.save and an interactive /save write only where a
session of the bundle belongs, piped and interactive chat take the same commands, /retry with --seed draws a new
sample reproducibly, a bundle's template is bounded in time, output and depth by `chat` and `app --platform web`, a
session file's header is checked against the bundle before a tensor is read, and a killed save leaves nothing that
the next run does not remove.

One fp32 ONNX export of the trained tiny preset, shared with test_chat (shared_export).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from deltaship.bundle.destination import OutputLock, lock_path
from deltaship.chat import Chat
from deltaship.chat.template import TIME_BUDGET_S
from deltaship.cli import main
from deltaship.commands.chat import _step
from deltaship.errors import DeltashipError
from deltaship.targets import open_bundle

N = 6
DEAD = 999_999_999  # above any pid_max: never a live process


@pytest.fixture(scope="module")
def bundle(shared_export) -> Path:
    return shared_export("chat-tiny-onnx-fp32", "qwen3.5-tiny", target="onnx", precision="fp32", max_context=192,
                         verify=False)  # fmt: skip


def _cli(*args: str, stdin: str | bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "deltaship", *args], input=stdin, capture_output=True,
                          text=isinstance(stdin, str), env=env, timeout=300)  # fmt: skip


def _records(run) -> list[dict]:
    return [json.loads(line) for line in run.stdout.splitlines()]


# ---- commands: the user's, not the input's -------------------------------------------------------------------


def test_piped_chat_takes_the_terminal_commands_and_save_only_to_its_session(bundle, tmp_path):
    session = tmp_path / "s.dschat"
    args = ("chat", str(bundle), "--json", "--max-new-tokens", str(N), "--session", str(session))
    script = "import os\n/help\n/bogus thing\n/save\n/save " + str(session) + "\n/quit\nnever sent\n"
    run = _cli(*args, stdin=script)
    assert run.returncode == 0, run.stderr
    records = _records(run)
    assert [r["command"] for r in records] == ["send", "help", "unknown", "save", "save", "quit"]
    assert records[1]["commands"] == records[2]["commands"] and "/retry" in records[1]["commands"]
    assert "/bogus" in run.stderr and "/undo" in run.stderr  # the unknown command, and the list, on stderr
    assert records[3]["path"] == str(session) and Chat.load(session, open_bundle(bundle, threads=1)).ids

    # a path named by a piped line is refused, whatever it is; nothing is written there
    for target in (tmp_path / "elsewhere.dschat", bundle / "manifest.json"):
        before = target.read_bytes() if target.exists() else None
        run = _cli(*args, stdin=f"import os\n/save {target}\n")
        assert run.returncode == 2 and "only to its --session file" in run.stderr, run.stderr
        assert (target.read_bytes() if target.exists() else None) == before
    run = _cli("chat", str(bundle), "--json", stdin="/save\n")  # no --session: nowhere to save
    assert run.returncode == 2 and "needs a file name" in run.stderr
    help_text = _cli("chat", "--help", stdin="").stdout
    assert all(c in help_text for c in ("/retry", "/undo", "/reset", "/save", "/help", "/quit", "/exit"))


def test_retry_with_a_seed_draws_a_new_sample_reproducibly(bundle):
    args = ("chat", str(bundle), "--json", "--max-new-tokens", str(N), "--temperature", "1", "--seed", "7")
    script = "import os\n/retry\n/retry\n/retry\n"
    runs = [_records(_cli(*args, stdin=script)) for _ in range(2)]
    timing = ("ttft_s", "decode_tok_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in runs[0]] == [
        {k: v for k, v in r.items() if k not in timing} for r in runs[1]
    ]  # the same --seed, the same sequence of retries
    first = runs[0]
    assert [r["seed"] for r in first] == [7, 8, 9, 10]
    assert len({tuple(r["reply_ids"]) for r in first}) > 1  # new samples, not the first reply again
    session = open_bundle(bundle, threads=1)
    for r in first:  # each the sample of its own seed from the same history
        session.reset()
        want = session.generate(r["history_ids"], N, stop_at_eos=False, temperature=1.0, seed=r["seed"]).output_ids
        assert r["reply_ids"] == want[: len(r["reply_ids"])]


@pytest.mark.parametrize("utf8_mode", ["strict", "surrogateescape"])
def test_random_bytes_on_stdin_are_one_clear_error(bundle, utf8_mode):
    noise = bytes(range(128, 256)) * 4 + b"\n"
    env = {"PYTHONIOENCODING": f"utf-8:{utf8_mode}"}
    run = _cli("chat", str(bundle), "--max-new-tokens", "1", stdin=b"hello\n" + noise, env=env)
    err = run.stderr.decode()
    assert run.returncode == 2, err
    assert "input line 2 is not UTF-8 text" in err and "Traceback" not in err


def test_chat_save_writes_only_where_a_session_of_the_bundle_belongs(bundle, tmp_path):
    chat = Chat(open_bundle(bundle, threads=1))
    chat.send("import os", max_new_tokens=2)
    other_bundle = tmp_path / "other"
    other_bundle.mkdir()
    (other_bundle / "manifest.json").write_text("{}")
    (other_bundle / "sub").mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    refused = {
        bundle / "talk.dschat": "inside the bundle",
        bundle / "manifest.json": "inside the bundle",
        other_bundle / "sub" / "talk.dschat": "inside the bundle",
        notes: "not a saved chat session of this bundle",
        tmp_path: "not a plain file",
    }
    before = sorted(p.name for p in bundle.iterdir())
    for path, match in refused.items():
        with pytest.raises(DeltashipError, match=match):
            chat.save(path)
        state = {"retries": 0, "line": 0}  # an interactive /save PATH follows the same rules
        with pytest.raises(DeltashipError, match=match):
            _step(chat, f"/save {path}", {}, False, True, io.StringIO(), None, state)
    assert sorted(p.name for p in bundle.iterdir()) == before and notes.read_text() == "mine"
    assert not (other_bundle / "sub" / "talk.dschat").exists()

    for bad in (None, 5, ""):  # the Python API: a DeltashipError, never a TypeError
        with pytest.raises(DeltashipError, match="a session file is a path"):
            chat.save(bad)
    mine = chat.save(tmp_path / "mine.dschat")  # a new file, then over its own session file
    assert chat.save(mine) == mine and not lock_path(mine).exists()  # the lock removed once written
    foreign = tmp_path / "foreign.dschat"  # a session file of another bundle
    foreign.write_bytes(mine.read_bytes().replace(b'"manifest_sha256":"', b'"manifest_sha256":"0', 1)[:-1])
    with pytest.raises(DeltashipError, match="not a saved chat session of this bundle"):
        chat.save(foreign)
    held = OutputLock(mine)  # another chat's session: its lock is held
    try:
        with pytest.raises(DeltashipError, match="in use by another deltaship chat"):
            chat.save(mine)
    finally:
        held.release()


def test_a_killed_save_leaves_nothing_the_next_run_keeps(bundle, tmp_path):
    """SIGKILL between the partial copy and its rename; the next chat on the session removes the copy (as --out's
    staging is removed), keeps a live process's, and every chat removes its lock when it ends."""
    session = tmp_path / "s.dschat"
    code = (
        "import os, signal, sys\n"
        "from deltaship.chat import Chat\n"
        "from deltaship.targets import open_bundle\n"
        f"chat = Chat(open_bundle({str(bundle)!r}, threads=1))\n"
        "chat.send('import os', max_new_tokens=2)\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"chat.save({str(session)!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    killed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = list(tmp_path.glob(".s.dschat.partial-*"))
    assert len(left) == 1 and not session.exists()
    live = tmp_path / f".s.dschat.partial-{os.getppid()}-abcd1234"  # a running process's: not ours to remove
    live.write_bytes(b"x")
    run = _cli("chat", str(bundle), "--session", str(session), "--max-new-tokens", "1", stdin="")
    assert run.returncode == 0, run.stderr
    assert "removed its partial output" in run.stderr and not left[0].exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([session.name, live.name])  # no lock file left


# ---- templates: bounded -----------------------------------------------------------------------------------------

HOSTILE = {  # the template, and the bound that stops it
    "nested range": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
        f"took more than {TIME_BUDGET_S:g} s",
    ),
    "string repetition": ("{{ 'a' * 10**10 }}", "repeats a string or list"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nests calls deeper than 64"),
    "huge for output": ("{% for i in range(100000) %}{{ messages[0].content * 1000 }}{% endfor %}", "renders more"),
    "renders nothing": ("{% for m in messages %}{% endfor %}", "to nothing"),
}
LIMIT_S, LIMIT_BYTES = 5.0, 200 << 20  # the bounds stated in docs/reliability.md


def _with_template(bundle: Path, out: Path, source: str) -> Path:
    """A copy of the bundle (hard links) whose chat_template.jinja is `source`, its manifest hashes updated."""
    shutil.copytree(bundle, out, copy_function=os.link)
    t = out / "chat_template.jinja"
    t.unlink()  # a hard link: the shared bundle's file is untouched
    t.write_text(source)
    m = out / "manifest.json"
    manifest = json.loads(m.read_text())
    manifest["files"]["chat_template.jinja"] = {"bytes": t.stat().st_size, "sha256": hashlib.sha256(t.read_bytes())
                                                .hexdigest()}  # fmt: skip
    manifest["bundle_bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    m.unlink()
    m.write_text(json.dumps(manifest, indent=2))
    return out


def _bounded(capsys, argv: list[str]) -> tuple[int, str]:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        t0 = time.monotonic()
        code = main(argv)
        took, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert took < LIMIT_S + 4, (argv, took)  # the render's budget plus opening the bundle on a loaded host
    assert peak < LIMIT_BYTES, (argv, peak)
    return code, err


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_template_is_refused_within_bounds_by_chat_and_app(bundle, tmp_path, capsys, monkeypatch, case):
    source, bound = HOSTILE[case]
    hostile = _with_template(bundle, tmp_path / "b", source)
    template = str(hostile / "chat_template.jinja")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    code, err = _bounded(capsys, ["chat", str(hostile), "--max-new-tokens", "1"])
    assert code == 2 and template in err and bound in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2  # what, and the fix
    code, err = _bounded(capsys, ["app", str(hostile), "--platform", "web", "--out", str(tmp_path / "kit")])
    assert code == 2 and template in err and bound in err, err
    assert not (tmp_path / "kit").exists() and not list(tmp_path.glob(".kit.*"))  # nothing written


def test_the_template_budget_stops_a_loop_that_calls_nothing():
    """A loop over a string calls no hook: the interval timer stops it at the budget."""
    from deltaship.chat.template import ChatTemplate

    t0 = time.monotonic()
    with pytest.raises(DeltashipError, match=f"took more than {TIME_BUDGET_S:g} s"):
        ChatTemplate("{% set s = 'ab' * 1000000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}",
                     where="t.jinja").render([{"role": "user", "content": "x"}], True)  # fmt: skip
    assert time.monotonic() - t0 < LIMIT_S


@pytest.mark.parametrize(
    "source",
    ["{{ '{:>999999999}'.format(1) }}", "{{ '{:>{w}}'.format(1, w=10**9) }}", "{{ '%999999999d' % 1 }}",
     "{{ '%*d' % (10**9, 1) }}", "{{ 'a'|center(10**9) }}", "{{ (10**400) ** 10**6 }}"],
)  # fmt: skip
def test_widths_and_powers_are_refused_before_they_are_built(source):
    """A field width or power is refused before Python allocates it (a 1 GB string, a number that takes minutes)."""
    from deltaship.chat.template import ChatTemplate

    tracemalloc.start()
    try:
        with pytest.raises(DeltashipError, match="t.jinja: the chat template (formats|passes a filter|computes)"):
            ChatTemplate(source, where="t.jinja").render([{"role": "user", "content": "x"}], True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_a_render_leaves_the_callers_timer_as_it_was():
    from deltaship.chat.template import ChatTemplate

    def mine(*a):
        pass

    handler = signal.signal(signal.SIGALRM, mine)
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        assert ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": "x"}], True) == "x"
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 90 < left <= 100 and signal.getsignal(signal.SIGALRM) is mine
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)


# ---- session files: checked before read ---------------------------------------------------------------------


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])


def _rewrite_header(path: Path, out: Path, edit, extra_bytes: int = 0) -> Path:
    """A copy of a session file whose safetensors header (and metadata, with its sha256) `edit` rewrote, its data
    region `extra_bytes` longer (sparse)."""
    from deltaship.chat.store import META_KEY, META_SHA_KEY

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"][META_KEY])
    edit(header, meta)
    text = json.dumps(meta)
    header["__metadata__"] = {META_KEY: text, META_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()}
    head = json.dumps(header).encode()
    data = raw[8 + n :]
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + data)
        f.truncate(8 + len(head) + len(data) + extra_bytes)
    return out


def test_a_session_file_is_checked_before_a_tensor_is_read(bundle, tmp_path):
    """Today's cost of a sparse 4 GiB tensor was 8.4 GB of RSS and 40 s: now it is refused from the header."""
    chat = Chat(open_bundle(bundle, threads=1))
    chat.send("import os", max_new_tokens=2)
    good = chat.save(tmp_path / "good.dschat")
    session = open_bundle(bundle, threads=1)
    tensors = {k: e for k, e in _header(good).items() if k != "__metadata__"}
    first = min(k for k in tensors if k.startswith("state/"))
    end = max(e["data_offsets"][1] for e in tensors.values())
    giant = 4 << 30
    grow = giant - (tensors[first]["data_offsets"][1] - tensors[first]["data_offsets"][0])

    def extra(header, meta):  # one more tensor, 4 GiB, after the others
        header["state/extra"] = {"dtype": "F32", "shape": [giant // 4], "data_offsets": [end, end + giant]}
        meta["tensors"]["state/extra"] = {"dtype": "float32", "shape": [giant // 4], "sha256": "0" * 64}

    def grown(header, meta):  # a state of the bundle, 4 GiB (the tensors after it moved along)
        e = header[first]
        for k, x in header.items():
            if k != "__metadata__" and x["data_offsets"][0] > e["data_offsets"][0]:
                x["data_offsets"] = [x["data_offsets"][0] + grow, x["data_offsets"][1] + grow]
        e.update(shape=[giant // 4], data_offsets=[e["data_offsets"][0], e["data_offsets"][0] + giant])
        meta["tensors"][first]["shape"] = [giant // 4]

    def shifted(header, meta):  # a gap before the first tensor, the last one past the file's end
        for k, e in header.items():
            if k != "__metadata__":
                e["data_offsets"] = [e["data_offsets"][0] + 64, e["data_offsets"][1] + 64]

    cases = {
        "a 4 GiB sparse tensor": (_rewrite_header(good, tmp_path / "x.dschat", extra, giant), "not a state of"),
        "a state grown to 4 GiB": (_rewrite_header(good, tmp_path / "g.dschat", grown, grow), "this bundle's is"),
        "offsets shifted": (_rewrite_header(good, tmp_path / "s.dschat", shifted), "gaps"),
        "data cut short": (_rewrite_header(good, tmp_path / "t.dschat", lambda h, m: None, -64), "describes"),
    }
    for name, (path, match) in cases.items():
        tracemalloc.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(DeltashipError, match=match):
                Chat.load(path, session)
            took, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert took < 2.0 and peak < 32 << 20, (name, took, peak)  # refused from the header: nothing read
        assert session.position == 0, name
    assert Chat.load(good, session).ids == chat.ids


def test_fuzzed_session_files_load_or_are_refused(bundle, tmp_path):
    """500 mutations of a real session file's safetensors header and metadata (an attacker recomputes the metadata's
    sha256): each loads as the conversation it holds, or is one DeltashipError naming the file; never another
    exception, and nothing is fed into the session."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_manifest_fuzz import values

    from deltaship.chat.store import META_KEY

    chat = Chat(open_bundle(bundle, threads=1))
    chat.send("import os", max_new_tokens=2)
    good = chat.save(tmp_path / "good.dschat")
    session = open_bundle(bundle, threads=1)
    names = sorted(k for k in _header(good) if k != "__metadata__")
    meta_keys = sorted(json.loads(_header(good)["__metadata__"][META_KEY]))
    out, seen = tmp_path / "fuzzed.dschat", {"refused": 0, "loaded": 0}

    @settings(max_examples=500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        edits = [(data.draw(st.sampled_from(["tensor", "meta", "bytes"])), data.draw(values)) for _ in range(2)]

        def edit(header, meta):
            for where, v in edits:
                if where == "tensor":
                    entry = header[data.draw(st.sampled_from(names))]
                    entry[data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = v
                elif where == "meta":
                    meta[data.draw(st.sampled_from(meta_keys))] = v

        extra = data.draw(st.sampled_from([0, 0, -1, 7, -4096]))
        _rewrite_header(good, out, edit, extra)
        try:
            loaded = Chat.load(out, session)
        except DeltashipError as e:
            assert str(out) in e.message or "fuzzed.dschat" in e.message, e.message
            assert session.position == 0
            seen["refused"] += 1
            return
        assert loaded.ids == chat.ids  # a mutation it may ignore (e.g. an unread field) leaves the conversation
        session.reset()
        seen["loaded"] += 1

    check()
    assert seen["refused"] > 300, seen
