"""`deltaship chat`: a conversation with a bundle: a REPL on a terminal, a line protocol otherwise.

Line protocol (stdin not a terminal): each line is a user message; `/retry`, `/undo`, `/reset` and `/save FILE` are
commands; `/tool JSON` gives the results of the last reply's tool calls ({"name", "content"}, or a list of them);
end of input ends the conversation. With json=True each turn prints one JSON object (reply, reply_ids,
history_ids: every token the state held before the reply, prefill_tokens: tokens fed for the turn, ttft_s,
decode_tok_s, stopped, and tool_calls / constraint where there are tools or a constraint), and each command one
object naming it.
"""

from __future__ import annotations

import json as jsonlib
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from filelock import FileLock, Timeout

from deltaship import options
from deltaship.chat import Chat
from deltaship.chat.store import bundle_prompt_cache
from deltaship.chat.tools import ToolCallStream
from deltaship.constrain import build_constraint
from deltaship.constrain.tools import check_choice, read_tools
from deltaship.errors import DeltashipEnvironmentError, DeltashipError
from deltaship.runtimes.base import check_sampling
from deltaship.targets import open_bundle

COMMANDS = ("/retry", "/undo", "/reset", "/save FILE", "/tool JSON", "/quit")


def chat(
    bundle: str | Path,
    system: str | None = None,
    session: str | Path | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    no_thinking: bool = False,
    json: bool = False,
    threads: int | None = None,
    prepack_cache: str | Path | None = None,
    stdin: IO[str] | None = None,
    stdout: IO[str] | None = None,
    json_schema: str | Path | None = None,
    regex: str | None = None,
    grammar: str | Path | None = None,
    tools: str | Path | None = None,
    tool_choice: str = "auto",
) -> int:
    """Talk with a bundle. session: a file loaded if it exists and saved (atomically) after every turn; a new one is
    written at once with the system message fed (an empty conversation so saved is a prompt cache)."""
    options.max_new_tokens(max_new_tokens)
    options.sampling(temperature, top_k, top_p, seed)  # as `generate`'s: top_k/top_p/seed need a temperature
    top_k, top_p = top_k or 0, 1.0 if top_p is None else top_p  # None: no cut (the session's 0 and 1.0)
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    kwargs: dict[str, Any] = {"enable_thinking": False} if no_thinking else {}
    # every reply is held to the constraint (a retry too); tools: rendered by the template, calls constrained
    constraint = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v}
    build_constraint(**constraint)  # checked before the bundle is opened
    if tools is not None:
        kwargs["tools"] = list(read_tools(tools).entries)
        check_choice(tool_choice, read_tools(kwargs["tools"], f"--tools {tools}"))
    elif tool_choice != "auto":
        raise DeltashipError(f"--tool-choice {tool_choice} without --tools", "pass --tools FILE (a function list)")
    with _locked(session):
        conv = _open(bundle, system, session, kwargs, threads, prepack_cache)
        conv.tool_choice = tool_choice
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        sampling.update(constraint)
        return _converse(conv, bundle, session, sampling, json, stdin, stdout)


@contextmanager
def _locked(session: str | Path | None):
    """One chat at a time per session file: a second one would save over the first one's turns."""
    if session is None:
        yield
        return

    lock = FileLock(str(session) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise DeltashipEnvironmentError(
            f"--session {session} is in use by another deltaship chat", "close that chat, or use another --session"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _open(bundle, system: str | None, session, kwargs: dict, threads: int | None, prepack_cache=None):
    """The conversation: loaded from the session file if it exists, else new (and saved there at once)."""

    sess = open_bundle(bundle, threads=threads, prepack_cache=prepack_cache)
    if session is not None and Path(session).exists():
        conv = Chat.load(session, sess)
        if system is not None and system != conv.system:
            raise DeltashipError(
                f"--session {session} was saved with another system message", "drop --system, or use another --session"
            )
        if conv.template_kwargs != kwargs:
            raise DeltashipError(
                f"--session {session} was saved with other template settings (--no-thinking, --tools) than these",
                "pass the same --no-thinking and --tools as when it was saved",
            )
        return conv
    if system is None:  # the system message of the bundle's shipped prompt cache, if it has one
        system = (bundle_prompt_cache(sess) or {}).get("system")
    conv = Chat(sess, system=system, template_kwargs=kwargs)
    if session is not None:  # a new session file holds the system message fed: a prompt cache for the next run
        conv.prime()
        conv.save(session)
    return conv


def _converse(conv, bundle, session, sampling: dict, json: bool, stdin: IO[str], stdout: IO[str]) -> int:
    interactive = stdin.isatty() and not json
    if interactive:
        _setup_readline()
        print(f"deltaship chat: {bundle} ({conv.session.runtime_name()}); commands: {', '.join(COMMANDS)}", file=stdout)
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                print(file=stdout)
                break
        else:
            line = stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
        if not line.strip():
            continue
        try:
            if _step(conv, line, sampling, json, interactive, stdout, session) == "quit":
                break
        except DeltashipError as e:
            if not interactive:
                raise
            print(f"error: {e.message}" + (f"\n  fix: {e.fix}" if e.fix else ""), file=sys.stderr)
    return 0


def _step(conv, line: str, sampling: dict, json: bool, interactive: bool, out: IO[str], session) -> str | None:
    word, _, rest = line.strip().partition(" ")
    if word in ("/quit", "/exit") and interactive:
        return "quit"
    if word == "/save":
        if not rest.strip():
            raise DeltashipError("/save needs a file name", "e.g. /save talk.dschat")
        path = conv.save(rest.strip())
        _say(out, json, {"command": "save", "path": str(path), "history_tokens": len(conv.ids)}, f"saved {path}")
        return None
    if word in ("/undo", "/reset"):
        conv.undo() if word == "/undo" else conv.reset()
        _say(out, json, {"command": word[1:], "history_tokens": len(conv.ids)}, f"({word[1:]}: {len(conv.ids)} tokens)")
    elif word == "/tool":
        try:
            results = jsonlib.loads(rest)
        except ValueError as e:
            fix = '/tool {"name": NAME, "content": TEXT} (or a list of them)'
            raise DeltashipError(f"/tool: not JSON ({e})", fix) from None
        stream = _Stream(conv, out) if interactive else None
        keep = {k: v for k, v in sampling.items() if k not in ("json_schema", "regex", "grammar")}
        reply = conv.send_tool_results(results, **keep, on_token=stream)
        _print_reply(conv, reply, "tool", json, stream, out)
    elif word == "/retry" or not line.startswith("/"):
        stream = _Stream(conv, out) if interactive else None
        reply = (
            conv.retry(**sampling, on_token=stream)
            if word == "/retry"
            else conv.send(line, **sampling, on_token=stream)
        )
        _print_reply(conv, reply, "retry" if word == "/retry" else "send", json, stream, out)
    else:
        raise DeltashipError(f"unknown command {word!r}", f"commands: {', '.join(COMMANDS)}; other text is a message")
    if session is not None:
        conv.save(session)
    return None


def _say(out: IO[str], json: bool, record: dict[str, Any], text: str) -> None:
    print(jsonlib.dumps(record) if json else text, file=out, flush=True)


def _print_reply(conv, reply, command: str, json: bool, stream, out: IO[str]) -> None:
    if reply.notice:
        print(f"notice: {reply.notice}", file=sys.stderr)
    if json:
        record = {
            "command": command,
            "reply": reply.text,
            "reply_ids": reply.ids,
            "history_ids": conv.ids[: reply.context_tokens],
            "prefill_tokens": reply.prefill_tokens,
            "ttft_s": round(reply.ttft_s, 6),
            "decode_tok_s": round(reply.decode_tok_s, 3),
            "stopped": reply.stopped,
        }
        if conv.tools is not None:
            record["tool_calls"] = reply.tool_calls
        if reply.constraint is not None:
            record["constraint"] = reply.constraint
        if reply.notice:
            record["notice"] = reply.notice
        print(jsonlib.dumps(record), file=out, flush=True)
    elif stream is not None:
        stream.finish()
    else:  # with tools: the text before the calls (the calls follow, one line each)
        print(conv.history[-1]["content"] if conv.tools is not None else reply.text, file=out, flush=True)
    if not json and reply.tool_calls:  # what a piped chat answers with `/tool {"name": ..., "content": ...}`
        for call in reply.tool_calls:
            print(f"tool call: {jsonlib.dumps(call)}", file=out, flush=True)


class _Stream:
    """Prints a reply as its tokens come (whole characters only: a byte-level token may end mid-character)."""

    def __init__(self, conv, out: IO[str]):
        self.conv, self.out, self.ids, self.shown = conv, out, [], 0
        self.calls = ToolCallStream() if conv.tools is not None else None  # a call is shown whole, at the end

    def __call__(self, token: int) -> None:
        if token in self.conv.stop_ids:
            return
        self.ids.append(token)
        text = self.conv.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        if self.calls is not None:
            self.out.write(self.calls.feed(text))
            self.out.flush()
            return
        self.out.write(text[self.shown :])
        self.out.flush()
        self.shown = len(text)

    def finish(self) -> None:
        text = self.conv.tokenizer.decode(self.ids)
        if self.calls is not None:
            self.calls.feed(text)
            self.out.write(self.calls.finish() + "\n")
            self.out.flush()
            return
        self.out.write(text[self.shown :] + "\n")
        self.out.flush()


def _setup_readline() -> None:
    try:
        import readline  # noqa: F401  # lazy: readline: line editing and this session's history for input()
    except ImportError:  # not on every platform
        pass
