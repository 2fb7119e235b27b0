"""One error family for everything a user can get wrong, and for what the machine cannot give.

Every message says what went wrong and where; `fix` says what to do about it. The CLI prints both
and exits with the error's `exit_code` (docs/reliability.md lists them); nothing is written when
one is raised. The Python API raises these, never `SystemExit`.
"""

from __future__ import annotations

# Exit codes of the `deltaship` command (docs/reliability.md).
EXIT_BAD_INPUT = 2  # the user's input: an option, a checkpoint, a bundle, a file
EXIT_ENVIRONMENT = 3  # the machine: disk full, out of memory, permissions, a busy resource
EXIT_INTERNAL = 1  # a deltaship bug: an exception nobody expected (`deltaship --debug ...` shows the traceback)
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (`deltaship inspect B | head -1`): 128 + SIGPIPE, as a shell says
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class DeltashipError(Exception):
    """A problem with the user's input, with the fix spelled out."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"


class DeltashipEnvironmentError(DeltashipError):
    """The input is fine but the machine is not: disk full, memory, permissions, a lock held by
    another process. Exit code 3."""

    exit_code = EXIT_ENVIRONMENT


class DeltashipRunError(DeltashipError):
    """A runtime failed in the middle of a run: exit 2 when the bundle's content caused it (a shape, a context, a
    vocabulary that disagrees with the graph), 3 when the machine did (memory, disk, a missing library).
    `output_ids` are the tokens produced before it (and `text` their decoding, where a tokenizer was at hand): the
    CLI prints them to stdout before the error."""

    def __init__(self, message: str, fix: str | None, exit_code: int, output_ids: list[int]):
        super().__init__(message, fix)
        self.exit_code = exit_code
        self.output_ids = list(output_ids)
        self.text: str | None = None


class DeltashipUnavailable(DeltashipError):
    """The bundle is fine but the runtime installed here cannot run it (e.g. too old for its opset):
    export-time verification records it as skipped, with this message, instead of failing."""
