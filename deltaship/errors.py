"""One error type for everything a user can get wrong.

Every message says what went wrong and where; `fix` says what to do about it. The CLI
prints both and exits with status 2; nothing is written when one is raised.
"""

from __future__ import annotations


class DeltashipError(Exception):
    """A problem with the user's input or environment, with the fix spelled out."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"


class DeltashipUnavailable(DeltashipError):
    """The bundle is fine but the runtime installed here cannot run it (e.g. too old for its opset):
    export-time verification records it as skipped, with this message, instead of failing."""
