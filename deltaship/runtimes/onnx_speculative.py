"""The ONNX session's speculative-decoding calls (deltaship/runtimes/speculative.py) for bundles exported with
--mtp: `verify` through the decoder's logit_rows / logits_rows / hidden_states I/O, the draft head in mtp.onnx,
and DeltaNet state snapshots (host copies of the current buffers)."""

from __future__ import annotations

from typing import Any

import numpy as np

from deltaship.errors import DeltashipError

_VERIFY_WIDTH = 4096


class OnnxSpeculation:
    """Mixed into OnnxSession; needs its sess, states, _vals, _cur, _bufs and position."""

    _draft_sess: Any = None
    _verify_positions: np.ndarray | None = None

    def verify(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run ids [T] at self.position (the position is not advanced): logits [len(rows), V] after each row and
        hidden states [T, H] of every position."""
        if "speculative" not in self.manifest:
            raise DeltashipError(f"{self.bundle}: no verify outputs in this bundle", "export it again with --mtp")
        io = self.sess.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64).reshape(1, -1))
        # ONNX Runtime keys its memory patterns by the XOR of all input dims: input_ids [1, T] and logit_rows [T]
        # cancel out, so position_ids (only element 0 is read) gets a width of its own per T, apart from the
        # widths plain calls give (1): each verify length keeps its own pattern
        width = _VERIFY_WIDTH + ids.size
        if self._verify_positions is None or self._verify_positions.shape[1] < width:
            self._verify_positions = np.zeros((1, _VERIFY_WIDTH + self.prefill_chunk + 1), np.int64)
        self._verify_positions[0, 0] = self.position
        io.bind_cpu_input("position_ids", self._verify_positions[:, :width])
        # an overridable initializer (default [-1]): bind_cpu_input does not find it, an OrtValue binds
        rows_value = self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rows, np.int64))
        io.bind_ortvalue_input("logit_rows", rows_value)
        for s in self.states:
            vals, cur = self._vals[s["name"]], self._cur[s["name"]]
            io.bind_ortvalue_input(s["name"], vals[cur])
            io.bind_ortvalue_output(s["output"], vals[(cur + 1) % len(vals)])
        io.bind_output("logits_rows")
        io.bind_output("hidden_states")
        self.sess.run_with_iobinding(io)
        for s in self.states:
            self._cur[s["name"]] = (self._cur[s["name"]] + 1) % len(self._vals[s["name"]])
        values = io.get_outputs()  # in binding order: the states, then logits_rows and hidden_states
        return values[-2].numpy()[0], values[-1].numpy()[0]

    def snapshot(self) -> dict[str, Any]:
        """Copies of the DeltaNet states (the KV caches keep their buffers) and the position."""
        if self.device != "cpu":
            raise DeltashipError(
                f"speculative decoding snapshots the DeltaNet states on the host; this session runs on {self.device}",
                "use the CPU provider for --speculative",
            )
        snap = {"position": self.position}
        for s in self.states:
            if s["kind"].startswith("deltanet"):
                snap[s["name"]] = self._bufs[s["name"]][self._cur[s["name"]]].copy()
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        for s in self.states:
            if s["name"] in snap:
                self._bufs[s["name"]][self._cur[s["name"]]][...] = snap[s["name"]]
        self.position = snap["position"]

    def _draft_session(self):
        if self._draft_sess is None:
            from deltaship.runtimes.onnx import _options

            block = self.manifest["speculative"]["draft"]
            self._draft_sess = self._ort.InferenceSession(
                str(self.bundle / block["file"]),
                sess_options=_options(self._ort, self.threads, None),
                providers=["CPUExecutionProvider"],
            )
            self._draft_states = block["states"]
            self._draft_bufs = {s["name"]: np.zeros(s["shape"], np.dtype(s["dtype"])) for s in self._draft_states}
            self._draft_vals = {n: self._ort.OrtValue.ortvalue_from_numpy(a) for n, a in self._draft_bufs.items()}
        return self._draft_sess

    def reset_draft(self) -> None:
        self._draft_session()
        for a in self._draft_bufs.values():
            a[...] = 0

    def draft(self, hidden: np.ndarray, ids: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        """The MTP head over hidden [T, H] at positions position .. position+T-1 and ids [T] (the tokens one
        position later): logits [V] for the token after the last one, and the head's hidden states [T, H]."""
        sess = self._draft_session()
        io = sess.io_binding()
        io.bind_cpu_input("hidden_states", np.ascontiguousarray(hidden, np.float32)[None])
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64).reshape(1, -1))
        io.bind_cpu_input("position", np.array([position], np.int64))
        for s in self._draft_states:  # GroupQueryAttention writes the new positions into the buffer it reads
            io.bind_ortvalue_input(s["name"], self._draft_vals[s["name"]])
            io.bind_ortvalue_output(s["output"], self._draft_vals[s["name"]])
        io.bind_output("logits")
        io.bind_output("mtp_hidden_states")
        sess.run_with_iobinding(io)
        values = io.get_outputs()
        return values[-2].numpy().reshape(-1), values[-1].numpy()[0]
