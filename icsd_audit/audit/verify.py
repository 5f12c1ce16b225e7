"""Checking dumps against their own provenance: the library behind ``icsd audit verify``.

Each batch is recomputed in float64 from its stored inputs with the settings its
file records (SPEC 9 ``allocator`` block; for an ``icsd audit coeffs`` output, the
settings recorded under ``audit_coeffs`` that computed its columns) and compared with
the stored ``g``, ``m`` and ``c``.  Producers allocate in float64 on float32-rounded
inputs and store float32, so a faithful dump differs from the recomputation by at
most the rounding of that store: half a float32 unit in the last place.  A value
*agrees* when ``|stored - recomputed| <= rtol * |recomputed| + atol`` with
``rtol = 2**-23`` (one float32 unit in the last place, twice that bound) and
``atol = 2**-126`` (the smallest normal float32: values below it are stored with
an absolute, not a relative, error).  Only valid tokens are compared (invalid ones
enter no allocation).

Files differ in settings?  Each batch is checked with its own file's; a batch whose
rows come from files that record different settings is bad input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from icsd_audit.alloc.options import AllocatorOptions, allocate_batch, required_columns
from icsd_audit.dumps.provenance import COEFFICIENT_KEYS, recorded_values, records_settings, relevant_keys
from icsd_audit.dumps.reader import DumpError, DumpReader, TokenBatch, prefetch, read_metadata, resolve_paths
from icsd_audit.audit.threads import single_threaded_maths

__all__ = ["STORAGE_RTOL", "STORAGE_ATOL", "CHECKED", "ColumnCheck", "BatchCheck", "VerifyResult", "verify_dumps",
           "verify_part", "file_settings"]

STORAGE_RTOL = 2.0 ** -23
STORAGE_ATOL = 2.0 ** -126
#: the deployed outputs compared, in this order
CHECKED = ("g", "m", "c")


@dataclass(frozen=True)
class ColumnCheck:
    """One stored column of one batch against its recomputation (valid tokens)."""

    name: str
    n_differ: int
    max_abs: float
    max_rel: float

    def to_dict(self) -> dict[str, Any]:
        return {"n_differ": self.n_differ, "max_abs_error": _finite(self.max_abs), "max_rel_error": _finite(self.max_rel)}


@dataclass(frozen=True)
class BatchCheck:
    """One batch: where its rows come from, how many valid tokens, and each checked column."""

    batch_id: int
    file: str
    n_tokens: int
    columns: tuple[ColumnCheck, ...]

    @property
    def ok(self) -> bool:
        return all(c.n_differ == 0 for c in self.columns)

    @property
    def max_abs(self) -> float:
        return max((c.max_abs for c in self.columns), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((c.max_rel for c in self.columns), default=0.0)

    def line(self) -> str:
        """``batch B (FILE): c differs on 1 of 169 tokens (max abs error ..., max rel error ...); g, m agree``."""
        bad = [c for c in self.columns if c.n_differ]
        good = [c.name for c in self.columns if not c.n_differ]
        parts = [f"{c.name} differs on {c.n_differ:,} of {self.n_tokens:,} tokens (max abs error {c.max_abs:.3e}, "
                 f"max rel error {c.max_rel:.3e})" for c in bad]
        tail = f"; {', '.join(good)} agree{'s' if len(good) == 1 else ''}" if good and bad else ""
        return f"batch {self.batch_id} ({self.file}): " + ("; ".join(parts) or "agrees") + tail

    def to_dict(self) -> dict[str, Any]:
        return {"batch_id": self.batch_id, "file": self.file, "n_tokens": self.n_tokens, "ok": self.ok,
                "columns": {c.name: c.to_dict() for c in self.columns}}


@dataclass(frozen=True)
class VerifyResult:
    """Every batch's check and the tolerance used; ``ok`` when every batch agrees."""

    batches: tuple[BatchCheck, ...]
    files: tuple[str, ...]
    checked: tuple[str, ...]
    rtol: float = STORAGE_RTOL
    atol: float = STORAGE_ATOL
    settings: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(b.ok for b in self.batches)

    @property
    def differing(self) -> tuple[BatchCheck, ...]:
        return tuple(b for b in self.batches if not b.ok)

    @property
    def n_tokens(self) -> int:
        return sum(b.n_tokens for b in self.batches)

    def summary(self) -> str:
        """One line: how much was checked, and whether it all agrees."""
        what = (f"{len(self.batches):,} batches, {self.n_tokens:,} tokens in {len(self.files):,} "
                f"file{'s' if len(self.files) != 1 else ''}; checked {', '.join(self.checked)}")
        worst = (f"max abs error {max((b.max_abs for b in self.batches), default=0.0):.3e}, max rel error "
                 f"{max((b.max_rel for b in self.batches), default=0.0):.3e}")
        if self.ok:
            return f"verify: {what}: every batch agrees within float32 storage tolerance ({worst})"
        return (f"verify: {what}: {len(self.differing):,} of {len(self.batches):,} batches differ beyond float32 "
                f"storage tolerance (rtol {self.rtol:.3g}, atol {self.atol:.3g}; {worst})")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "n_batches": len(self.batches), "n_differing": len(self.differing),
                "n_tokens": self.n_tokens, "files": list(self.files), "checked": list(self.checked),
                "tolerance": {"rtol": self.rtol, "atol": self.atol},
                "max_abs_error": _finite(max((b.max_abs for b in self.batches), default=0.0)),
                "max_rel_error": _finite(max((b.max_rel for b in self.batches), default=0.0)),
                "settings": [dict(s) for s in self.settings],
                "batches": [b.to_dict() for b in self.batches]}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def file_settings(path: Path | str, meta: Mapping[str, Any]) -> AllocatorOptions:
    """The settings that computed a file's stored ``g``, ``m``, ``c``: ``audit_coeffs`` for an
    ``icsd audit coeffs`` output, else the deployed ``allocator`` block; a missing or incomplete one is bad input."""
    coeffs = meta.get("audit_coeffs")
    block = coeffs.get("allocator") if isinstance(coeffs, Mapping) else None
    if not isinstance(block, Mapping):
        if not records_settings(meta):
            raise DumpError(path, "records no allocator settings (SPEC 9 'allocator' block), so there is nothing "
                                  "to recompute its g, m, c with; `icsd audit coeffs` with explicit flags recomputes it")
        block = meta["allocator"]
    try:
        values = recorded_values(path, block)
    except ValueError as exc:
        raise DumpError(path, str(exc).split(": ", 1)[1]) from None
    missing = [k for k in relevant_keys(values) if values[k] is None]
    if missing:
        raise DumpError(path, f"the recorded allocator settings leave {', '.join(missing)} unknown (null); "
                              "verify recomputes with recorded settings only")
    defaults = AllocatorOptions()
    return AllocatorOptions(**{k: values[k] if values[k] is not None else getattr(defaults, k)
                               for k in COEFFICIENT_KEYS})


def _compare(stored: np.ndarray, recomputed: np.ndarray, name: str, rtol: float, atol: float) -> ColumnCheck:
    s, r = stored.astype(np.float64), recomputed.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(s - r)
        err = np.where(np.isfinite(err), err, np.inf)  # a NaN or infinite stored value never agrees
        bad = err > rtol * np.abs(r) + atol
        rel = err / np.maximum(np.abs(r), atol)
    return ColumnCheck(name, int(bad.sum()), float(err.max(initial=0.0)), float(rel.max(initial=0.0)))


def _check_columns(reader: DumpReader) -> tuple[str, ...]:
    """The stored outputs to check: those of :data:`CHECKED` the first file has, which every file must have."""
    first = reader.paths[0]
    have = tuple(c for c in CHECKED if c in reader.schemas[0].names)
    if not have:
        raise DumpError(first, "holds none of the deployed columns g, m, c; verify compares them with a recomputation",
                        column="c")
    for path, schema in zip(reader.paths, reader.schemas):
        for c in have:
            if c not in schema.names:
                raise DumpError(path, f"column missing; {first} has it and verify checks it in every file", column=c)
            if not pa.types.is_floating(schema.field(c).type):
                raise DumpError(path, f"expected float16/32/64, got {schema.field(c).type}", column=c)
    return have


@single_threaded_maths
def verify_dumps(paths: Sequence[str | Path], *, rtol: float = STORAGE_RTOL, atol: float = STORAGE_ATOL,
                 progress: Callable[[int, int], None] | None = None, backend: str = "local",
                 ray_address: str | None = None, workers: int = 1) -> VerifyResult:
    """Recompute every batch of the dumps at ``paths`` with its recorded settings and compare ``g``, ``m``, ``c``.

    Bad input (no recorded settings, none of the columns, a batch spread over files
    with different settings, a value the reader refuses) raises
    :class:`~icsd_audit.dumps.reader.DumpError`.  ``backend="ray"``: each batch checked by
    a Ray task (:mod:`icsd_audit.audit.ray_backend`; ``ray_address``: the cluster, default a
    local one of ``workers`` CPUs), collected here in batch order: the same result.

    >>> res = verify_dumps(["runs/cpu-demo/dumps"])        # doctest: +SKIP
    >>> res.ok, [b.line() for b in res.differing]
    """
    from icsd_audit.audit.run import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    files = resolve_paths(paths)
    names = {m["allocator"]["allocator"] for m in map(read_metadata, files) if records_settings(m)}
    require = tuple(required_columns(*names))
    reader = DumpReader(files, columns=list(CHECKED), require=list(require))
    # the files the reader keeps (a resumed folder's superseded shards are left out, as every audit leaves them)
    opts = [file_settings(p, m) for p, m in zip(reader.paths, reader.metadata())]
    checked = _check_columns(reader)
    out: list[BatchCheck] = []
    n = len(reader.batch_ids)
    if backend == "ray":
        from icsd_audit.audit.ray_backend import ray_parts

        checks = ray_parts(verify_part, [str(f) for f in files], (require, tuple(opts), checked, rtol, atol),
                           reader.batch_ids, address=ray_address, workers=workers)
    else:
        checks = (_verify_batch(batch, reader.paths, opts, checked, rtol, atol) for batch in prefetch(reader))
    for i, check in enumerate(checks):
        out.append(check)
        if progress is not None:
            progress(i + 1, n)
    distinct = {tuple(sorted(o.to_dict().items())): o.to_dict() for o in opts}
    return VerifyResult(tuple(out), tuple(str(p) for p in reader.paths), checked, rtol, atol,
                        tuple(distinct.values()))


def verify_part(paths: Sequence[str], require: tuple[str, ...], opts: Sequence[AllocatorOptions],
                checked: Sequence[str], rtol: float, atol: float, batch_id: int) -> BatchCheck:
    """One batch's check, read by this process (what a Ray task runs; ``paths``: the driver's resolved files, so
    the file indices of ``opts`` are this reader's)."""
    import warnings

    from icsd_audit.audit.ray_backend import worker_reader
    from icsd_audit.audit.threads import one_intra_op_thread

    reader = worker_reader(paths, CHECKED, require)
    with one_intra_op_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the driver has shown them
        return _verify_batch(reader.batch(batch_id), reader.paths, opts, checked, rtol, atol)


def _verify_batch(batch: TokenBatch, paths: Sequence[Path], opts: Sequence[AllocatorOptions], checked: Sequence[str],
                  rtol: float, atol: float) -> BatchCheck:
    fidx = np.unique(batch.file_index).tolist()
    o = opts[fidx[0]]
    for j in fidx[1:]:
        if opts[j] != o:
            key = next(k for k in COEFFICIENT_KEYS if getattr(opts[j], k) != getattr(o, k))
            raise DumpError(paths[j], f"batch {batch.batch_id} also has rows in {paths[fidx[0]]}, which records "
                                      f"{key}={getattr(o, key)!r}, this file {getattr(opts[j], key)!r}: one batch, "
                                      "one allocation")
    alloc = allocate_batch(batch.tokens, o)
    valid = batch.tokens.valid
    cols = tuple(_compare(np.asarray(batch.tokens.columns[c], dtype=np.float64)[valid],
                          getattr(alloc, c).numpy()[valid], c, rtol, atol) for c in checked)
    return BatchCheck(int(batch.batch_id), str(paths[fidx[0]]), int(valid.sum()), cols)
