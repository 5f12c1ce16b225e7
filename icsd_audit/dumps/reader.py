"""Reading token dumps: path resolution, validation, streaming one batch at a time.

Allocation statistics never cross ``batch_id``, so the reader holds one batch (plus
the row group it came from) in memory, whatever the size of the run.  It first
reads only the ``batch_id`` column of every row group to learn which batches live
where, then yields batches in order of first appearance, re-reading a row group
only when its batch spans several.  Every row group is validated when first read,
so the first bad row of the first bad file is the one reported; a row group that
cannot be decoded or whose page fails its checksum (:mod:`icsd_audit.parquet_io`) is
one line naming the file, the column and the row group.

The ``icsd.dump`` metadata of every file is checked when the reader opens it: a
foreign schema, an unknown major version or a blob that is not a JSON object is
refused; a file without the blob gets one warning (:class:`DumpWarning`), and so do
files whose synthetic flags disagree (recorded allocator settings are compared by the
audit that applies them, :mod:`icsd_audit.audit.settings`).
"""

from __future__ import annotations

import json
import re
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from icsd_audit.data_schemas import load_schema
from icsd_audit.dumps.columns import (INT_COLS, OPTIONAL_FLOATS, REQUIRED, DumpError, DumpWarning,
                                      check_duplicates, check_types, check_values, first_line, to_tokens)
from icsd_audit.dumps.resolve import resolve_paths
from icsd_audit.dumps.store import StoreFile, is_url, local_path
from icsd_audit.parquet_io import CorruptRowGroup, open_file, read_row_group
from icsd_audit.tokens import Tokens

__all__ = ["DumpError", "DumpWarning", "TokenBatch", "DumpReader", "read_dumps", "prefetch", "resolve_paths",
           "read_metadata", "check_metadata", "schema_names", "METADATA_KEY", "REQUIRED"]

_SCHEMA = load_schema(1)
METADATA_KEY: str = _SCHEMA["metadata_key"]
_SCHEMA_NAME = "icsd.token_dump"
_MAJOR = 1
#: the rank in a DumpWriter shard name (``part-000003-r00001.parquet``)
_RANK_TAG = re.compile(r".*-(?P<rank>r\d{5})\.parquet")


def _parse_metadata(path: Path | str, kv: dict | None) -> dict | None:
    """The ``icsd.dump`` blob (None when absent); a foreign or unknown-version blob is a DumpError."""
    raw = (kv or {}).get(METADATA_KEY.encode())
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DumpError(path, f"metadata '{METADATA_KEY}' is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise DumpError(path, f"metadata '{METADATA_KEY}' is not a JSON object")
    if meta.get("schema") != _SCHEMA_NAME:
        raise DumpError(path, f"metadata '{METADATA_KEY}' names schema {meta.get('schema')!r}, not {_SCHEMA_NAME!r}")
    version = meta.get("version")
    try:
        major = int(str(version).split(".")[0]) if not isinstance(version, bool) else None
    except ValueError:
        major = None
    if major != _MAJOR:
        raise DumpError(path, f"metadata '{METADATA_KEY}' has schema version {version!r}; this icsd reads major "
                              f"version {_MAJOR} (upgrade icsd to read newer dumps)")
    return meta


def _read_schema(path: Path | str | StoreFile) -> pa.Schema:
    if isinstance(path, StoreFile):
        return pq.read_schema(path.path, filesystem=path.fs)
    if is_url(path) and local_path(path) is None:
        return _read_schema(resolve_paths([path])[0])
    return pq.read_schema(local_path(path))


def read_metadata(path: Path | str | StoreFile) -> dict:
    """The checked ``icsd.dump`` JSON blob of one file ({} when absent)."""
    try:
        kv = _read_schema(path).metadata
    except (pa.ArrowException, OSError) as exc:
        raise DumpError(path, f"not a readable Parquet file ({first_line(exc)})") from None
    return _parse_metadata(path, kv) or {}


def check_metadata(paths: Sequence[Path], metas: Sequence[dict | None]) -> None:
    """Warn once about files without provenance and about files whose synthetic flags disagree.

    Recorded allocator settings are compared where an audit applies them
    (:mod:`icsd_audit.audit.settings`): files that differ in a setting that changes
    coefficients are refused there, not pooled with a warning.
    """
    missing = [p for p, m in zip(paths, metas) if m is None]
    if missing:
        more = f" and {len(missing) - 1} more file(s)" if len(missing) > 1 else ""
        warnings.warn(f"{missing[0]}{more}: no '{METADATA_KEY}' metadata; provenance (producer, allocator, "
                      "synthetic flag) unknown; an audit uses its default allocator settings, or those the other "
                      "inputs record", DumpWarning, stacklevel=3)
    for key in ("synthetic",):
        groups: dict[str, list[Path]] = {}
        for p, m in zip(paths, metas):
            if m is not None:
                groups.setdefault(json.dumps(m.get(key), sort_keys=True, default=str), []).append(p)
        if len(groups) > 1:
            parts = [f"{files[0]}{f' (+{len(files) - 1} more)' if len(files) > 1 else ''}: {value}"
                     for value, files in groups.items()]
            warnings.warn(f"input files record different {key} settings, pooled anyway: " + "; ".join(parts),
                          DumpWarning, stacklevel=3)


def schema_names(paths: Sequence[str | Path]) -> set[str]:
    """Every column name in any of the dumps at ``paths`` (footers only)."""
    names: set[str] = set()
    for path in resolve_paths(paths):
        try:
            names.update(_read_schema(path).names)
        except (pa.ArrowException, OSError) as exc:
            raise DumpError(path, f"not a readable Parquet file ({first_line(exc)})") from None
    return names


@dataclass(frozen=True)
class TokenBatch:
    """One batch's rows and where they came from.

    ``tokens`` holds the required columns as numpy (int64 ids, float64 values, bool
    ``valid``) plus, in ``tokens.columns``, ``pos`` and the optional scalar columns the
    reader was asked for; ``table`` the rows as read (every requested column, for
    pass-through); ``file_index`` / ``file_row`` / ``global_row`` each row's origin.
    """

    batch_id: int
    tokens: Tokens
    table: pa.Table
    file_index: np.ndarray
    file_row: np.ndarray
    global_row: np.ndarray

    @property
    def n_rows(self) -> int:
        return int(self.global_row.size)


@dataclass(frozen=True)
class _Group:
    file: int
    index: int
    rows: int
    file_offset: int
    global_offset: int


class DumpReader:
    """Streams validated batches from files or directories of token dumps.

    ``columns``: extra columns to carry in ``TokenBatch.table`` besides the required
    ones (None: every column, as ``icsd audit coeffs`` needs for pass-through).
    ``require``: optional columns the caller cannot do without (e.g. ``score_norm`` for
    the ``fisher`` allocator); a file lacking one is a one-line :class:`DumpError`.
    The optional ``score_norm`` column is carried in ``tokens.columns`` whenever a file
    has it (checked finite and non-negative).
    """

    def __init__(self, paths: Sequence[str | Path], *, columns: Sequence[str] | None = (),
                 require: Sequence[str] = ()):
        opened = []
        for path in resolve_paths(paths):
            try:
                pf = open_file(path.open() if isinstance(path, StoreFile) else path)
            except (pa.ArrowException, OSError) as exc:
                raise DumpError(path, f"not a readable Parquet file ({first_line(exc)})") from None
            check_types(path, pf.schema_arrow, require)
            meta = _parse_metadata(path, pf.schema_arrow.metadata)
            groups, offset = [], 0
            for gi in range(pf.num_row_groups):
                n = pf.metadata.row_group(gi).num_rows
                if n == 0:
                    continue
                col = _read_group(pf, path, gi, ["batch_id"], offset).column(0)
                if col.null_count:
                    row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                    raise DumpError(path, "null value", column="batch_id", row=offset + row)
                ids = col.to_numpy()
                # (return_counts skips NumPy's lazy import of numpy.ma, ~10 ms)
                uniq, counts = np.unique(ids, return_counts=True)
                groups.append((gi, n, offset, uniq.tolist(), counts.tolist()))
                offset += n
            opened.append((path, pf, meta, groups))
        opened = _drop_superseded(opened)
        self.paths = [o[0] for o in opened]
        self._files = [o[1] for o in opened]
        self._metas: list[dict | None] = [o[2] for o in opened]
        self._groups: list[_Group] = []
        self._batches: "OrderedDict[int, list[int]]" = OrderedDict()
        total = 0
        self._batch_rows: dict[int, int] = {}
        for fi, (_, _, _, groups) in enumerate(opened):
            for gi, n, offset, ids, counts in groups:
                group_no = len(self._groups)
                self._groups.append(_Group(fi, gi, n, offset, total))
                for b, rows in zip(ids, counts):
                    self._batches.setdefault(int(b), []).append(group_no)
                    self._batch_rows[int(b)] = self._batch_rows.get(int(b), 0) + int(rows)
                total += n
        if total == 0:
            raise DumpError(self.paths[0] if len(self.paths) == 1 else ", ".join(map(str, self.paths)), "input holds no rows")
        check_metadata(self.paths, self._metas)
        self._check_integer_mix(None if columns is None else [*INT_COLS, "pos", *columns])
        self.n_rows = total
        self.schema = self._files[0].schema_arrow
        self._columns = None if columns is None else list(dict.fromkeys([*REQUIRED, "valid", "pos", *OPTIONAL_FLOATS,
                                                                         *columns]))
        # optional scalar columns that become token columns (None: read all, convert only pos)
        self._extra = () if columns is None else tuple(c for c in dict.fromkeys(columns) if c not in REQUIRED)
        self._cache: "OrderedDict[int, pa.Table]" = OrderedDict()

    def _check_integer_mix(self, names: Sequence[str] | None) -> None:
        """Refuse, before any batch is read, uint64 values >= 2**63 where other files give the column a signed type.

        Such values have no common integer type with the other files (pooling would
        wrap them onto negative ids); found from the row-group statistics, reading
        the column only where those are missing or show such a value.
        """
        schemas = self.schemas
        for name in dict.fromkeys(names if names is not None else [n for s in schemas for n in s.names]):
            types = [(s.field(name).type if name in s.names else None) for s in schemas]
            signed = next((i for i, t in enumerate(types) if t is not None and pa.types.is_signed_integer(t)), None)
            if signed is None:
                continue
            for fi, t in enumerate(types):
                if t is not None and pa.types.is_uint64(t):
                    hit = _first_beyond_int64(self._files[fi], self.paths[fi], name)
                    if hit is not None:
                        raise DumpError(self.paths[fi], f"value {hit[1]} does not fit {types[signed]}, this column's "
                                        f"type in {self.paths[signed]}; integer columns mixed across files must share "
                                        "a type (ids are int64, SPEC 1)", column=name, row=hit[0])

    @property
    def batch_ids(self) -> list[int]:
        return list(self._batches)

    def largest_batch(self) -> tuple[int, int]:
        """(batch id, rows) of the batch with the most rows (known from the ``batch_id`` column read at open)."""
        b = max(self._batch_rows, key=self._batch_rows.__getitem__)
        return b, self._batch_rows[b]

    def metadata(self) -> list[dict]:
        """Each file's checked ``icsd.dump`` blob ({} where absent)."""
        return [dict(m) if m is not None else {} for m in self._metas]

    @property
    def schemas(self) -> list[pa.Schema]:
        """Each file's Arrow schema, in input order."""
        return [pf.schema_arrow for pf in self._files]

    def row_groups(self) -> Iterator[tuple[Path, int, pa.Table]]:
        """Every row group in input order, as (file, global row offset, table)."""
        for gno, grp in enumerate(self._groups):
            yield self.paths[grp.file], grp.global_offset, self._load(gno)

    def column_groups(self, names: Sequence[str], *, workers: int = 1) -> Iterator[pa.Table]:
        """Only the named columns (those a file has) of every row group, in input order, unchecked.

        For a light first pass over the values (e.g. the landscape's ranks): nothing is
        validated here, so a caller must still stream the checked batches afterwards.
        ``workers`` > 1: that many threads read ahead, a file each (its row groups in order;
        no file is read by two threads at once), at most ``workers`` files at a time.
        """
        def read(fi: int) -> list[pa.Table]:
            pf, path = self._files[fi], self.paths[fi]
            cols = [c for c in names if c in pf.schema_arrow.names]
            return [_read_group(pf, path, g.index, cols, g.file_offset) for g in self._groups if g.file == fi]

        files = list(dict.fromkeys(g.file for g in self._groups))
        if workers <= 1 or len(files) < 2:
            for fi in files:
                yield from read(fi)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="icsd-columns") as pool:
            pending: deque = deque()
            for fi in files:
                pending.append(pool.submit(read, fi))
                if len(pending) >= workers:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()

    def _load(self, gno: int) -> pa.Table:
        if gno in self._cache:
            self._cache.move_to_end(gno)
            return self._cache[gno]
        grp = self._groups[gno]
        pf, path = self._files[grp.file], self.paths[grp.file]
        cols = None if self._columns is None else [c for c in self._columns if c in pf.schema_arrow.names]
        table = _read_group(pf, path, grp.index, cols, grp.file_offset)
        check_values(path, table, grp.file_offset)
        self._cache[gno] = table
        while len(self._cache) > 2:
            self._cache.popitem(last=False)
        return table

    def __iter__(self) -> Iterator[TokenBatch]:
        for b in self._batches:
            yield self.batch(b)

    def batch(self, b: int) -> TokenBatch:
        """The validated batch ``b`` alone (reads only the row groups holding it)."""
        if b not in self._batches:
            raise KeyError(f"no batch {b} in these dumps")
        gnos = self._batches[b]
        parts, fidx, frow, grow = [], [], [], []
        for gno in gnos:
            grp = self._groups[gno]
            table = self._load(gno)
            ids = table.column("batch_id").to_numpy()
            if ids[0] == b and ids[-1] == b and (ids == b).all():
                # the whole row group (the usual case): no copy, and no pyarrow.compute import
                sel = np.arange(table.num_rows)
                parts.append(table)
            else:
                sel = np.flatnonzero(ids == b)
                parts.append(table.take(pa.array(sel)))
            fidx.append(np.full(sel.size, grp.file, dtype=np.int32))
            frow.append(grp.file_offset + sel)
            grow.append(grp.global_offset + sel)
        table = pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]
        batch = TokenBatch(
            batch_id=b,
            tokens=to_tokens(table, self._extra),
            table=table,
            file_index=np.concatenate(fidx),
            file_row=np.concatenate(frow),
            global_row=np.concatenate(grow),
        )
        check_duplicates(self.paths, batch)
        return batch


def _drop_superseded(opened: list) -> list:
    """The files minus those whose every batch a later writer session wrote again in the same folder.

    The rule for folders a run was resumed or restarted into (docs/dumps.md, "Re-written
    batches"): a DumpWriter records a random ``session`` per instance (one launch) in
    its shards. A batch id that a later session of the same folder and writer rank
    (``-rNNNNN`` in the name) holds too is that batch written again: its latest write
    counts, and a shard all of whose batches were written again is skipped whole (one
    warning names the first and how many). "Later" is the reader's order (sorted paths),
    chronological for DumpWriter's names. Shards of one session may split a batch; files
    without a session (older versions, other writers) are never skipped.
    """
    winner: dict[tuple[Path, str | None], dict[int, tuple[str, Path]]] = {}
    skipped: list[tuple[Path, Path, list[int]]] = []
    keep = []
    for path, pf, meta, groups in reversed(opened):
        session = meta.get("session") if isinstance(meta, dict) else None
        if not isinstance(session, str):
            keep.append((path, pf, meta, groups))
            continue
        rank = m.group("rank") if (m := _RANK_TAG.fullmatch(path.name)) else None
        won = winner.setdefault((path.parent, rank), {})
        ids = sorted({b for g in groups for b in g[3]})
        for b in ids:
            won.setdefault(b, (session, path))
        if ids and all(won[b][0] != session for b in ids):
            skipped.append((path, won[ids[0]][1], ids))
        else:
            keep.append((path, pf, meta, groups))
    if skipped:
        path, by, ids = skipped[-1]  # the first in input order
        shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
        more = f" ({len(skipped) - 1} more shard(s) likewise)" if len(skipped) > 1 else ""
        warnings.warn(f"{path}: batch(es) {shown} written again later ({by}); this earlier shard is skipped, the "
                      f"latest write of a batch counts (a resumed or restarted run){more}", DumpWarning, stacklevel=3)
    return keep[::-1]


def _read_group(pf: pq.ParquetFile, path: Path, index: int, columns: list[str] | None, file_offset: int) -> pa.Table:
    """One row group; a page that fails its checksum or cannot be decoded is a DumpError naming the column."""
    try:
        return read_row_group(pf, index, columns)
    except CorruptRowGroup as exc:
        raise DumpError(path, f"corrupt data in row group {index}, which cannot be read ({exc.reason})",
                        column=exc.column, row=file_offset) from None


def _first_beyond_int64(pf: pq.ParquetFile, path: Path, name: str) -> tuple[int, int] | None:
    """(file row, value) of the first value >= 2**63 of the uint64 column ``name`` (None if there is none)."""
    md = pf.metadata
    leaf = next((j for j in range(md.num_columns) if md.schema.column(j).path == name), None)
    offset = 0
    for gi in range(md.num_row_groups):
        n = md.row_group(gi).num_rows
        stats = md.row_group(gi).column(leaf).statistics if leaf is not None else None
        if n and not (stats is not None and stats.has_min_max and int(stats.max) < 2**63):
            import pyarrow.compute as pc

            col = _read_group(pf, path, gi, [name], offset).column(0)
            bad = np.flatnonzero(pc.fill_null(pc.greater_equal(col, pa.scalar(2**63, pa.uint64())), False)
                                 .to_numpy(zero_copy_only=False))
            if bad.size:
                return offset + int(bad[0]), int(col[int(bad[0])].as_py())
        offset += n
    return None


def read_dumps(paths: Sequence[str | Path] | str | Path, *, columns: Sequence[str] = ()) -> Iterator[Tokens]:
    """Validated tokens of each batch of the dumps at ``paths``, one batch at a time.

    ``columns``: optional per-token columns to carry in ``Tokens.columns`` (e.g.
    ``["step", "env"]``); ``pos`` comes whenever the dumps have it.

    >>> for tokens in read_dumps("runs/cpu-demo/dumps"):          # doctest: +SKIP
    ...     out = allocate(tokens, allocator="icsd")
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for batch in DumpReader(paths, columns=list(columns)):
        yield batch.tokens


_Item = TypeVar("_Item")


def prefetch(batches: Iterator[_Item]) -> Iterator[_Item]:
    """Read the next batch (or row group) in a background thread while the caller works on this one.

    Parquet decoding releases the GIL, so reading overlaps allocation and the
    per-turn reduction; at most two batches are in memory.  Errors surface in order.
    """
    from concurrent.futures import ThreadPoolExecutor

    it = iter(batches)
    done = object()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(next, it, done)
        while True:
            batch = pending.result()
            if batch is done:
                return
            pending = pool.submit(next, it, done)
            yield batch  # type: ignore[misc]


