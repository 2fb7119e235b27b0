"""Multi-turn chat over one session, with O(1) turn checkpoints.

The state at a turn boundary is the DeltaNet states (fixed size) plus the position: `Session.checkpoint()` copies
the former; the KV caches only grow, so going back is moving the position. Each turn feeds only the tokens the
template adds; when the template rewrites the past (Qwen-family templates drop the <think> block of an assistant
turn once a user message follows it), the latest checkpoint before the first changed token is restored and the
template's version fed from there, so the state always holds the template's rendering of the history.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from deltaship.chat.store import (
    PROMPT_CACHE_FILE,
    apply_prompt_cache,
    check_save_target,
    checked_state,
    claimed,
    prompt_cache_settings,
    read_session_file,
    save_chat,
)
from deltaship.chat.template import ChatTemplate, bundle_chat_template, source_chat_template, template_file
from deltaship.chat.tools import message_calls, run_tool_loop, split_reply, tool_messages
from deltaship.constrain import Constraint, build_constraint, token_table
from deltaship.constrain.tools import Tools, after_think, check_choice, read_tools, tool_grammar
from deltaship.errors import DeltashipError
from deltaship.failures import run_failure
from deltaship.runtimes.base import Checkpoint, Session, check_sampling, masked, sample
from deltaship.runtimes.tokenizer import BundleTokenizer, load_tokenizer
from deltaship.targets import open_bundle

KEEP_TURNS = 16  # turns whose checkpoints stay in memory (2 DeltaNet copies each); older ones re-prefill if needed


@dataclass
class Reply:
    text: str
    ids: list[int]  # the tokens generated (the stop token included)
    stopped: str  # "eos" (the turn's end token), "length" (max_new_tokens) or "context" (the context is full)
    ttft_s: float  # from send() to the first token: rendering, the turn's prefill and one sample
    decode_tok_s: float  # tokens per second after the first
    prefill_tokens: int  # tokens fed for this turn (its own template tokens, plus a rewritten past)
    context_tokens: int  # tokens the state held when the reply began (chat.ids[:context_tokens])
    notice: str | None = None  # what the user should know (the context is full)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "arguments"}], complete calls only
    constraint: dict[str, Any] | None = None  # {"kind", "complete"} where the reply was constrained


@dataclass
class Turn:
    """One exchange: checkpoints where its own tokens begin and where its generation prompt begins (what the
    reply follows; a template that rewrites a past reply renders it from that prompt's role header on)."""

    messages_before: int
    before: Checkpoint | None
    before_reply: Checkpoint | None = None
    ids_before_reply: int = 0
    inputs: int = 1  # the messages the turn adds before its reply: a user message, or its tool results
    constraint: Constraint | None = None  # what the reply is held to (a retry generates under it again)
    tool_choice: str | None = None  # with tools: auto, required, none or a function's name


@dataclass
class _Fed:
    logits: np.ndarray | None
    fed: int


class Chat:
    """A conversation on a bundle's session: send, retry, undo, reset, save / load."""

    def __init__(
        self,
        session_or_bundle: Session | str | Path,
        system: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        template: str | None = None,
        tokenizer: Any = None,
        threads: int | None = None,
        prompt_cache: bool = True,
        tools: str | Path | list[Any] | None = None,
        tool_choice: str = "auto",
    ):
        if isinstance(getattr(session_or_bundle, "session", None), Session):  # what deltaship.load() returns
            session_or_bundle = session_or_bundle.session
        if isinstance(session_or_bundle, Session):
            self.session = session_or_bundle
        else:
            self.session = open_bundle(session_or_bundle, threads=threads)
        s = self.session
        if not s.can_checkpoint():  # each turn takes two checkpoints; retry and undo restore them
            raise DeltashipError(
                f"{s.runtime_name()}: a chat copies the session's DeltaNet states at each turn, and this runtime "
                "gives no access to them",
                "chat with deltaship's own session of the bundle (drop --runtime genai)",
            )
        if tokenizer is None:
            try:
                tokenizer = load_tokenizer(s.bundle, s.manifest)
            except DeltashipError as e:  # its fix names generate's --input-ids, which a chat has no use for
                raise DeltashipError(
                    e.message,
                    "chat needs the bundle's tokenizer and chat template: export a checkpoint directory that has "
                    "tokenizer.json (the trained qwen3.5-tiny preset does), or pass tokenizer= and template= to Chat",
                ) from None
        self.tokenizer = tokenizer
        if template is not None:
            self.template = ChatTemplate(template, where="the template= passed to Chat")
        else:
            source, special = bundle_chat_template(s.bundle, s.manifest)
            self.template = ChatTemplate(source, where=template_file(s.bundle, s.manifest), **special)
        self.template_kwargs = dict(template_kwargs or {})
        if tools is not None:  # rendered by the template (its `tools` variable) and saved with the settings
            self.template_kwargs["tools"] = list(read_tools(tools).entries)
        self.tools: Tools | None = (
            read_tools(self.template_kwargs["tools"], "tools") if self.template_kwargs.get("tools") else None
        )
        check_choice(tool_choice, self.tools)
        self.tool_choice = tool_choice
        tokens = s.manifest.get("tokens", {})
        self.stop_ids = set(s.eos_ids) | ({tokens["im_end"]} if isinstance(tokens.get("im_end"), int) else set())
        self.system = system
        self.use_prompt_cache = prompt_cache  # start from the bundle's shipped prompt cache where it holds `system`
        self.messages: list[dict[str, str]] = []
        self.turns: list[Turn] = []
        self._ids: list[int] = []
        self.reset()

    # ---- what the conversation holds ---------------------------------------------------------
    @property
    def history(self) -> list[dict[str, str]]:
        """The messages (system first, if any), as the template renders them."""
        return [dict(m) for m in self.messages]

    @property
    def ids(self) -> list[int]:
        """Every token the state holds, in order (len == the session's position)."""
        return list(self._ids)

    def render_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """The template's rendering of `messages`, tokenized."""
        text = self.template.render(messages, add_generation_prompt, **self.template_kwargs)
        return self.tokenizer.encode(text)

    # ---- turns ----------------------------------------------------------------------------------
    def send(
        self,
        text: str,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_token: Callable[[int], None] | None = None,
        *,
        json_schema: dict[str, Any] | bool | str | Path | None = None,
        regex: str | None = None,
        grammar: str | Path | None = None,
        tool_choice: str | None = None,
    ) -> Reply:
        """Add a user message and generate the assistant's reply (kept in the history). json_schema / regex /
        grammar hold the reply to a constraint (deltaship.constrain); tool_choice overrides the chat's for this
        reply."""
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        if not isinstance(text, str):
            raise DeltashipError(f"a message is text, got {type(text).__name__}", "pass a str")
        turn = self._turn(1, build_constraint(json_schema, regex, grammar), tool_choice)
        self.messages.append({"role": "user", "content": text})
        return self._respond_new(turn, max_new_tokens, temperature, top_k, top_p, seed, on_token)

    def send_tool_results(
        self,
        results: list[dict[str, Any]] | dict[str, Any],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_token: Callable[[int], None] | None = None,
        *,
        tool_choice: str | None = None,
    ) -> Reply:
        """Give the results of the last reply's tool calls ({"name", "content"} each, for a call it made) as the
        template's tool messages, and generate the assistant's next reply."""
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        last = self.messages[-1] if self.messages and self.messages[-1]["role"] == "assistant" else {}
        made = [{"name": c["function"]["name"]} for c in last.get("tool_calls", [])]
        msgs = tool_messages(results, made)
        turn = self._turn(len(msgs), None, tool_choice)
        self.messages.extend(msgs)
        return self._respond_new(turn, max_new_tokens, temperature, top_k, top_p, seed, on_token)

    def run_tools(self, text: str, functions: dict[str, Callable[..., Any]], max_rounds: int = 4, **sampling: Any):
        """Send `text` and run the tool loop: each call of the replies runs `functions[name](**arguments)` and its
        result goes back, until a reply calls nothing; the last round may not call (tool choice none). Returns
        the last reply."""
        return run_tool_loop(self, text, functions, max_rounds, **sampling)

    def _turn(self, inputs: int, constraint: Constraint | None, tool_choice: str | None) -> Turn:
        choice = self.tool_choice if tool_choice is None else tool_choice
        check_choice(choice, self.tools)
        if constraint is not None and self.tools is not None and choice != "none":
            raise DeltashipError(
                f"{constraint.where} and tools (tool choice {choice}) cannot be combined: a reply takes one "
                "constraint, and the tools' is the call grammar",
                "pass tool_choice='none' (--tool-choice none) with the constraint, or drop the constraint",
            )
        return Turn(messages_before=len(self.messages), before=None, inputs=inputs, constraint=constraint,
                    tool_choice=choice)  # fmt: skip

    def _respond_new(self, turn: Turn, *args: Any) -> Reply:
        reply = self._respond(turn, *args)
        if reply.stopped == "context" and not reply.ids:  # nothing fed, nothing generated: the turn never happened
            del self.messages[turn.messages_before :]
        return reply

    def retry(
        self,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_token: Callable[[int], None] | None = None,
        *,
        json_schema: dict[str, Any] | bool | str | Path | None = None,
        regex: str | None = None,
        grammar: str | Path | None = None,
        tool_choice: str | None = None,
    ) -> Reply:
        """Generate the last reply again: back to the checkpoint before the last turn, its tokens fed again, under
        the turn's constraint and tool choice (or the ones given here)."""
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        constraint = build_constraint(json_schema, regex, grammar)
        if not self.turns:
            raise DeltashipError("nothing to retry: no reply yet", "send a message first")
        again = self._turn(self.turns[-1].inputs, constraint or self.turns[-1].constraint,
                           tool_choice or self.turns[-1].tool_choice)  # fmt: skip
        turn = self.turns.pop()
        turn.constraint, turn.tool_choice = again.constraint, again.tool_choice
        del self.messages[turn.messages_before + turn.inputs :]  # keep the turn's input, drop the reply
        return self._respond(turn, max_new_tokens, temperature, top_k, top_p, seed, on_token)

    def undo(self) -> None:
        """Drop the last exchange (user message and reply): the state goes back to before it."""
        if not self.turns:
            raise DeltashipError("nothing to undo: no exchange yet", "send a message first")
        turn = self.turns.pop()
        del self.messages[turn.messages_before :]
        cp = turn.before
        if cp is not None and self.session.can_restore(cp):
            self.session.restore(cp)
            del self._ids[cp.position :]
        else:  # no checkpoint left for it: the next turn prefills the history again
            self._forget_state()

    def prime(self) -> int:
        """Feed the history as the template renders it without a generation prompt (e.g. the system message alone),
        so that the next turn feeds only its own tokens; saved, this is a prompt cache. Returns the tokens fed."""
        if not self.messages:
            return 0
        target = self.render_ids(self.messages, add_generation_prompt=False)
        common = _common_prefix(self._ids, target)
        if common < len(self._ids):
            cp = self._latest_checkpoint(common, Turn(len(self.messages), None))
            if cp is None:
                self._forget_state()
            else:
                self.session.restore(cp)
                del self._ids[cp.position :]
        fed = len(target) - len(self._ids)
        if fed > 0:
            self.session.prefill(target[len(self._ids) :])
            self._ids.extend(target[len(self._ids) :])
        return max(fed, 0)

    def reset(self) -> None:
        """Start over: only the system message (if any) remains; the state is empty, or holds the system message
        where the bundle ships a prompt cache of it (export --prompt-cache)."""
        self.messages = _opening(self.system)
        self.turns = []
        self._forget_state()
        if self.use_prompt_cache and self.system is not None:
            apply_prompt_cache(self)

    def _forget_state(self) -> None:
        self.session.reset()
        self._ids = []

    def _respond(self, turn: Turn, max_new_tokens, temperature, top_k, top_p, seed, on_token) -> Reply:
        out: list[int] = []  # the reply so far, kept for the error when the runtime fails mid-turn
        try:
            return self._run_turn(turn, max_new_tokens, temperature, top_k, top_p, seed, on_token, out)
        except Exception as e:  # the runtime's error mid-turn: one error with the reply so far, as generate's
            failure = run_failure(e, out)
            if failure is None:
                raise
            failure.text = self.tokenizer.decode([t for t in out if t not in self.stop_ids])
            # the state is the runtime's to say nothing of now: the turn never happened, the next one prefills
            del self.messages[turn.messages_before :]
            self._forget_state()
            raise failure from e

    def _run_turn(self, turn: Turn, max_new_tokens, temperature, top_k, top_p, seed, on_token, out) -> Reply:
        s = self.session
        t0 = time.perf_counter()
        previous = self.messages[: turn.messages_before]
        target = self.render_ids(self.messages, add_generation_prompt=True)
        # where this turn's own tokens begin (after the history as the template renders it now), and where its
        # generation prompt begins (after the user message)
        boundary = _common_prefix(self.render_ids(previous, add_generation_prompt=False), target) if previous else 0
        prompt = _common_prefix(self.render_ids(self.messages, add_generation_prompt=False), target)
        if len(target) > s.max_context:  # refused whole: no silent truncation of the history
            notice = (
                f"the conversation needs {len(target)} tokens and a reply; the bundle's context is {s.max_context}: "
                "undo or reset the conversation, or export with a larger --max-context"
            )
            if turn.before is not None:  # a retry: the turn stays as it was, without its reply
                self.turns.append(turn)
            return Reply("", [], "context", 0.0, 0.0, 0, len(self._ids), notice)
        fed = self._feed(target, (boundary, max(boundary, min(prompt, len(target) - 1))), turn)
        turn.ids_before_reply = len(self._ids)
        context = len(self._ids)
        rng = np.random.default_rng(seed)
        stopped, notice, first = "length", None, None
        logits = fed.logits
        guide = self._guide(turn)
        while len(out) < max_new_tokens:
            tok = sample(masked(logits, guide), temperature, top_k, top_p, rng)
            if guide is not None:
                guide.advance(tok)
            out.append(tok)
            if first is None:
                first = time.perf_counter()
            if on_token:
                on_token(tok)
            if tok in self.stop_ids:
                stopped = "eos"
                break
            if len(out) >= max_new_tokens:
                break
            if s.position >= s.max_context:
                stopped = "context"
                notice = (
                    f"the context is full ({s.max_context} tokens): the reply stops here; undo or reset the "
                    "conversation, or export with a larger --max-context"
                )
                break
            logits = s.decode(tok)
            self._ids.append(tok)
        end = time.perf_counter()
        ttft = (first or end) - t0
        rate = (len(out) - 1) / (end - first) if first is not None and len(out) > 1 and end > first else 0.0
        content = self.tokenizer.decode([t for t in out if t not in self.stop_ids])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            message["content"], calls = split_reply(content, self.tools)
            if calls:
                message["tool_calls"] = message_calls(calls)
        self.messages.append(message)
        self.turns.append(turn)
        self._drop_old_checkpoints()
        constrained = {"kind": guide.constraint.kind, "complete": guide.complete()} if guide is not None else None
        return Reply(content, out, stopped, ttft, rate, fed.fed, context, notice, calls, constrained)

    def _guide(self, turn: Turn):
        """The parser of this turn's constraint (or the tools' call grammar), fresh: a reply's constraint starts
        and ends with it, so a turn's checkpoint needs only the constraint itself, not a parser state."""
        constraint = turn.constraint
        think = self.template.render(self.messages, True, **self.template_kwargs).endswith("<think>\n")
        if constraint is None and self.tools is not None:
            constraint = tool_grammar(self.tools, turn.tool_choice or self.tool_choice, think)
        elif constraint is not None and think:
            constraint = after_think(constraint)
        if constraint is None:
            return None
        text = getattr(self.tokenizer, "json_text", None)
        if not isinstance(text, str):
            raise DeltashipError(
                "a constrained reply needs the bundle's tokenizer.json (the token table the masks are computed over)",
                "chat with the bundle's own tokenizer (drop tokenizer=)",
            )
        return constraint.guide(token_table(text, self.session.vocab_size, sorted(self.stop_ids)))

    def _feed(self, target: list[int], marks: tuple[int, int], turn: Turn) -> _Fed:
        """Make the state hold `target` (the history and the new turn, as the template renders them), feeding only
        what it lacks. marks: where the turn's own tokens begin and where its generation prompt begins; the turn's
        checkpoints are taken there (undo goes back to the first, retry and a rewritten reply to the second)."""
        s = self.session
        common = _common_prefix(self._ids, target)
        if common < len(self._ids) or common >= len(target):
            # the held tokens leave the template's rendering (a rewritten past, a retry): go back to the latest
            # checkpoint at or before the first difference, with at least one token left to feed
            cp = self._latest_checkpoint(min(common, len(target) - 1), turn)
            if cp is None:
                self._forget_state()
            else:
                s.restore(cp)
                del self._ids[cp.position :]
        start = len(self._ids)
        logits = None
        for attr, at in zip(("before", "before_reply"), marks):
            if len(self._ids) < at:
                logits = s.prefill(target[len(self._ids) : at])
                self._ids.extend(target[len(self._ids) : at])
            cp = getattr(turn, attr)
            kept = cp is not None and s.can_restore(cp) and cp.position == len(self._ids)
            if len(self._ids) == at and not kept:
                setattr(turn, attr, s.checkpoint())
            elif not kept and cp is not None and not s.can_restore(cp):
                setattr(turn, attr, None)
        if len(self._ids) < len(target):
            logits = s.prefill(target[len(self._ids) :])
            self._ids.extend(target[len(self._ids) :])
        return _Fed(logits, len(target) - start)

    def _latest_checkpoint(self, limit: int, turn: Turn) -> Checkpoint | None:
        cps = [c for t in [*self.turns, turn] for c in (t.before, t.before_reply) if c is not None]
        ok = [c for c in cps if c.position <= limit and self.session.can_restore(c)]
        return max(ok, key=lambda c: c.position, default=None)

    def _drop_old_checkpoints(self) -> None:
        for t in self.turns[:-KEEP_TURNS]:
            t.before = t.before_reply = None

    # ---- saved sessions ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the conversation (state, ids, messages, the last exchange's checkpoints) to one file, atomically.
        Refused inside a bundle, over a file that is not a session of this bundle, and on a session another chat
        holds (its lock); what a killed save left beside `path` is removed first."""
        path = _file_path(path, "save")
        check_save_target(path, self.session)
        with claimed(path, "save"):
            return save_chat(self, path)

    @classmethod
    def load(cls, path: str | Path, session_or_bundle: Session | str | Path, **kwargs: Any) -> Chat:
        """A conversation saved by `save`, on a session of the same bundle (checked: identity, hashes, version)."""
        path = _file_path(path, "load")
        if isinstance(session_or_bundle, Session):
            session = session_or_bundle
        else:
            session = open_bundle(session_or_bundle, threads=kwargs.pop("threads", None))
        meta, tensors = read_session_file(path, session)  # the header checked against the bundle before a read
        state, cps = checked_state(path, meta, tensors, session)
        chat = cls(
            session, system=meta["system"], template_kwargs=meta["template_kwargs"], prompt_cache=False, **kwargs
        )
        chat.use_prompt_cache = True  # the file's state now; a later reset() may start from the bundle's cache
        session.load_state_file_arrays(meta["position"], state)
        chat.messages = [dict(m) for m in meta["messages"]]
        chat._ids = list(meta["ids"])
        last = meta["last_turn"]
        if last is not None:
            made = [Checkpoint(pos, st, session._owner, len(session._rewinds)) for pos, st in cps]
            chat.turns = [
                Turn(
                    messages_before=last["messages_before"],
                    before=made[last["before"]] if last["before"] is not None else None,
                    before_reply=made[last["before_reply"]] if last["before_reply"] is not None else None,
                    ids_before_reply=last["ids_before_reply"],
                    # the messages between the turn's start and its reply: a user message or tool results
                    inputs=max(1, len(chat.messages) - last["messages_before"] - 1),
                )
            ]
        return chat


def _file_path(path: Any, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise DeltashipError(f"Chat.{what}: a session file is a path, got {path!r:.80}", "pass a str or a Path")
    return Path(path)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n], np.int64), np.asarray(b[:n], np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def _opening(system: str | None) -> list[dict[str, str]]:
    """The messages a chat starts with: the system message, if any (what a prompt cache holds)."""
    return [{"role": "system", "content": system}] if system else []


def prompt_cache_tokens(tokenizer_files: list[Path], path: Path) -> int:
    """How many tokens `export --prompt-cache FILE` would ship for a checkpoint with these tokenizer files
    (ModelSource.tokenizer_files): the system message as the checkpoint's chat template renders it without a
    generation prompt, as write_prompt_cache feeds it (`deltaship plan --prompt-cache FILE`)."""
    system, template_kwargs = prompt_cache_settings(Path(path))
    tok = next((f for f in tokenizer_files if f.name == "tokenizer.json"), None)
    if tok is None:
        raise DeltashipError(
            "--prompt-cache: the model has no tokenizer, so no chat template to render the system message with",
            "pass --prompt-cache-tokens N (the system message's length in tokens) instead",
        )
    messages = _opening(system)
    if not messages:
        return 0
    source, special = source_chat_template(tokenizer_files)
    where = next((f for f in tokenizer_files if f.name == "chat_template.jinja"), tok.parent / "tokenizer_config.json")
    text = ChatTemplate(source, where=where, **special).render(messages, False, **template_kwargs)
    return len(BundleTokenizer(tok).encode(text))


def write_prompt_cache(
    bundle_dir: Path, manifest: dict[str, Any], system: str, template_kwargs: dict, threads: int | None = None
) -> dict:
    """Feed the system message in the bundle being built and save that state into it (PROMPT_CACHE_FILE); return
    the manifest's chat.prompt_cache record. `manifest` is the provisional one, with every file but the cache."""
    session = open_bundle(bundle_dir, threads=threads)
    chat = Chat(session, system=system, template_kwargs=template_kwargs, prompt_cache=False)
    fed = chat.prime()
    save_chat(chat, Path(bundle_dir) / PROMPT_CACHE_FILE, shipped=True)
    return {"file": PROMPT_CACHE_FILE, "system": system, "template_kwargs": template_kwargs, "tokens": fed}
