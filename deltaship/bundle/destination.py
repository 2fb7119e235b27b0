"""An output directory (`--out`) as deltaship claims it: checked, locked, recovered, and replaced by rename.

The rules (docs/reliability.md):
- `--force` replaces only what deltaship wrote (a bundle: manifest.json with deltaship's schema id; an app kit:
  kit.json with "kit": "deltaship.app"; profile plots: plots.json) or an empty directory; anything else is
  refused, and so is an --out that is, holds or lies inside an input, or that holds the current directory.
- One writer per --out: an exclusive lock on `.NAME.lock` beside it, taken without waiting.
- Work goes to `.NAME.partial-PID-RAND`, an old output is moved to `.NAME.old-PID` and back on failure. A process
  killed in between leaves those behind; the next writer to the same --out removes a dead process's partial
  output and puts back (or, when the new output is complete, removes) a backup, saying so in one line each.
- NAME is --out's own name, shortened with a hash when the longest sibling name would pass NAME_MAX.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Iterable

from filelock import FileLock, Timeout

from deltaship.bundle.format import MANIFEST, SCHEMA
from deltaship.errors import DeltashipEnvironmentError, DeltashipError
from deltaship.files import read_int, read_json

NAME_MAX = 255
_LONGEST_SUFFIX = len(".partial-") + 10 + 1 + 8  # pid (at most 10 digits), "-", 8 random hex digits
KIT_MARKER = ("kit.json", "kit", "deltaship.app")  # written by deltaship.apps.write_kit
PLOTS_MARKER = ("plots.json", "kind", "deltaship.plots")  # written by profile --plots


def notice(message: str) -> None:
    """One line on stderr that a person (or a log) must see even with --quiet: what deltaship cleaned up."""
    print(f"deltaship: {message}", file=sys.stderr, flush=True)


def stem(out: Path) -> str:
    """The name part of --out's sibling files: the name itself, or (when `.NAME.partial-PID-RAND` would pass
    NAME_MAX bytes) a prefix of it and a hash of the whole name, so every legal --out has legal siblings."""
    name = out.name
    if len(name.encode()) + 1 + _LONGEST_SUFFIX <= NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    head = name.encode()[: NAME_MAX - 1 - _LONGEST_SUFFIX - 1 - len(digest)].decode(errors="ignore")
    return f"{head}~{digest}"


def lock_path(out: Path) -> Path:
    return out.parent / f".{stem(out)}.lock"


def _marker(path: Path, marker: tuple[str, str, str]) -> bool:
    name, key, value = marker
    try:
        doc = read_json(path / name, name, "")
    except DeltashipError:  # unreadable, too big, not JSON: not deltaship's
        return False
    return isinstance(doc, dict) and doc.get(key) == value


def what_is(out: Path) -> str:
    """'missing', 'empty', 'bundle', 'kit', 'plots', 'file', 'symlink' or 'other' (a directory deltaship did not
    write)."""
    if out.is_symlink():
        return "symlink"
    if not out.exists():
        return "missing"
    if not out.is_dir():
        return "file"
    if not any(out.iterdir()):
        return "empty"
    try:
        manifest = read_json(out / MANIFEST, MANIFEST, "")
        if isinstance(manifest, dict) and manifest.get("schema") == SCHEMA:
            return "bundle"
    except DeltashipError:
        pass
    for kind, marker in (("kit", KIT_MARKER), ("plots", PLOTS_MARKER)):
        if _marker(out, marker):
            return kind
    return "other"


def _listing(out: Path, n: int = 5) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies under b (both resolved)."""
    return a == b or b in a.parents


DEFAULT_REPLACES = ("bundle", "kit")


def check_destination(
    out: Path,
    force: bool,
    inputs: Iterable[str | Path] = (),
    option: str = "--out",
    replaces: tuple[str, ...] = DEFAULT_REPLACES,
) -> None:
    """Refuse, before any work, an `out` this command must not write: see the module's rules. `inputs` are the
    command's input paths (a checkpoint or bundle directory; names that are not directories are skipped);
    `replaces`: the kinds of directory (what_is) that `force` may replace."""
    out = Path(out)
    real = out.resolve()
    for i in inputs:
        p = Path(i)
        if not p.is_dir():
            continue
        src = p.resolve()
        if _inside(real, src) or _inside(src, real):
            how = "is" if real == src else ("lies inside" if _inside(real, src) else "holds")
            raise DeltashipError(
                f"{option} {out} {how} the input {i}; writing it would destroy the input; nothing was written",
                f"choose an {option} directory outside {i}",
            )
    cwd = Path.cwd().resolve()
    if _inside(cwd, real):
        what = "is the current directory" if real == cwd else "holds the current directory"
        raise DeltashipError(f"{option} {out} {what}; nothing was written", f"choose a new {option} directory")
    kind = what_is(out)
    if kind == "file":
        raise DeltashipError(
            f"{option} {out} exists and is a file; nothing was written", f"choose another {option} directory"
        )
    if kind == "symlink":
        raise DeltashipError(
            f"{option} {out} is a symbolic link (to {os.readlink(out)}); nothing was written",
            f"pass the directory it points to, or another {option} directory",
        )
    if kind in ("missing", "empty"):
        return
    if not force:
        raise DeltashipError(
            f"{option} {out} already exists and is not empty; nothing was written",
            f"pass --force to replace it, or choose another {option} directory",
        )
    if kind not in replaces:
        names = {"bundle": "a deltaship bundle", "kit": "an app kit", "plots": "profile plots"}
        held = f"is {names[kind]}" if kind in names else f"holds files deltaship did not write ({_listing(out)})"
        raise DeltashipError(
            f"{option} {out} {held}; {'--force' if option == '--out' else option} replaces only "
            + ", ".join(names[k] for k in replaces)
            + " or an empty directory; nothing was written",
            f"choose another {option} directory, or move {out} away yourself if it should go",
        )


def check_output_file(path: Path, inputs: Iterable[str | Path] = (), option: str = "--report") -> None:
    """Refuse, before any work, a file output that is a directory or lies inside an input (a bundle's files are
    hashed in its manifest: a report written among them would break it)."""
    path = Path(path)
    if path.is_dir():
        raise DeltashipError(f"{option} {path} is a directory; nothing was written", f"pass a file name to {option}")
    real = path.resolve()
    for i in inputs:
        if Path(i).is_dir() and _inside(real, Path(i).resolve()):
            raise DeltashipError(
                f"{option} {path} lies inside the input {i}; nothing was written", f"write {option} outside {i}"
            )


def replace_file(path: Path, data: str | bytes, option: str = "--report", mode: int | None = None) -> None:
    """Write a file output whole or not at all: a private file beside it, flushed, renamed over it.
    `mode`: the file's permissions (default: a normal file's under the umask; 0o600 keeps it private)."""
    path = Path(path)
    with environment_errors(path, option):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{stem(path)}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask() if mode is None else mode)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


class Destination:
    """A claimed --out: checked, locked (one writer at a time) and cleared of what killed writers left.
    A context manager; release() frees the lock."""

    def __init__(
        self,
        out: Path,
        force: bool,
        inputs: Iterable[str | Path] = (),
        option: str = "--out",
        replaces: tuple[str, ...] = DEFAULT_REPLACES,
    ):
        self.out, self.force, self.option, self.replaces = Path(out), force, option, replaces
        self.inputs = tuple(inputs)
        check_destination(self.out, force, self.inputs, option, replaces)
        self._lock: OutputLock | None = None
        try:
            with environment_errors(self.out, option):
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self._acquire()
                recover(self.out)
            # again: recovery may have put a backup back
            check_destination(self.out, force, self.inputs, option, replaces)
        except BaseException:
            self.release()
            raise

    def _acquire(self) -> None:
        self._lock = OutputLock(self.out, self.option)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Destination:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class OutputLock:
    """The exclusive lock on `.NAME.lock` beside `out` (lock_path), taken without waiting; its file is removed
    before the lock is let go, so no run leaves one behind. busy(who, lock file): the (message, fix) of the error
    when another process holds it (default: an --out's)."""

    def __init__(self, out: Path, option: str = "--out", busy=None):
        self.out, self.path = Path(out), lock_path(Path(out))
        self._lock: FileLock | None = None
        self._remove = False
        for _ in range(3):
            lock = FileLock(str(self.path), timeout=0)
            try:
                lock.acquire()
            except Timeout:
                holder = _holder(self.path)
                who = f"process {holder}" if holder else "another process"
                what, fix = (busy or _busy_out(option, self.out))(who, self.path)
                raise DeltashipEnvironmentError(what, fix) from None
            # The holder removes the lock file before it lets go; a lock taken on the removed file is no lock.
            fd = getattr(getattr(lock, "_context", None), "lock_file_fd", None)
            try:
                same = fd is not None and os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if fd is None or same:
                self._lock, self._remove = lock, fd is not None
                try:
                    self.path.write_text(f"{os.getpid()}\n")  # for the next writer's message; the lock is on the inode
                except OSError:
                    pass  # a full disk: the writer will say so; the pid is only for a message
                return
            lock.release()
        raise DeltashipEnvironmentError(
            f"{option} {self.out}: its lock {self.path} keeps changing hands; nothing was written",
            f"wait for the other writers to finish, or choose another {option}",
        )

    def release(self) -> None:
        if self._lock is not None:
            if self._remove:
                self.path.unlink(missing_ok=True)  # while still held: see __init__
            self._lock.release()
            self._lock = None


def _busy_out(option: str, out: Path):
    def busy(who: str, path: Path) -> tuple[str, str]:
        return (
            f"{option} {out} is being written by {who} (lock {path}); nothing was written",
            f"wait for it to finish, or choose another {option}",
        )

    return busy


def _holder(path: Path) -> int | None:
    """The pid holding the lock on `path`: from the kernel's lock table where there is one (Linux), else the pid
    its holder wrote into it."""
    try:
        ino = os.stat(path).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            f = line.split()
            if len(f) > 5 and f[1] == "FLOCK" and f[5].rsplit(":", 1)[-1] == str(ino) and f[4].isdigit():
                return int(f[4])
    except (OSError, ValueError):
        pass
    return read_int(path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a dead process's pid we were given again; we hold the lock, so it is not ours
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def siblings(out: Path, kind: str) -> list[tuple[Path, int]]:
    """`.STEM.<kind>-PID[-RAND]` beside `out`, with their pids (kind: partial or old)."""
    prefix = f".{stem(out)}.{kind}-"
    found = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    for p in entries:
        if p.name.startswith(prefix):
            pid = p.name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit():
                found.append((p, int(pid)))
    return sorted(found)


def recover(out: Path) -> list[str]:
    """Undo what killed writers to `out` left (called with the lock held); returns the notices it printed."""
    said = []
    for p, pid in siblings(out, "partial"):
        if not _alive(pid):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:  # a file output's (replace_file's) partial copy
                p.unlink(missing_ok=True)
            said.append(
                f"an earlier write to {out} (pid {pid}) did not finish: it was killed (out of memory, a signal) or "
                f"crashed; removed its partial output {p.name}"
            )
    for p, pid in siblings(out, "old"):
        if _alive(pid):
            continue
        kind = what_is(out)
        if kind == "missing":
            p.rename(out)
            said.append(
                f"an earlier write to {out} (pid {pid}) was killed while replacing it; put the previous {out} back"
            )
        elif kind in ("bundle", "kit", "plots"):
            shutil.rmtree(p, ignore_errors=True)
            said.append(f"an earlier write to {out} (pid {pid}) finished but left its backup {p.name}; removed it")
        else:
            said.append(f"{p.name} beside {out} holds the {out} of an earlier write (pid {pid}); left for you to check")
    for line in said:
        notice(line)
    return said


def new_staging(out: Path) -> Path:
    """A private directory beside `out` for this process's work (see recover)."""
    p = out.parent / f".{stem(out)}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    p.mkdir(mode=0o700)
    return p


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` (and root) to disk: after the rename, a power loss must find
    either the old output or the complete new one."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(d))


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished staging directory to `out`; an old `out` is moved aside first and removed after."""
    os.chmod(tmp, 0o777 & ~_umask())  # staging was private; the result gets normal permissions
    fsync_tree(tmp)
    old = None
    if out.exists():
        old = out.parent / f".{stem(out)}.old-{os.getpid()}"
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- OSError -> one line ---------------------------------------------------------------------------------
_FIXES = {
    errno.ENAMETOOLONG: "choose a shorter {option} (each path component at most 255 bytes)",
    errno.EACCES: "choose an {option} in a directory you can write, or fix its permissions",
    errno.EPERM: "choose an {option} in a directory you can write, or fix its permissions",
    errno.EROFS: "choose an {option} on a writable file system",
}


def _mount(path: Path) -> Path:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    while not os.path.ismount(p):
        p = p.parent
    return p


class environment_errors:
    """Turn an OSError of the machine (disk full, quota, name too long, permissions, read-only) while writing
    `out` into one DeltashipEnvironmentError (exit 3) naming the directory, the reason and the fix.
    `written`: a function giving the bytes written so far (for "free N")."""

    KINDS = (errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.EACCES, errno.EPERM, errno.EROFS)

    def __init__(self, out: Path, option: str = "--out", written=None):
        self.out, self.option, self.written = out, option, written

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, e, tb) -> bool:
        if not isinstance(e, OSError) or e.errno not in self.KINDS:
            return False
        where = e.filename or self.out
        reason = os.strerror(e.errno)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            mount = _mount(self.out.parent)
            wrote = self.written() if self.written else 0
            free = shutil.disk_usage(mount).free + wrote  # once the staging directory is gone
            quota = " (your quota)" if e.errno == errno.EDQUOT else ""
            reached = f"; it had written {_size(wrote)} when the disk filled and needs more" if wrote else ""
            fix = (
                f"free space{quota} on {mount} ({_size(free)} free now{reached}), or choose an {self.option} on "
                "another disk"
            )
        else:
            fix = _FIXES[e.errno].format(option=self.option)
        raise DeltashipEnvironmentError(
            f"cannot write {self.option} {self.out}: {reason} ({where}); nothing was written", fix
        ) from e


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def tree_bytes(root: Path) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total
