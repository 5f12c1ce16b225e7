"""Streaming the SPEC 6 statistics over dumps: the library behind ``icsd audit tcm|quadrants|...``.

Each batch is read once, allocated once per distinct allocator
(:func:`icsd_audit.alloc.options.weight_pair`), reduced to per-turn sums by the accumulators
and dropped; the bootstrap runs once at the end on those sums.  Reading runs one batch
ahead and ``workers`` batches are allocated at once (each by one thread, so the
numbers do not depend on it), so memory is ``workers + 2`` batches plus a few floats
per action turn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from icsd_audit.alloc.settings import DEFAULTS
from icsd_audit.alloc.options import AllocatorOptions, required_columns, weighted_batches
from icsd_audit.dumps.reader import DumpReader, prefetch
from icsd_audit.stats.api import AuditResults, GroupedResult, LandscapeAccumulator, LandscapeResult
from icsd_audit.stats.landscape import LandscapeRanks
from icsd_audit.stats.budget import (LANDSCAPE_STATISTICS, audit_statistic_count, check_bootstrap, check_grid,
                                     check_resources)
from icsd_audit.audit.batches import add_batch, new_accumulator
from icsd_audit.audit.threads import single_threaded_maths

__all__ = ["AuditRequest", "BACKENDS", "run_audit", "run_audit_groups", "run_landscape", "landscape_ranks", "deployed_request",
           "BY_COLUMNS"]

BY_COLUMNS = ("step", "env", "task")


@dataclass(frozen=True)
class AuditRequest:
    """What to audit: two weightings, bootstrap options and statistic options."""

    base: AllocatorOptions = AllocatorOptions(allocator="sdar")
    compare: AllocatorOptions = AllocatorOptions(allocator="icsd")
    n_resamples: int = 10_000
    confidence_level: float = 0.95
    unit: str = "action-turn"
    seed: int = 0
    workers: int = 1
    by: str | None = None
    eps: float = DEFAULTS.eps
    clip_eps: float = 0.2
    dual_clip: float = 3.0
    n_bins: int = 5


def deployed_request(paths: Sequence[str | Path], **options: Any) -> AuditRequest:
    """An :class:`AuditRequest` comparing SDAR with what the dumps record as deployed (SPEC 9).

    ``options``: further :class:`AuditRequest` fields (``n_resamples``, ``by``, ...);
    the TCM threshold ``eps`` is the deployed allocator's.
    """
    from icsd_audit.audit.settings import audit_settings

    base, compare = audit_settings(paths).pair()
    return AuditRequest(base=base, compare=compare, eps=compare.eps, **options)


BACKENDS = ("local", "ray")


@single_threaded_maths
def run_audit(
    paths: Sequence[str | Path],
    req: AuditRequest | None = None,
    *,
    statistics: Sequence[str],
    progress: Callable[[int, int], None] | None = None,
    backend: str = "local",
    ray_address: str | None = None,
) -> AuditResults:
    """Stream every batch of ``paths`` into one accumulator and bootstrap once.

    ``req=None``: SDAR against the deployed allocator, with the settings the dumps
    record (:func:`deployed_request`). ``backend="ray"``: each batch is read, allocated
    and reduced by a Ray task (:mod:`icsd_audit.audit.ray_backend`; ``ray_address``: the
    cluster, default a local one with ``req.workers`` CPUs), merged here in batch order:
    the same bits as ``"local"``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if req is None:
        req = deployed_request(paths)
    n_stat = audit_statistic_count(tuple(statistics), req.n_bins)
    check_bootstrap(req.n_resamples, n_stat)
    columns = [req.by] if req.by else []
    reader = DumpReader(paths, columns=columns, require=required_columns(req.base.allocator, req.compare.allocator))
    check_resources(reader, workers=req.workers)
    if req.unit == "batch":
        check_bootstrap(req.n_resamples, n_stat, n_batches=len(reader.batch_ids))
    acc = new_accumulator(req, statistics)
    n = len(reader.batch_ids)
    if backend == "local":
        for i, (batch, weights, u) in enumerate(weighted_batches(prefetch(reader), req.base, req.compare,
                                                                  workers=req.workers)):
            add_batch(acc, reader, req, batch, weights, u)
            if progress is not None:
                progress(i + 1, n)
        return acc.finalize(n_resamples=req.n_resamples, confidence_level=req.confidence_level, unit=req.unit,
                            rng=req.seed, workers=req.workers)
    from icsd_audit.audit.ray_backend import batch_part, ray_bootstrap, ray_parts

    with ray_bootstrap(ray_address, req.workers):  # the map, then the bootstrap's work units, on one cluster
        for i, part in enumerate(ray_parts(batch_part, paths, (req, acc.statistics), reader.batch_ids,
                                           address=ray_address, workers=req.workers)):
            acc.merge(part)
            if progress is not None:
                progress(i + 1, n)
        return acc.finalize(n_resamples=req.n_resamples, confidence_level=req.confidence_level, unit=req.unit,
                            rng=req.seed, workers=req.workers)


def landscape_ranks(reader: DumpReader, grid: int, *, steps: set[Any] | None = None) -> dict:
    """The landscape's first pass: every environment's exact mid-rank edges from delta and advantage alone.

    Reads only ``delta``, ``advantage``, ``valid`` and ``env`` (no allocation), 4 bytes per
    valid token of delta kept until the edges are cut (the advantages, constant over a
    turn, as distinct values per row group); the checked stream comes after.  ``steps``
    (a set) also reads ``step`` and receives the smallest and largest step of each row
    group's valid tokens: it ends with two or more values exactly when the valid tokens
    span two or more steps (the report's per-step curve is computed only then).
    """
    ranks = LandscapeRanks(grid=grid)
    # the next row group decoded (and its page checksums verified) in a thread while this one is ranked
    wanted = ["delta", "advantage", "valid", "env"] + (["step"] if steps is not None else [])
    for table in prefetch(reader.column_groups(wanted)):
        names = table.column_names
        valid = table.column("valid").to_numpy(zero_copy_only=False) if "valid" in names else None
        ranks.add(table.column("delta").to_numpy(), table.column("advantage").to_numpy(),
                  env=table.column("env").to_numpy(zero_copy_only=False) if "env" in names else None, valid=valid)
        if steps is not None and "step" in names:
            s = table.column("step").to_numpy(zero_copy_only=False)
            s = s if valid is None else s[valid.astype(bool)]
            if s.size:  # (int64 by the schema: a min and a max, not a sort)
                steps.update((s.min().item(), s.max().item()) if s.dtype.kind in "iu" else np.unique(s).tolist())
    return ranks.finalize()


@single_threaded_maths
def run_audit_groups(groups: Sequence[tuple[Any, Sequence[str | Path], AuditRequest]], *, statistics: Sequence[str],
                     by: str = "settings", backend: str = "local", ray_address: str | None = None) -> AuditResults:
    """Audit each group ``(key, files, request)`` on its own and return one result per key (``by``).

    For files deployed with different settings (``--by settings``): every group is
    allocated with its own settings and bootstrapped on its own turns.  ``backend="ray"``:
    every group's batches as Ray tasks on one cluster (:func:`run_audit`), the same bits.
    """
    keys = tuple(k for k, _, _ in groups)
    if len(set(keys)) != len(keys):
        raise ValueError(f"group keys must be distinct, got {list(keys)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    with contextlib.ExitStack() as stack:
        if backend == "ray":  # one cluster for every group, not one start-up per group
            from icsd_audit.audit.ray_backend import ray_bootstrap

            stack.enter_context(ray_bootstrap(ray_address, max((r.workers for _, _, r in groups), default=1)))
        results = [run_audit(files, req, statistics=statistics, backend=backend, ray_address=ray_address)
                   for _, files, req in groups]
    return AuditResults(**{s: GroupedResult(by, keys, tuple(getattr(r, s) for r in results)) for s in statistics})


@single_threaded_maths
def run_landscape(paths: Sequence[str | Path], req: AuditRequest | None = None, *, grid: int = 20,
                  backend: str = "local", ray_address: str | None = None) -> LandscapeResult:
    """Allocation intensity on the joint mid-rank grid (per ``env`` when the dumps carry it).

    Two passes: the exact mid-rank edges from the values (:func:`landscape_ranks`),
    then the allocated batches reduced to grid sums and per-turn region sums as they
    stream, so memory stays a few floats per turn plus 4 bytes per token during the
    first pass.  ``req=None``: SDAR against the deployed allocator (:func:`deployed_request`).
    ``backend="ray"``: the second pass's batches as Ray tasks, merged here in batch order
    (the first pass runs here), the same bits as ``"local"``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    check_grid(grid)
    if req is None:
        req = deployed_request(paths)
    check_bootstrap(req.n_resamples, LANDSCAPE_STATISTICS)
    reader = DumpReader(paths, columns=["env"], require=required_columns(req.base.allocator, req.compare.allocator))
    check_resources(reader, workers=req.workers, landscape=True)
    acc = LandscapeAccumulator(grid=grid, base_name=req.base.allocator, compare_name=req.compare.allocator,
                               ranks=landscape_ranks(reader, grid))
    if backend == "local":
        for batch, weights, _ in weighted_batches(prefetch(reader), req.base, req.compare, workers=req.workers):
            acc.add(batch.tokens, weights, env=batch.tokens.columns.get("env"))
        return acc.finalize(n_resamples=req.n_resamples, confidence_level=req.confidence_level, rng=req.seed,
                            workers=req.workers)
    from icsd_audit.audit.ray_backend import landscape_part, ray_bootstrap, ray_parts

    with ray_bootstrap(ray_address, req.workers):
        for part in ray_parts(landscape_part, paths, (req, acc.ranks, grid), reader.batch_ids, address=ray_address,
                              workers=req.workers):
            acc.merge(part)
        return acc.finalize(n_resamples=req.n_resamples, confidence_level=req.confidence_level, rng=req.seed,
                            workers=req.workers)
