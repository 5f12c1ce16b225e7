"""What a shard's columns must hold, and the tokens the reader makes of them.

The checks name the file, the column and the first offending row (:class:`DumpError`); the reader
(:mod:`icsd_audit.dumps.reader`) runs them on every row group it reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from icsd_audit.data_schemas import load_schema
from icsd_audit.tokens import Tokens

__all__ = ["DumpError", "DumpWarning", "REQUIRED", "INT_COLS", "FLOAT_COLS", "OPTIONAL_FLOATS", "first_line",
           "check_types", "check_values", "check_duplicates", "to_tokens"]

REQUIRED: tuple[str, ...] = tuple(load_schema(1)["required"])
INT_COLS = ("batch_id", "traj_id", "turn_id")
FLOAT_COLS = ("advantage", "ratio", "delta")
#: optional float columns that become token columns whenever a file has them (SPEC 1)
OPTIONAL_FLOATS = ("score_norm",)
#: optional float columns checked (float type; finite and >= 0 where read) whenever a file has them
_NONNEGATIVE_FLOATS = {"score_norm": "a norm", "entropy": "an entropy"}
_REQUIRED_BY = {"score_norm": "the 'fisher' allocator (SPEC 5: m = Phi_G(|A rho| score_norm))",
                "entropy": "--by entropy (SPEC 11: the student's next-token entropy)"}


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
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_types(path: Path, schema: pa.Schema, require: Sequence[str] = ()) -> None:
    names = set(schema.names)
    for col in REQUIRED:
        if col not in names:
            raise DumpError(path, f"required column missing (have: {', '.join(schema.names) or 'none'})", column=col)
    for col in require:
        if col not in names:
            raise DumpError(path, f"column missing; {_REQUIRED_BY.get(col, 'the requested computation')} needs it",
                            column=col)
    for col in _NONNEGATIVE_FLOATS:
        if col in names and not pa.types.is_floating(schema.field(col).type):
            raise DumpError(path, f"expected float16/32/64, got {schema.field(col).type}", column=col)
    for col in INT_COLS + ("pos",):
        if col in names and not pa.types.is_integer(schema.field(col).type):
            raise DumpError(path, f"expected an integer type, got {schema.field(col).type}", column=col)
    for col in FLOAT_COLS:
        if not pa.types.is_floating(schema.field(col).type):
            raise DumpError(path, f"expected float16/32/64, got {schema.field(col).type}", column=col)
    if "valid" in names and not pa.types.is_boolean(schema.field("valid").type):
        raise DumpError(path, f"expected bool, got {schema.field('valid').type}", column="valid")


def to_tokens(table: pa.Table, extra: Sequence[str]) -> Tokens:
    out: dict[str, np.ndarray] = {}
    for col in INT_COLS:
        out[col] = table.column(col).to_numpy().astype(np.int64)
    for col in FLOAT_COLS:
        out[col] = table.column(col).to_numpy().astype(np.float64)
    if "valid" in table.column_names:
        out["valid"] = table.column("valid").to_numpy(zero_copy_only=False).astype(bool, copy=False)
    else:
        out["valid"] = np.ones(table.num_rows, dtype=bool)
    columns: dict[str, np.ndarray] = {}
    if "pos" in table.column_names:
        columns["pos"] = table.column("pos").to_numpy().astype(np.int64, copy=False)
    for col in OPTIONAL_FLOATS:
        if col in table.column_names:
            columns[col] = table.column(col).to_numpy().astype(np.float64)
    for col in extra:
        if col in table.column_names and col != "valid" and not pa.types.is_nested(table.schema.field(col).type):
            columns[col] = table.column(col).to_numpy(zero_copy_only=False)
    return Tokens.from_mapping(out, columns=columns)


def check_values(path: Path, table: pa.Table, file_offset: int) -> None:
    for col in REQUIRED + tuple(c for c in ("valid", "pos") if c in table.column_names):
        if table.column(col).null_count:
            row = int(np.flatnonzero(table.column(col).is_null().to_numpy(zero_copy_only=False))[0])
            raise DumpError(path, "null value", column=col, row=file_offset + row)
    for col in FLOAT_COLS + tuple(c for c in _NONNEGATIVE_FLOATS if c in table.column_names):
        if col in _NONNEGATIVE_FLOATS and table.column(col).null_count:
            row = int(np.flatnonzero(table.column(col).is_null().to_numpy(zero_copy_only=False))[0])
            raise DumpError(path, "null value", column=col, row=file_offset + row)
        values = table.column(col).to_numpy()
        bad = ~np.isfinite(values)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise DumpError(path, f"{'NaN' if np.isnan(values[row]) else 'infinite'} value", column=col, row=file_offset + row)
        if col == "ratio" and not (values > 0).all():
            row = int(np.flatnonzero(~(values > 0))[0])
            raise DumpError(path, f"ratio {values[row]:g} is not > 0 (a ratio of two probabilities of a sampled "
                                  "token)", column=col, row=file_offset + row)
        if col in _NONNEGATIVE_FLOATS and (values < 0).any():
            row = int(np.flatnonzero(values < 0)[0])
            raise DumpError(path, f"negative value ({_NONNEGATIVE_FLOATS[col]})", column=col, row=file_offset + row)


def check_duplicates(paths: list[Path], batch: Any) -> None:
    t = batch.tokens
    if "pos" not in t.columns or batch.n_rows < 2:
        return
    pos = t.columns["pos"]
    keys = np.stack([t.traj_id, t.turn_id, pos])
    step = np.sign(np.diff(keys, axis=1))
    # Written dumps are sorted by (traj, turn, pos): then duplicates are neighbours
    # and no sort is needed; otherwise sort lexicographically (ties by input row).
    first_change = np.where(step[0] != 0, step[0], np.where(step[1] != 0, step[1], step[2]))
    if (first_change >= 0).all():
        order = np.arange(batch.n_rows)
    else:
        order = np.lexsort((batch.global_row, pos, t.turn_id, t.traj_id))
        keys = keys[:, order]
    dup = np.flatnonzero((keys[:, 1:] == keys[:, :-1]).all(axis=0))
    if dup.size:
        j = order[dup + 1]
        first = j[np.argmin(batch.global_row[j])]
        raise DumpError(
            paths[int(batch.file_index[first])],
            f"duplicate token row (batch {batch.batch_id}, traj {t.traj_id[first]}, turn {t.turn_id[first]}, pos {pos[first]})",
            column="pos",
            row=int(batch.file_row[first]),
        )
