"""Decode at a context depth without paying for its prefill: the synthetic fill of `deltaship profile --contexts`.

A decode step's cost at depth c depends on how many KV rows attention reads, not on their values; the memory an app
holds at that depth is the KV rows it has written. So, per session, once:

1. a real prefill of a short random prompt (PREFIX tokens, or the smallest depth asked for if that is shorter)
   fills the DeltaNet states (conv and recurrent) and the first KV rows with what this model really computes;
2. for each depth c, in increasing order, the KV rows [filled, c) of every attention layer are written with
   synthetic rows: every element is drawn, independently, from the same KV head and channel of the real rows
   (a bootstrap of the real prefix), in the bundle's own KV dtype and bytes (int8 codes; int4 packed bytes, two
   codes a byte, drawn as bytes, so the packing needs no decoding). A block of BLOCK synthetic rows is drawn and
   repeated along the sequence. The DeltaNet states stay those of the real prefix: they are fixed-size, and a
   real prefix gives them a real norm;
3. the session is moved to position c (Session.seek) and single decode steps are timed there (each writes row c
   and reads rows 0 .. c); the process's resident set size (RSS, /proc/self/statm) is read after them.

The records say `fill: synthetic` and carry this description; tokens generated after such a fill mean nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any, Callable

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.stats import summarize

PREFIX = 256  # tokens of real prefill whose KV rows and DeltaNet states seed the fill
BLOCK = 4096  # synthetic rows drawn at a time, repeated along the sequence

FILL_NOTE = (
    "synthetic fill, not a prefill: a real prefill of a short random prompt sets the DeltaNet states and the first KV "
    "rows; the KV rows up to the depth are then drawn element by element from the same head and channel of those real "
    "rows (a bootstrap, in the bundle's KV dtype: int8 codes, int4 packed bytes), 4,096-row blocks repeated; "
    "one decode step is then timed at the depth"
)


FILLABLE = ("OnnxSession", "ExecuTorchSession")  # sessions whose KV buffers the fill can write


def fillable(session) -> bool:
    """Whether the synthetic fill can reach depths in this session (onnxruntime-genai's KV cache is its own)."""
    return type(session).__name__ in FILLABLE


class StateAccess:
    """The KV-cache tensors of a session as writable numpy views along their sequence axis, whatever the runtime."""

    def __init__(self, session):
        self.session = session
        self.kind = type(session).__name__
        if self.kind not in FILLABLE:
            raise DeltashipError(
                f"the synthetic context fill needs the KV buffers; {session.runtime_name()} does not expose them",
                "profile contexts in deltaship's own ONNX or ExecuTorch runtime (no --runtime)",
            )
        self.kv = [s for s in session.manifest["states"] if s["kind"].startswith("kv_cache")]
        if not self.kv:
            raise DeltashipError("this bundle has no KV cache to fill", "profile a bundle with attention layers")

    def _region(self, state: dict[str, Any]) -> tuple[int, int]:
        """(address, bytes) of the state's current buffer in this process's memory."""
        s = self.session
        if self.kind == "OnnxSession":
            a = s._bufs[state["name"]][s._cur[state["name"]]]
            return a.ctypes.data, a.nbytes
        t = s._state(state["buffer"])
        return t.data_ptr(), t.numel() * t.element_size()

    def release_kv(self) -> bool:
        """Give the zeroed KV buffers' whole pages back to the kernel (madvise MADV_DONTNEED: the pages read as
        zeros again, as after a reset, and are no longer resident), so that the resident set grows with the rows
        written, as an app's freshly allocated buffer does. Call right after a reset. False where it cannot
        (not Linux, or the buffers live on a GPU): the KV cache then counts whole in every RSS reading."""
        if sys.platform != "linux" or getattr(self.session, "device", "cpu") != "cpu":
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page, dontneed = mmap.PAGESIZE, 4  # MADV_DONTNEED on Linux
        for st in self.kv:
            addr, size = self._region(st)
            lo, hi = -(-addr // page) * page, (addr + size) // page * page
            if hi > lo and libc.madvise(lo, hi - lo, dontneed) != 0:
                return False
        return True

    def seq_axis(self) -> int:
        # ONNX: the canonical [1, Hkv, S, D]; ExecuTorch: its buffers are [1, S, Hkv, D]
        return 2 if self.kind == "OnnxSession" else 1

    def read_rows(self, state: dict[str, Any], rows: int) -> np.ndarray:
        """A copy of the state's first `rows` rows (only those: a whole 262K cache would be copied otherwise)."""
        s, ax = self.session, self.seq_axis()
        idx = [slice(None)] * len(state["shape"])
        idx[ax] = slice(0, rows)
        if self.kind == "OnnxSession":
            if s.device == "cpu":
                return s._bufs[state["name"]][s._cur[state["name"]]][tuple(idx)].copy()
            return s._vals[state["name"]][s._cur[state["name"]]].numpy()[tuple(idx)].copy()
        return s._state(state["buffer"])[tuple(idx)].numpy().copy()

    def write_span(self, state: dict[str, Any], start: int, stop: int, block: np.ndarray) -> None:
        """Write rows [start, stop) of the state, in place, with `block` (the state's layout) repeated."""
        s, ax = self.session, self.seq_axis()
        on_gpu = self.kind == "OnnxSession" and s.device != "cpu"
        if self.kind == "OnnxSession":
            val = s._vals[state["name"]][s._cur[state["name"]]]
            # CPU: the OrtValue wraps this numpy buffer, written where it is; GPU: one host copy, written back once
            dest = val.numpy() if on_gpu else s._bufs[state["name"]][s._cur[state["name"]]]
        else:
            import torch  # lazy: torch: only a session whose states are torch tensors

            dest = s._state(state["buffer"])
        for at in range(start, stop, block.shape[ax]):
            n = min(block.shape[ax], stop - at)
            idx = [slice(None)] * block.ndim
            idx[ax] = slice(at, at + n)
            part = np.take(block, np.arange(n), axis=ax)
            if self.kind == "OnnxSession":
                dest[tuple(idx)] = part
            else:
                dest[tuple(idx)].copy_(torch.from_numpy(part))
        if on_gpu:
            val.update_inplace(dest)


class SyntheticFill:
    """Fills one session's KV cache to increasing depths (see the module's docstring)."""

    def __init__(self, session, prefix: int, seed: int = 0):
        self.access = StateAccess(session)
        self.session = session
        self.rng = np.random.default_rng(seed)
        vocab = session.vocab_size
        prefix = max(1, min(prefix, session.max_context - 1))
        session.reset()
        self.released = self.access.release_kv()
        session.prefill(self.rng.integers(0, vocab, prefix).tolist())
        self.prefix = prefix
        self.filled = prefix
        ax = self.access.seq_axis()
        self.blocks = {}
        for st in self.access.kv:
            real = self.access.read_rows(st, prefix)  # the real rows
            self.blocks[st["name"]] = self._bootstrap(real, ax, min(BLOCK, session.max_context))

    def _bootstrap(self, real: np.ndarray, ax: int, rows: int) -> np.ndarray:
        """`rows` rows, each element drawn from the same head and channel of a random real row."""
        shape = list(real.shape)
        shape[ax] = rows
        pick = self.rng.integers(0, real.shape[ax], size=shape)
        return np.take_along_axis(real, pick, axis=ax)

    def fill_to(self, depth: int) -> int:
        """Write synthetic rows [filled, depth) of every KV state; returns the rows written."""
        if depth > self.session.max_context:
            raise DeltashipError(
                f"depth {depth} is past the bundle's max context of {self.session.max_context}",
                "pick a context below the bundle's max context",
            )
        start = self.filled
        for st in self.access.kv:
            if depth > start:
                self.access.write_span(st, start, depth, self.blocks[st["name"]])
        self.filled = max(self.filled, depth)
        return max(0, depth - start)


def sweep(
    session,
    contexts: list[int],
    repeat: Callable[..., list[float]],
    warmups: int,
    reps: int,
    min_seconds: float,
    rss: Callable[[], int],
    now: Callable[[], float],
    on_phase: Callable[[str], None] = lambda p: None,
    prefix: int = PREFIX,
) -> list[dict[str, Any]]:
    """decode_latency_s and rss_bytes at each depth (increasing), after the synthetic fill; raw records."""
    manifest = session.manifest
    memory = manifest.get("memory") or {}
    kv_dtype = memory.get("kv_dtype")
    per_token = (memory.get("kv_bytes_per_token") or {}).get(kv_dtype)
    dn_bytes = memory.get("deltanet_state_bytes")
    # the attention kernel's scratch per token and intra-op thread (ONNX Runtime, fp16 KV), with the session's
    # threads (None: the runtime's default, one per core)
    scratch = (memory.get("kv_scratch_bytes_per_token_per_thread") or {}).get(kv_dtype, 0)
    threads = getattr(session, "threads", None) or os.cpu_count() or 1
    out: list[dict[str, Any]] = []
    depths = sorted(c for c in contexts if c < session.max_context)
    for c in sorted(set(contexts) - set(depths)):
        out.append(
            {
                "metric": "decode_latency_s",
                "unit": "s",
                "context": c,
                "samples": [],
                "flags": ["skipped_over_max_context"],
            }
        )
    if not depths:
        return out
    on_phase("context_fill")
    filler = SyntheticFill(session, min(prefix, depths[0]))
    base_rss = rss()  # the KV pages released, the real prefix's rows written
    fill_info = {
        "fill": "synthetic",
        "fill_prefix_tokens": filler.prefix,
        "kv_pages_released": filler.released,
        "kv_dtype": kv_dtype,
        "note": FILL_NOTE,
    }
    for c in depths:
        on_phase(f"context_{c}")
        t0 = now()
        filler.fill_to(c)
        fill_s = now() - t0
        tok = 1

        def step() -> float:
            session.position = c  # every step reads rows 0 .. c-1 and writes row c
            t = now()
            session.decode(tok)
            return now() - t

        samples = repeat(step, warmups, reps, min_seconds)
        lat = {
            "metric": "decode_latency_s",
            "unit": "s",
            "context": c,
            "samples": samples,
            **summarize(samples),
            **fill_info,
            "fill_s": fill_s,
            "position_seen": session.position - 1,
        }
        out.append(lat)
        resident = rss()
        mem = {
            "metric": "rss_bytes",
            "unit": "bytes",
            "context": c,
            "samples": [resident],
            **summarize([resident]),
            "flags": [],
            **fill_info,
            "rss_after_prefix_bytes": base_rss,
            "note": "resident set size (/proc/self/statm) after the decode steps at this depth; "
            "rss_after_prefix_bytes: after the real prefix, before the synthetic rows",
        }
        if per_token is not None and dn_bytes is not None:  # the manifest's arithmetic at this depth (rows 0 .. c)
            mem["manifest_kv_bytes"] = int((c + 1) * per_token)
            mem["manifest_state_bytes"] = int(dn_bytes + (c + 1) * per_token)
            mem["manifest_kv_bytes_past_prefix"] = int((c + 1 - filler.prefix) * per_token)
            if scratch:
                mem["manifest_kv_scratch_bytes_past_prefix"] = int((c + 1 - filler.prefix) * scratch * threads)
                mem["threads"] = threads
        out.append(mem)
    return out
