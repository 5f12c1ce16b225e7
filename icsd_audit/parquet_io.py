"""Parquet with page checksums: every file icsd writes carries a CRC-32 per page, every read checks it.

Every Parquet writer in icsd goes through :func:`write_table` or :func:`writer`, every
reader through :func:`open_file` or :func:`read_table`. Written pages carry the CRC-32
of their bytes (``write_page_checksum``); reading verifies it
(``page_checksum_verification``), so a flipped bit in a page is an error, never a
different number: zstd frames as written carry no checksum of their own, and unverified,
a one-bit flip in the middle of a zstd float page reads back as other values. Files written without
checksums (older icsd versions, other tools) read as before, unverified.

:func:`read_row_group` raises :class:`CorruptRowGroup` naming the column whose page
fails (pyarrow's own message names only the page's ordinal).
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["WRITE_OPTIONS", "CorruptRowGroup", "write_table", "writer", "open_file", "read_table", "read_row_group",
           "corrupt_column"]

#: What every icsd Parquet writer passes to pyarrow, beside its own options.
WRITE_OPTIONS: dict[str, Any] = {"write_page_checksum": True}
_READ_OPTIONS: dict[str, Any] = {"page_checksum_verification": True}


class CorruptRowGroup(OSError):
    """A row group that cannot be read: ``column`` (None if no single column fails alone) and ``reason``."""

    def __init__(self, row_group: int, column: str | None, reason: str):
        super().__init__(f"corrupt data in row group {row_group}" + (f", column {column!r}" if column else "")
                         + f" ({reason})")
        self.row_group, self.column, self.reason = row_group, column, reason


def write_table(table: pa.Table, where: str | Path | IO[bytes], **options: Any) -> None:
    """``pq.write_table`` with page checksums."""
    pq.write_table(table, where, **options, **WRITE_OPTIONS)


def writer(where: str | Path | IO[bytes], schema: pa.Schema, **options: Any) -> pq.ParquetWriter:
    """``pq.ParquetWriter`` with page checksums."""
    return pq.ParquetWriter(where, schema, **options, **WRITE_OPTIONS)


def open_file(source: str | Path | IO[bytes] | pa.NativeFile) -> pq.ParquetFile:
    """``pq.ParquetFile`` whose every page read is checked against its checksum (where the file has them)."""
    return pq.ParquetFile(source, **_READ_OPTIONS)


def read_table(source: str | Path, *, columns: Sequence[str] | None = None) -> pa.Table:
    """``pq.read_table`` of one file, its page checksums checked."""
    return open_file(source).read(columns=None if columns is None else list(columns))


def read_row_group(pf: pq.ParquetFile, index: int, columns: Sequence[str] | None = None) -> pa.Table:
    """One row group of ``pf``; :class:`CorruptRowGroup` when a page fails or a column's row count is off."""
    expected = pf.metadata.row_group(index).num_rows
    try:
        table = pf.read_row_group(index, columns=None if columns is None else list(columns))
        if table.num_rows == expected:
            return table
        reason = f"{table.num_rows} rows where the footer says {expected}"
    except (pa.ArrowException, OSError, EOFError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    raise CorruptRowGroup(index, corrupt_column(pf, index, columns), reason)


def corrupt_column(pf: pq.ParquetFile, row_group: int, columns: Sequence[str] | None = None) -> str | None:
    """The first of ``columns`` (default: all) whose pages in ``row_group`` fail; None if each reads alone.

    Called after a read of several columns failed: reading them one at a time names the
    column that holds the bad page. A column that reads alone but with another row count
    than the footer's (a flipped count in a page header) is the bad one.
    """
    names = list(columns) if columns is not None else list(pf.schema_arrow.names)
    rows = pf.metadata.row_group(row_group).num_rows
    for name in names:
        try:
            if pf.read_row_group(row_group, columns=[name]).num_rows != rows:
                return name
        except (pa.ArrowException, OSError, EOFError):
            return name
    return None
