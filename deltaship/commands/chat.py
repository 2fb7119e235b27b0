"""`deltaship chat`: a conversation with a bundle: a REPL on a terminal, a line protocol otherwise.

Line protocol (stdin not a terminal): each line is a user message, or one of the same commands as on a terminal
(COMMANDS); end of input or /quit ends the conversation. `/tool JSON` gives the results of the last reply's tool
calls ({"name", "content"}, or a list of them). With json=True each turn prints one JSON object (reply,
reply_ids, history_ids: every token the state held before the reply, prefill_tokens: tokens fed for the turn,
ttft_s, decode_tok_s, stopped, seed, and tool_calls / constraint where there are tools or a constraint), and each
command one object naming it. A line of piped input is data, not a command line: its /save takes no file (it saves
to --session); only a person at the terminal names one.
"""

from __future__ import annotations

import json as jsonlib
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from deltaship import options
from deltaship.chat import Chat
from deltaship.chat.store import bundle_prompt_cache, claimed
from deltaship.chat.tools import ToolCallStream
from deltaship.constrain import build_constraint
from deltaship.constrain.tools import check_choice, read_tools
from deltaship.errors import DeltashipError
from deltaship.files import parse_json
from deltaship.runtimes.base import check_sampling
from deltaship.targets import open_bundle

COMMANDS = {
    "/retry": "generate the last reply again (with --seed: the next seed of that turn's sequence)",
    "/undo": "drop the last exchange",
    "/reset": "start over (the system message stays)",
    "/save [FILE]": "save to --session (on a terminal also to FILE: a new file or a session of this bundle)",
    "/tool JSON": 'the results of the last reply\'s tool calls: {"name": ..., "content": ...} or a list of them',
    "/help": "list the commands",
    "/quit, /exit": "end the chat",
}


def commands_help() -> str:
    """The commands, one a line (chat --help's epilog, /help, an unknown command's notice)."""
    return "\n".join(f"  {c:<14} {what}" for c, what in COMMANDS.items())


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
    with claimed(Path(session)):
        yield


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
        print(f"deltaship chat: {bundle} ({conv.session.runtime_name()}); /help lists the commands", file=stdout)
    state = {"retries": 0, "line": 0}  # retries of the last turn: its seed's place in the sequence
    while True:
        state["line"] += 1
        try:
            if interactive:
                try:
                    line = input("> ")
                except EOFError:
                    print(file=stdout)
                    break
            else:
                line = _read_line(stdin, state["line"])
                if line is None:
                    break
            _check_text(line, state["line"])
        except (UnicodeDecodeError, DeltashipError) as e:
            err = e if isinstance(e, DeltashipError) else _not_text(state["line"])
            if not interactive:
                raise err from None
            print(f"error: {err.message}" + (f"\n  fix: {err.fix}" if err.fix else ""), file=sys.stderr)
            continue
        if not line.strip():
            continue
        try:
            if _step(conv, line, sampling, json, interactive, stdout, session, state) == "quit":
                break
        except DeltashipError as e:
            if not interactive:
                raise
            print(f"error: {e.message}" + (f"\n  fix: {e.fix}" if e.fix else ""), file=sys.stderr)
    return 0


def _read_line(stdin: IO[str], n: int) -> str | None:
    """Line n of piped input (None at its end), decoded as UTF-8 line by line from the bytes where there are bytes
    (a text stream decodes ahead, so its error would name the wrong line)."""
    raw = getattr(stdin, "buffer", None)
    if raw is None:
        line = stdin.readline()
    else:
        data = raw.readline()
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError:
            raise _not_text(n) from None
    return line.rstrip("\n").removesuffix("\r") if line else None


def _not_text(n: int) -> DeltashipError:
    return DeltashipError(f"chat: input line {n} is not UTF-8 text", "pipe UTF-8 text to chat, one message a line")


def _check_text(line: str, n: int) -> None:
    """A line decoded with surrogateescape (a C locale) holds lone surrogates where its bytes were not UTF-8."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        raise _not_text(n) from None


def _step(conv, line: str, sampling: dict, json: bool, interactive: bool, out: IO[str], session, state) -> str | None:
    word, _, rest = line.strip().partition(" ")
    if word in ("/quit", "/exit"):
        if json:
            _say(out, json, {"command": word[1:]}, "")
        return "quit"
    if word == "/help":
        _say(out, json, {"command": "help", "commands": list(COMMANDS)}, "commands:\n" + commands_help())
        return None
    if word == "/save":
        path = _save_path(rest.strip(), session, interactive)
        path = conv.save(path)
        _say(out, json, {"command": "save", "path": str(path), "history_tokens": len(conv.ids)}, f"saved {path}")
        return None
    if word in ("/undo", "/reset"):
        conv.undo() if word == "/undo" else conv.reset()
        state["retries"] = 0
        _say(out, json, {"command": word[1:], "history_tokens": len(conv.ids)}, f"({word[1:]}: {len(conv.ids)} tokens)")
    elif word == "/tool":
        fix = '/tool {"name": NAME, "content": TEXT} (or a list of them)'
        results = parse_json(rest, "/tool", "tool result line", fix)  # a piped line is untrusted: bounded
        stream = _Stream(conv, out) if interactive else None
        keep = {k: v for k, v in sampling.items() if k not in ("json_schema", "regex", "grammar")}
        reply = conv.send_tool_results(results, **keep, on_token=stream)
        _print_reply(conv, reply, "tool", json, stream, out)
    elif word == "/retry" or not line.startswith("/"):
        stream = _Stream(conv, out) if interactive else None
        state["retries"] = state["retries"] + 1 if word == "/retry" else 0
        seed = sampling["seed"]
        if seed is not None:  # retry k of a turn samples with seed + k: a new sample, the same sequence every run
            seed += state["retries"]
        turn = {**sampling, "seed": seed}
        reply = conv.retry(**turn, on_token=stream) if word == "/retry" else conv.send(line, **turn, on_token=stream)
        _print_reply(conv, reply, "retry" if word == "/retry" else "send", json, stream, out, seed)
    else:
        print(f"unknown command {word!r} (other text is a message); commands:\n{commands_help()}", file=sys.stderr)
        if json:  # one record per line read, as for every other command
            _say(out, json, {"command": "unknown", "word": word, "commands": list(COMMANDS)}, "")
        return None
    if session is not None:
        conv.save(session)
    return None


def _save_path(arg: str, session, interactive: bool) -> Path:
    """Where /save writes: --session, or (a person at the terminal only) the file named."""
    if not arg:
        if session is None:
            raise DeltashipError("/save needs a file name here (no --session)", "e.g. /save talk.dschat")
        return Path(session)
    if interactive or (session is not None and Path(arg).absolute() == Path(session).absolute()):
        return Path(arg)
    raise DeltashipError(
        f"/save {arg}: a piped conversation saves only to its --session file, never to a path its input names",
        "pass --session FILE and use /save alone (or chat on a terminal)",
    )


def _say(out: IO[str], json: bool, record: dict[str, Any], text: str) -> None:
    print(jsonlib.dumps(record) if json else text, file=out, flush=True)


def _print_reply(conv, reply, command: str, json: bool, stream, out: IO[str], seed: int | None = None) -> None:
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
            "seed": seed,
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
