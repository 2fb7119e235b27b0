"""The ExecuTorch session's speculative-decoding calls (deltaship/runtimes/speculative.py) for .pte programs exported
with --mtp: `verify` and `mtp_draft` are methods of the same program. 'verify' reads and writes the very buffers
'forward' does (exported with share_mutable_buffers); the snapshot copies the DeltaNet buffers out through the
method's attributes (the program's own memory) and the restore copies them back in place."""

from __future__ import annotations

from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Checkpoint


class ExecuTorchSpeculation:
    """Mixed into ExecuTorchSession; needs its program, method, _torch, manifest and position."""

    _verify_method: Any = None
    _draft_method: Any = None

    def _program_method(self, part: str):
        block = self.manifest.get("speculative")
        if not block:
            raise DeltashipError(
                f"{self.bundle}: no verify/draft methods in this program", "export it again with --mtp"
            )
        return self.program.load_method(block[part]["program_method"])

    def verify(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run ids [T] at self.position (not advanced): logits [len(rows), V] after each row and hidden states
        [T, H] of every position. The method takes at most prefill_chunk tokens: a longer call runs in chunks."""
        if self._verify_method is None:
            self._verify_method = self._program_method("verify")
        t = self._torch
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        rows = np.asarray(rows, np.int64).reshape(-1) % ids.size
        logits: list[np.ndarray] = []
        hidden: list[np.ndarray] = []
        for start in range(0, ids.size, self.prefill_chunk):
            part = ids[start : start + self.prefill_chunk]
            mine = rows[(rows >= start) & (rows < start + part.size)] - start
            out = self._verify_method.execute(
                [
                    t.from_numpy(part.reshape(1, -1)),
                    t.tensor([self.position + start], dtype=t.long),
                    t.from_numpy(mine if mine.size else np.array([part.size - 1], np.int64)),
                ]
            )
            if mine.size:
                logits.append(out[0][0].float().numpy().copy())
            hidden.append(out[1][0].float().numpy().copy())
        return np.concatenate(logits), np.concatenate(hidden)

    def snapshot(self) -> dict[str, Any]:
        """Copies of the DeltaNet buffers (the KV caches keep theirs) and the position."""
        snap: dict[str, Any] = {"position": self.position}
        for s in self.manifest["states"]:
            if s["kind"].startswith("deltanet"):
                snap[s["buffer"]] = self._state(s["buffer"]).clone()
        return snap

    def restore(self, snap) -> None:
        """Put back a `snapshot()`; a session Checkpoint (Session.checkpoint) goes to Session.restore."""
        if isinstance(snap, Checkpoint):
            return super().restore(snap)
        for name, value in snap.items():
            if name != "position":
                self._state(name).copy_(value)
        self.position = snap["position"]

    def reset_draft(self) -> None:
        if self._draft_method is None:
            self._draft_method = self._program_method("draft")
        for s in self.manifest["speculative"]["draft"]["states"]:
            self._draft_method._method.get_attribute(s["buffer"]).zero_()

    def draft(self, hidden: np.ndarray, ids: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        """The MTP head over hidden [T, H] at positions position .. position+T-1 and ids [T] (the tokens one
        position later): logits [V] for the token after the last one, and the head's hidden states [T, H]."""
        if self._draft_method is None:
            self.reset_draft()
        t = self._torch
        hidden = np.ascontiguousarray(hidden, np.float32)
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        outs = []
        for start in range(0, ids.size, self.prefill_chunk):  # the method takes at most prefill_chunk positions
            outs.append(
                self._draft_method.execute(
                    [
                        t.from_numpy(hidden[start : start + self.prefill_chunk][None]),
                        t.from_numpy(ids[start : start + self.prefill_chunk].reshape(1, -1)),
                        t.tensor([position + start], dtype=t.long),
                    ]
                )
            )
        logits = outs[-1][0].reshape(-1).float().numpy().copy()
        return logits, np.concatenate([o[1][0].float().numpy() for o in outs])
