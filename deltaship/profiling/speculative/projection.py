"""The projection: decode tokens/s that measured per-call costs give at a stated acceptance rate, simulating the
speculative driver's calls (deltaship/runtimes/speculative.py). A projection, labelled as such, never a measurement."""

from __future__ import annotations

from typing import Any

import numpy as np

from deltaship.runtimes.speculative import MAX_PENDING

# the trained tiny head's measured depth-1 acceptance (int4 ONNX, 8 held-out prompts x 128 greedy tokens)
PROJECTION_ACCEPTANCE = 0.75
PROJECTION_SOURCE = (
    "qwen3.5-tiny's trained MTP head, measured: depth-1 acceptance 0.752 (fp32) / 0.766 (int4) over 8 held-out "
    "prompts x 128 greedy tokens (docs/results/mtp.md)"
)


def _cost(table: dict[int, float]):
    """ms of a call of n tokens/positions: the measured value, or a straight line through the two longest measured
    calls beyond them (calls grow about linearly with their length once past the bandwidth-bound few)."""
    xs = sorted(table)

    def at(n: int) -> float:
        if n in table:
            return table[n]
        a, b = xs[-2], xs[-1]
        return table[b] + (n - b) * (table[b] - table[a]) / (b - a)

    return at


def project(costs: dict[str, Any], depth: int, acceptance: float, calls: int = 20000, seed: int = 0) -> dict[str, Any]:
    """Decode speed from measured per-call costs (ms) at an acceptance rate: the driver's calls simulated with each
    draft accepted with probability `acceptance`, independently. costs: decode (one step), verify {T: ms},
    draft {P: ms}, snapshot, restore, and rollback_to_first where the session has it (a call that fed the newest
    token and its drafts keeps its first token when the first draft is rejected: no snapshot at depth 1, no
    re-fed tokens)."""
    first = costs.get("rollback_to_first")  # None: the session rolls back by snapshot only

    verify, draft = (
        _cost({int(k): v for k, v in costs["verify"].items()}),
        _cost({int(k): v for k, v in costs["draft"].items()}),
    )
    rng = np.random.default_rng(seed)
    pending, emitted_before, total_ms, tokens = 1, 1, 0.0, 0
    for _ in range(calls):
        ms = draft(emitted_before) + (depth - 1) * draft(1) + verify(pending + depth)
        ms += 0.0 if first is not None and depth == 1 and pending == 1 else costs["snapshot"]
        ok = rng.random(depth) < acceptance
        accepted = depth if ok.all() else int(np.argmin(ok))
        tokens += accepted + 1
        if accepted == depth:
            pending = 1
        elif first is not None and accepted == 0 and pending == 1:
            ms += first
        else:  # restore; the accepted tokens and the decoder's own ride along with the next call
            ms += costs["restore"]
            pending += accepted + 1
            if pending - 1 > MAX_PENDING:
                ms += verify(pending - 1)
                pending = 1
        emitted_before = accepted + 1
        total_ms += ms
    ms_per_token = total_ms / tokens
    return {
        "acceptance": acceptance,
        "tokens_per_verify": round(tokens / calls, 4),
        "ms_per_token": round(ms_per_token, 4),
        "tokens_per_s": round(1e3 / ms_per_token, 2),
        "tokens_per_s_plain": round(1e3 / costs["decode"], 2),
        "speedup": round(costs["decode"] / ms_per_token, 4),
    }
