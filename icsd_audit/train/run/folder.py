"""Run folders are append-only history: what may start in a folder, and who holds it while a run writes.

A run folder (``icsd train --out R``) holds one run: ``config.json``, ``metrics.jsonl``,
``eval.jsonl``, ``run.json``, ``dumps/`` and ``checkpoints/``. The rules, checked before
anything is written:

* a new run into a folder that holds another run is refused in one line: ``--resume``
  continues that run, ``--out`` elsewhere starts a new one, and ``--overwrite`` moves the
  old run aside to ``R.old-YYYYmmdd-HHMMSS`` (never deleting it) and starts afresh;
* while a run writes, it holds an exclusive lock on ``R/.icsd-run.lock`` (``flock``), so a
  second process (a resume launched twice, a new run with ``--overwrite``) is refused
  instead of interleaving with it; holding the lock, a run removes the temporaries a
  killed run left in the folder (staged steps, staging checkpoints, half-written files).

Engines other than the built-in loop use the same functions for the same folder layout:
:func:`check_run_folder` before any work, then ``with open_run_folder(...)`` around the run.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import time
from pathlib import Path
from typing import Iterator

__all__ = ["RUN_FILES", "RunFolderError", "held_run", "check_run_folder", "open_run_folder", "move_aside",
           "remove_temporaries", "drop_steps_from", "committed_steps", "stop_line", "LOCK_FILE"]

#: what a run writes at the top of its folder; any of them means the folder holds a run
RUN_FILES = ("config.json", "metrics.jsonl", "eval.jsonl", "run.json", "dumps", "checkpoints")
LOCK_FILE = ".icsd-run.lock"
_ICSD_TEMP = r"\..+\.icsd-[a-z]+-[A-Za-z0-9]*-\d+-[A-Za-z0-9_]+"
#: temporaries per folder: ``.NAME.icsd-KIND-HOST-PID-*`` everywhere, and what older versions left
#: (a shard's ``.stepN-mbM.parquet.*.tmp``, a checkpoint's ``.step-N.tmp-*``)
_TEMPORARY = {"": re.compile(_ICSD_TEMP), "dumps": re.compile(_ICSD_TEMP + r"|\.step\d+-mb\d+\.parquet\..+\.tmp"),
              "checkpoints": re.compile(_ICSD_TEMP + r"|\.step-\d+\.tmp-.+")}


class RunFolderError(ValueError):
    """A run folder that this run may not start in, or may not write: one line saying what to do."""


def held_run(out: str | Path) -> list[str]:
    """The run files present in ``out`` (empty: no run there)."""
    out = Path(out)
    return [name for name in RUN_FILES if os.path.lexists(out / name)] if out.is_dir() else []


def _writable(out: Path) -> None:
    probe = out
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if os.path.lexists(out) and not out.is_dir():
        raise RunFolderError(f"--out {out}: exists and is not a folder")
    if not probe.is_dir():
        raise RunFolderError(f"--out {out}: cannot be created: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunFolderError(f"--out {out}: cannot be written: no write permission in {probe}")


def check_run_folder(out: str | Path, *, resume: bool, overwrite: bool) -> list[str]:
    """Refuse, before any work, a run that may not start in ``out``; return the run files already there."""
    out = Path(out)
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite contradict each other: --resume continues the run in --out, "
                             "--overwrite moves it aside and starts a new one; pass one")
    _writable(out)
    found = held_run(out)
    if found and overwrite and not resume:
        here, target = Path.cwd().resolve(), out.resolve()
        if not out.name or out.name in (".", "..") or target == here or target in here.parents:
            raise RunFolderError(f"--out {out} --overwrite: {target} is this shell's folder or holds it, so it cannot "
                                 f"be moved aside; run the command from outside it (cd {target.parent}; --out "
                                 f"{target.name or '.'} --overwrite)")
    if found and not (resume or overwrite):
        raise RunFolderError(f"--out {out} holds another run ({', '.join(found)}); continue it with --resume, "
                             f"choose a new --out, or pass --overwrite to move it aside (to {out.name}.old-<date>) "
                             "and start afresh; a run folder is never overwritten")
    return found


def move_aside(out: str | Path) -> Path:
    """Rename ``out`` to a dated sibling ``NAME.old-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... when taken) and return it."""
    out = Path(out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        aside = out.with_name(f"{out.name}.old-{stamp}" + (f"-{n}" if n > 1 else ""))
        if os.path.lexists(aside):
            continue
        try:
            os.rename(out, aside)  # refuses to replace a non-empty folder, so a race cannot clobber one
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                continue
            raise
        return aside
    raise RunFolderError(f"--overwrite: no free name to move {out} aside to")


class _Lock:
    """An exclusive ``flock`` on ``folder/.icsd-run.lock``, held until :meth:`release`."""

    def __init__(self, folder: Path, *, note_pid: bool = True):
        import fcntl

        self.path = folder / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise RunFolderError(f"--out {folder}: another icsd process (pid {holder}) is writing this run folder; "
                                 "wait for it to end or choose another --out") from None
        except OSError as exc:  # a file system without flock (some network mounts): run unlocked
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                os.close(self.fd)
                raise
        if note_pid:  # for the message a second process gets
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock; the empty lock file stays (removing it would race)
            self.fd = -1


def remove_temporaries(out: str | Path) -> list[Path]:
    """Remove what killed runs left in ``out``, ``out/dumps`` and ``out/checkpoints`` (the caller holds the lock)."""
    removed = []
    for sub, pattern in _TEMPORARY.items():
        with contextlib.suppress(OSError):
            for entry in sorted((Path(out) / sub).iterdir()):
                if not pattern.fullmatch(entry.name):
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()
                removed.append(entry)
    return removed


@contextlib.contextmanager
def open_run_folder(out: str | Path, *, resume: bool, overwrite: bool) -> Iterator[tuple[Path | None, list[Path]]]:
    """Hold ``out`` for a run: lock it, re-check it, move an old run aside, clean temporaries.

    Yields ``(moved_to, removed)``: where ``--overwrite`` moved the old run (None when it
    did not) and the temporaries removed. The lock is released when the block ends.
    """
    out = Path(out)
    moved: Path | None = None
    if overwrite and held_run(out):
        old = _Lock(out, note_pid=False)  # no live run may be in the folder being moved (left as it was)
        try:
            moved = move_aside(out)
        finally:
            old.release()
    out.mkdir(parents=True, exist_ok=True)
    lock = _Lock(out)
    try:
        check_run_folder(out, resume=resume, overwrite=False)  # again, now that no one else can start here
        yield moved, remove_temporaries(out)
    finally:
        lock.release()


_STEP_ENTRY = re.compile(r"step(\d{6})(?:-r\d{5}|-mb\d+\.parquet)?")


def drop_steps_from(dumps: str | Path, start: int) -> list[Path]:
    """Remove the committed steps ``>= start`` in ``dumps`` (a resumed run redoes them); the caller holds the lock.

    Matches the step folders ``stepNNNNNN[-rRRRRR]/`` and the flat ``stepNNNNNN-mbMMM.parquet``
    shards of older versions.
    """
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(Path(dumps).iterdir()):
            m = _STEP_ENTRY.fullmatch(entry.name)
            if m and int(m.group(1)) >= start:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(entry)
    return removed


def committed_steps(dumps: str | Path) -> list[int]:
    """The steps whose dumps are committed in ``dumps`` (step folders and older versions' flat shards)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return sorted({int(m.group(1)) for e in Path(dumps).iterdir() if (m := _STEP_ENTRY.fullmatch(e.name))})
    return []


def stop_line(signal_name: str, *, out: Path, started: bool, step: int | None, first: int, done: int,
              checkpoint: Path | None, resume_command: str | None = None, fresh_command: str | None = None) -> str:
    """The one line a stopped run prints: what is complete and how to continue, losing nothing.

    ``first``..``done - 1`` are the steps this launch completed (``done`` = the next step
    to run); ``checkpoint`` is the newest complete one in the folder. Steps complete with
    no checkpoint cannot be continued (``--resume`` refuses them): the line then suggests
    ``fresh_command`` (the command with ``--overwrite``), which keeps them in a dated folder.
    """
    if not started:
        return f"stopped by {signal_name} before the run started: nothing was written to {out}"
    during = f" during step {step}" if step is not None else ""
    if done > first:
        complete = f"steps {first}..{done - 1} are complete in {out} (metrics, dumps)"
    elif first > 0:
        complete = f"no step completed in this launch; steps 0..{first - 1} in {out} are as before"
    else:
        complete = f"no step completed; {out} holds the configuration only"
    resume = resume_command or "the same command with --resume"
    if checkpoint is not None:
        where = f"from {checkpoint.parent.name}/{checkpoint.name}"
        n = checkpoint.name.rsplit("-", 1)[-1]
        if n.isdigit() and int(n) + 1 < done:
            where += f"; steps {int(n) + 1}..{done - 1} are redone, the same numbers again"
    elif done > 0:
        again = fresh_command or "the same command with --overwrite"
        return (f"stopped by {signal_name}{during}; {complete}; no checkpoint yet, so they cannot be continued: "
                f"start again with: {again} (steps 0..{done - 1} move to {out.name}.old-<date>, nothing is deleted)")
    else:
        where = "from step 0: no checkpoint yet"
    return f"stopped by {signal_name}{during}; {complete}; continue with: {resume} ({where})"
