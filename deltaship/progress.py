"""Progress of a long command (export, profile) on stderr, for a person at a terminal and for a log.

At a terminal, rich draws a live status line (spinner, elapsed time, the current step's detail, e.g.
the tensor being streamed) under the finished steps. In a log (stderr is not a terminal: CI, nohup, a
pipe) every step is a plain timestamped line and a step's detail is written at most every `every`
seconds, so a long step is never silent and the log stays free of control characters.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`say(msg)` for a step, `say(msg, inline=True)` for detail inside the current step, `done()` at the end."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, every: float = 10.0):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.every = every
        self.t0 = time.monotonic()
        self._last_detail = float("-inf")
        self._status = None
        self._console = None
        if enabled and self.stream.isatty():
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False)

    def _stamp(self, msg: str) -> str:
        return f"[{time.monotonic() - self.t0:6.1f}s] {msg}"

    def __call__(self, msg: str, inline: bool = False) -> None:
        if not self.enabled:
            return
        if self._console is not None:
            if inline:
                if self._status is None:
                    self._status = self._console.status("", spinner="dots")
                    self._status.start()
                self._status.update(self._stamp(msg.strip()))
            else:
                self.done()
                self._console.print(self._stamp(msg), markup=False)
            return
        now = time.monotonic()
        if inline and now - self._last_detail < self.every:
            return
        if inline:
            self._last_detail = now
        self.stream.write(self._stamp(msg) + "\n")
        self.stream.flush()

    def done(self) -> None:
        """End the current step's live detail (a terminal's status line)."""
        if self._status is not None:
            self._status.stop()
            self._status = None
