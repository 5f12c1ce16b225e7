"""A run's JSON Lines files (``metrics.jsonl``, ``eval.jsonl``) read line by line, within bounds.

Each line is read with at most :data:`MAX_LINE_BYTES` bytes (a longer one is refused in
one line naming the file, the line and the constant, before the rest of it is read),
decoded as UTF-8 and parsed on its own; only the keys the caller keeps (and ``step``)
stay in memory, so a file's size bounds the time but never the memory of a comparison,
whatever a line holds. Anything a line cannot be read as is one :class:`RunError` naming
the file and the line: bytes that are not UTF-8, JSON that does not parse or nests
deeper than the parser recurses, a value that is not an object. A last line cut short
(a crash mid-write: invalid JSON with nothing after it) is dropped.
"""

from __future__ import annotations

import contextlib
import io
import json
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # (the dumps package imports pyarrow, which reading local runs never needs)
    from icsd_audit.dumps.store import StoreFile

__all__ = ["RunError", "MAX_LINE_BYTES", "read_records"]

#: The longest line of a run's JSONL file read (bytes): a metrics record is a few KiB.
MAX_LINE_BYTES = 16 * 2**20


class RunError(ValueError):
    """A run folder that cannot be read: one line naming the file (and line) and what is wrong."""


def _lines(path: Path | StoreFile) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, bytes, whether it is the file's last line) of each line, none longer than the limit."""
    with contextlib.ExitStack() as stack:
        fh = stack.enter_context(path.open("rb"))
        if not isinstance(path, Path):  # a store's file reads whole lines only: buffer it to read within the limit
            fh = stack.enter_context(io.BufferedReader(fh))
        number, line = 0, fh.readline(MAX_LINE_BYTES + 1)
        while line:
            number += 1
            if len(line) > MAX_LINE_BYTES and not (len(line) == MAX_LINE_BYTES + 1 and line.endswith(b"\n")):
                limit = f"{MAX_LINE_BYTES // 2**20} MiB" if MAX_LINE_BYTES % 2**20 == 0 else f"{MAX_LINE_BYTES:,} bytes"
                raise RunError(f"{path}: line {number} is longer than {limit}, the limit per line (MAX_LINE_BYTES "
                               "in icsd_audit/runs/jsonl.py); a metrics record is a few KiB")
            following = fh.readline(MAX_LINE_BYTES + 1)
            yield number, line, not following
            line = following


def read_records(path: Path | StoreFile, *, keep: Callable[[str], bool] | None = None
                 ) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
    """(line number, record) of each JSON object line of ``path``, and whether any line held an ``eval/`` key.

    ``keep``: the keys to keep besides ``step`` (None: all); it is asked once per distinct key.
    An absent file has no records. ``path`` may be an object of a store (read through fsspec).
    """
    if not path.is_file():
        return [], False
    out: list[tuple[int, dict[str, Any]]] = []
    kept: set[str] = {"step"}
    dropped: set[str] = set()
    saw_eval = False
    for number, raw, last in _lines(path):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RunError(f"{path}: line {number} is not UTF-8 text (byte {exc.start + 1} of the line); "
                           "expected JSON Lines") from None
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except ValueError:
            if last:
                break  # torn by a crash mid-write
            raise RunError(f"{path}: line {number} is not valid JSON") from None
        except RecursionError:
            raise RunError(f"{path}: line {number} nests JSON deeper than can be read") from None
        if not isinstance(rec, dict):
            raise RunError(f"{path}: line {number} is not a JSON object")
        new = rec.keys() - kept - dropped
        if new:
            saw_eval = saw_eval or any(map(str.startswith, new, repeat("eval/")))
            accepted = new if keep is None else set(filter(keep, new))
            kept |= accepted
            dropped |= new - accepted
        if dropped and not dropped.isdisjoint(rec.keys()):
            rec = {k: rec[k] for k in rec.keys() & kept}
        out.append((number, rec))
    return out, saw_eval
