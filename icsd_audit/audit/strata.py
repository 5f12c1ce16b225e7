"""Token strata over dumps (SPEC 11): the library behind ``icsd audit strata`` and the report's strata section.

Two passes.  The first reads only the covariate (``entropy``, ``logp``, ``pos`` or
``delta``, with ``valid``) of every row group and cuts the edges from every valid token
(4-8 bytes per token while the edges are cut); dumps without a ``pos`` column number the rows
of each turn instead, which needs the ids, so that first pass reads whole batches.  The
second streams the batches as :func:`icsd_audit.audit.run.run_audit` does: each batch allocated
once, reduced to per-turn, per-bin sums (both in a worker thread, :func:`reduced_batches`) and
dropped; one bootstrap at the end.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from icsd_audit.alloc.options import required_columns, weight_pair
from icsd_audit.dumps.reader import DumpError, DumpReader, TokenBatch, prefetch
from icsd_audit.stats.budget import check_bootstrap, check_resources
from icsd_audit.stats.pages import plain_empty, prefault
from icsd_audit.audit.run import AuditRequest, deployed_request
from icsd_audit.audit.threads import single_threaded_maths
from icsd_audit.stats.strata import StrataAccumulator, covariate_values, strata_edges
from icsd_audit.stats.results import StrataResult, StrataSpec

__all__ = ["run_strata", "covariate_column", "missing_covariate", "collect_covariate", "check_covariate",
           "covariate_sample", "reduced_batches"]

#: the dump column each covariate is read from
_SOURCE = {"entropy": "entropy", "logp": "logp", "pos": "pos", "abs_delta": "delta"}
_WHY = {"entropy": "the student's next-token entropy (SPEC 11), which `icsd train` writes",
        "logp": "the student's log-probability of the sampled token"}


def covariate_column(covariate: str) -> str | None:
    """The optional dump column a covariate needs (None: every dump has what it needs)."""
    return covariate if covariate in ("entropy", "logp") else None


def missing_covariate(reader: DumpReader, covariate: str) -> str | None:
    """One line naming the input files that lack the covariate's column (None when none does)."""
    col = covariate_column(covariate)
    if col is None:
        return None
    lacking = [str(p) for p, s in zip(reader.paths, reader.schemas) if col not in s.names]
    if not lacking:
        return None
    shown = ", ".join(lacking[:5]) + (f" and {len(lacking) - 5} more" if len(lacking) > 5 else "")
    return (f"--by {covariate} needs the '{col}' column ({_WHY[covariate]}), which {len(lacking)} of "
            f"{len(reader.paths)} input file(s) lack: {shown}")


def collect_covariate(reader: DumpReader, covariate: str, *, workers: int = 1) -> np.ndarray:
    """The covariate of every valid token of ``reader``'s dumps (input order): the edges' sample.

    Reads only the covariate's column and ``valid`` per row group, unchecked: the checked
    stream that follows reports a bad value with its file and row (:func:`check_covariate`).
    The values keep the column's dtype (float32 or integers: half the memory of float64,
    whose conversion is exact and keeps their order; :func:`strata_edges` cuts them as
    float64).  ``workers`` threads read the files (:meth:`DumpReader.column_groups`).
    """
    names = [set(s.names) for s in reader.schemas]
    if covariate == "pos" and not all("pos" in n for n in names):
        # rows numbered within their turn: needs the whole batch (ids), so read batches
        parts = [covariate_values(b.tokens, "pos")[b.tokens.valid] for b in DumpReader(reader.paths, columns=[])]
        return np.concatenate(parts) if parts else np.zeros(0)
    col = _SOURCE[covariate]
    out, at = None, 0  # the valid values, written in place (no list of parts, no concatenated copy)
    for table in reader.column_groups([col, "valid"], workers=workers):
        x = table.column(col).to_numpy(zero_copy_only=False)
        # sized for every row, valid or not: faulted in as the valid values are written (stats/pages.py)
        if out is None:
            out = plain_empty((reader.n_rows,), x.dtype, populate=False)
        elif np.result_type(out, x) != out.dtype:  # a file of a wider type: the values so far widened (exactly)
            wide = np.result_type(out, x)
            grown = plain_empty((reader.n_rows,), wide, populate=False)
            prefault(grown[:at])
            grown[:at] = out[:at]
            out = grown
        x = x.astype(out.dtype, copy=False)
        keep = table.column("valid").to_numpy(zero_copy_only=False).astype(bool, copy=False) \
            if "valid" in table.column_names else None
        m = x.size if keep is None else int(np.count_nonzero(keep))
        dst = out[at : at + m]
        prefault(dst)
        if m == x.size and covariate == "abs_delta":  # every row valid: one pass
            np.abs(x, out=dst)
        elif m == x.size:
            np.copyto(dst, x)
        else:
            np.compress(keep, x, out=dst)
            if covariate == "abs_delta":
                np.abs(dst, out=dst)
        at += m
    return np.zeros(0) if out is None else out[:at]


def check_covariate(reader: DumpReader, batch: TokenBatch, x: np.ndarray, covariate: str) -> None:
    """A NaN or infinite covariate of a valid token is an input error naming its file, column and row."""
    bad = ~np.isfinite(x) & batch.tokens.valid
    if bad.any():
        i = int(np.argmax(bad))
        raise DumpError(reader.paths[int(batch.file_index[i])], "NaN value" if np.isnan(x[i]) else "infinite value",
                        column=_SOURCE[covariate], row=int(batch.file_row[i]))


def covariate_sample(reader: DumpReader, covariate: str, *, workers: int = 1) -> np.ndarray:
    """:func:`collect_covariate`, and where it holds a non-finite value, the checked read that names it."""
    x = collect_covariate(reader, covariate, workers=workers)
    if x.size and not np.isfinite(x).all():
        for batch in reader:
            check_covariate(reader, batch, covariate_values(batch.tokens, covariate), covariate)
    if x.size == 0:
        raise DumpError(reader.paths[0] if len(reader.paths) == 1 else ", ".join(map(str, reader.paths)),
                        "no valid token to cut into strata")
    return x


def reduced_batches(reader: DumpReader, acc: StrataAccumulator, req: AuditRequest, by: str
                    ) -> Iterator[StrataAccumulator]:
    """Each batch of ``reader`` allocated, checked and reduced to its per-turn strata sums (a :meth:`part
    <StrataAccumulator.part>` of ``acc``), in input order, to :meth:`~StrataAccumulator.merge` into ``acc``.

    ``req.workers`` threads take a batch each from start to end, so the allocation of one (torch, which
    releases the GIL) overlaps the reduction of another (numpy): reduced in the consuming thread, the
    reductions were the stream's critical path (at 20M tokens, 2.7 s of its 5.3).  Each batch is computed
    by one thread, as in a serial pass, and the parts merge in input order: the same bits, and the first
    bad batch in input order raises first.  At most ``req.workers`` batches are in flight.
    """

    def reduce(batch: TokenBatch, first_row: int) -> StrataAccumulator:
        weights, u = weight_pair(batch.tokens, req.base, req.compare)
        x = covariate_values(batch.tokens, by)
        check_covariate(reader, batch, x, by)
        part = acc.part()
        part.add(batch.tokens.replace(u=u), weights, x=x, first_row=first_row)
        return part

    rows = 0
    if req.workers <= 1:
        for batch in prefetch(reader):
            yield reduce(batch, rows)
            rows += len(batch.tokens)
        return
    with ThreadPoolExecutor(max_workers=req.workers, thread_name_prefix="icsd-strata") as pool:
        pending: deque = deque()
        for batch in prefetch(reader):
            pending.append(pool.submit(reduce, batch, rows))
            rows += len(batch.tokens)
            if len(pending) >= req.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


# one torch intra-op thread, as every audit entry point: above 32768 tokens a batch's allocation bits would
# otherwise follow the core count, and a library caller would get other intervals than the CLI and the report
@single_threaded_maths
def run_strata(
    paths: Sequence[str | Path],
    req: AuditRequest | None = None,
    *,
    by: str,
    bins: int | None = None,
    top: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> StrataResult:
    """Token strata of the dumps at ``paths`` by the covariate ``by`` (SPEC 11).

    ``req``: the weightings, bootstrap options and TCM threshold (``None``: SDAR against the
    deployed allocator with the settings the dumps record, :func:`deployed_request`);
    ``req.by`` must be None.  ``bins``/``top`` as :class:`StrataSpec`.
    """
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
    n_bins = spec.k if spec.k is not None else 2
    check_bootstrap(req.n_resamples, 7 * n_bins)
    check_resources(reader, workers=req.workers)
    edges = strata_edges(covariate_sample(reader, by, workers=req.workers), spec, workers=req.workers)
    acc = StrataAccumulator(spec=spec, edges=edges, eps=req.eps, base_name=req.base.allocator,
                            compare_name=req.compare.allocator)
    acc.reserve(reader.n_rows)  # per-turn sums copied into one matrix during the stream, not after it
    n = len(reader.batch_ids)
    for i, part in enumerate(reduced_batches(reader, acc, req, by)):
        acc.merge(part)
        if progress is not None:
            progress(i + 1, n)
    return acc.finalize(n_resamples=req.n_resamples, confidence_level=req.confidence_level, unit=req.unit,
                        rng=req.seed, workers=req.workers)

