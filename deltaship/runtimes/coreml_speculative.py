"""The Core ML session's speculative-decoding calls (deltaship/runtimes/speculative.py) for packages exported with
--mtp: fixed-shape functions `verify_T` (T tokens in; every row's logits and hidden states out; the decoder's
states) and `mtp_draft` (the MTP head over one position, its own KV cache). A call of any length runs as a sum of
the verify sizes, largest first. Snapshot / restore copy the DeltaNet states: the io arrays the session holds, and
for Core ML states their buffers (the evaluator's arrays; MLState.read_state / write_state on macOS)."""

from __future__ import annotations

from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Checkpoint


class CoreMLSpeculation:
    """Mixed into the Core ML sessions; needs parts, _io, _run, _take_outputs, manifest and position."""

    def _block(self) -> dict[str, Any]:
        block = self.manifest.get("speculative")
        if not block:
            raise DeltashipError(
                f"{self.bundle}: no verify/draft functions in this package", "export it again with --mtp"
            )
        return block

    def verify(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run ids [T] at self.position (not advanced): logits [len(rows), V] after each row and hidden states
        [T, H] of every position."""
        functions = {int(t): f for t, f in self._block()["verify"]["functions"].items()}
        sizes = sorted(functions, reverse=True)
        part = self.parts[0]
        ids = np.asarray(ids, np.int64).reshape(-1)
        rows = np.asarray(rows, np.int64).reshape(-1) % ids.size
        logits: list[np.ndarray] = []
        hidden: list[np.ndarray] = []
        start = 0
        while start < ids.size:
            t = next(s for s in sizes if s <= ids.size - start)
            feeds = {
                "input_ids": ids[start : start + t].reshape(1, -1).astype(np.int32),
                "position": np.array([self.position + start], np.int32),
            }
            for s in part["state_specs"]:
                if s["mode"] == "io":
                    feeds[s["coreml_input"]] = self._io[s["name"]]
            out = self._run(0, functions[t], feeds)
            self._take_outputs(part, out)  # the io states
            logits.append(np.asarray(out["logits"], np.float32).reshape(t, -1))
            hidden.append(np.asarray(out["hidden_states"], np.float32).reshape(t, -1))
            start += t
        return np.concatenate(logits)[rows], np.concatenate(hidden)

    def _deltanet(self) -> list[dict]:
        return [s for s in self.manifest["states"] if s["kind"].startswith("deltanet")]

    def snapshot(self) -> dict[str, Any]:
        """Copies of the DeltaNet states (the KV caches keep theirs: their length pointer is the position)."""
        snap: dict[str, Any] = {"position": self.position, "io": {}, "state": {}}
        for s in self._deltanet():
            if s["mode"] == "io":
                snap["io"][s["name"]] = self._io[s["name"]].copy()
            else:
                snap["state"][s["coreml_input"]] = self._read_state(s["coreml_input"])
        return snap

    def restore(self, snap) -> None:
        """Put back a `snapshot()`; a session Checkpoint (Session.checkpoint) goes to Session.restore."""
        if isinstance(snap, Checkpoint):
            return super().restore(snap)
        for name, value in snap["io"].items():
            self._io[name] = value.copy()
        for name, value in snap["state"].items():
            self._write_state(name, value)
        self.position = snap["position"]

    def reset_draft(self) -> None:
        self._draft_io = {}
        for s in self._block()["draft"]["states"]:
            if s["mode"] == "io":
                self._draft_io[s["name"]] = np.zeros(s["shape"], np.float32)
        self._reset_draft_states()

    def draft(self, hidden: np.ndarray, ids: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        """The MTP head over hidden [T, H] at positions position .. position+T-1 and ids [T] (the tokens one
        position later), one position per call of the fixed-shape function: logits [V] for the token after the
        last one, and the head's hidden states [T, H]."""
        block = self._block()["draft"]
        if not hasattr(self, "_draft_io"):
            self.reset_draft()
        hidden = np.asarray(hidden, np.float32).reshape(len(np.asarray(ids).reshape(-1)), -1)
        ids = np.asarray(ids, np.int64).reshape(-1)
        outs, logits = [], None
        for i in range(ids.size):
            feeds = {
                "hidden_states": hidden[i].reshape(1, 1, -1),
                "input_ids": ids[i : i + 1].reshape(1, 1).astype(np.int32),
                "position": np.array([position + i], np.int32),
            }
            for s in block["states"]:
                if s["mode"] == "io":
                    feeds[s["coreml_input"]] = self._draft_io[s["name"]]
            out = self._run_draft(block["function"], feeds)
            for s in block["states"]:
                if s["mode"] == "io":
                    self._draft_io[s["name"]] = np.asarray(out[s["coreml_output"]], np.float32)
            logits = np.asarray(out["logits"], np.float32).reshape(-1)
            outs.append(np.asarray(out["mtp_hidden_states"], np.float32).reshape(1, -1))
        return logits, np.concatenate(outs)
