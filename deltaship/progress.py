"""Progress of a long command (export, profile) on stderr, for a person at a terminal and for a log.

At a terminal, rich draws a live status line (spinner, elapsed time, the current step's detail, e.g.
the tensor being streamed) under the finished steps. In a log (stderr is not a terminal: CI, nohup, a
pipe) every step is a plain timestamped line and a step's detail is written only once `every` seconds
have passed without a line, so a long step is never silent, a short one adds no line, and the log stays
free of control characters. A step that reports nothing itself (a toolchain's lowering) runs under
`heartbeat()`, which reports its elapsed time from a thread.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, TextIO


class Progress:
    """`say(msg)` for a step, `say(msg, inline=True)` for detail inside the current step, `done()` at the end."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, every: float = 10.0):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.every = every
        self.t0 = time.monotonic()
        self._last_line = time.monotonic()
        self._lock = threading.Lock()  # heartbeat() reports from a thread
        self._status = None
        self._console = None
        if enabled and self.stream.isatty():
            from rich.console import Console  # lazy: rich

            self._console = Console(file=self.stream, highlight=False)

    def _stamp(self, msg: str) -> str:
        return f"[{time.monotonic() - self.t0:6.1f}s] {msg}"

    def __call__(self, msg: str, inline: bool = False) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._say(msg, inline)

    def _say(self, msg: str, inline: bool) -> None:
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
        if inline and now - self._last_line < self.every:
            return
        self._last_line = now
        self.stream.write(self._stamp(msg) + "\n")
        self.stream.flush()

    def done(self) -> None:
        """End the current step's live detail (a terminal's status line)."""
        if self._status is not None:
            self._status.stop()
            self._status = None


@contextlib.contextmanager
def heartbeat(say: Callable[[str], None] | None, label: str, every: float = 1.0) -> Iterator[None]:
    """Report `label, N s` through `say` every `every` seconds while the block runs (from a thread): for a step
    inside a toolchain that reports nothing itself, e.g. ExecuTorch's lowering to XNNPACK. Pass an inline `say`
    (`lambda m: progress(m, inline=True)`): a terminal redraws its status line, a log gets a line every ~10 s."""
    if say is None:
        yield
        return
    stop = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            say(f"{label}, {time.monotonic() - t0:.0f} s")

    thread = threading.Thread(target=beat, name=f"deltaship heartbeat: {label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
