"""Writing token dumps from any trainer (ours, verl, TRL): tensors in, Parquet shards out.

The writer knows nothing of our training loop.  It takes torch tensors or numpy
arrays, either flat per-token or padded ``(B, T)`` with a response mask (per-row
ids of shape ``(B,)`` are broadcast), sorts rows by (batch, trajectory, turn,
position) and writes one zstd shard per call through a temporary file and a rename,
so a crash never leaves a half-written shard where a reader would find it. Every page
carries a checksum (:mod:`icsd_audit.parquet_io`).

``out_dir`` may be a URL of an object store (``s3://``, ``gs://``, ``hf://``, ``memory://``;
:mod:`icsd_audit.dumps.store`): each shard is then one PUT of its complete bytes after
a check that its name is free, and a step commits by a marker object written last
(step shards carry the writer's session in their names), since a store has no rename.

A shard never replaces an existing file: it is published with a hard link, which
fails when the name is taken (then the next sequence number is tried).  Names are
``{prefix}-{seq:06d}-{tag}.parquet`` with ``tag`` the writer's ``rank`` (``r00003``)
or, without one, its process id (``p12345``), and ``seq`` continuing after the largest
in the directory; so two ranks or two processes sharing a directory, or a writer
restarted after a shard was deleted, never write over each other's batches, and the
sorted order of names (the reader's order) stays chronological.

Steps commit whole: ``with writer.step(k): ...`` (or ``s = writer.step(k)`` ...
``s.commit()``) writes the step's shards into a hidden staging folder and publishes
them together by renaming it to ``step{k:06d}/`` (``step{k:06d}-r{rank:05d}/`` with a
rank), so a reader sees all of a step's shards or none. A step written again (a
resumed run redoing it) replaces the earlier one. Temporaries name their host and
process (``.NAME.icsd-KIND-HOST-PID-*``): a writer opening a folder removes those of
processes that no longer run, and the reader skips them, warning about a staged step.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from icsd_audit.dumps.provenance import allocator_block, json_safe, producer_block
from icsd_audit.dumps.reader import METADATA_KEY
from icsd_audit.dumps.store import StoreError, local_path, marker_name, put_new, store_of
from icsd_audit.parquet_io import write_table

__all__ = ["DumpWriter", "StepCommit", "write_table_atomic", "metadata_json", "dump_metadata", "dictionary_columns", "step_folder_name"]

#: the Parquet codecs a dump shard may use (every Parquet reader decodes them)
_CODECS = ("zstd", "snappy", "none")

_ARROW_TYPES = {
    "batch_id": pa.int64(), "traj_id": pa.int64(), "turn_id": pa.int32(), "pos": pa.int32(),
    "step": pa.int64(), "token_id": pa.int32(), "valid": pa.bool_(), "fallback": pa.bool_(),
}


def dump_metadata(*, producer: Mapping[str, Any] | str, synthetic: bool, allocator: Mapping[str, Any] | Any = None,
                  **extra: Any) -> dict[str, Any]:
    """The JSON blob stored under ``icsd.dump`` in every shard's key-value metadata.

    ``producer`` and ``allocator`` become SPEC 9's complete blocks
    (:func:`~icsd_audit.dumps.provenance.producer_block`,
    :func:`~icsd_audit.dumps.provenance.allocator_block`: every key present, ``None``
    where unknown); ``extra`` keys follow, with non-finite numbers written as ``None``.
    """
    prod = producer_block(producer)
    return {"schema": "icsd.token_dump", "version": 1, "producer": prod, "synthetic": bool(synthetic),
            "allocator": allocator_block(allocator), **json_safe(extra)}


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """Columns worth dictionary encoding: ids and labels, never continuous floats.

    Dictionary pages for high-cardinality floats cost time and space for nothing
    (measured on 2M synthetic rows: 862 ms / 84 MB with, 501 ms / 64 MB without).
    """
    return [f.name for f in schema if not (pa.types.is_floating(f.type) or pa.types.is_fixed_size_list(f.type))]


def metadata_json(metadata: Mapping[str, Any]) -> bytes:
    """The bytes stored under the shard metadata key for ``metadata`` (:func:`json_safe`, sorted keys)."""
    return json.dumps(json_safe(metadata), sort_keys=True, allow_nan=False).encode()


def write_table_atomic(table: pa.Table, path: str | Path, *, metadata: Mapping[str, Any] | bytes | None = None,
                       row_group_size: int = 1 << 17, compression: str = "zstd", exclusive: bool = False) -> Path:
    """Write ``table`` to ``path`` through a temporary file in the same directory, then rename.

    ``metadata``: the ``icsd.dump`` block, or its bytes from :func:`metadata_json`.
    ``exclusive``: never replace an existing ``path`` (raise :class:`FileExistsError`);
    the complete file is published with a hard link, atomic on POSIX file systems.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if exclusive and os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, "shard exists; a dump writer never replaces a file", str(path))
    table = _with_metadata(table, metadata)
    from icsd_audit.outputs import temp_prefix

    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "shard"), dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600; a published dump gets the mode any new file would get.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        try:
            write_table(table, tmp, row_group_size=row_group_size, compression=compression,
                        use_dictionary=dictionary_columns(table.schema))
        except OSError as exc:  # a full disk: name the shard asked for, not the temporary (removed below)
            from icsd_audit.outputs import write_failed

            raise write_failed(exc, path) from None
        if exclusive:
            _publish_exclusive(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def _with_metadata(table: pa.Table, metadata: Mapping[str, Any] | bytes | None) -> pa.Table:
    if metadata is None:
        return table
    kv = dict(table.schema.metadata or {})
    kv[METADATA_KEY.encode()] = metadata if isinstance(metadata, bytes) else metadata_json(metadata)
    return table.replace_schema_metadata(kv)


def _shard_bytes(table: pa.Table, *, metadata: Mapping[str, Any] | bytes | None, row_group_size: int,
                 compression: str = "zstd") -> bytes:
    """A complete shard in memory, for a store where an object is created by one PUT."""
    table = _with_metadata(table, metadata)
    sink = pa.BufferOutputStream()
    write_table(table, sink, row_group_size=row_group_size, compression=compression,
                use_dictionary=dictionary_columns(table.schema))
    return sink.getvalue().to_pybytes()


def _publish_exclusive(tmp: str, path: Path) -> None:
    """Give the complete file ``tmp`` the name ``path`` unless that name is taken."""
    try:
        os.link(tmp, path)  # fails with EEXIST, never replaces
        return
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "shard exists; a dump writer never replaces a file", str(path)) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
    # no hard links on this file system: claim the name first, then rename over our own claim
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.replace(tmp, path)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().to("cpu")
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


class DumpWriter:
    """Append-only shard writer: ``write(...)`` once per actor mini-batch.

    ``float_dtype`` is the storage type of value columns (float32 keeps dumps small;
    the audit reads them back as float64).  Columns beyond the schema pass through;
    2-D per-token arrays (e.g. gradient sketches) become fixed-size float32 lists.
    ``rank``: the data-parallel rank of a distributed trainer, part of every shard
    name (default: the process id), so writers sharing ``out_dir`` never collide.

    Provenance (SPEC 9): ``allocation`` holds the deployed allocator settings (a
    mapping or a dataclass such as :class:`~icsd_audit.alloc.options.AllocatorOptions`;
    ``allocator`` is the same argument under its older name), written as the complete
    ``allocator`` block of every shard, ``None`` for what it does not say; ``producer``
    (a name or a mapping with ``engine``, ``engine_version`` and free keys) becomes the
    ``producer`` block, with ``rank`` and ``world_size``.  ``write(allocation=...)``
    replaces the block for one shard, for a producer whose settings change per call.
    ``null_nan``: optional float columns whose NaN values are written as nulls (no value there).
    ``compression``: the Parquet codec of every shard (``zstd``, the smallest files; ``snappy``
    costs about 1 ms less per shard of a few hundred rows for 7-14 % more bytes, the choice of a
    recorder writing one small shard per training step).
    """

    def __init__(self, out_dir: str | Path, *, producer: Mapping[str, Any] | str, synthetic: bool = False,
                 allocation: Mapping[str, Any] | Any = None, allocator: Mapping[str, Any] | Any = None,
                 metadata: Mapping[str, Any] | None = None, prefix: str = "part", row_group_size: int = 1 << 17,
                 float_dtype: Any = np.float32, rank: int | None = None, world_size: int | None = None,
                 null_nan: tuple[str, ...] = (), compression: str = "zstd"):
        if rank is not None and (isinstance(rank, bool) or int(rank) != rank or rank < 0):
            raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
        if allocation is not None and allocator is not None:
            raise ValueError("give the deployed settings once: allocation= (allocator= is its older name)")
        local = local_path(out_dir)
        self._store: tuple[Any, str] | None = None if local is not None else store_of(str(out_dir))
        self.out_dir: Path | str = local if local is not None else str(out_dir).rstrip("/")
        prod = producer_block(producer, rank=None if rank is None else int(rank), world_size=world_size)
        self.metadata = dump_metadata(producer=prod, synthetic=synthetic,
                                      allocator=allocation if allocation is not None else allocator,
                                      **dict(metadata or {}))
        # one id per writer (one launch): a later session's shard of a batch replaces an earlier one (reader.py)
        self.metadata.setdefault("session", secrets.token_hex(8))
        self.prefix, self.row_group_size, self.float_dtype = prefix, row_group_size, float_dtype
        self.null_nan = frozenset(null_nan)
        if compression not in _CODECS:
            raise ValueError(f"compression must be one of {', '.join(_CODECS)}, got {compression!r}")
        self.compression = compression
        self.rank = None if rank is None else int(rank)
        self.tag = f"r{self.rank:05d}" if self.rank is not None else f"p{os.getpid()}"
        self._stage: Path | str | None = None
        self._stage_target: Path | str | None = None  # the step folder the staged shards will be published as
        self._meta_cache: tuple[dict[str, Any], bytes] | None = None
        self._taken = re.compile(rf"{re.escape(prefix)}-(\d+)(?:-[^.]*)?\.parquet")
        if self._store is not None:
            # a step's shards and its commit marker carry this (dumps/store.py): unique to this writer
            self._commit_id = secrets.token_hex(8)
            self._staged_names: list[str] = []
            self._seq = self._next_seq(self._store[1])
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        from icsd_audit.outputs import remove_stale

        remove_stale(self.out_dir)  # shards and staged steps of writers killed in this folder
        seqs = [int(m.group(1)) for q in self.out_dir.iterdir() if (m := self._taken.fullmatch(q.name))]
        self._seq = max(seqs) + 1 if seqs else 0

    def _next_seq(self, folder: str) -> int:
        """One past the largest shard number in a store's ``folder`` (0 when it holds none or does not exist)."""
        fs = self._store[0]
        try:
            names = [x.rstrip("/").rsplit("/", 1)[-1] for x in fs.ls(folder, detail=False)]
        except FileNotFoundError:
            names = []
        except OSError as exc:
            raise StoreError(str(self.out_dir), f"cannot list this location ({exc})") from None
        seqs = [int(m.group(1)) for q in names if (m := self._taken.fullmatch(q))]
        return max(seqs) + 1 if seqs else 0

    def _write_remote(self, table: pa.Table, meta: Mapping[str, Any], name: str | None) -> str:
        fs, root = self._store
        folder = self._stage if self._stage is not None else str(self.out_dir)
        fpath = root + folder[len(str(self.out_dir)):]
        data = _shard_bytes(table, metadata=meta, row_group_size=self.row_group_size, compression=self.compression)
        # the writer's id in every name (``-s``: a step shard, taken once its marker names it; ``-w``: a lone shard)
        session = f"-{'s' if self._stage is not None else 'w'}{self._commit_id}"
        while True:
            shard = name if name is not None else f"{self.prefix}-{self._seq:06d}{session}-{self.tag}.parquet"
            try:
                put_new(fs, f"{fpath}/{shard}", data, f"{folder}/{shard}")
            except FileExistsError:
                if name is not None:
                    raise
                self._seq += 1
                continue  # another writer holds this name: take the next
            if name is None:
                self._seq += 1
            if self._stage is not None:
                self._staged_names.append(shard)
            return f"{folder}/{shard}"

    def write(self, *, batch_id: Any, traj_id: Any, turn_id: Any, advantage: Any, ratio: Any, delta: Any,
              mask: Any = None, name: str | None = None, allocation: Mapping[str, Any] | Any = None,
              **columns: Any) -> Path | str:
        """Write one shard and return its path (its URL on a store; never replacing an existing file).

        An explicit ``name`` that exists raises :class:`FileExistsError`.  With ``mask`` (shape ``(B, T)``), every 2-D input is read at the masked
        positions, 1-D inputs of length ``B`` are per-row values, and ``pos``
        defaults to the token's index among its row's masked positions.  Without
        it, every input is flat of the same length (scalars broadcast).
        ``allocation``: this shard's deployed settings, in place of the writer's.
        """
        meta = self.metadata if allocation is None else {**self.metadata, "allocator": allocator_block(allocation)}
        if allocation is None:  # one writer's shards share their metadata: encode it once (a step's shard is small)
            if self._meta_cache is None or self._meta_cache[0] != meta:  # the block may be edited between shards
                self._meta_cache = (copy.deepcopy(meta), metadata_json(meta))
            meta = self._meta_cache[1]
        cols: dict[str, Any] = dict(batch_id=batch_id, traj_id=traj_id, turn_id=turn_id, advantage=advantage,
                                    ratio=ratio, delta=delta, **columns)
        arrays = self._flatten(cols, None if mask is None else _to_numpy(mask).astype(bool))
        order = np.lexsort(tuple(arrays[k] for k in ("pos", "turn_id", "traj_id", "batch_id") if k in arrays))
        table = pa.table({k: self._arrow(k, v[order]) for k, v in arrays.items()})
        if self._store is not None:
            return self._write_remote(table, meta, name)
        write = dict(metadata=meta, row_group_size=self.row_group_size, exclusive=True, compression=self.compression)
        folder = self._stage if self._stage is not None else self.out_dir
        if self._stage is not None:  # a private staging folder: no reader sees it before the step's rename
            return self._write_staged(table, meta, name)
        if name is not None:
            return write_table_atomic(table, folder / name, **write)
        while True:
            path = folder / f"{self.prefix}-{self._seq:06d}-{self.tag}.parquet"
            self._seq += 1
            try:
                return write_table_atomic(table, path, **write)
            except FileExistsError:
                continue  # another writer (same rank, reused pid) holds this name: take the next

    def _write_staged(self, table: pa.Table, meta: bytes | Mapping[str, Any], name: str | None) -> Path:
        """A shard written in place in this writer's staging folder.

        The folder is this writer's own, hidden, and published whole by one rename (or
        discarded, and a killed writer's removed as stale), so a half-written shard there is
        never read: the temporary file and hard link that guard a shard written straight into
        a dump folder (:func:`write_table_atomic`) would only cost time.  Names are still
        claimed exclusively.  A shard of up to one row group is encoded in memory and written in
        one call (cheaper than pyarrow's file writes for the few hundred rows of a training step).
        """
        path = self._stage / (name if name is not None else f"{self.prefix}-{self._seq:06d}-{self.tag}.parquet")
        if name is None:
            self._seq += 1
        table = _with_metadata(table, meta)
        opts = dict(row_group_size=self.row_group_size, compression=self.compression,
                    use_dictionary=dictionary_columns(table.schema))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mode: what any new file gets
        try:
            with os.fdopen(fd, "wb") as fh:
                if table.num_rows <= self.row_group_size:
                    sink = pa.BufferOutputStream()
                    write_table(table, sink, **opts)
                    fh.write(sink.getvalue())
                else:
                    write_table(table, fh, **opts)
        except OSError as exc:  # a full disk: name the shard the step will publish
            from icsd_audit.outputs import write_failed

            raise write_failed(exc, Path(self._stage_target) / path.name) from None
        return path

    def step(self, step: int) -> "StepCommit":
        """Stage the shards of step ``step``; they appear together on :meth:`StepCommit.commit`.

        Until then :meth:`write` puts shards into a hidden staging folder (the returned
        paths point there). Used as a context manager, the step is committed when the
        block ends normally and discarded when it raises.
        """
        if self._stage is not None:
            raise RuntimeError("DumpWriter.step: the previous step is neither committed nor discarded")
        if self._store is not None:
            folder = step_folder_name(step, self.rank)
            self._seq = max(self._seq, self._next_seq(f"{self._store[1]}/{folder}"))
            return StepCommit(self, f"{self.out_dir}/{folder}")
        return StepCommit(self, self.out_dir / step_folder_name(step, self.rank))

    def _flatten(self, cols: dict[str, Any], mask: np.ndarray | None) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if mask is None:
            n = int(_to_numpy(cols["advantage"]).shape[0])
            for k, v in cols.items():
                a = _to_numpy(v)
                out[k] = np.broadcast_to(a, (n,)).copy() if a.ndim == 0 else a
                if out[k].shape[0] != n:
                    raise ValueError(f"column {k!r} has {out[k].shape[0]} rows, expected {n}")
            return out
        rows, cols_idx = np.nonzero(mask)
        for k, v in cols.items():
            a = _to_numpy(v)
            if a.ndim == 0:
                a = np.full(rows.size, a)
            elif a.shape[:2] == mask.shape:
                a = a[mask]
            elif a.ndim == 1 and a.shape[0] == mask.shape[0]:
                a = a[rows]
            else:
                raise ValueError(f"column {k!r} of shape {a.shape} fits neither the mask {mask.shape} nor its rows")
            out[k] = a
        if "pos" not in out:
            first = np.r_[0, np.flatnonzero(np.diff(rows)) + 1]
            out["pos"] = np.arange(rows.size) - np.repeat(first, np.diff(np.r_[first, rows.size]))
        return out

    def _arrow(self, name: str, a: np.ndarray) -> pa.Array:
        if a.ndim == 2:
            flat = pa.array(a.astype(np.float32).reshape(-1))
            return pa.FixedSizeListArray.from_arrays(flat, a.shape[1])
        if name in _ARROW_TYPES:
            return pa.array(a, type=_ARROW_TYPES[name])
        if a.dtype.kind == "f":
            # a NaN in a null_nan column means "no value here" (a teacher log-prob outside a top-k): null
            return pa.array(a.astype(self.float_dtype, copy=False), from_pandas=name in self.null_nan)
        return pa.array(a)


def step_folder_name(step: int, rank: int | None = None) -> str:
    """Where a committed step's shards live: ``step000003`` (``step000003-r00001`` for rank 1)."""
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return f"step{int(step):06d}" + ("" if rank is None else f"-r{int(rank):05d}")


class StepCommit:
    """One staged step of a :class:`DumpWriter` (see :meth:`DumpWriter.step`)."""

    def __init__(self, writer: DumpWriter, target: Path | str):
        self.writer, self.target = writer, target
        if isinstance(target, str):  # a store: shards go straight into the step folder, named by this writer
            self.staged: Path | str = target
            writer._staged_names = []
        else:
            from icsd_audit.outputs import staging_dir

            self.staged = staging_dir(target, "step")
        writer._stage, writer._stage_target = self.staged, target

    def _commit_remote(self) -> str | None:
        """Write the commit marker (last): the reader takes the step's shards from now on."""
        w = self.writer
        names, w._staged_names = list(w._staged_names), []
        if not names:
            return None
        fs, root = w._store
        marker = marker_name(w._commit_id)
        folder = root + str(self.target)[len(str(w.out_dir)):]
        blob = json.dumps({"schema": "icsd.step_commit", "version": 1, "shards": names}, sort_keys=True).encode()
        put_new(fs, f"{folder}/{marker}", blob, f"{self.target}/{marker}")
        return str(self.target)

    def commit(self) -> Path | str | None:
        """Publish the staged shards as ``target`` in one rename; None when the step wrote none.

        A committed step of the same name (a resumed run redoing it) is replaced: swapped
        out atomically where the file system allows, then removed. On a store: the commit
        marker listing the step's shards is written (a resumed run's later shards of a
        batch supersede the earlier ones, as for re-written batches).
        """
        from icsd_audit.outputs import exchange_paths, staging_dir

        self.writer._stage = None
        if isinstance(self.target, str):
            return self._commit_remote()
        if not any(self.staged.iterdir()):
            shutil.rmtree(self.staged, ignore_errors=True)
            return None
        if not os.path.lexists(self.target):
            os.rename(self.staged, self.target)
            return self.target
        if not self.target.is_dir() or self.target.is_symlink():
            raise FileExistsError(errno.EEXIST, "exists and is not a step folder this writer committed",
                                  str(self.target))
        if exchange_paths(self.staged, self.target):
            shutil.rmtree(self.staged, ignore_errors=True)  # it now holds the replaced step
        else:  # no atomic exchange here: the old step leaves first, for a moment neither is there
            old = staging_dir(self.target, "old")
            os.rename(self.target, old / "d")
            os.rename(self.staged, self.target)
            shutil.rmtree(old, ignore_errors=True)
        return self.target

    def discard(self) -> None:
        """Drop the staged shards: nothing of this step is published."""
        self.writer._stage = None
        if isinstance(self.target, str):  # no marker names them: no reader takes them, removed as a courtesy
            w = self.writer
            names, w._staged_names = list(w._staged_names), []
            folder = w._store[1] + str(self.target)[len(str(w.out_dir)):]
            for n in names:
                with contextlib.suppress(OSError):  # an object the store already lost: nothing left to remove
                    w._store[0].rm_file(f"{folder}/{n}")
            return
        shutil.rmtree(self.staged, ignore_errors=True)

    def __enter__(self) -> "StepCommit":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()
