"""One model, many clients: the generation a request asks for, on the one shared session, one request at a time.

`Engine.generate` renders nothing: it takes the prompt's tokens, restores the longest held prefix of them
(held.py), feeds the rest, holds the conversation at the end of the prompt (before generating: Qwen's template
drops an earlier reply's <think> block, so the next request's prompt extends this prompt, not the generated text),
and decodes; a request's constraint (response_format, constraints.py) masks each token of the reply, never the
prompt, so held conversations are the same with or without one. `Scheduler` runs requests first come, first served
on one worker thread, with a bounded queue; a cancelled request (its client went away) is skipped if it is still
queued and stops decoding at its next token. There is no batched decode: the session holds one sequence.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from deltaship.chat import Chat
from deltaship.constrain import Constraint, token_table
from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Session, TokenGuide, check_sampling, masked, sample
from deltaship.serve.held import HeldConversations, common_prefix

NEXT_TURN_PROBE = "deltaship"  # a reply's text, to find where a next turn's rendering leaves this prompt


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Result:
    ids: list[int] = field(default_factory=list)  # generated, the stop token included
    text: str = ""
    finish_reason: str = "length"  # "stop" (an end token or a stop string), "length", "cancelled"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0


class Engine:
    """The session, the bundle's chat template and tokenizer (a `Chat`'s: prompts are rendered as `deltaship chat`
    renders them), and the held conversations."""

    def __init__(
        self,
        session: Session,
        max_held_bytes: int,
        max_held: int,
        reuse: bool = True,
        tokenizer: Any = None,
        template: str | None = None,
    ):
        """tokenizer, template: for a bundle that carries none (a preset with random weights), as `Chat` takes."""
        self.session = session
        # the renderer: template, tokenizer, stop ids (it owns no turn here)
        self.chat = Chat(session, tokenizer=tokenizer, template=template)
        self.tokenizer = self.chat.tokenizer
        self.stop_ids = set(self.chat.stop_ids)
        self.reuse = reuse
        self.held = HeldConversations(session, max_held_bytes, max_held)

    def render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
        """A chat request's prompt (the template's rendering of the messages with the generation prompt, tokenized)
        and where to hold it besides its end: after the system message (other conversations share it), and where
        the next turn's rendering leaves this prompt (Qwen's template renders a past reply without the generation
        prompt's <think>: the next turn extends the prompt up to its `<|im_start|>assistant\n`, not further)."""
        t = self.chat.template
        prompt = self.tokenizer.encode(t.render(messages, True, **template_kwargs))
        marks = []
        if messages[0]["role"] == "system" and len(messages) > 1:
            marks.append(common_prefix(prompt, self.tokenizer.encode(t.render(messages[:1], False, **template_kwargs))))
        if messages[-1]["role"] != "assistant":
            after = messages + [{"role": "assistant", "content": NEXT_TURN_PROBE}]
            marks.append(common_prefix(prompt, self.tokenizer.encode(t.render(after, False, **template_kwargs))))
        return prompt, sorted(m for m in set(marks) if 0 < m < len(prompt))

    def opens_think(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> bool:
        """Whether the generation prompt opens a <think> block the reply starts inside (as Chat's _guide asks)."""
        return self.chat.template.render(messages, True, **template_kwargs).endswith("<think>\n")

    def guide(self, constraint: Constraint) -> TokenGuide:
        """A fresh parser for one reply over the tokenizer's token table (built once per server: constrain caches
        it). Its end-of-sequence ids are the reply's stop ids (the end of turn too): allowed only where the
        structure is complete, and the only tokens once it admits nothing more."""
        text = getattr(self.tokenizer, "json_text", None)
        if text is None:
            raise DeltashipError(
                "this server's tokenizer has no tokenizer.json, so it cannot drive response_format",
                "serve a bundle exported with its tokenizer.json",
            )
        return constraint.guide(token_table(text, self.session.vocab_size, sorted(self.stop_ids)))

    def generate(
        self,
        prompt: list[int],
        sampling: Sampling,
        cancelled: threading.Event | None = None,
        on_text: Callable[[str], None] | None = None,
        guide: TokenGuide | None = None,
        marks: list[int] = (),
    ) -> Result:
        """Generate after `prompt`, holding it at its end and at `marks` (positions inside it). on_text gets the text
        as it becomes final (their concatenation is the result's text: held back while it may still become a stop
        string or is an unfinished character). guide: the request's constraint's parser (self.guide), fresh for
        this reply: it masks every token drawn."""
        s = self.session
        check_sampling(sampling.max_tokens, sampling.temperature, 0, sampling.top_p)
        if not prompt:
            raise DeltashipError("the prompt is empty", "send at least one message with text")
        if len(prompt) >= s.max_context:
            raise DeltashipError(
                f"the prompt has {len(prompt)} tokens; the bundle's context is {s.max_context}",
                "shorten the conversation, or export the bundle with a larger --max-context",
            )
        t0 = time.perf_counter()
        if self.reuse:
            cached, logits = self.held.start(prompt)
        else:
            s.reset()
            cached, logits = 0, None
        if logits is None:
            at = cached
            for m in sorted(marks) if self.reuse else ():
                if at < m < len(prompt):
                    self.held.hold(prompt[:m], s.prefill(prompt[at:m]))
                    at = m
            logits = s.prefill(prompt[at:])
        if self.reuse:
            self.held.hold(prompt, logits)
        out = Result(prompt_tokens=len(prompt), cached_tokens=cached)
        rng = np.random.default_rng(sampling.seed)
        shown = 0
        longest_stop = max((len(x) for x in sampling.stop), default=0)
        while len(out.ids) < sampling.max_tokens:
            if cancelled is not None and cancelled.is_set():
                out.finish_reason = "cancelled"
                break
            tok = sample(masked(logits, guide), sampling.temperature, 0, sampling.top_p, rng)
            if not out.ids:
                out.ttft_s = time.perf_counter() - t0
            out.ids.append(tok)
            if guide is not None:
                guide.advance(tok)
            if tok in self.stop_ids:
                out.finish_reason = "stop"
                break
            text = self.tokenizer.decode([t for t in out.ids if t not in self.stop_ids])
            cut = min((i for i in (text.find(x) for x in sampling.stop) if i >= 0), default=-1)
            if cut >= 0:
                out.text, out.finish_reason = text[:cut], "stop"
                break
            out.text = text
            final = len(text) - (longest_stop - 1 if longest_stop else 0)
            if text.endswith("\ufffd"):  # a byte-level token ended mid-character
                final = min(final, len(text) - 1)
            if on_text and final > shown:
                on_text(text[shown:final])
                shown = final
            if len(out.ids) >= sampling.max_tokens or s.position >= s.max_context:
                break
            logits = s.decode(tok)
        if on_text and len(out.text) > shown:
            on_text(out.text[shown:])
        return out


class Busy(DeltashipError):
    """The queue is full (the server answers 503 with Retry-After)."""


@dataclass
class Job:
    """One request's work, run on the scheduler's thread: run() is called there unless cancelled first."""

    run: Callable[[], Any]
    done: Callable[[Any, BaseException | None], None]  # called on the worker thread with (result, error)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    """First come, first served on one worker thread; at most `max_queue` requests waiting or running."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="deltaship-serve-engine", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._pending >= self.max_queue:
                raise Busy(f"{self._pending} requests are waiting or running", "retry after a few seconds")
            self._pending += 1
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while (job := self._q.get()) is not None:
            result, error = None, None
            try:
                if not job.cancelled.is_set():  # a client that went away while queued costs nothing
                    result = job.run()
            except BaseException as e:  # handed to the request's handler, which answers with it
                error = e
            finally:
                with self._lock:
                    self._pending -= 1
            job.done(result, error)
