"""The dump reader's errors and warnings (one line naming the file, the column and the row)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DumpError", "DumpWarning", "first_line"]


class DumpError(ValueError):
    """Bad input: a one-line message naming the file, the column and the row."""

    def __init__(self, path: Path | str, message: str, column: str | None = None, row: int | None = None):
        where = str(path)
        if column is not None:
            where += f": column '{column}'"
        if row is not None:
            where += f", row {row}"
        super().__init__(f"{where}: {message}")
        self.path, self.column, self.row = str(path), column, row


class DumpWarning(UserWarning):
    """Input that is usable but whose provenance is missing or inconsistent."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
