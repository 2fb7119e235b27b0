"""The session API every runtime implements: prefill, decode, generate, reset.

A session owns one sequence's state (DeltaNet conv/recurrent states and the KV cache) and the
position of the next token. Subclasses implement `_forward(ids)` for a chunk of at most
`prefill_chunk` tokens; everything else (chunking, bounds checks, sampling) lives here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from deltaship import options
from deltaship.errors import DeltashipError
from deltaship.failures import run_failure


@dataclass(frozen=True)
class Checkpoint:
    """A sequence's state at a position, as one session can go back to it: copies of the DeltaNet conv and
    recurrent states (fixed size, whatever the history) and the position. The KV caches are not copied: they only
    grow, so going back to `position` moves the pointer (the entries past it are overwritten by the next call)."""

    position: int
    states: dict[str, Any]  # DeltaNet state name -> a copy, in the runtime's own layout
    owner: object = field(repr=False, compare=False)  # the session that took it (its KV caches hold positions < p)
    serial: int = field(repr=False, compare=False)  # the session's rewind count when it was taken

    def nbytes(self) -> int:
        return sum(int(np.asarray(a).nbytes) for a in self.states.values())


@dataclass
class Generation:
    input_ids: list[int]
    output_ids: list[int]
    logits: list[np.ndarray] = field(default_factory=list)  # row i: logits that chose output_ids[i]
    stopped: str = "length"  # "length", "eos", "context" or "constraint" (its structure ended, no eos id)


class TokenGuide(Protocol):
    """What constrains a generation (deltaship.constrain's Guide): the tokens allowed next, advanced by each one
    emitted. The loop masks the logits with `allowed()` before greedy or sampling (temperature, top-k, top-p)."""

    def allowed(self) -> np.ndarray: ...  # bool [vocab]

    def advance(self, token: int) -> None: ...

    def done(self) -> bool: ...  # nothing but an end-of-sequence token can follow


def masked(logits: np.ndarray, guide: TokenGuide | None) -> np.ndarray:
    """The logits with every token the guide does not allow at -inf (a copy); the logits themselves without one."""
    if guide is None:
        return logits
    allowed = guide.allowed()
    out = np.full(logits.shape, -np.inf, dtype=np.float32)
    out[: allowed.size][allowed] = logits[: allowed.size][allowed]
    return out


class Session(ABC):
    """One sequence on one bundle."""

    def __init__(self, bundle: Path, manifest: dict[str, Any], prefill_chunk: int | None = None):
        self.bundle = Path(bundle)
        self.manifest = manifest
        self.max_context = int(manifest["max_context"])
        self.vocab_size = int(manifest["model"]["vocab_size"])
        self.prefill_chunk = int(prefill_chunk or manifest["prefill_chunk"])
        self.position = 0
        self._owner = object()  # what this session's checkpoints name as theirs
        self._rewinds: list[int] = []  # each rewind's target position: KV entries at or past it may be rewritten
        eos = manifest.get("tokens", {}).get("eos") or []
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

    # ---- to implement -------------------------------------------------------------------
    @abstractmethod
    def _forward(self, ids: np.ndarray) -> np.ndarray:
        """Run ids [T] (int64) at self.position; return float32 logits [vocab] of the last one."""

    @abstractmethod
    def _reset_states(self) -> None:
        """Zero every state tensor."""

    def _read_states(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Copies of the named states (manifest names), in the runtime's own layout and dtype."""
        raise DeltashipError(
            f"{type(self).__name__} cannot read its states", "use deltaship's own session for this bundle's target"
        )

    def _write_states(self, arrays: dict[str, np.ndarray]) -> None:
        """Overwrite the named states with full-shape arrays in the runtime's own layout (as _read_states gives)."""
        raise DeltashipError(
            f"{type(self).__name__} cannot write its states", "use deltaship's own session for this bundle's target"
        )

    def runtime_name(self) -> str:
        return self.manifest["target"]

    # what a profile's latencies are, where they are not the runtime's own on this device (an emulation of it)
    latency_note: str | None = None

    # ---- public API --------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence: zero all states, next token is position 0."""
        self._reset_states()
        self._rewind(0)

    # ---- checkpoints -------------------------------------------------------------------
    def deltanet_states(self) -> list[dict[str, Any]]:
        """The manifest entries of the fixed-size states a checkpoint copies (DeltaNet conv and recurrent)."""
        return [s for s in self.manifest["states"] if s["kind"].startswith("deltanet")]

    def can_checkpoint(self) -> bool:
        """Whether this session can copy its states out and back (checkpoint, restore, saved chats): a runtime that
        keeps them out of reach (onnxruntime-genai's own buffers) cannot."""
        return type(self)._read_states is not Session._read_states

    def checkpoint(self) -> Checkpoint:
        """The sequence's state now: one copy of the DeltaNet states (no KV cache) and the position."""
        names = [s["name"] for s in self.deltanet_states()]
        return Checkpoint(self.position, self._read_states(names), self._owner, len(self._rewinds))

    def can_restore(self, cp: Checkpoint) -> bool:
        """Whether `cp` is this session's and its KV entries (positions < cp.position) are still in place: no
        rewind to an earlier position happened since it was taken (the tokens fed after one overwrite them)."""
        later = self._rewinds[cp.serial :]
        return cp.owner is self._owner and (not later or min(later) >= cp.position)

    def restore(self, cp: Checkpoint) -> None:
        """Go back to a checkpoint of this session: its DeltaNet states are copied back, the position moves to it.
        Generating after a restore gives what a fresh session fed the same tokens would give."""
        if cp.owner is not self._owner:
            raise DeltashipError(
                "this checkpoint was taken by another session (its KV cache is not in this one)",
                "restore a checkpoint into the session that took it, or save and load a whole chat (deltaship.chat)",
            )
        if not self.can_restore(cp):
            raise DeltashipError(
                f"the checkpoint at position {cp.position} is stale: the session went back to position "
                f"{min(self._rewinds[cp.serial :])} since, and the tokens fed after that overwrote its KV entries",
                "restore a checkpoint taken after the last rewind, or reset and prefill the tokens again",
            )
        self._write_states(cp.states)
        self._rewind(cp.position)

    def _rewind(self, position: int) -> None:
        self._rewinds.append(position)
        self.position = position

    def state_file_arrays(self) -> dict[str, np.ndarray]:
        """Every state as a saved session keeps it: the DeltaNet states whole, each KV cache up to the position."""
        arrays = self._read_states([s["name"] for s in self.manifest["states"]])
        for s in self.manifest["states"]:
            if s["kind"].startswith("kv_cache"):
                axis = self._seq_axis(s, arrays[s["name"]])
                arrays[s["name"]] = np.ascontiguousarray(np.take(arrays[s["name"]], range(self.position), axis=axis))
        return arrays

    def load_state_file_arrays(self, position: int, arrays: dict[str, np.ndarray]) -> None:
        """Put back what state_file_arrays gave (checked by the caller: names, shapes, dtypes), at `position`.

        One state at a time: a KV cache goes through a whole-length copy of itself (its prefix written into it), so
        the restore holds at most one such copy beside `arrays` (what `deltaship plan` counts for a prompt cache)."""
        self.reset()
        for s in self.manifest["states"]:
            a = arrays[s["name"]]
            # the whole-length copy is bound to no name: freed as soon as it is written, before the next one
            self._write_states({s["name"]: self._kv_whole(s, a, position) if s["kind"].startswith("kv_cache") else a})
        self.position = position

    def _kv_whole(self, state: dict[str, Any], prefix: np.ndarray, position: int) -> np.ndarray:
        """A KV cache at its whole length (a copy of the session's, zero after reset) with `prefix` as its first
        `position` entries."""
        whole = self._read_states([state["name"]])[state["name"]]
        idx = [slice(None)] * whole.ndim
        idx[self._seq_axis(state, whole)] = slice(0, position)
        whole[tuple(idx)] = prefix
        return whole

    def state_layout(self) -> dict[str, tuple[tuple[int, ...], str, int | None]]:
        """{state: (full shape, dtype, sequence axis or None)} in the runtime's layout, as _read_states gives."""
        layout = {}
        for s in self.manifest["states"]:  # one copy at a time: a restore checks a file against this
            a = self._read_states([s["name"]])[s["name"]]
            kv = s["kind"].startswith("kv_cache")
            layout[s["name"]] = (tuple(a.shape), str(a.dtype), self._seq_axis(s, a) if kv else None)
        return layout

    def _seq_axis(self, state: dict[str, Any], array: np.ndarray) -> int:
        """The sequence axis of a KV cache in the runtime's layout: the first after the batch of max_context."""
        for axis in range(1, array.ndim):
            if array.shape[axis] == self.max_context:
                return axis
        raise DeltashipError(
            f"state {state['name']} {list(array.shape)} has no axis of the max context ({self.max_context})",
            "export the bundle again with this version of deltaship",
        )

    def _check(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise DeltashipError("the prompt is empty", "pass at least one token")
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise DeltashipError(
                f"token id(s) {sorted(set(bad.tolist()))[:8]} are outside the vocabulary (0 .. {self.vocab_size - 1})",
                "pass ids produced by this model's tokenizer",
            )
        if self.position + arr.size > self.max_context:
            raise DeltashipError(
                f"{arr.size} token(s) at position {self.position} exceed the bundle's max context of "
                f"{self.max_context}",
                "shorten the prompt, reset the session, or export with a larger --max-context",
            )
        return arr

    def seek(self, position: int) -> None:
        """Profiling only: move to `position` without computing (the state is left as it is).

        Decode cost depends on how deep the context is, not on the state's values, so this reaches a
        context depth without paying for its prefill. Generated tokens after a seek are meaningless.
        """
        if not 0 <= position < self.max_context:
            raise DeltashipError(
                f"position {position} is outside 0 .. {self.max_context - 1}",
                "pick a context below the bundle's max context",
            )
        self._rewind(position)

    def _chunks(self, n: int) -> list[int]:
        """How a prompt of n tokens is split into calls: chunks of prefill_chunk, then the rest."""
        return [min(self.prefill_chunk, n - i) for i in range(0, n, self.prefill_chunk)]

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Feed a prompt (in chunks of prefill_chunk tokens); return logits after its last token."""
        arr = self._check(ids)
        logits = None
        start = 0
        for size in self._chunks(arr.size):
            logits = self._forward(arr[start : start + size])
            self.position += size
            start += size
        return logits

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; return the logits for the next one."""
        arr = self._check([token])
        logits = self._forward(arr)
        self.position += 1
        return logits

    def generate(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        keep_logits: bool = False,
        on_token: Callable[[int], None] | None = None,
        guide: TokenGuide | None = None,
    ) -> Generation:
        """Prefill `ids` then produce up to max_new_tokens (greedy unless temperature > 0); with a guide, only the
        tokens it allows (deltaship.constrain)."""
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        rng = np.random.default_rng(options.seed(seed))
        ids = list(int(i) for i in ids)
        gen = Generation(input_ids=ids, output_ids=[])
        try:
            if max_new_tokens == 0:
                self.prefill(ids)
                return gen
            logits = self.prefill(ids)
            return decode_loop(
                self,
                gen,
                logits,
                max_new_tokens,
                self.decode,
                temperature,
                top_k,
                top_p,
                rng,
                stop_at_eos,
                keep_logits,
                on_token,
                guide,
            )
        except Exception as e:  # the runtime's error mid-run: one error that keeps the tokens so far
            failure = run_failure(e, gen.output_ids)
            if failure is None:
                raise
            raise failure from e


def decode_loop(
    session: Session,
    gen: Generation,
    logits: np.ndarray,
    max_new_tokens: int,
    decode: Callable[[int], np.ndarray],
    temperature: float,
    top_k: int,
    top_p: float,
    rng: np.random.Generator,
    stop_at_eos: bool,
    keep_logits: bool,
    on_token: Callable[[int], None] | None,
    guide: TokenGuide | None = None,
) -> Generation:
    """From the logits after the prompt: sample, record, stop (eos, max_new_tokens, context) or decode the token.
    A guide masks the logits before sampling and stops the loop where its structure admits nothing more (stopped
    "eos" on the end-of-sequence token it allows there, "constraint" where it has none). gen.logits keeps the
    model's own logits, unmasked."""
    while max_new_tokens:
        tok = sample(masked(logits, guide), temperature, top_k, top_p, rng)
        if guide is not None:
            guide.advance(tok)
        gen.output_ids.append(tok)
        if keep_logits:
            gen.logits.append(logits.copy())
        if on_token:
            on_token(tok)
        if stop_at_eos and tok in session.eos_ids:
            gen.stopped = "eos"
            break
        if guide is not None and guide.done() and (tok in session.eos_ids or not session.eos_ids):
            gen.stopped = "eos" if tok in session.eos_ids else "constraint"
            break
        if len(gen.output_ids) >= max_new_tokens:
            break
        if session.position >= session.max_context:
            gen.stopped = "context"
            break
        logits = decode(tok)
    return gen


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """Sampling settings that mean something; anything else (a wrong type included) is refused before any work."""
    options.at_least("--max-new-tokens", max_new_tokens, 0, "pass --max-new-tokens 0 or more")
    options.temperature(temperature)  # finite and >= 0, as the CLI's --temperature
    options.at_least("--top-k", top_k, 0, "use 0 (no top-k cut) or a positive count")
    options.top_p(top_p)  # a number in (0, 1]


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """Greedy when temperature == 0; else temperature / top-k / top-p sampling."""
    if temperature <= 0:
        return int(np.argmax(logits))
    p = probabilities(logits, temperature, top_k, top_p)
    return int(rng.choice(p.size, p=p))


def probabilities(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution `sample` draws from when temperature > 0, as float64 probabilities."""
    z = logits.astype(np.float64) / temperature
    if top_k > 0 and top_k < z.size:
        cut = np.partition(z, -top_k)[-top_k]
        z = np.where(z < cut, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p
