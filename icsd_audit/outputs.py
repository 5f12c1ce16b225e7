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
           "terminate_cleanly", "staging_dir"]


class OutputError(ValueError):
    """An output path that must not or cannot be written: one line naming it."""

    def __init__(self, path: Path | str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = str(path)


def _input_files(inputs: Sequence[str | Path]) -> list[Path]:
    from icsd_audit.dumps.reader import resolve_paths

    return resolve_paths(inputs)


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


def check_output_file(out: str | Path, inputs: Sequence[str | Path], *, option: str = "--out") -> Path:
    """Refuse an output file that is an input (same file, symlink, hard link) or cannot be written."""
    out = Path(out)
    if os.path.lexists(out):
        for f in _input_files(inputs):
            if _same_file(out, f):
                what = "is" if out.absolute() == f.absolute() else "resolves to"
                raise OutputError(out, f"{option} {what} the input file {f}; an output never replaces an input")
        if out.is_dir():
            raise OutputError(out, f"{option} is a directory; give a file name")
        if out.exists() and not out.is_file():
            raise OutputError(out, f"{option} exists and is not a regular file")
    _check_parent(out)
    return out


def check_output_dir(out: str | Path, inputs: Sequence[str | Path], *, owned: Callable[[str], bool],
                     option: str = "--out") -> Path:
    """Refuse an output directory that is or holds an input, holds foreign files, or cannot be written.

    ``owned(relative_path)`` says whether a file already in ``out`` is one this
    command writes (the swap removes every file of the old directory).
    """
    out = Path(out)
    files = _input_files(inputs)
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
    removed = []
    parent = Path(parent)
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            m = _TEMP.fullmatch(entry.name)
            pid = int(m.group("pid")) if m else 0
            if m and m.group("host") == _host() and pid != os.getpid() and not _alive(pid):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()
                removed.append(entry)
    return removed


def _mkdtemp(target: Path, kind: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(target, kind), dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide a shared report once swapped in
    return tmp


def staging_dir(target: str | Path, kind: str) -> Path:
    """A fresh hidden directory next to ``target`` that the caller fills and renames to ``target`` (or removes).

    Named like every temporary here, so a killed process's one is removed by the next
    :func:`remove_stale` in that directory (this call runs one first).
    """
    return _mkdtemp(Path(target), kind)


@contextlib.contextmanager
def temp_dir(target: str | Path, kind: str = "tmp") -> Iterator[Path]:
    """A hidden scratch directory next to ``target`` (same file system), removed on exit and on SIGTERM."""
    tmp = _mkdtemp(Path(target), kind)
    try:
        with terminate_cleanly():
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit(143)`` so ``finally`` blocks remove temporaries (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- swapping a directory in

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
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
                with open(path, "wb") as fh:
                    fh.write(data)
            if not os.path.lexists(target):
                os.rename(new, target)
                new = None  # type: ignore[assignment]
            elif not _exchange(new, target):  # after an exchange ``new`` holds the old set
                old = Path(tempfile.mkdtemp(prefix=_prefix(target, "old"), dir=target.parent))
                os.rename(target, old / "d")
                os.rename(new, target)
                new = old
    finally:
        if new is not None:
            shutil.rmtree(new, ignore_errors=True)
    return {rel: out / rel for rel in files}
