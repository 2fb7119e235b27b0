"""What a failure that reached the `deltaship` command tells the user: one line of what went wrong, one of the fix,
and an exit code (deltaship/errors.py: 2 the input, 3 the machine, 1 a deltaship bug). deltaship/cli.py's main()
is the one caller; the Python API raises, and leaves this to its caller."""

from __future__ import annotations

import errno
import os
import select
import sys

from deltaship.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTERNAL, DeltashipError, DeltashipRunError

# OSErrors that are the machine's, not the input's: exit 3 with the path and what to do about it
_ENVIRONMENT_FIXES = {
    errno.ENOSPC: "free space on that filesystem (or write somewhere else) and run again",
    errno.EDQUOT: "free space within your disk quota (or write somewhere else) and run again",
    errno.EROFS: "that filesystem is read-only: write somewhere else",
    errno.EACCES: "check its permissions (ls -l), or write somewhere else",
    errno.EPERM: "check its permissions and ownership, or write somewhere else",
    errno.EBUSY: "another process is using it: wait for it to finish (or stop it) and run again",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.EMFILE: "raise the open-file limit (ulimit -n) and run again",
    errno.ENFILE: "the system's open-file table is full: close other programs and run again",
}
# OSErrors that mean the user named something that is not there, or not what it should be: exit 2
_INPUT_FIXES = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "check the path: a part of it is a file, not a directory",
    errno.EISDIR: "pass a file, not a directory",
}


def os_error(e: OSError) -> tuple[int, str, str]:
    """An OSError as (exit code, what, fix), naming the file it is about."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = f"{where}: {e.strerror or e}" if where else (e.strerror or str(e))
    if e.errno in _INPUT_FIXES:
        return EXIT_BAD_INPUT, what, _INPUT_FIXES[e.errno]
    fix = _ENVIRONMENT_FIXES.get(e.errno, "check the file, device or connection named and run again")
    return EXIT_ENVIRONMENT, what, fix


def _out_of_memory(e: BaseException) -> bool:
    """A toolchain's own out-of-memory error: torch's OutOfMemoryError and allocator RuntimeErrors, ONNX Runtime's
    failed allocations (its RuntimeException/Fail), ExecuTorch's MemoryAllocationFailed."""
    text = str(e).lower()
    return type(e).__name__ == "OutOfMemoryError" or (
        (isinstance(e, RuntimeError) or type(e).__module__.startswith("onnxruntime"))
        and any(
            s in text
            for s in ("out of memory", "can't allocate memory", "failed to allocate", "bad_alloc", "memoryallocation")
        )
    )


def describe(e: BaseException) -> tuple[int, str, str | None]:
    """What a failure that reached main() tells the user: (exit code, what went wrong, the fix)."""
    if isinstance(e, DeltashipError):
        return e.exit_code, e.message, e.fix
    if isinstance(e, MemoryError) or _out_of_memory(e):
        return (
            EXIT_ENVIRONMENT,
            "ran out of memory" + (f" ({type(e).__name__}: {e})" if str(e) else ""),
            "close other programs, or use a smaller model, a lower --precision or a shorter --max-context "
            "(`deltaship plan` shows what fits)",
        )
    if isinstance(e, OSError):
        return os_error(e)
    if isinstance(e, UnicodeEncodeError):
        return (
            EXIT_ENVIRONMENT,
            f"cannot write this text in the {e.encoding} encoding ({e.reason})",
            "use a UTF-8 locale, or set PYTHONIOENCODING=utf-8",
        )
    if isinstance(e, UnicodeError):
        return EXIT_BAD_INPUT, f"text that is not valid UTF-8: {e}", "pass UTF-8 text, and save files as UTF-8"
    if type(e).__module__.startswith("onnxruntime"):  # Fail, InvalidGraph, InvalidArgument, ... while running
        return (
            EXIT_BAD_INPUT,
            f"ONNX Runtime could not run the bundle: {type(e).__name__}: {e}",
            "check it with `deltaship inspect BUNDLE` and export it again with this version of deltaship",
        )
    return (
        EXIT_INTERNAL,
        f"internal error: {type(e).__name__}: {e}",
        "this is a deltaship bug; rerun with --debug (deltaship --debug ...) and report the traceback",
    )


def run_failure(e: BaseException, output_ids: list[int] | None) -> DeltashipRunError | None:
    """A runtime's exception in the middle of a run, as one DeltashipRunError carrying the tokens produced so far:
    the machine's (memory, an OSError's errno, a missing library) exit 3, anything else the runtime raised while
    running the bundle (ONNX Runtime's errors and RuntimeErrors, ExecuTorch's) exit 2. None for a DeltashipError
    (already one) and for any other exception: a deltaship bug stays exit 1. output_ids None: not known."""
    if isinstance(e, DeltashipError):
        return None
    if isinstance(e, ImportError):
        code, what, fix = EXIT_ENVIRONMENT, f"a library the runtime needs is missing ({e})", "reinstall the runtime"
    else:
        code, what, fix = describe(e)
        if code == EXIT_INTERNAL:
            if not isinstance(e, RuntimeError):
                return None
            what = f"the runtime failed while running the bundle ({type(e).__name__}: {e})"
            code, fix = EXIT_BAD_INPUT, "check it with `deltaship inspect BUNDLE`, and export it again"
    what = " ".join(what.split())[:1000]  # one line, however long the runtime's message
    if output_ids is None:  # a driver that keeps its tokens to itself (speculative, image + text)
        return DeltashipRunError(what, fix, code, [])
    n = len(output_ids)
    return DeltashipRunError(f"{what}; after {n} new token{'' if n == 1 else 's'}", fix, code, output_ids)


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (a BrokenPipeError elsewhere, e.g. an ssh pipe, is a failure)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is no file: assume it was stdout
        return True


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail again on the closed pipe
    (the Python docs' recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is no file (captured): nothing to flush at exit
        pass
