"""Token strata (SPEC 11): where each allocation's mass, and its conflict mass, lands by a per-token covariate.

Covariates: ``entropy`` (the student's next-token entropy, an optional dump column),
``logp``, ``pos`` (position in the turn's response) and ``abs_delta`` (|delta|).  The edges
are the empirical quantiles k/K of the covariate over every valid token of the audit
(:func:`strata_edges`: numpy ``quantile``, method ``linear``, duplicates dropped), a token's
bin is the number of edges <= x (``searchsorted(..., side="right")``); ``top=q`` splits
the tokens at or above the (1 - q) quantile from the rest.  Per bin and weighting: token
share, mass share, intensity (mass share / token share), the bin's trusted-conflict mass
(SPEC 6), and compare minus base.

Edges need the whole sample, so a caller first collects the covariate of every valid token
(4-8 bytes per token, :mod:`icsd_audit.audit.strata` reads only that column), cuts the
edges, then streams batches into a :class:`StrataAccumulator`, which keeps per-turn sums
per bin (float64, merged by concatenation in batch order, SPEC 12).  The bootstrap is
SPEC 7's action-turn bootstrap on the same machinery as :func:`icsd_audit.stats.api.tcm`
(:func:`~icsd_audit.stats.bootstrap.bootstrap_ratio_families`): the action turns, their
order and their batches are the ones :class:`~icsd_audit.stats.accumulator.AuditAccumulator`
builds, so the resamples are the ones every statistic of the audit reads, and a strata
statistic (named by :attr:`StrataSpec.name`) has one interval whichever command computes it.

Pure numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from icsd_audit.stats.bootstrap import BootstrapResult, RatioBootstrapResult, RatioFamily, bootstrap_ratio_families
from icsd_audit.stats.pages import plain_empty, prefault
from icsd_audit.stats.pool import on_threads
from icsd_audit.stats.rank_edges import linear_quantiles
from icsd_audit.stats.results import EPS, PairedResult, check_names, tcm_undefined_reason
from icsd_audit.stats.results import (
    COVARIATES, FORKING_TOP, N_STRATA_BINS, StrataBin, StrataResult, StrataSpec,
)
from icsd_audit.stats.turns import ClusterIndex, as_numpy, check_finite
from icsd_audit.tokens import Tokens, Weights

__all__ = ["COVARIATES", "N_STRATA_BINS", "FORKING_TOP", "StrataSpec", "StrataBin", "StrataResult",
           "StrataAccumulator", "strata", "strata_edges", "strata_bins", "turn_positions", "covariate_values"]

#: per (turn, bin) sums kept by the accumulator, in this order
_QUANTITIES = ("n", "base", "compare", "tcm_num_base", "tcm_den_base", "tcm_num_compare", "tcm_den_compare")
_NQ = len(_QUANTITIES)
#: at most this many edges: bins by comparisons (int8 counts) rather than a binary search
_FEW_EDGES = 32


def strata_edges(x: Any, spec: StrataSpec, *, workers: int = 1) -> np.ndarray:
    """SPEC 11's edges: numpy ``quantile`` (``linear``) of ``x`` (as float64) at k/K (or 1 - q), duplicates
    dropped, float64; the same bits from the few order statistics they need (:func:`linear_quantiles`, on
    ``workers`` threads)."""
    a = np.asarray(x).reshape(-1)
    if a.size == 0:
        raise ValueError("no valid token to cut into strata")
    qs = spec.quantiles()
    if not qs:
        return np.zeros(0, dtype=np.float64)
    return np.unique(linear_quantiles(a, qs, workers=workers))


def strata_bins(x: Any, edges: np.ndarray) -> np.ndarray:
    """Each token's bin: the number of edges <= x (``searchsorted(edges, x, side="right")``, edges sorted)."""
    a = np.asarray(x, dtype=np.float64)
    e = np.asarray(edges, dtype=np.float64).reshape(-1)
    if e.size > _FEW_EDGES:
        return np.searchsorted(e, a, side="right").astype(np.int64)
    # a few edges: one comparison per edge (3x as fast as the binary search of each value)
    b = np.zeros(a.shape, dtype=np.int8)
    ge = np.empty(a.shape, dtype=bool)
    for v in e.tolist():
        np.add(b, np.greater_equal(a, v, out=ge), out=b)
    nan = np.isnan(a)
    if nan.any():  # NaN sorts after every edge
        b[nan] = e.size
    return b.astype(np.int64)


def turn_positions(batch_id: Any, traj_id: Any, turn_id: Any) -> np.ndarray:
    """0-based index of each row among the rows of its action turn, in the given (file) order.

    The ``pos`` covariate of dumps without a ``pos`` column: every row of the turn counts,
    valid or not, as a ``pos`` column would number them.
    """
    keys = [np.asarray(k).reshape(-1) for k in (batch_id, traj_id, turn_id)]
    n = keys[0].size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cidx = ClusterIndex(*keys)
    ids = cidx.ids()
    counts = np.bincount(ids, minlength=cidx.n)
    starts = np.cumsum(counts) - counts
    order = np.argsort(ids, kind="stable")
    out = np.empty(n, dtype=np.int64)
    out[order] = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)
    return out


def covariate_values(tokens: Tokens, covariate: str) -> np.ndarray:
    """The covariate of every row of ``tokens`` (valid or not), as float64.

    ``entropy`` and ``logp`` come from ``tokens.columns``; ``pos`` from the ``pos`` column,
    else the index within the turn in row order (:func:`turn_positions`); ``abs_delta`` is |delta|.
    """
    if covariate in ("entropy", "logp"):
        return as_numpy(tokens.column(covariate), covariate).astype(np.float64)
    if covariate == "pos":
        if "pos" in tokens.columns:
            return as_numpy(tokens.columns["pos"], "pos").astype(np.float64)
        n = len(tokens)
        batch = np.zeros(n, dtype=np.int64) if tokens.batch_id is None else as_numpy(tokens.batch_id, "batch_id", n)
        return turn_positions(batch, as_numpy(tokens.traj_id, "traj_id", n), as_numpy(tokens.turn_id, "turn_id", n)
                              ).astype(np.float64)
    if covariate == "abs_delta":
        return np.abs(as_numpy(tokens.delta, "delta").astype(np.float64))
    raise ValueError(f"unknown covariate {covariate!r}; choose from {', '.join(COVARIATES)}")


class StrataAccumulator:
    """Per-turn, per-bin sums of the strata statistics; one bootstrap at the end.

    ``edges`` come from the whole sample (:func:`strata_edges`) and stay fixed in every
    resample (SPEC 11).  Memory: 7 floats per action turn and bin.
    """

    def __init__(self, *, spec: StrataSpec, edges: Any, eps: float = EPS, base_name: str = "sdar",
                 compare_name: str = "icsd"):
        self.spec = spec
        self.edges = np.asarray(edges, dtype=np.float64).reshape(-1)
        if self.edges.size and not (np.isfinite(self.edges).all() and (np.diff(self.edges) > 0).all()):
            raise ValueError("strata edges must be finite and strictly increasing")
        self.n_bins = int(self.edges.size) + 1
        self.eps = float(eps)
        if not (self.eps >= 0):
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        self.base_name, self.compare_name = check_names(base_name, compare_name)
        # per add: (bins x quantities, turns), the rows of the bootstrap's column matrix; after :meth:`reserve`,
        # copied into _M (columns x capacity, _used of them filled) as they come instead
        self._sums: list[np.ndarray] = []
        self._batch: list[np.ndarray] = []
        self._expected_rows: int | None = None
        self._M: np.ndarray | None = None
        self._used = 0
        nb = self.n_bins
        self._counts = {k: np.zeros(nb, dtype=np.int64) for k in ("n", "active", "supported", "supported_adv0")}
        self._xmin, self._xmax = np.inf, -np.inf
        self._rows = 0

    def part(self) -> "StrataAccumulator":
        """An empty accumulator with these settings and edges, for a batch reduced apart (:meth:`merge` appends it)."""
        return StrataAccumulator(spec=self.spec, edges=self.edges, eps=self.eps, base_name=self.base_name,
                                 compare_name=self.compare_name)

    def reserve(self, rows: int) -> None:
        """Expect about ``rows`` input rows in all (valid or not, e.g. :attr:`DumpReader.n_rows`): the per-turn sums
        then go into one matrix as each batch is added or merged, sized from the first batch's turns per row
        (10 % over; grown by half, with a copy, if the estimate falls short), so that :meth:`family` copies
        nothing after the stream; each batch's columns are faulted in before they are written (one call per row,
        :func:`~icsd_audit.stats.pages.prefault`; capacity never written costs nothing), while the stream's threads
        compute."""
        if self._sums or self._M is not None:
            raise ValueError("reserve before adding any batch")
        self._expected_rows = max(1, int(rows))

    def _keep(self, piece: np.ndarray, rows: int) -> None:
        """Keep one batch's (columns x turns) sums: in the list, or copied into the reserved matrix."""
        if self._expected_rows is None:
            self._sums.append(piece)
            return
        k, w = piece.shape
        if self._M is None or self._used + w > self._M.shape[1]:
            if self._M is None:
                cap = int(np.ceil(w / max(rows, 1) * self._expected_rows * 1.1)) + w
            else:
                cap = max(self._used + w, int(self._M.shape[1] * 1.5))
            grown = plain_empty((k, cap), populate=False)  # sized from an estimate: faulted in as batches arrive
            if self._M is not None:
                prefault(grown[:, : self._used])
                grown[:, : self._used] = self._M[:, : self._used]
            self._M = grown
        dst = self._M[:, self._used : self._used + w]
        prefault(dst)  # a call per row rather than a fault per page (stats/pages.py)
        dst[...] = piece
        self._used += w

    def add(self, tokens: Tokens, weights: Weights, *, x: Any, first_row: int | None = None) -> None:
        """Add tokens (one or several batches), their two weightings and their covariate ``x`` (one per row).

        ``first_row``: the input row of the first token, for error messages (default: the rows added so far).
        """
        if (weights.base_name, weights.compare_name) != (self.base_name, self.compare_name):
            raise ValueError(f"weights are labelled ({weights.base_name}, {weights.compare_name}) but the "
                             f"accumulator compares ({self.base_name}, {self.compare_name})")
        delta = as_numpy(tokens.delta, "delta")
        n = delta.shape[0]
        adv = as_numpy(tokens.advantage, "advantage", n)
        ratio = as_numpy(tokens.ratio, "ratio", n)
        wb = as_numpy(weights.base, self.base_name, n)
        wc = as_numpy(weights.compare, self.compare_name, n)
        traj = as_numpy(tokens.traj_id, "traj_id", n)
        turn = as_numpy(tokens.turn_id, "turn_id", n)
        batch = np.zeros(n, dtype=np.int64) if tokens.batch_id is None else as_numpy(tokens.batch_id, "batch_id", n)
        u = None if tokens.u is None else as_numpy(tokens.u, "u", n)
        xa = as_numpy(x, self.spec.covariate, n)
        for name, a in (("traj_id", traj), ("turn_id", turn), ("batch_id", batch)):
            if a.dtype.kind not in "iu":
                raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
        rows = None
        if tokens.valid is not None:
            keep = as_numpy(tokens.valid, "valid", n).astype(bool)
            if not keep.all():
                rows = np.flatnonzero(keep)
                delta, adv, ratio, wb, wc, traj, turn, batch, xa = (
                    a[rows] for a in (delta, adv, ratio, wb, wc, traj, turn, batch, xa))
                u = None if u is None else u[rows]
        for name, a, nonneg in (("delta", delta, False), ("advantage", adv, False), ("ratio", ratio, False),
                                (self.base_name, wb, True), (self.compare_name, wc, True),
                                (self.spec.covariate, xa, False)) + ((("u", u, False),) if u is not None else ()):
            check_finite(name, a, nonnegative=nonneg, offset=self._rows if first_row is None else int(first_row),
                         rows=rows)
        self._rows += n
        m = delta.shape[0]
        if m == 0:
            return
        x64 = np.asarray(xa, dtype=np.float64)
        self._xmin, self._xmax = min(self._xmin, float(x64.min())), max(self._xmax, float(x64.max()))
        b = strata_bins(x64, self.edges)
        cidx = ClusterIndex(batch, traj, turn)  # the clusters, and their order, of AuditAccumulator
        nb = self.n_bins
        key = cidx.ids() * nb + b
        size = cidx.n * nb
        wb64, wc64 = np.asarray(wb, dtype=np.float64), np.asarray(wc, dtype=np.float64)
        # SPEC 6's TCM sets, as AuditAccumulator computes them (u in float64 unless given)
        if u is not None:
            u64 = np.asarray(u, dtype=np.float64)
        else:
            u64 = adv.astype(np.float64) * ratio.astype(np.float64) * delta.astype(np.float64)
        dpos = delta > 0
        act = np.flatnonzero(dpos & (np.abs(u64) > self.eps))
        neg = act[u64[act] < 0]
        # row b * 7 + q holds quantity q of bin b for every turn (the totals are the bins' sums, :meth:`family`)
        out = np.empty((nb * _NQ, cidx.n), dtype=np.float64)
        view = out.reshape(nb, _NQ, cidx.n)
        view[:, 0] = np.bincount(key, minlength=size).reshape(cidx.n, nb).T
        # a set's sums from its tokens alone: the same additions, in the same order, as the whole batch's with
        # 0 elsewhere (adding +0.0 to a sum of non-negative weights changes no bit)
        ka, kn = key[act], key[neg]
        for q, k, w in ((1, key, wb64), (2, key, wc64), (3, kn, wb64[neg]), (4, ka, wb64[act]), (5, kn, wc64[neg]),
                        (6, ka, wc64[act])):
            view[:, q] = np.bincount(k, weights=w, minlength=size).reshape(cidx.n, nb).T
        self._keep(out, n)
        self._batch.append(batch[cidx.first].astype(np.int64))
        for name, sel in (("n", None), ("active", act), ("supported", dpos), ("supported_adv0", dpos & (adv == 0))):
            self._counts[name] += np.bincount(b if sel is None else b[sel], minlength=nb)

    def merge(self, part: "StrataAccumulator") -> None:
        """Append ``part`` (the same spec and edges, one batch) after the batches here: the bits of adding it here.

        Its per-turn sums are kept as computed; its bin counts (integers) add; the
        covariate's range takes the min and max.
        """
        if (part.spec, part.eps, part.base_name, part.compare_name) != (self.spec, self.eps, self.base_name,
                                                                        self.compare_name) \
                or not np.array_equal(part.edges, self.edges):
            raise ValueError("merge: the part was built with other settings or edges")
        for piece in part._sums if part._M is None else [part._M[:, : part._used]]:
            self._keep(piece, part._rows)
        self._batch.extend(part._batch)
        for k, v in part._counts.items():
            self._counts[k] += v
        self._xmin, self._xmax = min(self._xmin, part._xmin), max(self._xmax, part._xmax)
        self._rows += part._rows

    # -- output
    def _names(self) -> list[str]:
        stem = self.spec.name
        ratios = [f"{stem}:{b}:{q}" for b in range(self.n_bins)
                  for q in ("token_share", "share:base", "share:compare", "tcm:base", "tcm:compare")]
        diffs = [f"{stem}:{b}:{q}:diff" for b in range(self.n_bins) for q in ("share", "tcm")]
        return ratios + diffs

    def family(self, *, workers: int = 1, donate: bool = False) -> RatioFamily:
        """The bootstrap request of this statistic: per-turn columns, bins side by side.

        The three denominators (all tokens, each weighting's whole mass) are the totals of the
        bins' columns (no product of their own).  Each bin's columns form a column group and
        each TCM numerator is tied to its denominator (the numerator of a turn is its
        denominator where the turn's active tokens all have u < 0, 0 where they all have u > 0),
        so the engine multiplies a bin only over the turns that reach it, and a numerator only
        on turns of mixed signs (:class:`~icsd_audit.stats.engine.segments.SegmentedFamily`).  The
        columns are gathered into one (columns x turns) float64 matrix, each batch's piece
        released once copied (already done where :meth:`reserve` was called), and handed over as
        its transpose (a view, which the bootstrap takes without a copy): about 8 bytes per turn
        per column.  ``workers`` threads copy the pieces (NumPy copies without the GIL).  ``donate``: the family is
        only handed to the bootstrap, whose engine then sorts the matrix in place; otherwise the engine multiplies a
        sorted copy (as much again).
        """
        if not self._sums and not self._used:
            raise ValueError("no valid tokens to audit")
        nb = self.n_bins
        pieces, self._sums = self._sums, []
        offsets = np.cumsum([0] + [p.shape[1] for p in pieces]).tolist()
        if self._M is not None:  # reserved: already in place (its rows are as long as the capacity)
            M, self._M = self._M[:, : self._used], None
        else:
            M = plain_empty((nb * _NQ, offsets[-1]))

        def put(i: int) -> None:
            M[:, offsets[i] : offsets[i + 1]] = pieces[i]
            pieces[i] = None  # released once copied

        on_threads(put, range(len(pieces)), workers)
        tot_n, tot_b, tot_c = nb * _NQ, nb * _NQ + 1, nb * _NQ + 2
        num: list[int] = []
        den: list[int] = []
        for b in range(nb):
            c = b * _NQ
            num += [c + 0, c + 1, c + 2, c + 3, c + 5]
            den += [tot_n, tot_b, tot_c, c + 4, c + 6]
        diffs: list[tuple[int, int]] = []
        for b in range(nb):
            r = 5 * b
            diffs += [(r + 2, r + 1), (r + 4, r + 3)]
        self._batch_final = np.concatenate(self._batch)
        return RatioFamily(M.T, num, den, strata=self._batch_final, differences=diffs, names=self._names(),
                           totals=[[b * _NQ + q for b in range(nb)] for q in (0, 1, 2)],
                           column_groups=[list(range(b * _NQ, (b + 1) * _NQ)) for b in range(nb)],
                           tied=[(b * _NQ + q, b * _NQ + q + 1) for b in range(nb) for q in (3, 5)], donate=donate)

    def results(self, raw: RatioBootstrapResult, *, unit: str = "action-turn") -> StrataResult:
        """The result object from the bootstrap of :meth:`family` (with its replicates, for the intensities)."""
        nb = self.n_bins
        c = self._counts
        n_total = int(c["n"].sum())
        stem = self.spec.name
        edges = self.edges.tolist()
        bins = []
        for b in range(nb):
            def r(q: str, b: int = b) -> BootstrapResult:
                return raw.result(f"{stem}:{b}:{q}")

            tok = r("token_share")
            share = PairedResult(r("share:base"), r("share:compare"), r("share:diff"))
            tcm = PairedResult(r("tcm:base"), r("tcm:compare"), r("tcm:diff"))
            inten = [_quotient(raw, f"{stem}:{b}:share:{side}", f"{stem}:{b}:token_share")
                     for side in ("base", "compare")]
            defined = c["active"][b] > 0 and np.isfinite(tcm.base.estimate) and np.isfinite(tcm.compare.estimate)
            why = None if defined else tcm_undefined_reason(
                n_tokens=int(c["n"][b]), n_active=int(c["active"][b]), n_supported=int(c["supported"][b]),
                n_supported_zero_advantage=int(c["supported_adv0"][b]), eps=self.eps)
            bins.append(StrataBin(
                index=b, lo=edges[b - 1] if b > 0 else self._xmin, hi=edges[b] if b < nb - 1 else self._xmax,
                n_tokens=int(c["n"][b]), token_share=tok, share=share, intensity_base=inten[0],
                intensity_compare=inten[1], tcm=tcm, n_active_tokens=int(c["active"][b]), tcm_undefined=why,
            ))
        return StrataResult(
            spec=self.spec, edges=tuple(edges), bins=tuple(bins), base_name=self.base_name,
            compare_name=self.compare_name, n_tokens=n_total, n_turns=int(self._batch_final.size),
            n_batches=int(np.unique(self._batch_final).size), eps=self.eps, n_resamples=raw.n_resamples,
            confidence_level=raw.confidence_level, unit=unit,
        )

    def finalize(self, *, n_resamples: int = 10_000, confidence_level: float = 0.95, unit: str = "action-turn",
                 rng: Any = None, chunk_size: int | None = None, workers: int = 1) -> StrataResult:
        """Bootstrap this statistic on the resample stream of its layout (SPEC 7) and build the result."""
        (raw,) = bootstrap_ratio_families([self.family(workers=workers, donate=True)], n_resamples=n_resamples,
                                          confidence_level=confidence_level,
                                          unit=unit, rng=rng, chunk_size=chunk_size, workers=workers,
                                          keep_replicates=True)
        return self.results(raw, unit=unit)


def _quotient(raw: RatioBootstrapResult, num: str, den: str) -> BootstrapResult:
    """The ratio of two of a bootstrap's statistics, its interval from their ratio on each resample.

    The intensity (mass share / token share) is not a ratio of pooled sums, so it takes its
    percentile interval from the kept replicates (the same resamples as everything else):
    NumPy's linear percentile over the resamples where it is defined, widened to contain the
    estimate, as :mod:`icsd_audit.stats.bootstrap` does for every statistic.
    """
    i, j = raw.index(num), raw.index(den)
    with np.errstate(divide="ignore", invalid="ignore"):
        est = float(raw.estimate[0, i] / raw.estimate[0, j]) if raw.estimate[0, j] != 0 else float("nan")
        if raw.replicates is None:
            raise ValueError("the strata bootstrap must keep its replicates (keep_replicates=True)")
        a = raw.replicates[:, 0, j].astype(np.float64)
        rep = np.where(a != 0, raw.replicates[:, 0, i].astype(np.float64) / np.where(a != 0, a, 1.0), np.nan)
    rep = rep[np.isfinite(rep)]
    alpha = 1.0 - raw.confidence_level
    if rep.size == 0 or not np.isfinite(est):
        lo = hi = se = float("nan")
    else:
        lo, hi = (float(v) for v in np.quantile(rep, [alpha / 2, 1 - alpha / 2], method="linear"))
        lo, hi = min(lo, est), max(hi, est)
        se = float(rep.std(ddof=1)) if rep.size > 1 else float("nan")
    return BootstrapResult(est, lo, hi, se, raw.n_resamples, raw.confidence_level, "percentile", raw.unit)


def strata(
    tokens: Tokens,
    weights: Weights,
    *,
    by: str,
    x: Any = None,
    bins: int | None = None,
    top: float | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: str = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    eps: float = EPS,
) -> StrataResult:
    """Token strata (SPEC 11): per bin of the covariate ``by``, each weighting's mass share, intensity and TCM.

    ``by``: ``entropy``, ``logp``, ``pos`` or ``abs_delta``; ``x`` (one value per row)
    overrides the covariate taken from ``tokens`` (:func:`covariate_values`).  ``bins=K``
    (default 10) quantile bins, or ``top=q``: the tokens at or above the (1 - q) quantile
    against the rest.  Edges from every valid token, fixed in the resamples; bootstrap
    options as in :func:`icsd_audit.stats.api.tcm`; ``eps`` is SPEC 6's TCM threshold.
    """
    spec = StrataSpec(by, bins, top)
    xa = covariate_values(tokens, by) if x is None else as_numpy(x, by, len(tokens)).astype(np.float64)
    valid = np.ones(len(tokens), dtype=bool) if tokens.valid is None else as_numpy(tokens.valid, "valid").astype(bool)
    check_finite(by, xa[valid], rows=np.flatnonzero(valid))
    acc = StrataAccumulator(spec=spec, edges=strata_edges(xa[valid], spec), eps=eps, base_name=weights.base_name,
                            compare_name=weights.compare_name)
    acc.add(tokens, weights, x=xa)
    return acc.finalize(n_resamples=n_resamples, confidence_level=confidence_level, unit=unit, rng=rng,
                        chunk_size=chunk_size, workers=workers)
