"""Output paths that never clobber an input, and output directories swapped in whole.

Why a module of its own: every command that writes (``coeffs``, ``report``,
``figures``) must refuse, before any work, an output that would replace one of its
inputs (the same file, a symlink or a hard link to it, a directory holding inputs)
or that cannot be written (a directory where a file is wanted, a path under a
file, a directory without write permission); and a multi-file output must appear
as a whole.  :func:`publish_directory` writes a directory's complete new contents
into a fresh hidden sibling and swaps it in with one rename, so a reader sees the
old set or the new one, never a mix, and no file of an earlier run survives.

Temporaries are hidden siblings named ``.{name}.icsd-{kind}-{host}-{pid}-{random}``;
they never end in ``.parquet`` (the dump reader skips them) and :func:`remove_stale`
deletes those a killed process (``kill -9``) of this host left behind (a live
process of another host sharing the directory is never touched).  Nothing here imports
torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

__all__ = ["OutputError", "check_output_file", "check_output_dir", "publish_directory", "temp_dir", "remove_stale",
           "terminate_cleanly", "Deferral", "staging_dir", "temp_prefix", "write_text_atomic", "check_not_input", "GracefulStop",
           "Stopped", "write_failed", "reserve", "current_umask", "umask_mode", "umask_tree"]


class OutputError(ValueError):
    """An output path that must not or cannot be written: one line naming it."""

    def __init__(self, path: Path | str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = str(path)


def write_failed(exc: OSError, path: str | Path, what: str = "cannot write") -> OSError:
    """``exc`` (a full disk, an I/O error) as an OSError naming ``path`` and what failed.

    Writes fail with the path of a hidden temporary or none at all (pyarrow's
    "Error writing bytes to file", ``write()``'s bare errno); the user needs the
    output they asked for and what went wrong: ``PATH: cannot write: No space left
    on device``.
    """
    if exc.errno:
        reason = os.strerror(exc.errno)
    else:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return OSError(exc.errno or errno.EIO, f"{what}: {reason}", str(path))


def reserve(fd: int, size: int) -> None:
    """Give the file ``fd`` ``size`` bytes of disk now, so a full disk fails here, not later.

    A memory map written into an unreserved (sparse) file on a full disk dies with
    SIGBUS; ``posix_fallocate`` reserves the blocks (or fails with ENOSPC as an
    ordinary OSError).  Where the file system cannot reserve, zeros are written.
    """
    if size <= 0:
        return
    if hasattr(os, "posix_fallocate"):  # absent on macOS: the zero writes below reserve the space instead
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
                raise
    chunk = bytes(min(size, 1 << 24))
    os.lseek(fd, 0, os.SEEK_SET)
    done = 0
    while done < size:
        done += os.write(fd, chunk[: min(len(chunk), size - done)])


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_parent(out: Path) -> None:
    """The nearest existing ancestor of ``out`` is a directory we may create entries in."""
    parent = out.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(out, f"cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(out, f"cannot be written: no write permission in directory {parent}")


def check_output_file(out: str | Path, inputs: Sequence[Path], *, option: str = "--out") -> Path:
    """Refuse an output file that is an input (same file, symlink, hard link) or cannot be written.

    ``inputs`` are the input files themselves (a dump directory resolved to its shards by the caller).
    """
    out = Path(out)
    if os.path.lexists(out):
        for f in inputs:
            if _same_file(out, f):
                what = "is" if out.absolute() == f.absolute() else "resolves to"
                raise OutputError(out, f"{option} {what} the input file {f}; an output never replaces an input")
        if out.is_dir():
            raise OutputError(out, f"{option} is a directory; give a file name")
        if out.exists() and not out.is_file():
            raise OutputError(out, f"{option} exists and is not a regular file")
    _check_parent(out)
    return out


def check_output_dir(out: str | Path, inputs: Sequence[Path], *, owned: Callable[[str], bool],
                     option: str = "--out") -> Path:
    """Refuse an output directory that is or holds an input, holds foreign files, or cannot be written.

    ``owned(relative_path)`` says whether a file already in ``out`` is one this
    command writes (the swap removes every file of the old directory); ``inputs`` are the input files themselves.
    """
    out = Path(out)
    files = list(inputs)
    if os.path.lexists(out):
        for f in files:
            if _same_file(out, f):
                raise OutputError(out, f"{option} is the input file {f}; an output never replaces an input")
        if not out.is_dir():
            raise OutputError(out, f"{option} exists and is not a directory")
        real = out.resolve()
        for f in files:
            if real in f.resolve().parents:
                raise OutputError(out, f"{option} holds the input file {f}; an output never replaces an input")
        foreign = _foreign(real, owned)
        if foreign:
            raise OutputError(out, f"{option} holds files this command did not write ({foreign}); "
                                   "choose a new or empty directory")
        if not os.access(real, os.W_OK | os.X_OK):
            raise OutputError(out, f"cannot be written: no write permission in directory {out}")
        _check_parent(real)
    else:
        _check_parent(out)
    return out


def _foreign(root: Path, owned: Callable[[str], bool]) -> str | None:
    """The first file or link under ``root`` that ``owned`` does not claim (None: all claimed)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if not owned(rel):
                return rel
    return None


# --------------------------------------------------------------------------- temporaries

_TEMP = re.compile(r"\.(?P<name>.+)\.icsd-(?P<kind>[a-z]+)-(?P<host>[A-Za-z0-9]*)-(?P<pid>\d+)-[A-Za-z0-9_]+")


def _host() -> str:
    import socket

    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:24]


def _prefix(target: Path, kind: str) -> str:
    return f".{target.name}.icsd-{kind}-{_host()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def remove_stale(parent: str | Path) -> list[Path]:
    """Delete the temporaries in ``parent`` left by processes that no longer run."""
    removed: list[Path] = []
    parent = Path(parent)
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    host = None
    # runs before every staged step: a dump folder holds one entry per step, so the scan stays on plain names
    for name in names:
        if ".icsd-" not in name:
            continue
        m = _TEMP.fullmatch(name)
        if m is None:
            continue
        host = _host() if host is None else host
        pid = int(m.group("pid"))
        if m.group("host") == host and pid != os.getpid() and not _alive(pid):
            entry = parent / name
            if os.path.isdir(entry) and not os.path.islink(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
            removed.append(entry)
    return removed


def _mkdtemp(target: Path, kind: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=_prefix(target, kind), dir=target.parent))
    except OSError as exc:
        raise write_failed(exc, target, "cannot create a temporary directory next to it") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide a shared report once swapped in
    return tmp


def temp_prefix(target: str | Path, kind: str) -> str:
    """The name prefix of a temporary for ``target`` (``.NAME.icsd-KIND-HOST-PID-``): give it a random tail."""
    return _prefix(Path(target), kind)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``path`` now holds ``text``, written to a temporary file and renamed: a crash keeps the old or the new."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "tmp"), dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 is not what a plain new file gets
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def staging_dir(target: str | Path, kind: str) -> Path:
    """A fresh hidden directory next to ``target`` that the caller fills and renames to ``target`` (or removes).

    Named like every temporary here, so a killed process's one is removed by the next
    :func:`remove_stale` in that directory (this call runs one first).
    """
    return _mkdtemp(Path(target), kind)


@contextlib.contextmanager
def temp_dir(target: str | Path, kind: str = "tmp") -> Iterator[Path]:
    """A hidden scratch directory next to ``target`` (same file system), removed on exit and on SIGTERM.

    A SIGTERM that arrives while the directory is being made is deferred to the ``try`` whose ``finally``
    removes it: never taken between its creation and that ``try``.
    """
    deferral = Deferral()
    with terminate_cleanly(deferral):
        tmp = _mkdtemp(Path(target), kind)
        try:
            deferral.take()
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class Deferral:
    """A SIGTERM held by :func:`terminate_cleanly` until :meth:`take` (Python runs signal handlers in the
    main thread, whichever thread the signal reached, so the hold needs no signal mask)."""

    def __init__(self) -> None:
        self.taking = False
        self.pending = 0

    def take(self) -> None:
        """From now on SIGTERM exits at once; one that came while held exits here."""
        self.taking = True
        if self.pending:
            raise SystemExit(128 + self.pending)


@contextlib.contextmanager
def terminate_cleanly(deferral: Deferral | None = None) -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit(143)`` so ``finally`` blocks remove temporaries (main thread only);
    with a ``deferral``, a SIGTERM before its :meth:`Deferral.take` waits for it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        if deferral is not None and not deferral.taking:
            deferral.pending = signum
            return
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- swapping a directory in

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_directory(out: str | Path, files: Mapping[str, bytes], *, owned: Callable[[str], bool]) -> dict[str, Path]:
    """Make ``out`` hold exactly ``files`` (relative path -> bytes), swapped in as one set.

    Files are written into a fresh hidden sibling directory, which then replaces
    ``out`` with one atomic exchange (two renames where the file system has no
    exchange, a moment in which ``out`` is absent but never mixed).  An existing
    ``out`` holding files ``owned`` does not claim is refused before anything is written.
    """
    out = Path(out)
    target = out.resolve() if out.is_symlink() else out.absolute()
    if os.path.lexists(target):
        if not target.is_dir():
            raise OutputError(out, "exists and is not a directory")
        foreign = _foreign(target, owned)
        if foreign:
            raise OutputError(out, f"holds files this command did not write ({foreign}); choose a new or empty directory")
    new = _mkdtemp(target, "new")
    try:
        with terminate_cleanly():
            umask = os.umask(0)
            os.umask(umask)
            for rel, data in files.items():
                path = new / rel
                if path.parent != new and not path.parent.is_dir():
                    path.parent.mkdir(parents=True)
                    os.chmod(path.parent, 0o777 & ~umask)
                try:
                    with open(path, "wb") as fh:
                        fh.write(data)
                except OSError as exc:  # a full disk: name the file asked for, not the hidden temporary
                    raise write_failed(exc, out / rel) from None
            new = _swap_in(new, target)
    finally:
        if new is not None:
            shutil.rmtree(new, ignore_errors=True)
    return {rel: out / rel for rel in files}


def _swap_in(new: Path, target: Path) -> Path | None:
    """Put the complete directory ``new`` at ``target``; returns what is left to delete (the old set, or None).

    Another publisher may create or swap ``target`` between any two steps (two
    reports into one new folder at the same instant): a rename onto a directory it
    has just created fails with ENOTEMPTY, an exchange or move of a ``target`` it has
    just moved away with ENOENT.  Each such step is retried against the new state, so
    both publishers succeed and ``target`` ends as one publisher's whole set, as when
    the two ran one after the other.
    """
    retry = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT)
    for _ in range(1000):
        try:
            if not os.path.lexists(target):
                os.rename(new, target)
                return None
            if exchange_paths(new, target):  # after an exchange ``new`` holds the old set
                return new
            old = Path(tempfile.mkdtemp(prefix=_prefix(target, "old"), dir=target.parent))
            try:
                os.rename(target, old / "d")
            except OSError:
                os.rmdir(old)
                raise
            try:
                os.rename(new, target)
            except OSError:
                shutil.rmtree(old, ignore_errors=True)  # the set moved aside was the other publisher's, now replaced
                raise
            return old
        except OSError as exc:
            if exc.errno not in retry:
                raise
    raise OSError(errno.EBUSY, "another process keeps replacing this directory", str(target))


# --------------------------------------------------------------------------- outputs apart from inputs


def check_not_input(out: str | Path, inputs: Mapping[str, str | Path | None], *, option: str = "--out") -> Path:
    """Refuse an output path that is, holds, or lies inside one of ``inputs`` (label -> path), before any work.

    For commands whose inputs are folders or files other than dumps (a model folder, a
    checkpoint, data files): ``icsd train --out M`` with ``--model M`` would overwrite
    the model's ``config.json``, ``--out R`` holding ``--model R/checkpoints/step-2``
    would prune it, and ``icsd eval --out M/config.json`` would replace a model file.
    Paths are compared after resolving symbolic links; missing inputs are skipped.
    """
    out = Path(out)
    real_out = Path(os.path.realpath(out.expanduser()))
    for label, raw in inputs.items():
        if raw is None or not os.path.lexists(Path(raw).expanduser()):
            continue
        real_in = Path(os.path.realpath(Path(raw).expanduser()))
        if real_out == real_in or _same_file(out, real_in):
            why = "is"
        elif real_out in real_in.parents:
            why = "holds"
        elif real_in in real_out.parents:
            why = "lies inside"
        else:
            continue
        raise OutputError(out, f"{option} {why} the {label} {raw}; an output never replaces or enters an input: "
                               f"choose another {option}")
    return out


# --------------------------------------------------------------------------- graceful stop


class Stopped(BaseException):
    """A run stopped by SIGTERM or SIGINT (:class:`GracefulStop`); exit with :attr:`exit_code` (143 / 130).

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the
    way up mistakes it for an error and carries on.
    """

    def __init__(self, signum: int, message: str = ""):
        self.signum = int(signum)
        self.signal_name = signal.Signals(self.signum).name
        super().__init__(message or f"stopped by {self.signal_name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop:
    """SIGTERM and SIGINT become :class:`Stopped`, held back while a file is being written.

    ``with GracefulStop() as stop:`` installs the handlers (main thread only; elsewhere it
    does nothing) and restores the previous ones on exit. A signal raises ``Stopped`` at
    once, unless it arrives inside ``with stop.critical():`` (writing a shard, committing a
    step, appending a metrics line, saving a checkpoint): then that block finishes and
    ``Stopped`` is raised as it ends, so no file is left half-written and nothing further
    is written. A second signal inside a critical block raises at once (the user
    insists); the block's own clean-up and the next run remove its temporaries.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._depth = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous = {}

    def _handle(self, signum: int, frame: object) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if self._depth == 0 or not first:
            raise Stopped(self.signum if first else signum)

    def check(self) -> None:
        """Raise ``Stopped`` if a signal arrived (during a critical block that has ended)."""
        if self.signum is not None and self._depth == 0:
            raise Stopped(self.signum)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A block that a first signal lets finish; ``Stopped`` is raised when it ends."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        self.check()


# --------------------------------------------------------------------------- modes of new files


def current_umask() -> int:
    """The process's umask (read by setting and restoring it: Python has no getter)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def umask_mode(path: str | Path, *, executable: bool = False) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would have: 0666 (0777 for folders and
    ``executable`` files) less the user's umask.

    Temporaries come from ``mkstemp``/``mkdtemp`` (0600/0700) and some writers
    (safetensors) create 0600 files; once renamed into place they must be readable by
    whoever the user's umask lets read them, like every other file the toolkit writes.
    """
    full = 0o777 if executable or Path(path).is_dir() else 0o666
    os.chmod(path, full & ~current_umask())


def umask_tree(folder: str | Path) -> None:
    """:func:`umask_mode` on ``folder`` and everything under it (a checkpoint, a model cache)."""
    mask = current_umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, (0o777 if os.stat(p).st_mode & 0o100 else 0o666) & ~mask)
