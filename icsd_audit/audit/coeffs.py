"""Recomputing allocations from dumps: the library behind ``icsd audit coeffs``.

Each batch is allocated on its own (statistics never cross ``batch_id``) in float64
with the same allocator functions training deployed.  Coefficients are parked in
a disk-backed array indexed by input row, then a second pass streams the input row
groups in order and appends them, so the output keeps the input row order without
holding the run in memory.

The scratch directory (memory maps of 33 bytes per row, their disk space reserved
before the first write so a full disk is an error rather than SIGBUS, and the output
until it is complete) is a hidden sibling of the output named ``.{out}.icsd-coeffs-{host}-{pid}-*``
holding no ``*.parquet`` file, so a reader pointed at the output's directory never
reads it; it is removed on success, on any error and on SIGTERM, and a later run
removes those of processes killed outright (``kill -9``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from icsd_audit import parquet_io

from icsd_audit.alloc.options import AllocatorOptions, allocate_batch, required_columns
from icsd_audit.alloc.variants import Allocation
from icsd_audit.dumps.provenance import json_safe
from icsd_audit.dumps.writer import dictionary_columns, dump_metadata
from icsd_audit.dumps.reader import METADATA_KEY, DumpError, DumpReader, TokenBatch, resolve_paths
from icsd_audit.alloc.segments import dense_ids, segment_sum
from icsd_audit.stats.budget import check_resources
from icsd_audit.outputs import check_output_file, reserve, temp_dir, write_failed
from icsd_audit.audit.threads import single_threaded_maths

__all__ = ["CoeffsSummary", "BatchCoeffs", "batch_coeffs", "iter_allocations", "compute_coefficients",
           "merged_metadata"]

#: columns coeffs writes (replacing deployed ones of the same name)
OUTPUT_COLUMNS = ("g", "u", "m", "c", "fallback")


def iter_allocations(reader: DumpReader, opts: AllocatorOptions) -> Iterator[tuple[TokenBatch, Allocation]]:
    for batch in reader:
        yield batch, allocate_batch(batch.tokens, opts)


@dataclass
class CoeffsSummary:
    """Totals for the stderr summary of ``icsd audit coeffs``."""

    n_rows: int = 0
    n_tokens: int = 0
    n_batches: int = 0
    n_turns: int = 0
    fallback_tokens: int = 0
    max_turn_mass_error: float = 0.0
    sum_g: float = 0.0
    sum_c: float = 0.0
    diagnostics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fallback_share(self) -> float:
        return self.fallback_tokens / self.n_tokens if self.n_tokens else 0.0


@dataclass(frozen=True)
class BatchCoeffs:
    """One batch's recomputed coefficients (float64; ``rows``: their global input rows) and its summary terms."""

    rows: np.ndarray
    g: np.ndarray
    u: np.ndarray
    m: np.ndarray
    c: np.ndarray
    fallback: np.ndarray
    n_tokens: int
    n_turns: int
    fallback_tokens: int
    sum_g: float
    sum_c: float
    mass_error: float
    diagnostics: dict[str, Any]


def batch_coeffs(batch: TokenBatch, opts: AllocatorOptions) -> BatchCoeffs:
    """Allocate one batch with ``opts``: what every backend of :func:`compute_coefficients` computes per batch."""
    alloc = allocate_batch(batch.tokens, opts)
    d = alloc.diagnostics
    return BatchCoeffs(rows=batch.global_row, g=alloc.g.numpy(), u=alloc.u.numpy(), m=alloc.m.numpy(),
                       c=alloc.c.numpy(), fallback=alloc.fallback.numpy(), n_tokens=d.n_tokens, n_turns=d.n_turns,
                       fallback_tokens=int(alloc.fallback.sum()), sum_g=float(alloc.g.sum()),
                       sum_c=float(alloc.c.sum()), mass_error=_turn_mass_error(batch, alloc),
                       diagnostics={"batch_id": batch.batch_id, **d.to_dict()})


def coeffs_part(paths: Sequence[str], opts: AllocatorOptions, batch_id: int) -> BatchCoeffs:
    """One batch's :class:`BatchCoeffs`, read by this process (what a Ray task runs)."""
    import warnings

    from icsd_audit.audit.ray_backend import worker_reader
    from icsd_audit.audit.threads import one_intra_op_thread

    reader = worker_reader(paths, None, tuple(required_columns(opts.allocator)))
    with one_intra_op_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the driver has shown them
        return batch_coeffs(reader.batch(batch_id), opts)


def _batch_coeffs(reader: DumpReader, paths: Sequence[str | Path], opts: AllocatorOptions, backend: str,
                  ray_address: str | None, workers: int) -> Iterator[BatchCoeffs]:
    """Every batch's :class:`BatchCoeffs` in batch order: here, or by Ray tasks (``backend="ray"``)."""
    if backend == "ray":
        from icsd_audit.audit.ray_backend import ray_parts

        yield from ray_parts(coeffs_part, paths, (opts,), reader.batch_ids, address=ray_address, workers=workers)
        return
    for batch in reader:
        yield batch_coeffs(batch, opts)


def _turn_mass_error(batch: TokenBatch, alloc: Allocation) -> float:
    """Largest |sum c - sum g| over the batch's turns, relative to the turn's sum g."""
    t = batch.tokens
    turn, n = dense_ids(torch.from_numpy(t.traj_id), torch.from_numpy(t.turn_id))
    sg = segment_sum(alloc.g, turn, n)
    sc = segment_sum(alloc.c, turn, n)
    return float(((sc - sg).abs() / sg.abs().clamp(min=1e-300)).max()) if n else 0.0


@single_threaded_maths
def compute_coefficients(paths: Sequence[str | Path], out: str | Path, opts: AllocatorOptions | None = None, *,
                         backend: str = "local", ray_address: str | None = None, workers: int = 1) -> CoeffsSummary:
    """Write every input column plus g, u, m, c (float64) and fallback (bool), in input row order.

    ``opts``: the allocator settings; ``None`` recomputes what was deployed, with the
    settings the dumps record (:func:`~icsd_audit.audit.settings.deployed_options`).
    ``backend="ray"``: each batch allocated by a Ray task (:mod:`icsd_audit.audit.ray_backend`;
    ``ray_address``: the cluster, default a local one of ``workers`` CPUs), written here in
    batch order: the same file as ``"local"``.
    """
    from icsd_audit.audit.run import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    out = check_output_file(out, [f for f in resolve_paths(paths) if isinstance(f, Path)] if paths else [])
    if opts is None:
        from icsd_audit.audit.settings import deployed_options

        opts = deployed_options(paths)
    reader = DumpReader(paths, columns=None, require=required_columns(opts.allocator))
    schema = _output_schema(reader)
    check_resources(reader, workers=1)
    summary = CoeffsSummary(n_rows=reader.n_rows)
    with temp_dir(out, "coeffs") as tmp:
        store = {k: _scratch(Path(tmp) / f"{k}.f64", np.float64, reader.n_rows, out) for k in ("g", "u", "m", "c")}
        fb = _scratch(Path(tmp) / "fallback.bool", np.bool_, reader.n_rows, out)
        for part in _batch_coeffs(reader, paths, opts, backend, ray_address, workers):
            for k in store:
                store[k][part.rows] = getattr(part, k)
            fb[part.rows] = part.fallback
            summary.n_tokens += part.n_tokens
            summary.n_batches += 1
            summary.n_turns += part.n_turns
            summary.fallback_tokens += part.fallback_tokens
            summary.sum_g += part.sum_g
            summary.sum_c += part.sum_c
            summary.max_turn_mass_error = max(summary.max_turn_mass_error, part.mass_error)
            summary.diagnostics.append(part.diagnostics)

        meta = merged_metadata(reader)
        meta["audit_coeffs"] = {"allocator": opts.to_dict()}
        tmp_out = Path(tmp) / "out.partial"  # not *.parquet: no reader ever takes it for a dump
        writer: pq.ParquetWriter | None = None
        try:
            for _, offset, table in reader.row_groups():
                sl = slice(offset, offset + table.num_rows)
                for k in ("g", "u", "m", "c"):
                    table = _set_column(table, k, pa.array(np.asarray(store[k][sl])))
                table = _set_column(table, "fallback", pa.array(np.asarray(fb[sl])))
                if writer is None:
                    kv = dict(table.schema.metadata or {})
                    kv[METADATA_KEY.encode()] = json.dumps(json_safe(meta), sort_keys=True, allow_nan=False).encode()
                    full = pa.schema([f if f.name in OUTPUT_COLUMNS else schema.field(f.name) for f in table.schema]).with_metadata(kv)
                    writer = parquet_io.writer(tmp_out, full, compression="zstd",
                                               use_dictionary=dictionary_columns(full))
                writer.write_table(table.select(writer.schema.names).cast(writer.schema))
            if writer is not None:
                writer.close()
        except OSError as exc:  # a full disk: name the output asked for, not the scratch file (removed)
            raise write_failed(exc, out) from None
        finally:
            if writer is not None and writer.is_open:
                with contextlib.suppress(OSError):
                    writer.close()
        tmp_out.replace(out)
    return summary


def _scratch(path: Path, dtype: Any, n: int, out: Path) -> np.ndarray:
    """A zeroed array of ``n`` values mapped onto ``path``, its disk space reserved first.

    Writing a memory map whose file has no blocks yet kills the process with SIGBUS
    on a full disk; reserving them first makes a full disk one OSError here, naming
    the output whose scratch it is.
    """
    size = n * np.dtype(dtype).itemsize
    try:
        with open(path, "wb") as fh:
            reserve(fh.fileno(), size)
    except OSError as exc:
        raise write_failed(exc, out, f"cannot reserve {size / 1e6:,.1f} MB of scratch space next to it") from None
    return np.memmap(path, dtype=dtype, mode="r+", shape=(n,))


def _set_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, values)
    return table.append_column(name, values)


def _output_schema(reader: DumpReader) -> pa.Schema:
    """The one schema of the output table: every input's columns in their common type.

    Inputs whose columns differ are refused before any work; types that differ are
    widened to the narrowest type holding them all (int32 and int64 -> int64, float32
    and float64 -> float64; the reader has already refused uint64 values that no
    signed type holds).
    """
    first, ref = reader.paths[0], reader.schemas[0]
    want = [n for n in ref.names if n not in OUTPUT_COLUMNS]
    for path, schema in zip(reader.paths[1:], reader.schemas[1:]):
        have = [n for n in schema.names if n not in OUTPUT_COLUMNS]
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing or extra:
            what = "; ".join(x for x in (f"lacks {', '.join(missing)}" if missing else "",
                                         f"has extra {', '.join(extra)}" if extra else "") if x)
            raise DumpError(path, f"columns differ from {first} ({what}); coeffs writes one table, so every input "
                                  "needs the same columns", column=(missing or extra)[0])
    fields = []
    for name in want:
        out = ref.field(name)
        for path, schema in zip(reader.paths[1:], reader.schemas[1:]):
            src = schema.field(name).type
            if src == out.type:
                continue
            try:
                out = out.with_type(pa.unify_schemas([pa.schema([out]), pa.schema([schema.field(name)])],
                                                     promote_options="permissive").field(name).type)
            except (pa.ArrowException, ValueError, TypeError):
                raise DumpError(path, f"type {src} has no common type with {ref.field(name).type}, its type in "
                                      f"{first}", column=name) from None
        fields.append(out)
    return pa.schema(fields)


def merged_metadata(reader: DumpReader) -> dict[str, Any]:
    """The output's ``icsd.dump`` blob: the inputs' when they agree, else the shared part plus per-file groups.

    When inputs disagree (different runs, producers or allocator settings), the keys
    they share stay at the top level and ``inputs`` lists each distinct combination of
    the others with the files that carry it, so no file's provenance is lost or
    misattributed; ``synthetic`` is true when any input is synthetic.
    """
    blobs = reader.metadata()
    def key(v: Any) -> str:
        return json.dumps(v, sort_keys=True, default=str)

    if len({key(b) for b in blobs}) == 1:
        return dict(blobs[0]) if blobs[0] else dump_metadata(producer="unknown", synthetic=False)
    names = list(dict.fromkeys(k for b in blobs for k in b))
    shared = [k for k in names if all(k in b for b in blobs) and len({key(b[k]) for b in blobs}) == 1]
    differing = [k for k in names if k not in shared]
    groups: dict[str, dict[str, Any]] = {}
    for path, b in zip(reader.paths, blobs):
        part = {k: b.get(k) for k in differing}
        groups.setdefault(key(part), {"files": [], **part})["files"].append(str(path))
    meta = {k: blobs[0][k] for k in shared}
    meta.update(schema="icsd.token_dump", version=1)
    if "synthetic" not in shared:
        meta["synthetic"] = any(b.get("synthetic") is True for b in blobs)
    if "producer" not in shared:
        meta["producer"] = {"name": "mixed: see inputs"}
    meta["inputs"] = list(groups.values())
    return meta
