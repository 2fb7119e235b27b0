"""Multi-turn chat (deltaship/chat): session checkpoints, incremental templates, retry / undo, saved sessions.

One fp32 ONNX export of the trained tiny preset per run. The tiny model answers most prompts alike when greedy,
so exactness is also checked where a wrong state cannot hide: the DeltaNet states against a fresh prefill of the
same ids, and sampled replies (same seed) against a fresh session's.

Mutation-checked by hand (2026-11-27): skipping `s.restore(cp)` in Chat._feed (retry and the rewritten past then
feed on top of the reply) fails test_retry_and_undo_restore and test_cli_json_conversation; keeping the position
after undo (no restore) fails test_retry_and_undo_restore.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deltaship.chat import Chat
from deltaship.chat.store import read_session_file
from deltaship.check.inspect import describe, inspect
from deltaship.errors import DeltashipError
from deltaship.models.presets import PRESETS
from deltaship.targets import open_bundle

CONTEXT = 192
N = 10  # new tokens per reply


@pytest.fixture(scope="module")
def bundle(shared_export) -> Path:
    """Built once per run, shared with test_trust_chat (no test writes into it)."""
    return shared_export("chat-tiny-onnx-fp32", "qwen3.5-tiny", target="onnx", precision="fp32", max_context=CONTEXT,
                         verify=False)  # fmt: skip


def _deltanet(session) -> dict[str, np.ndarray]:
    return session._read_states([s["name"] for s in session.deltanet_states()])


def assert_state_is_fresh_prefill(chat: Chat) -> None:
    """The chat's session holds exactly what a fresh session fed chat.ids holds (DeltaNet states, position)."""
    s = chat.session
    assert s.position == len(chat.ids)
    fresh = open_bundle(s.bundle, threads=1)
    fresh.prefill(chat.ids)
    got, want = _deltanet(s), _deltanet(fresh)
    for name in want:  # chunking differs (turn by turn vs one prefill): float noise only
        np.testing.assert_allclose(got[name], want[name], atol=2e-4, err_msg=name)


# ---- Session.checkpoint / restore ---------------------------------------------------------------------


def test_restore_is_exact(bundle):
    ids = list(b"def parse(path):\n    with open(path) as f:\n        return ")
    s = open_bundle(bundle, threads=1)
    s.prefill(ids[:20])
    cp = s.checkpoint()
    assert cp.position == 20 and set(cp.states) == {x["name"] for x in s.deltanet_states()}
    first = s.generate(ids[20:], 16, temperature=1.0, seed=3).output_ids
    s.restore(cp)
    assert s.position == 20
    for name, a in _deltanet(s).items():
        np.testing.assert_array_equal(a, cp.states[name])  # bit for bit
    again = s.generate(ids[20:], 16, temperature=1.0, seed=3).output_ids
    fresh = open_bundle(bundle, threads=1).generate(ids, 16, temperature=1.0, seed=3).output_ids
    assert first == again == fresh

    # a checkpoint past a rewind whose tokens overwrote its KV entries is refused, as is another session's
    late = s.checkpoint()
    s.restore(cp)
    s.prefill(ids[20:30])
    with pytest.raises(DeltashipError, match="stale"):
        s.restore(late)
    other = open_bundle(bundle, threads=1)
    with pytest.raises(DeltashipError, match="another session"):
        other.restore(cp)


# ---- templates ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("thinking", [True, False])
def test_incremental_turns_equal_whole_render(bundle, preset, thinking):
    """Each turn feeds only what the template adds; the state then holds the whole history rendered at once."""
    chat = Chat(
        open_bundle(bundle, threads=1),
        system="You are terse.",
        template_kwargs={"enable_thinking": thinking},
        template=PRESETS[preset].chat_template(),
    )
    for k, text in enumerate(["import os", "def f(x):", "class A:"]):
        reply = chat.send(text, max_new_tokens=N)
        whole = chat.render_ids(chat.history[:-1], add_generation_prompt=True)
        assert chat.ids[: reply.context_tokens] == whole
        assert 0 < reply.prefill_tokens < len(whole) or k == 0
    assert_state_is_fresh_prefill(chat)
    tail = "<think>\n" if thinking else "<think>\n\n</think>\n\n"
    assert chat.template.render(chat.history, True, **chat.template_kwargs).endswith("<|im_start|>assistant\n" + tail)


# a checkpoint's own template (Qwen2.5's form): a default system message when none is given, no thinking
OWN_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% else %}{% set rest = messages %}<|im_start|>system\nYou are helpful."
    "<|im_end|>\n{% endif %}{% for m in rest %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_incremental_turns_on_a_checkpoints_own_template(tmp_path):
    """A hidden-shape checkpoint (odd head counts, d_k != d_v) bringing its own tokenizer and a chat template in
    tokenizer_config.json: the bundle carries them, and each turn feeds only what the template adds while the state
    holds the whole history rendered at once (a fresh prefill's)."""
    from helpers import set_json, write_checkpoint

    from deltaship.compile import export
    from deltaship.models.presets import write_tiny_tokenizer

    ckpt = write_checkpoint("odd_heads", tmp_path / "ckpt", seed=3, vocab_size=260, eos_token_id=256)
    write_tiny_tokenizer(ckpt)
    (ckpt / "chat_template.jinja").unlink()
    set_json(ckpt / "tokenizer_config.json", "chat_template", OWN_TEMPLATE)
    out = tmp_path / "b"
    export(str(ckpt), out, target="onnx", max_context=CONTEXT, verify=False, progress=False)
    chat = Chat(out, threads=1)
    for k, text in enumerate(["import os", "def f(x):", "class A:"]):
        reply = chat.send(text, max_new_tokens=N, temperature=1.0, seed=k)
        whole = chat.render_ids(chat.history[:-1], add_generation_prompt=True)
        assert chat.ids[: reply.context_tokens] == whole
        assert 0 < reply.prefill_tokens < len(whole) or k == 0
    assert chat.tokenizer.decode(chat.ids).startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n")
    assert_state_is_fresh_prefill(chat)


def test_think_block_of_past_turns_is_dropped(bundle, monkeypatch):
    """A reply with a <think> block: rendered as generated while it is the last turn, without the block once a
    user message follows; the chat restores the checkpoint before that reply and feeds it as the template
    renders it."""
    import deltaship.chat.conversation as conversation

    chat = Chat(open_bundle(bundle, threads=1))
    scripted = [*chat.tokenizer.encode("because\n</think>\n\nyes"), chat.session.manifest["tokens"]["im_end"]]
    it = iter(scripted)
    monkeypatch.setattr(conversation, "sample", lambda *a: next(it))
    first = chat.send("is it?", max_new_tokens=len(scripted))
    assert first.text == "because\n</think>\n\nyes" and first.stopped == "eos"
    rendered = chat.template.render(chat.history, False)
    assert "<think>\nbecause\n</think>\n\nyes<|im_end|>" in rendered
    monkeypatch.undo()
    second = chat.send("sure?", max_new_tokens=N)
    history = chat.template.render(chat.history[:-1], True)
    assert "because" not in history and "<|im_start|>assistant\nyes<|im_end|>" in history
    assert chat.ids[: second.context_tokens] == chat.tokenizer.encode(history)
    # fed from the checkpoint before the first reply (its generation prompt): that reply as rendered now, and the
    # new turn
    assert second.prefill_tokens == second.context_tokens - len(chat.render_ids(chat.history[:1], False))
    assert_state_is_fresh_prefill(chat)


def test_chat_refuses_a_session_without_state_access(bundle):
    """onnxruntime-genai continues a sequence but keeps its states out of reach: a chat on it is refused at once."""
    with pytest.raises(DeltashipError, match="no access to them") as e:
        Chat(open_bundle(bundle, runtime="genai"))
    assert "deltaship's own session" in e.value.fix


def test_template_is_sandboxed():
    from deltaship.chat.template import ChatTemplate

    hostile = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(DeltashipError, match="failed to render"):
        ChatTemplate(hostile).render([{"role": "user", "content": "x"}], True)


def test_template_from_tokenizer_config(tmp_path):
    """Without chat_template.jinja: tokenizer_config.json's chat_template (a string, or the list form's "default"),
    rendered with its special tokens; none at all is a clear error."""
    from deltaship.chat.template import ChatTemplate, bundle_chat_template

    # the manifest lists the file (bundle_path reads only listed files; hashes are open_bundle's check)
    manifest = {"tokenizer": {"files": ["tokenizer_config.json"]}, "files": {"tokenizer_config.json": {}}}
    config = {"bos_token": {"content": "<s>"}, "chat_template": [{"name": "default", "template": "{{ bos_token }}x"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    source, special = bundle_chat_template(tmp_path, manifest)
    assert ChatTemplate(source, **special).render([], False) == "<s>x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(DeltashipError, match="no chat template"):
        bundle_chat_template(tmp_path, manifest)


def test_bundle_carries_the_template(bundle):
    assert (bundle / "chat_template.jinja").read_text() == PRESETS["qwen3.5-tiny"].chat_template()
    assert "chat_template.jinja" in json.loads((bundle / "manifest.json").read_text())["tokenizer"]["files"]


# ---- retry, undo, context --------------------------------------------------------------------------------


def test_retry_and_undo_restore(bundle):
    chat = Chat(open_bundle(bundle, threads=1), system="Be brief.")
    chat.send("import sys", max_new_tokens=N)
    sampled = chat.send("def main():", max_new_tokens=N, temperature=1.0, seed=7)
    history = chat.ids[: sampled.context_tokens]
    fresh = open_bundle(bundle, threads=1).generate(history, N, temperature=1.0, seed=7, stop_at_eos=False)
    assert sampled.ids == fresh.output_ids[: len(sampled.ids)]

    again = chat.retry(max_new_tokens=N, temperature=1.0, seed=7)
    assert again.ids == sampled.ids and chat.ids[: again.context_tokens] == history
    # from the checkpoint before the reply: its generation prompt only
    assert again.prefill_tokens == len(chat.tokenizer.encode("<|im_start|>assistant\n<think>\n"))
    assert len(chat.history) == 5
    assert_state_is_fresh_prefill(chat)

    before = len(chat.history)
    chat.undo()
    assert len(chat.history) == before - 2
    assert chat.session.position == len(chat.ids) < sampled.context_tokens
    assert_state_is_fresh_prefill(chat)
    third = chat.send("def main():", max_new_tokens=N, temperature=1.0, seed=7)
    assert third.ids == sampled.ids and chat.ids[: third.context_tokens] == history

    chat.reset()
    assert chat.ids == [] and chat.history == [{"role": "system", "content": "Be brief."}]
    with pytest.raises(DeltashipError, match="nothing to"):
        chat.reset() or chat.undo()


@pytest.mark.parametrize("mutation", ["skipped restore", "position kept after undo"])
def test_retry_and_undo_checks_catch_a_broken_restore(bundle, monkeypatch, mutation):
    """test_retry_and_undo_restore fails on a restore that does not write the DeltaNet states back, and on one that
    leaves the position where it was (undo then keeps the dropped exchange's tokens in the state)."""
    from deltaship.runtimes.base import Session
    from deltaship.runtimes.onnx import OnnxSession

    if mutation == "skipped restore":
        monkeypatch.setattr(OnnxSession, "_write_states", lambda self, arrays: None)
    else:

        def restore(self, cp):  # the states written back, the position left where it was
            self._write_states(cp.states)
            self._rewinds.append(cp.position)

        monkeypatch.setattr(Session, "restore", restore)
    with pytest.raises(AssertionError):
        test_retry_and_undo_restore(bundle)


def test_context_full_stops_with_notice(bundle):
    chat = Chat(open_bundle(bundle, threads=1))
    reply = chat.send("x" * 100, max_new_tokens=200)
    assert reply.stopped == "context" and "context is full" in reply.notice
    assert chat.session.position == CONTEXT == len(chat.ids)
    chat.undo()
    too_long = chat.send("y" * (CONTEXT + 5), max_new_tokens=4)
    assert too_long.stopped == "context" and too_long.ids == [] and "larger --max-context" in too_long.notice
    assert chat.history == [] and chat.ids == []  # refused whole: nothing fed, nothing kept


# ---- the command -------------------------------------------------------------------------------------------


def _cli(*args: str, stdin: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "deltaship", *args], input=stdin, capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize("sampling", [(), ("--temperature", "1", "--seed", "3")], ids=["greedy", "sampled"])
def test_cli_json_conversation(bundle, tmp_path, sampling):
    """Greedy as a user would run it; sampled (one seed per reply) too, since the tiny model's greedy replies hardly
    depend on the history, while a sampled reply moves with any change of the logits."""
    script = "import os\ndef main():\n/retry\nclass A:\n/undo\nx = 1\n"
    args = ("chat", str(bundle), "--json", "--max-new-tokens", str(N), "--system", "Code.", *sampling)
    run = _cli(*args, stdin=script)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["command"] for r in records] == ["send", "send", "retry", "send", "undo", "send"]
    turns = [r for r in records if r["command"] != "undo"]
    session = open_bundle(bundle, threads=1)
    for r in turns:  # each reply is the greedy continuation of the history it was given
        session.reset()
        seed = {"seed": r["seed"], "temperature": 1.0} if sampling else {}
        want = session.generate(r["history_ids"], N, stop_at_eos=False, **seed).output_ids
        assert r["reply_ids"] == want[: len(r["reply_ids"])]
        assert r["stopped"] in ("length", "eos") and r["ttft_s"] > 0
        assert 0 < r["prefill_tokens"] <= len(r["history_ids"])
    first, second, retry, third, undo, fourth = records
    assert first["prefill_tokens"] == len(first["history_ids"])
    for r in (second, third, fourth):  # the turn's own tokens (and the reply before it, as the template renders
        assert r["prefill_tokens"] < len(r["history_ids"]) - len(first["history_ids"]) + 20  # it), not the history
    assert retry["history_ids"] == second["history_ids"]
    # greedy: the same reply; sampled: the retry draws with the next seed of the turn (3 + 1), the rest with 3
    assert [r["seed"] for r in turns] == ([None] * 5 if not sampling else [3, 3, 4, 3, 3])
    assert retry["reply_ids"] == second["reply_ids"] or sampling
    assert retry["prefill_tokens"] < second["prefill_tokens"]
    # undo drops "class A:" and its reply: the next turn follows the retried reply as if it never happened
    assert undo["history_tokens"] < len(third["history_ids"])
    assert b"class A:" not in bytes(t for t in fourth["history_ids"] if t < 256)
    head = retry["history_ids"][: -len(b"<think>\n")]  # the generation prompt's <think> is not kept in history
    assert fourth["history_ids"][: len(head)] == head
    if sampling:
        return
    # the CLI's generate agrees with one turn
    ids = ",".join(map(str, third["history_ids"]))
    gen = _cli("generate", str(bundle), "--input-ids", ids, "--max-new-tokens", str(N), "--json", stdin="")
    assert json.loads(gen.stdout)["output_ids"][: len(third["reply_ids"])] == third["reply_ids"]


def test_saved_session_continues_in_another_process(bundle, tmp_path):
    path = tmp_path / "talk.dschat"
    chat = Chat(open_bundle(bundle, threads=1), system="Code.")
    chat.send("import os", max_new_tokens=N)
    chat.send("def main():", max_new_tokens=N)
    chat.save(path)
    meta, _ = read_session_file(path)
    assert meta["position"] == len(chat.ids) and len(meta["checkpoints"]) == 2

    run = _cli(
        "chat", str(bundle), "--session", str(path), "--json", "--max-new-tokens", str(N), "--temperature", "1",
        "--seed", "5", stdin="class A:\n/retry\n",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    there = [json.loads(line) for line in run.stdout.splitlines()]
    here = chat.send("class A:", max_new_tokens=N, temperature=1.0, seed=5)
    assert there[0]["reply_ids"] == here.ids and there[0]["history_ids"] == chat.ids[: here.context_tokens]
    assert there[0]["prefill_tokens"] == here.prefill_tokens
    retried = chat.retry(max_new_tokens=N, temperature=1.0, seed=6)  # the retry after the reload: seed 5 + 1
    assert there[1]["reply_ids"] == retried.ids and there[1]["seed"] == 6

    # --session saved after every turn: the file now holds the retried turn
    reloaded = Chat.load(path, open_bundle(bundle, threads=1))
    assert reloaded.history == chat.history and reloaded.ids == chat.ids
    assert reloaded.retry(max_new_tokens=N, temperature=1.0, seed=6).ids == retried.ids


def test_new_session_file_is_a_prompt_cache_and_locked(bundle, tmp_path):
    """A new --session file is written at once with the system message fed; the next run's first turn feeds only
    its own tokens. A second chat on the same file is refused while the first holds it."""
    from filelock import FileLock

    from deltaship.bundle.destination import lock_path

    path = tmp_path / "cache.dschat"
    run = _cli("chat", str(bundle), "--system", "You write Python.", "--session", str(path), "--json", stdin="")
    assert run.returncode == 0 and run.stdout == "", run.stderr
    meta, _ = read_session_file(path)
    chat = Chat(open_bundle(bundle, threads=1), system="You write Python.")
    assert meta["ids"] == chat.render_ids(chat.history, add_generation_prompt=False) and meta["last_turn"] is None
    run = _cli("chat", str(bundle), "--session", str(path), "--json", "--max-new-tokens", "4", stdin="import os\n")
    turn = json.loads(run.stdout)
    assert turn["history_ids"][: meta["position"]] == meta["ids"]
    assert turn["prefill_tokens"] == len(turn["history_ids"]) - meta["position"]  # not the system message again
    want = chat.send("import os", max_new_tokens=4)
    assert turn["reply_ids"] == want.ids and turn["history_ids"] == chat.ids[: want.context_tokens]

    assert not lock_path(path).exists()  # released and removed when the chat ended
    with FileLock(str(lock_path(path))):
        busy = _cli("chat", str(bundle), "--session", str(path), stdin="hi\n")
    assert busy.returncode == 3 and "in use by another deltaship chat" in busy.stderr


def _saved(bundle, tmp_path) -> Path:
    chat = Chat(open_bundle(bundle, threads=1))
    chat.send("import os", max_new_tokens=4)
    return chat.save(tmp_path / "s.dschat")


def _rewrite_meta(path: Path, edit) -> None:
    import hashlib

    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from deltaship.chat.store import META_KEY, META_SHA_KEY

    with safe_open(str(path), "np") as f:
        meta = json.loads(f.metadata()[META_KEY])
    edit(meta)
    text = json.dumps(meta)
    tensors = load_file(str(path))
    save_file(tensors, str(path), metadata={META_KEY: text, META_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()})


def test_bad_session_files_are_refused(bundle, tmp_path):
    good = _saved(bundle, tmp_path)
    data = good.read_bytes()
    cases = {}
    cases["tampered tensor byte"] = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], "altered"
    at = data.index(b"position")  # inside the header's JSON text
    cases["tampered metadata"] = data[:at] + b"pos1tion" + data[at + 8 :], "altered"
    cases["truncated"] = data[: len(data) // 2], "truncated"
    for name, (content, match) in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.dschat"
        bad.write_bytes(content)
        session = open_bundle(bundle, threads=1)
        with pytest.raises(DeltashipError, match=match):
            Chat.load(bad, session)
        assert session.position == 0, name  # nothing loaded

    newer = tmp_path / "newer.dschat"
    newer.write_bytes(data)
    _rewrite_meta(newer, lambda m: m.update(version=2))
    with pytest.raises(DeltashipError, match="newer") as e:
        Chat.load(newer, open_bundle(bundle, threads=1))
    assert "upgrade deltaship" in e.value.fix

    foreign = tmp_path / "foreign.dschat"
    foreign.write_bytes(data)
    _rewrite_meta(foreign, lambda m: m["bundle"].update(manifest_sha256="0" * 64))
    with pytest.raises(DeltashipError, match="another bundle"):
        Chat.load(foreign, open_bundle(bundle, threads=1))

    pickled = tmp_path / "pickle.dschat"
    pickled.write_bytes(b"\x80\x04\x95" + b"\x00" * 64)
    with pytest.raises(DeltashipError, match="not a readable session file"):
        Chat.load(pickled, open_bundle(bundle, threads=1))
    assert Chat.load(good, open_bundle(bundle, threads=1)).ids  # the good one still loads


def test_save_is_atomic(bundle, tmp_path, monkeypatch):
    good = _saved(bundle, tmp_path)
    before = good.read_bytes()
    chat = Chat.load(good, open_bundle(bundle, threads=1))
    chat.send("more", max_new_tokens=2)

    def crash(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(Exception, match="disk full"):
        chat.save(good)
    assert good.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [good.name]


# ---- ExecuTorch -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_executorch_checkpoint_restore(tiny_pte):
    """The .pte's DeltaNet buffers copied out and back: a chat retry and a fresh prefill agree."""
    bundle = tiny_pte("fp32")
    s = open_bundle(bundle, threads=1)
    ids = list(b"def parse(path):\n    return ")
    s.prefill(ids[:9])
    cp = s.checkpoint()
    first = s.generate(ids[9:], 12, temperature=1.0, seed=2).output_ids
    s.restore(cp)
    again = s.generate(ids[9:], 12, temperature=1.0, seed=2).output_ids
    fresh = open_bundle(bundle, threads=1).generate(ids, 12, temperature=1.0, seed=2).output_ids
    assert first == again == fresh
    chat = Chat(open_bundle(bundle, threads=1))
    chat.send("import os", max_new_tokens=6)
    r = chat.send("def f():", max_new_tokens=6, temperature=1.0, seed=4)
    assert chat.retry(max_new_tokens=6, temperature=1.0, seed=4).ids == r.ids


def json_conversation_matches_generate(bundle: Path, tmp_path: Path, reload: bool = True) -> None:
    """`deltaship chat --json --session FILE` (the command's function, in this process) over a scripted conversation,
    sampled with one seed per reply: each reply is what a fresh session of the bundle generates from that turn's
    history_ids; a turn feeds its own tokens (the system message was fed when the new session file was written);
    /retry feeds only the generation prompt and draws with the turn's next seed; the session file, loaded into a
    new session, continues with the tokens of a chat that never stopped (reload=False: that last part left out)."""
    import io

    from deltaship.commands.chat import chat as chat_command

    path, n, seed = tmp_path / "talk.dschat", 4, {"temperature": 1.0, "seed": 3}

    def run(script: str) -> list[dict]:
        out = io.StringIO()
        chat_command(bundle, system="Code.", session=path, max_new_tokens=n, json=True, threads=1,
                     stdin=io.StringIO(script), stdout=out, **seed)  # fmt: skip
        return [json.loads(line) for line in out.getvalue().splitlines()]

    first = run("a\nb\n/retry\n")
    later = run("c\n") if reload else []
    fresh = open_bundle(bundle, threads=1)
    for r in first + later:
        fresh.reset()
        want = fresh.generate(r["history_ids"], n, stop_at_eos=False, temperature=1.0, seed=r["seed"]).output_ids
        assert r["reply_ids"] == want[: len(r["reply_ids"])] and r["reply_ids"]
    a, b, retry = first
    assert [a["seed"], b["seed"], retry["seed"]] == [3, 3, 4]  # a retry draws with the turn's next seed
    assert 0 < a["prefill_tokens"] < len(a["history_ids"])  # not the system message: the session file held it
    # its own tokens, and the reply before it from its generation prompt on (the template drops the prompt's <think>)
    assert 0 < b["prefill_tokens"] < len(b["history_ids"]) - len(a["history_ids"]) + 20
    assert retry["history_ids"] == b["history_ids"]
    assert retry["prefill_tokens"] < b["prefill_tokens"]
    if not reload:
        return
    (after_load,) = later
    chat = Chat(open_bundle(bundle, threads=1), system="Code.")
    for text in ("a", "b", None, "c"):
        turn = {**seed, "seed": retry["seed"]} if text is None else seed  # the CLI's retry seed, passed to the API
        r = chat.send(text, max_new_tokens=n, **turn) if text else chat.retry(max_new_tokens=n, **turn)
    assert after_load["reply_ids"] == r.ids and after_load["history_ids"] == chat.ids[: r.context_tokens]


@pytest.mark.slow
def test_executorch_chat_json_conversation(tiny_pte, tmp_path):
    json_conversation_matches_generate(tiny_pte("fp32"), tmp_path)


@pytest.mark.slow
def test_coreml_chat_json_conversation(tiny_coreml_mtp, tmp_path):
    """Core ML through the Linux evaluator, every state an io tensor (fp32); the reload is left out (its evaluator
    is slow; a saved session's reload is tested on ONNX and ExecuTorch)."""
    json_conversation_matches_generate(tiny_coreml_mtp("fp32"), tmp_path, reload=False)


def test_chat_does_not_import_torch(bundle, tmp_path):
    code = (
        "import sys; from deltaship.chat import Chat; "
        f"c = Chat({str(bundle)!r}, threads=1); c.send('hi', max_new_tokens=3); c.retry(max_new_tokens=3); "
        f"c.save({str(tmp_path / 's.dschat')!r}); Chat.load({str(tmp_path / 's.dschat')!r}, c.session); "
        "bad = [m for m in ('torch', 'transformers', 'executorch', 'coremltools') if m in sys.modules]; "
        "assert not bad, bad; print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.slow
def test_coreml_checkpoint_restore(tiny_coreml_mtp):
    """Core ML through the Linux evaluator, every state a Core ML state (fp16): the checkpoint copies the DeltaNet
    states out of the state buffers and back; the same calls after a restore give the same tokens as a fresh
    session making them."""
    bundle = tiny_coreml_mtp("fp16-state")
    s = open_bundle(bundle)
    ids = list(b"def parse(path):\n    return ")
    s.prefill(ids[:9])
    cp = s.checkpoint()
    first = s.generate(ids[9:], 8, temperature=1.0, seed=2).output_ids
    s.restore(cp)
    for name, a in _deltanet(s).items():
        np.testing.assert_array_equal(a, cp.states[name])
    again = s.generate(ids[9:], 8, temperature=1.0, seed=2).output_ids
    fresh = open_bundle(bundle)
    fresh.prefill(ids[:9])
    assert first == again == fresh.generate(ids[9:], 8, temperature=1.0, seed=2).output_ids
    chat = Chat(open_bundle(bundle))
    r = chat.send("def f():", max_new_tokens=4, temperature=1.0, seed=4)
    assert chat.retry(max_new_tokens=4, temperature=1.0, seed=4).ids == r.ids


# ---- prompt caches shipped in bundles --------------------------------------------------------------------------


def test_shipped_prompt_cache(tmp_path):
    """export --prompt-cache: the bundle holds the state after the system message; a chat with that system message
    starts from it (nothing fed for it) and replies as one that fed it; another system message feeds its own."""
    from deltaship.chat.store import PROMPT_CACHE_FILE
    from deltaship.compile import export

    system = "You write Python code."
    (tmp_path / "system.txt").write_text(system + "\n")
    out = tmp_path / "cached"
    manifest = export("qwen3.5-tiny", out, target="onnx", precision="fp32", max_context=CONTEXT, verify=False,
                      progress=False, prompt_cache=tmp_path / "system.txt")  # fmt: skip
    record = manifest["chat"]["prompt_cache"]
    assert record["system"] == system and PROMPT_CACHE_FILE in manifest["files"]

    cached = Chat(out, system=system, threads=1)
    plain = Chat(out, system=system, threads=1, prompt_cache=False)
    assert cached.session.position == record["tokens"] == len(cached.ids) > 0 and plain.ids == []
    assert cached.ids == plain.render_ids(plain.history, add_generation_prompt=False)
    assert_state_is_fresh_prefill(cached)
    a = cached.send("import os", max_new_tokens=N, temperature=1.0, seed=1)
    b = plain.send("import os", max_new_tokens=N, temperature=1.0, seed=1)
    assert a.ids == b.ids and a.prefill_tokens == b.prefill_tokens - record["tokens"]
    cached.reset()  # back to the cache, not to an empty state
    assert cached.session.position == record["tokens"]
    other = Chat(out, system="Something else.", threads=1)
    assert other.ids == []
    shown = describe(inspect(out))
    assert f"chat        prompt cache {PROMPT_CACHE_FILE} (" in shown and f"{record['tokens']} tokens" in shown
    assert repr(system) in shown

    # the CLI takes the cache's system message when given none
    run = _cli("chat", str(out), "--json", "--max-new-tokens", str(N), stdin="import os\n")
    turn = json.loads(run.stdout)
    assert turn["history_ids"][: record["tokens"]] == cached.ids[: record["tokens"]]
    assert turn["prefill_tokens"] == len(turn["history_ids"]) - record["tokens"]

    # the cache is a bundle file like any other: altered, the bundle does not open
    data = bytearray((out / PROMPT_CACHE_FILE).read_bytes())
    data[-3] ^= 1
    (out / PROMPT_CACHE_FILE).write_bytes(bytes(data))
    with pytest.raises(DeltashipError, match=PROMPT_CACHE_FILE):
        open_bundle(out)


def test_prompt_cache_needs_a_tokenizer(tmp_path):
    from deltaship.compile import export

    (tmp_path / "s.txt").write_text("hi")
    with pytest.raises(DeltashipError, match="--prompt-cache: qwen3.5-0.8b has no tokenizer"):
        export(
            "qwen3.5-0.8b", tmp_path / "o", target="onnx", verify=False, progress=False, prompt_cache=tmp_path / "s.txt"
        )
    assert not (tmp_path / "o").exists()
