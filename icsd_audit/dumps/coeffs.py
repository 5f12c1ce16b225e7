"""Recomputing allocations from dumps: the library behind ``icsd audit coeffs``.

Each batch is allocated on its own (statistics never cross ``batch_id``) in float64
with the same allocator functions training deployed.  Coefficients are parked in
a disk-backed array indexed by input row, then a second pass streams the input row
groups in order and appends them, so the output keeps the input row order without
holding the run in memory.

The scratch directory (memmaps of up to 40 bytes per row, and the output until it
is complete) is a hidden sibling of the output named ``.{out}.icsd-coeffs-{pid}-*``
holding no ``*.parquet`` file, so a reader pointed at the output's directory never
reads it; it is removed on success, on any error and on SIGTERM, and a later run
removes those of processes killed outright (``kill -9``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from icsd_audit.alloc.options import AllocatorOptions, allocate_batch
from icsd_audit.alloc.variants import Allocation
from icsd_audit.dumps.writer import dictionary_columns, dump_metadata
from icsd_audit.dumps.reader import METADATA_KEY, DumpReader, TokenBatch
from icsd_audit.alloc.segments import dense_ids, segment_sum
from icsd_audit.outputs import temp_dir

__all__ = ["CoeffsSummary", "iter_allocations", "compute_coefficients"]


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


def _turn_mass_error(batch: TokenBatch, alloc: Allocation) -> float:
    """Largest |sum c - sum g| over the batch's turns, relative to the turn's sum g."""
    t = batch.tokens
    turn, n = dense_ids(torch.from_numpy(t.traj_id), torch.from_numpy(t.turn_id))
    sg = segment_sum(alloc.g, turn, n)
    sc = segment_sum(alloc.c, turn, n)
    return float(((sc - sg).abs() / sg.abs().clamp(min=1e-300)).max()) if n else 0.0


def compute_coefficients(paths: Sequence[str | Path], out: str | Path, opts: AllocatorOptions) -> CoeffsSummary:
    """Write every input column plus g, u, m, c (float64) and fallback (bool), in input row order."""
    out = Path(out)
    reader = DumpReader(paths, columns=None)
    summary = CoeffsSummary(n_rows=reader.n_rows)
    with temp_dir(out, "coeffs") as tmp:
        store = {k: np.lib.format.open_memmap(Path(tmp) / f"{k}.npy", mode="w+", dtype=np.float64, shape=(reader.n_rows,))
                 for k in ("g", "u", "m", "c")}
        fb = np.lib.format.open_memmap(Path(tmp) / "fallback.npy", mode="w+", dtype=np.bool_, shape=(reader.n_rows,))
        for batch, alloc in iter_allocations(reader, opts):
            for k in store:
                store[k][batch.global_row] = getattr(alloc, k).numpy()
            fb[batch.global_row] = alloc.fallback.numpy()
            d = alloc.diagnostics
            summary.n_tokens += d.n_tokens
            summary.n_batches += 1
            summary.n_turns += d.n_turns
            summary.fallback_tokens += int(alloc.fallback.sum())
            summary.sum_g += float(alloc.g.sum())
            summary.sum_c += float(alloc.c.sum())
            summary.max_turn_mass_error = max(summary.max_turn_mass_error, _turn_mass_error(batch, alloc))
            summary.diagnostics.append({"batch_id": batch.batch_id, **d.to_dict()})

        meta = reader.metadata()[0]
        meta = dict(meta) if meta else dump_metadata(producer="unknown", synthetic=False)
        meta["audit_coeffs"] = {"allocator": opts.kwargs()}
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
                    kv[METADATA_KEY.encode()] = json.dumps(meta, sort_keys=True).encode()
                    schema = table.schema.with_metadata(kv)
                    writer = pq.ParquetWriter(tmp_out, schema, compression="zstd",
                                              use_dictionary=dictionary_columns(schema))
                writer.write_table(table.cast(writer.schema))
        finally:
            if writer is not None:
                writer.close()
        tmp_out.replace(out)
    return summary


def _set_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, values)
    return table.append_column(name, values)
