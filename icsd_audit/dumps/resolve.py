"""Where the dumps are: files, directories and store URLs resolved to the files a reader opens, in its order.

Local paths keep every check of a file system (permissions, broken links, link loops,
a file reached twice); URLs of a store go through :mod:`icsd_audit.dumps.store`. On both,
hidden scratch folders of icsd writers are skipped (a staged step with one warning), and
so are the shards of a step that no commit marker names (one warning for all).
"""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from pathlib import Path
from typing import Callable, Sequence

from icsd_audit.dumps.columns import DumpError, DumpWarning, first_line
from icsd_audit.dumps.store import StoreError, StoreFile, committed, list_files, local_path

__all__ = ["resolve_paths"]

#: hidden scratch directories of icsd writers (``.NAME.icsd-KIND-HOST-PID-*``, and ``.icsd-coeffs-*`` of older versions)
_SCRATCH = re.compile(r"\..*icsd-[a-z]+-.*")
#: a step that a DumpWriter staged and has not committed (dumps/writer.py)
_STAGED_STEP = re.compile(r"\.(?P<name>.+)\.icsd-step-.*")


def _unreadable(path: Path, what: str) -> DumpError:
    return DumpError(path, f"permission denied: cannot read this {what}")


def resolve_paths(paths: Sequence[str | Path | StoreFile]) -> list[Path | StoreFile]:
    """Files as given, directories expanded to every ``*.parquet`` below them in sorted order.

    A string ``SCHEME://...`` other than ``file://`` names objects of a store (fsspec,
    :mod:`icsd_audit.dumps.store`): an object, or every ``*.parquet`` below a prefix.
    Hidden scratch directories of icsd writers are skipped, and so are the shards of a
    step its writer never committed (no commit marker names them; one warning).  An unreadable file or
    directory, a broken ``*.parquet`` link, a directory link that loops back to a
    directory holding it, and a file reached twice (given twice, or through a link)
    are each an error naming the path (never silently skipped, never read twice).
    """
    if not paths:
        raise DumpError("<input>", "no input paths given")
    out: list[Path | StoreFile] = []
    remote: list[StoreFile] = []
    uncommitted: list[str] = []
    for raw in paths:
        if isinstance(raw, StoreFile):  # resolved before (a caller passing resolve_paths' own output)
            out.append(raw)
            remote.append(raw)
            continue
        p = local_path(raw)
        if p is None:
            try:
                listing = list_files(str(raw), scratch=_SCRATCH, staged=_STAGED_STEP)
            except StoreError as exc:
                raise DumpError(exc.url, exc.reason) from None
            for x in listing.staged:
                warnings.warn(f"{x}: uncommitted step (its writer stopped before committing it, or is writing it "
                              "now): ignored", DumpWarning, stacklevel=2)
            uncommitted.extend(listing.uncommitted)
            if not listing.files:
                raise DumpError(raw, "location holds no committed *.parquet files")
            out.extend(listing.files)
            remote.extend(listing.files)
            continue
        if p.is_dir():
            if not os.access(p, os.R_OK | os.X_OK):
                raise _unreadable(p, "directory")
            found = _walk(p, uncommitted)
            if not found:
                raise DumpError(p, "directory holds no *.parquet files")
            out.extend(sorted(found))
        elif p.is_file():
            out.append(p)
        elif os.path.lexists(p):
            raise _broken_link(p)
        else:
            raise DumpError(p, "no such file or directory")
    _warn_uncommitted(uncommitted)
    urls: dict[str, StoreFile] = {}
    for f in remote:
        if urls.setdefault(f.url, f) is not f:
            raise DumpError(f, "given twice; its rows would count twice, so give each file once")
    seen: dict[tuple[int, int], Path] = {}
    for f in out:
        if isinstance(f, StoreFile):
            continue
        if not os.access(f, os.R_OK):
            raise _unreadable(f, "file")
        st = f.stat()
        first = seen.setdefault((st.st_dev, st.st_ino), f)
        if first is not f:
            how = "given twice" if os.path.abspath(first) == os.path.abspath(f) else f"the same file as {first}"
            raise DumpError(f, f"{how}; its rows would count twice, so give each file once")
    return out


def _broken_link(p: Path) -> DumpError:
    """A symbolic link that leads nowhere: its target missing, or a loop of links."""
    try:
        os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return DumpError(p, "symbolic link loop (the link resolves to itself)")
    return DumpError(p, f"broken symbolic link (its target {os.readlink(p)} does not exist)")


def _warn_uncommitted(skipped: Sequence[str | Path]) -> None:
    """One warning for every step shard that no commit marker names (dumps/store.py)."""
    if not skipped:
        return
    folders = {str(s).replace(os.sep, "/").rsplit("/", 1)[0] for s in skipped}
    more = f" ({len(skipped) - 1} more shard(s); {len(folders)} folder(s) in all)" if len(skipped) > 1 else ""
    warnings.warn(f"{skipped[0]}: uncommitted step shard (no commit marker names it: its writer stopped before "
                  f"committing the step, or is writing it now): ignored{more}", DumpWarning, stacklevel=3)


def _local_marker(folder: str) -> Callable[[str], list[str]]:
    def read(name: str) -> list[str]:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as fh:
                shards = json.load(fh)["shards"]
        except OSError as exc:
            raise DumpError(path, f"cannot read this commit marker ({first_line(exc)})") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise DumpError(path, f"not a valid commit marker ({first_line(exc)})") from None
        if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
            raise DumpError(path, "not a valid commit marker (its 'shards' is not a list of names)")
        return shards

    return read


def _walk(top: Path, uncommitted: list) -> list[Path]:
    """Every ``*.parquet`` file below ``top``, following directory links but refusing loops.

    The shards of an uncommitted step (a commit marker's, dumps/store.py) go to ``uncommitted``.
    """
    found: list[Path] = []

    def fail(exc: OSError) -> None:
        raise _unreadable(Path(exc.filename or top), "directory") from None

    for d, dirs, files in os.walk(top, onerror=fail, followlinks=True):
        for x in sorted(dirs):
            if m := _STAGED_STEP.fullmatch(x):
                warnings.warn(f"{Path(d) / x}: uncommitted {m.group('name')} (its writer stopped before committing it, "
                              "or is writing it now): ignored", DumpWarning, stacklevel=3)
        dirs[:] = [x for x in dirs if not _SCRATCH.fullmatch(x)]
        here = os.path.realpath(d)
        for x in dirs:
            link = os.path.join(d, x)
            if os.path.islink(link):
                real = os.path.realpath(link)
                if here == real or here.startswith(real.rstrip(os.sep) + os.sep):
                    raise DumpError(link, f"symbolic link loop: it points to {os.readlink(link)}, a directory that "
                                          "holds the link; remove the link or give the directories separately")
        taken, left = committed(sorted(files), _local_marker(d))
        uncommitted.extend(Path(d) / f for f in left)
        for f in taken:
            path = os.path.join(d, f)
            if not f.endswith(".parquet"):
                continue
            if os.path.isfile(path):
                found.append(Path(path))
            elif os.path.islink(path) and not os.path.exists(path):
                raise _broken_link(Path(path))
    return found
