"""Held conversations: the states of many conversations on one shared session, keyed by the tokens they hold.

A session's `Checkpoint` copies only the DeltaNet states: it holds while the session's KV caches still hold its
positions, i.e. until another conversation is fed there. A server interleaves conversations, so each held one keeps
its DeltaNet states (a `Checkpoint`, valid in the session while nothing overwrote its positions) and, once another
conversation is about to be fed over it, its KV prefix copied out of the session ("spilled"). Restoring it is then
one `load_state_file_arrays` (its KV prefix and DeltaNet states written back). Why one shared session and copies,
not a session per conversation: the copy is a memcpy of the conversation's own states, orders of magnitude below
the re-prefill it saves, while each extra session holds its own runtime and whole-length KV caches, and at 0.8B its
weights, per conversation (measured: bench/serve/reuse_choice.py, docs/results/serve.md).

Keys are token prefixes of rendered prompts, never a client's id: a request restores the longest held prefix of
its prompt and feeds only the rest. Memory is bounded (bytes and count) with least-recently-used eviction; an
entry is charged what it holds once spilled, from the start, so the bound holds whichever entries spill.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Checkpoint, Session


@dataclass
class Held:
    """One held conversation: the state after `ids`, and the logits that follow them (a request whose prompt is
    exactly `ids` feeds nothing)."""

    ids: tuple[int, ...]
    checkpoint: Checkpoint  # DeltaNet states at len(ids), in the shared session
    logits: np.ndarray
    nbytes: int  # what it holds once its KV prefix is copied out
    kv: dict[str, np.ndarray] | None = None  # each KV cache cut to len(ids), once another conversation took over


class HeldConversations:
    """The conversations a server holds on one session (see the module's docstring)."""

    def __init__(self, session: Session, max_bytes: int, max_entries: int):
        if max_entries < 1 or max_bytes < 0:
            raise DeltashipError(
                f"held conversations: max_entries {max_entries} and max_bytes {max_bytes} must be >= 1 and >= 0",
                "pass --max-sessions 1 or more and --cache-ram 0 or more",
            )
        self.session = session
        self.max_bytes, self.max_entries = max_bytes, max_entries
        layout = session.state_layout()  # {state: (shape, dtype, seq axis or None)}
        self._kv_axes = {name: axis for name, (_, _, axis) in layout.items() if axis is not None}
        self._kv_bytes_per_token = sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize // session.max_context
            for shape, dtype, axis in layout.values()
            if axis is not None
        )
        self._entries: OrderedDict[tuple[int, ...], Held] = OrderedDict()  # least recently used first
        self.nbytes = 0  # what the held conversations are charged, together (read by /health from another thread)
        self.spilled_bytes = 0  # KV prefixes copied out so far (for the bench and tests)

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, prompt: list[int]) -> Held | None:
        """The held conversation with the longest token prefix of `prompt`."""
        best = None
        for held in self._entries.values():
            n = len(held.ids)
            usable = held.kv is not None or self.session.can_restore(held.checkpoint)
            if usable and n <= len(prompt) and (best is None or n > len(best.ids)) and held.ids == tuple(prompt[:n]):
                best = held
        return best

    def start(self, prompt: list[int]) -> tuple[int, np.ndarray | None]:
        """Put the session at the longest held prefix of `prompt` (else empty); return how many tokens of it the
        session now holds and, when that is all of them, the logits after them."""
        held = self.longest(prompt)
        s = self.session
        if held is None:
            self._spill_above(0)
            s.reset()
            return 0, None
        self._entries.move_to_end(held.ids)
        position = len(held.ids)
        if s.can_restore(held.checkpoint):
            self._spill_above(position)
            s.restore(held.checkpoint)
        else:  # another conversation was fed over it: its KV prefix comes back in with its DeltaNet states
            self._spill_above(0)
            s.load_state_file_arrays(position, {**held.checkpoint.states, **held.kv})
            held.checkpoint = s.checkpoint()
        return position, (held.logits if position == len(prompt) else None)

    def hold(self, prompt: list[int], logits: np.ndarray) -> None:
        """Hold the conversation the session is at now (`prompt`, just fed: the session's position is its length),
        with the logits after it."""
        s = self.session
        ids = tuple(prompt)
        if s.position != len(ids):
            raise DeltashipError(
                f"held conversations: the session is at {s.position}, not at the end of the {len(ids)}-token prompt",
                "hold a conversation right after feeding its prompt, before generating",
            )
        old = self._entries.pop(ids, None)
        if old is not None:
            self.nbytes -= old.nbytes
        if old is not None and s.can_restore(old.checkpoint) and old.checkpoint.position == s.position:
            cp = old.checkpoint
        else:
            cp = s.checkpoint()
        logits = np.array(logits, copy=True)
        nbytes = cp.nbytes() + logits.nbytes + self._kv_bytes_per_token * len(ids)
        self._entries[ids] = Held(ids, cp, logits, nbytes)
        self.nbytes += nbytes
        self._evict()

    def _evict(self) -> None:
        while self._entries and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes

    def _spill_above(self, position: int) -> None:
        """Copy out the KV prefix of every held conversation still only in the session whose positions past
        `position` the next feed overwrites."""
        s = self.session
        live = [
            h for h in self._entries.values() if h.kv is None and len(h.ids) > position and s.can_restore(h.checkpoint)
        ]
        if not live:
            return
        arrays = s.state_file_arrays()  # each KV cache cut to the position (past every live entry's end)
        for h in live:
            n = len(h.ids)
            h.kv = {
                name: np.ascontiguousarray(np.take(arrays[name], range(n), axis=axis))
                for name, axis in self._kv_axes.items()
            }
            self.spilled_bytes += sum(a.nbytes for a in h.kv.values())


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n
