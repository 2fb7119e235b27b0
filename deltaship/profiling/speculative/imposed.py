"""A session proxy that imposes an acceptance rate on the speculative driver, to time its real calls on a bundle
whose own head accepts nothing."""

from __future__ import annotations

from typing import Any

import numpy as np

from deltaship.runtimes.speculative import rolls_back_to_first


class ImposedAcceptance:
    """A session (delegating everything) whose verify calls come back with each row's next fed token made the row's
    argmax or not by a shuffled schedule that accepts round(100 rate) of every 100 rows: greedy speculative decoding
    then accepts drafts at that rate, in random order. It times the driver's real calls (draft, verify, rollback) on a
    bundle whose own head accepts nothing (random weights); the tokens it emits mean nothing. Rows are rigged only
    in calls that ask for every row (the driver's verify calls; prefill asks for the last row only)."""

    def __init__(self, session: Any, rate: float, seed: int = 0, rollback: bool = True):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_rate", rate)
        object.__setattr__(self, "_rollback", rollback)  # False: undo rejections by snapshot even where it could not
        object.__setattr__(self, "_rng", np.random.default_rng(seed))
        object.__setattr__(self, "_schedule", [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def __setattr__(self, name: str, value: Any) -> None:  # the driver moves session.position
        setattr(self._session, name, value)

    def can_rollback_to_first(self) -> bool:
        return self._rollback and rolls_back_to_first(self._session)

    def verify(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, hidden = self._session.verify(ids, rows)
        if len(rows) == ids.size:
            logits = np.array(logits)
            for j in range(ids.size - 1):
                row, tok = logits[j], int(ids[j + 1])
                if not self._schedule:
                    block = np.arange(100) < round(100 * self._rate)
                    self._schedule.extend(self._rng.permutation(block).tolist())
                row[tok] = row.max() + 1.0 if self._schedule.pop() else row.min() - 1.0
        return logits, hidden
