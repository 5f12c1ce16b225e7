"""``icsd audit strata --backend ray``: the token strata's second pass (SPEC 11) as Ray tasks.

The first pass (the covariate's sample and the edges cut from it) runs on the driver, as
:func:`icsd_audit.audit.strata.run_strata` runs it, with the same checks. Then each batch
is one Ray task (:mod:`icsd_audit.audit.ray_backend`): read, allocated, its covariate
checked, reduced into a copy of the driver's empty
:class:`~icsd_audit.stats.strata.StrataAccumulator` (same spec and edges); the driver
merges the parts in batch order and bootstraps once, its work units as Ray tasks
(:func:`~icsd_audit.audit.ray_backend.ray_bootstrap`), so the result is the bits of the
local run for any number of workers.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from icsd_audit.alloc.options import required_columns, weighted_batches
from icsd_audit.audit.ray_backend import ray_bootstrap, ray_parts, worker_reader
from icsd_audit.audit.run import AuditRequest, deployed_request
from icsd_audit.audit.strata import check_covariate, covariate_column, covariate_sample, missing_covariate
from icsd_audit.audit.threads import one_intra_op_thread, single_threaded_maths
from icsd_audit.dumps.reader import DumpReader
from icsd_audit.stats.budget import check_bootstrap, check_resources
from icsd_audit.stats.results import StrataResult, StrataSpec
from icsd_audit.stats.strata import StrataAccumulator, covariate_values, strata_edges

__all__ = ["run_strata_ray", "strata_part"]


def strata_part(paths: Sequence[str], req: AuditRequest, covariate: str, template: StrataAccumulator,
                batch_id: int) -> StrataAccumulator:
    """One batch read, allocated and reduced into a copy of ``template`` (what a Ray task runs)."""
    col = covariate_column(covariate)
    reader = worker_reader(paths, (col,) if col else (), tuple(required_columns(req.base.allocator,
                                                                                 req.compare.allocator)))
    acc = copy.deepcopy(template)  # (an object-store copy's arrays are read-only)
    with one_intra_op_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the driver has shown them
        for batch, weights, u in weighted_batches([reader.batch(batch_id)], req.base, req.compare):
            x = covariate_values(batch.tokens, covariate)
            check_covariate(reader, batch, x, covariate)
            acc.add(batch.tokens.replace(u=u), weights, x=x)
    return acc


@single_threaded_maths
def run_strata_ray(
    paths: Sequence[str | Path],
    req: AuditRequest | None = None,
    *,
    by: str,
    bins: int | None = None,
    top: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    ray_address: str | None = None,
) -> StrataResult:
    """:func:`~icsd_audit.audit.strata.run_strata` with the batches as Ray tasks (``ray_address``: the cluster,
    default a local one of ``req.workers`` CPUs): the same result."""
    spec = StrataSpec(by, bins, top)
    if req is None:
        req = deployed_request(paths)
    if req.by is not None:
        raise ValueError("token strata are pooled over every batch; --by names the covariate here")
    col = covariate_column(by)
    reader = DumpReader(paths, columns=[col] if col else [], require=required_columns(req.base.allocator,
                                                                                      req.compare.allocator))
    why = missing_covariate(reader, by)
    if why is not None:
        raise ValueError(why)
    check_bootstrap(req.n_resamples, 7 * (spec.k if spec.k is not None else 2))
    check_resources(reader, workers=req.workers)
    acc = StrataAccumulator(spec=spec, edges=strata_edges(covariate_sample(reader, by), spec), eps=req.eps,
                            base_name=req.base.allocator, compare_name=req.compare.allocator)
    n = len(reader.batch_ids)
    template: Any = copy.deepcopy(acc)
    with ray_bootstrap(ray_address, req.workers):  # the map, then the bootstrap's work units, on one cluster
        for i, part in enumerate(ray_parts(strata_part, paths, (req, by, template), reader.batch_ids,
                                           address=ray_address, workers=req.workers)):
            acc.merge(part)
            if progress is not None:
                progress(i + 1, n)
        return acc.finalize(n_resamples=req.n_resamples, confidence_level=req.confidence_level, unit=req.unit,
                            rng=req.seed, workers=req.workers)
