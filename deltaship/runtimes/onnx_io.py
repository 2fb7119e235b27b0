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
        # session's call. bench/speculative/onnx_spinning.py, 0.8B int4, 2 threads, 4 alternated runs each:
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
