"""What the ONNX Runtime sessions (the decoder's, the MTP draft head's, the vision tower's) share: their
SessionOptions, and the decoder's position inputs in either of the forms a bundle takes them."""

from __future__ import annotations

from typing import Any

import numpy as np

from deltaship.logs import ort_log_severity


def session_options(
    ort,
    threads: int | None,
    profile_prefix: str | None,
    strict: bool = False,
    turn_taking: bool = False,
):
    opts = ort.SessionOptions()
    opts.log_severity_level = ort_log_severity()  # its warnings are about the graph, not the user's input
    if threads:
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    if strict:
        opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if turn_taking:
        # a session that takes turns with another call after call (speculative decoding: the draft head's and the
        # decoder's): its intra-op threads stop spinning when a call returns, or they take the cores from the other
        # session's call. 822ab80:bench/speculative/onnx_spinning.py, 0.8B int4, 2 threads, 4 alternated runs each:
        # speculative decoding at an imposed acceptance of 0.776 ran 18.1 tok/s spinning, 28.8 stopping; plain decoding
        # 26.1 and 24.8
        # (within the runs' spread, but kept for sessions that do not take turns: docs/results/mtp.md)
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    return opts


def counts_positions(manifest: dict[str, Any]) -> bool:
    """Whether the bundle's decoder takes its start position as onnxruntime-genai's sequence-length pair
    (current_sequence_length int32 [1] = p + T, past_sequence_length int32 [1, 1] = p + T - 1), as bundles do
    now; older ones take position_ids int64 [1, T] (only element 0, p, is read)."""
    return any(i.get("kind") == "current_sequence_length" for i in manifest.get("inputs", []))


KEEP_ROWS = "num_logits_to_keep"  # an --mtp decoder's input (kind logits_to_keep); a plain call feeds [0]


def keeps_rows(manifest: dict[str, Any]) -> bool:
    """Whether the decoder takes num_logits_to_keep (--mtp bundles that compute their verify rows in the graph)."""
    return any(i.get("kind") == "logits_to_keep" for i in manifest.get("inputs", []))


def position_feeds(counted: bool, position: int, tokens: int) -> dict[str, np.ndarray]:
    """The position inputs of a call of `tokens` tokens starting at `position`, in either form."""
    if counted:
        end = position + tokens
        return {
            "current_sequence_length": np.array([end], np.int32),
            "past_sequence_length": np.array([[end - 1]], np.int32),
        }
    # [[p]] only: the graph reads element 0, and ONNX Runtime keys its memory patterns by the XOR of all input
    # dims, in which input_ids [1, T] and position_ids [1, T] would cancel out
    return {"position_ids": np.array([[position]], np.int64)}


class DecodeInputs:
    """The inputs of a one-token call, each a preallocated OrtValue on `device`: input_ids int64 [1, 1] and the
    position, as current_sequence_length int32 [1] and past_sequence_length int32 [1, 1] (counted=True) or as
    position_ids int64 [1, 1] (older bundles).

    set() writes the values in place, so the buffers keep their addresses: a decode IOBinding made once keeps
    reading them, and a captured CUDA graph reads its inputs from the addresses it was captured with. On the CPU
    the OrtValues wrap numpy arrays (ortvalue_from_numpy shares host memory), which set() writes directly; on a
    device it copies host arrays in (OrtValue.update_inplace)."""

    def __init__(self, ort, device: str = "cpu", counted: bool = True, keep_rows: bool = False, tokens: int = 1):
        self.device = device
        self.counted = counted
        self.tokens = tokens
        args = ("cuda", 0) if device == "cuda" else ()
        self._host = {"input_ids": np.zeros((1, tokens), np.int64), **position_feeds(counted, 0, tokens)}
        if keep_rows:  # an --mtp decoder's num_logits_to_keep: [0], the last row (export/onnx/mtp.py); a verify
            # call's [T] copies of its row count
            self._host[KEEP_ROWS] = np.zeros(1 if tokens == 1 else tokens, np.int64)
        # num_logits_to_keep stays on the host: a capture graph reads it on the CPU only (shape arithmetic)
        self.values = {
            n: ort.OrtValue.ortvalue_from_numpy(a, *(() if n == KEEP_ROWS else args)) for n, a in self._host.items()
        }
        self.input_ids = self.values["input_ids"]

    def set(self, token: int, position: int) -> None:
        self.set_many(np.array([token]), position)

    def set_many(self, ids: np.ndarray, position: int, keep: int | None = None) -> None:
        """ids [T] at `position`; keep: num_logits_to_keep's value (an --mtp decoder; 0 when not given)."""
        h = self._host
        h["input_ids"][0, :] = ids
        if self.counted:
            h["current_sequence_length"][0] = position + self.tokens
            h["past_sequence_length"][0, 0] = position + self.tokens - 1
        else:
            h["position_ids"][0, 0] = position
        if KEEP_ROWS in h:
            h[KEEP_ROWS][:] = keep or 0
        if self.device != "cpu":
            for name, value in self.values.items():
                if name != KEEP_ROWS:
                    value.update_inplace(h[name])
