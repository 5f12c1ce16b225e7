"""Streaming accumulator of per-turn sums for TCM, quadrants, share shift and clipping.

:class:`AuditAccumulator` reduces each batch of tokens to one row per action turn
holding every numerator and denominator the requested statistics need (SPEC 6), keeps
those rows (a few floats per turn), and at :meth:`AuditAccumulator.finalize` runs one
stratified action-turn bootstrap for all statistics together (SPEC 7).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from icsd_audit.stats.bootstrap import (
    BootstrapResult, RatioBootstrapResult, RatioFamily, bootstrap_ratio_families, exact_zero_result,
)
from icsd_audit.stats.pages import HUGE_PAGE_BYTES
from icsd_audit.stats.results import (
    CLIP_EPS, DUAL_CLIP, EPS, MASS_RTOL, N_SHIFT_BINS, REGIONS, STATISTICS, AuditResults, ClipResult, ClipSet,
    GroupedResult, PairedResult, QuadrantsResult, ShiftBin, ShiftResult, TCMResult, check_names, shift_bin_labels,
)
from icsd_audit.tokens import Tokens, Weights
from icsd_audit.stats.turns import (
    ClusterIndex, GroupCodes, as_numpy, bin_sums, check_finite, check_turns, factorize, masked,
)

__all__ = ["AuditAccumulator", "midrank_bins"]


#: the per-turn float columns :meth:`AuditAccumulator.results` reads (the quadrants' exact-zero test; counts apart)
_RESULT_COLUMNS = frozenset({"total_b", "total_c", *(f"q_{r}_{x}" for r in REGIONS for x in "bc")})


def _check_positive(name: str, x: Any, *, strict: bool = True) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {x!r}") from None
    if not math.isfinite(v) or (v <= 0 if strict else v < 0):
        raise ValueError(f"{name} must be {'> 0' if strict else '>= 0'}, got {x!r}")
    return v


class AuditAccumulator:
    """Reduce batches of tokens to per-turn sums; bootstrap every statistic at the end.

    >>> acc = AuditAccumulator(statistics=("tcm", "quadrants"))
    >>> for tokens in read_dumps(paths):                          # doctest: +SKIP
    ...     acc.add(tokens, Weights(g, c))
    >>> res = acc.finalize(n_resamples=10_000, rng=0)             # doctest: +SKIP

    Memory: a few floats per action turn per statistic, whatever the number of tokens.
    """

    def __init__(
        self,
        *,
        statistics: Sequence[str] = STATISTICS,
        eps: float = EPS,
        clip_eps: float = CLIP_EPS,
        dual_clip: float = DUAL_CLIP,
        n_bins: int = N_SHIFT_BINS,
        base_name: str = "sdar",
        compare_name: str = "icsd",
        by: str | None = None,
        mass_rtol: float = MASS_RTOL,
    ):
        stats = tuple(statistics)
        unknown = [s for s in stats if s not in STATISTICS]
        if unknown or not stats:
            raise ValueError(f"unknown statistics {unknown}; choose from {', '.join(STATISTICS)}")
        self.statistics = tuple(s for s in STATISTICS if s in stats)
        self.eps = _check_positive("eps", eps, strict=False)
        self.clip_eps = _check_positive("clip_eps", clip_eps)
        self.dual_clip = _check_positive("dual_clip", dual_clip)
        if self.dual_clip <= 1 + self.clip_eps:
            raise ValueError(f"dual_clip must exceed 1 + clip_eps = {1 + self.clip_eps}, got {dual_clip}")
        if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
            raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
        self.n_bins = int(n_bins)
        self.base_name, self.compare_name = check_names(base_name, compare_name)
        self.by = by
        self.mass_rtol = _check_positive("mass_rtol", mass_rtol, strict=False)
        self._cols: dict[str, list[np.ndarray]] = {}
        self._batch: list[np.ndarray] = []
        self._group: list[np.ndarray] = []
        self._ntok: list[np.ndarray] = []
        self._groups = GroupCodes()
        self._n_clusters = 0
        self._rows = 0
        # shift: S+ sub-clusters (cluster, advantage value) with token counts and sums
        self._sp: dict[str, list[np.ndarray]] = {k: [] for k in ("cluster", "adv", "n", "b", "c")}
        # clip: pooled ratio moments (count, mean, M2), merged batch by batch
        self._ratio_moments: dict[int, list[float]] = {}

    # -- input
    def add(self, tokens: Tokens, weights: Weights, *, group: Any = None, turns: ClusterIndex | None = None) -> None:
        """Add tokens (one or several batches) and their two weightings.

        ``weights.base`` / ``weights.compare`` are the two non-negative weightings (e.g.
        g and c), labelled as this accumulator's names; ``tokens.u`` defaults to
        advantage * ratio * delta in float64; ``group`` is the per-token key of ``by``
        (required when the accumulator has ``by``); ``turns``: :func:`~icsd_audit.stats.turns.turn_index` of
        these tokens when the caller has it (used without ``by``).
        """
        check_weight_names(weights, self.base_name, self.compare_name)
        delta, advantage, ratio = tokens.delta, tokens.advantage, tokens.ratio
        traj_id, turn_id, batch_id, valid, u = tokens.traj_id, tokens.turn_id, tokens.batch_id, tokens.valid, tokens.u
        base, compare = weights.base, weights.compare
        delta_a = as_numpy(delta, "delta")
        n = delta_a.shape[0]
        adv_a = as_numpy(advantage, "advantage", n)
        ratio_a = as_numpy(ratio, "ratio", n)
        wb = as_numpy(base, self.base_name, n)
        wc = as_numpy(compare, self.compare_name, n)
        traj = as_numpy(traj_id, "traj_id", n)
        turn = as_numpy(turn_id, "turn_id", n)
        batch = np.zeros(n, dtype=np.int64) if batch_id is None else as_numpy(batch_id, "batch_id", n)
        keep = None if valid is None else as_numpy(valid, "valid", n).astype(bool)
        ua = None if u is None else as_numpy(u, "u", n)
        if self.by is not None and group is None:
            raise ValueError(f"group values are required: the accumulator groups by {self.by!r}")
        if self.by is None and group is not None:
            raise ValueError("group values given, but the accumulator was built without by=")
        grp = None if group is None else as_numpy(group, "group", n)
        for name, a in (("traj_id", traj), ("turn_id", turn), ("batch_id", batch)):
            if a.dtype.kind not in "iu":
                raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
        if keep is not None and not keep.all():
            sel = np.flatnonzero(keep)
            delta_a, adv_a, ratio_a, wb, wc, traj, turn, batch = (
                x[sel] for x in (delta_a, adv_a, ratio_a, wb, wc, traj, turn, batch)
            )
            ua = None if ua is None else ua[sel]
            grp = None if grp is None else grp[sel]
            rows = sel
        else:
            rows = None
        for name, a, nonneg in (
            ("delta", delta_a, False), ("advantage", adv_a, False), ("ratio", ratio_a, False),
            (self.base_name, wb, True), (self.compare_name, wc, True),
        ) + ((("u", ua, False),) if ua is not None else ()):
            check_finite(name, a, nonnegative=nonneg, offset=self._rows, rows=rows)
        self._rows += n
        m = delta_a.shape[0]
        if m == 0:
            return
        gcode = self._groups.encode(grp) if grp is not None else None
        check_turns(turns, m)
        if grp is not None:
            cidx = ClusterIndex(batch, traj, turn, gcode)
        else:
            cidx = turns if turns is not None else ClusterIndex(batch, traj, turn)
        first = cidx.first
        self._batch.append(batch[first].astype(np.int64))
        self._group.append(gcode[first] if gcode is not None else np.zeros(first.size, dtype=np.int64))
        self._ntok.append(cidx.count().astype(np.int32))

        # (float64 views where the inputs are float64 already: nothing below writes to them)
        wb64 = np.asarray(wb, dtype=np.float64)
        wc64 = np.asarray(wc, dtype=np.float64)
        cols: dict[str, np.ndarray] = {}
        buf = np.empty(m, dtype=np.float64)  # the masked column of each sum (consumed at once)

        def put(name: str, mask: np.ndarray | None, w: np.ndarray) -> None:
            cols[name] = cidx.sum(w if mask is None else masked(w, mask, buf))

        dpos = delta_a > 0
        if "tcm" in self.statistics:
            u64 = np.asarray(ua, dtype=np.float64) if ua is not None else adv_a.astype(np.float64) * ratio_a.astype(np.float64) * delta_a.astype(np.float64)
            act = dpos & (np.abs(u64) > self.eps)
            neg = act & (u64 < 0)
            put("tcm_num_b", neg, wb64)
            put("tcm_den_b", act, wb64)
            put("tcm_num_c", neg, wc64)
            put("tcm_den_c", act, wc64)
            cols["tcm_active_n"] = _count(cidx, act)
            # why TCM is undefined when no token is active (TCMResult.undefined)
            cols["tcm_supported_n"] = _count(cidx, dpos)
            cols["tcm_supported_adv0_n"] = _count(cidx, dpos & (adv_a == 0))
        if "quadrants" in self.statistics or "clip" in self.statistics:
            put("total_b", None, wb64)
            put("total_c", None, wc64)
        if "quadrants" in self.statistics:
            dneg = delta_a < 0
            apos, aneg = adv_a > 0, adv_a < 0
            masks = {
                "pos_delta_pos_adv": dpos & apos,
                "pos_delta_neg_adv": dpos & aneg,
                "neg_delta_pos_adv": dneg & apos,
                "neg_delta_neg_adv": dneg & aneg,
            }
            masks["neutral"] = ~(dpos | dneg) | ~(apos | aneg)
            for r, mk in masks.items():
                put(f"q_{r}_b", mk, wb64)
                put(f"q_{r}_c", mk, wc64)
                cols[f"q_{r}_n"] = _count(cidx, mk)
        if "clip" in self.statistics:
            # the clip rule in the inputs' own dtype (a float32 ratio of 1.2 is not > 1.2)
            lo, hi, cap = 1 - self.clip_eps, 1 + self.clip_eps, self.dual_clip
            apos, aneg = adv_a > 0, adv_a < 0
            outside = (ratio_a < lo) | (ratio_a > hi)
            capm = aneg & (ratio_a > cap)
            flat = (apos & (ratio_a > hi)) | (aneg & (ratio_a < lo)) | capm
            absd = np.abs(delta_a.astype(np.float64))
            cols["n"] = cidx.count().astype(np.int32)
            cols["clip_out_n"] = _count(cidx, outside)
            cols["clip_flat_n"] = _count(cidx, flat)
            cols["clip_cap_n"] = _count(cidx, capm)
            for side, w in (("b", wb64), ("c", wc64)):
                wd = w * absd
                put(f"clip_out_{side}", outside, w)
                put(f"clip_flat_{side}", flat, w)
                put(f"wd_total_{side}", None, wd)
                put(f"wd_out_{side}", outside, wd)
                put(f"wd_flat_{side}", flat, wd)
            r64 = np.asarray(ratio_a, dtype=np.float64)
            for g in (np.unique(gcode).tolist() if gcode is not None else [0]):
                rg = r64[gcode == g] if gcode is not None else r64
                self._merge_moments(int(g), rg)
        if "shift" in self.statistics:
            sp = np.flatnonzero(dpos)
            if sp.size:
                cl = cidx.ids()[sp]
                a = adv_a[sp].astype(np.float64)
                sub = _splus_clusters(cl, a)
                self._sp["cluster"].append(cl[sub.first] + self._n_clusters)
                self._sp["adv"].append(a[sub.first])
                self._sp["n"].append(sub.count().astype(np.int64))
                self._sp["b"].append(sub.sum(wb64[sp]))
                self._sp["c"].append(sub.sum(wc64[sp]))
        for k, v in cols.items():
            self._cols.setdefault(k, []).append(v)
        self._n_clusters += cidx.n

    def merge(self, part: "AuditAccumulator") -> None:
        """Append ``part``, an accumulator of the same settings that holds one batch, after the batches here.

        The same bits as adding that batch here (:meth:`add`): its per-turn sums are kept as computed, its group
        values take this accumulator's codes, its turns are numbered after these, and its ratio moments merge by
        the same formula. So a batch may be reduced anywhere (a Ray worker) and merged here in batch order.
        """
        same = ("statistics", "eps", "clip_eps", "dual_clip", "n_bins", "base_name", "compare_name", "by")
        if any(getattr(part, k) != getattr(self, k) for k in same):
            raise ValueError("merge: the part was built with other settings")
        remap = self._groups.encode(np.asarray(part._groups.values)) if part._groups.values else np.zeros(0, np.int64)
        code = (lambda g: remap[g]) if self.by is not None else (lambda g: g)  # noqa: E731
        self._batch.extend(part._batch)
        self._group.extend(code(g) for g in part._group)
        self._ntok.extend(part._ntok)
        for k, v in part._cols.items():
            self._cols.setdefault(k, []).extend(v)
        for k, v in part._sp.items():
            self._sp[k].extend([x + self._n_clusters for x in v] if k == "cluster" else v)
        for g, (n2, mean2, m2b) in part._ratio_moments.items():
            self._combine_moments(int(code(g)) if self.by is not None else int(g), n2, mean2, m2b)
        self._n_clusters += part._n_clusters
        self._rows += part._rows

    def _merge_moments(self, g: int, r: np.ndarray) -> None:
        if r.size == 0:
            return
        n2, mean2 = float(r.size), float(r.mean())
        m2b = float(((r - mean2) ** 2).sum())
        self._combine_moments(g, n2, mean2, m2b)

    def _combine_moments(self, g: int, n2: float, mean2: float, m2b: float) -> None:
        cur = self._ratio_moments.get(g)
        if cur is None:
            self._ratio_moments[g] = [n2, mean2, m2b]
            return
        n1, mean1, m2a = cur
        n = n1 + n2
        d = mean2 - mean1
        self._ratio_moments[g] = [n, mean1 + d * n2 / n, m2a + m2b + d * d * n1 * n2 / n]

    # -- output
    def families(self, *, released: Callable[[], Any] | None = None) -> list[tuple[str, RatioFamily]]:
        """One bootstrap request per statistic, each from its own per-turn columns (SPEC 7).

        Their resamples depend on the seed and the turn layout only, so a statistic's interval is the same whichever
        other statistics (or accumulators, e.g. the report's) are bootstrapped with it.  Each statistic's columns are
        gathered into one (columns x turns) float64 matrix and the per-batch pieces are released as they are used:
        about 8 bytes per turn per column at the peak.  ``released`` is called after each statistic's pieces are
        dropped (to hand their freed pages back to the OS).
        """
        if self._n_clusters == 0:
            raise ValueError("no valid tokens to audit")
        batch = np.concatenate(self._batch)
        gcode = np.concatenate(self._group)
        if self.by is not None:
            rank, _ = self._groups.order()
            grank = rank[gcode]
        else:
            grank = np.zeros_like(gcode)
        self._batch_final, self._grank = batch, grank
        if "shift" in self.statistics:
            self._shift_meta = self._shift_columns(grank, len(self._groups.values) if self.by else 1)
        specs: list[tuple[str, list[tuple[str, str, str]], list[tuple[str, str, str]], dict[str, list[str]]]] = []
        for stat in self.statistics:
            # ratios (name, numerator column, denominator column), differences, and totals as the sums of their
            # parts (the shift's S+ mass as its bins' sums: no product of its own; still from the statistic's
            # own columns alone, SPEC 7).  The quadrants keep their totals: with turn-mass-matched weightings
            # the two are the same bits turn by turn, so a region's paired difference stays exactly 0 where
            # its two masses agree
            ratios: list[tuple[str, str, str]] = []
            diffs: list[tuple[str, str, str]] = []
            totals: dict[str, list[str]] = {}

            def paired(key: str, nb: str, db: str, nc: str, dc: str) -> None:
                ratios.append((f"{key}:b", nb, db))
                ratios.append((f"{key}:c", nc, dc))
                diffs.append((f"{key}:d", f"{key}:c", f"{key}:b"))

            if stat == "tcm":
                paired("tcm", "tcm_num_b", "tcm_den_b", "tcm_num_c", "tcm_den_c")
            elif stat == "quadrants":
                for r in REGIONS:
                    paired(f"q:{r}", f"q_{r}_b", "total_b", f"q_{r}_c", "total_c")
            elif stat == "shift":
                for lab in shift_bin_labels(self.n_bins):
                    paired(f"s:{lab}", f"sh_{lab}_b", "sh_total_b", f"sh_{lab}_c", "sh_total_c")
                totals = {f"sh_total_{x}": [f"sh_{lab}_{x}" for lab in shift_bin_labels(self.n_bins)] for x in "bc"}
            else:
                for side in ("out", "flat"):
                    ratios.append((f"clip:{side}:tokens", f"clip_{side}_n", "n"))
                    paired(f"clip:{side}:mass", f"clip_{side}_b", "total_b", f"clip_{side}_c", "total_c")
                    paired(f"clip:{side}:absd", f"wd_{side}_b", "wd_total_b", f"wd_{side}_c", "wd_total_c")
                ratios.append(("clip:cap:tokens", "clip_cap_n", "n"))
            specs.append((stat, ratios, diffs, totals))
        # per-turn columns: one matrix per statistic, pieces dropped after their last use
        needed = [sorted({c for _, a, b in ratios for c in (a, b) if c not in totals})
                  for _, ratios, _, totals in specs]
        last = {c: i for i, names in enumerate(needed) for c in names}
        # the token counts the results read, as counted (int32; the clipping's matrix, which has them too, goes)
        self._cols_final = final = {k: np.concatenate(v) for k, v in self._cols.items() if k.endswith("_n")}
        out: list[tuple[str, RatioFamily]] = []
        for i, ((stat, ratios, diffs, totals), names) in enumerate(zip(specs, needed)):
            M = np.empty((len(names), self._n_clusters), dtype=np.float64)
            for k, c in enumerate(names):
                np.concatenate(self._cols[c], out=M[k], casting="unsafe")
                if c in _RESULT_COLUMNS and c not in final:  # (the quadrants' totals; a matrix no result reads goes)
                    final[c] = M[k]
                if last[c] == i:
                    del self._cols[c]
            if released is not None:
                released()
            col_of = {c: k for k, c in enumerate([*names, *totals])}
            rix = {r[0]: j for j, r in enumerate(ratios)}
            out.append((stat, RatioFamily(
                M.T,  # (turns x columns) as a view: the bootstrap takes the rows of M as they are
                [col_of[a] for _, a, _ in ratios],
                [col_of[b] for _, _, b in ratios],
                strata=batch,
                groups=grank,
                differences=[(rix[a], rix[b]) for _, a, b in diffs],
                names=[r[0] for r in ratios] + [d[0] for d in diffs],
                totals=[[col_of[c] for c in parts] for parts in totals.values()],
            )))
        self._cols = {}
        return out

    def results(self, raws: Sequence[RatioBootstrapResult], *, unit: str = "action-turn") -> AuditResults:
        """The result objects from the bootstraps of :meth:`families` (in that order)."""
        raw_of = dict(zip(self.statistics, raws))
        cols, batch, grank = self._cols_final, self._batch_final, self._grank
        ntok = np.concatenate(self._ntok)
        gvalues = self._groups.order()[1] if self.by is not None else [None]
        first = raws[0]
        out: dict[str, list[Any]] = {s: [] for s in self.statistics}
        # every family has the same clusters and groups: raw.groups are the group codes present, sorted
        for gi, g in enumerate(first.groups):
            sel = grank == g
            ctx = _Ctx(self, raw_of, gi, sel, cols, ntok, batch, unit)
            if "tcm" in self.statistics:
                out["tcm"].append(ctx.tcm())
            if "quadrants" in self.statistics:
                out["quadrants"].append(ctx.quadrants())
            if "shift" in self.statistics:
                out["shift"].append(ctx.shift(self._shift_meta[g]))
            if "clip" in self.statistics:
                out["clip"].append(ctx.clip(self._clip_moments(g)))
        final: dict[str, Any] = {}
        for s, lst in out.items():
            if self.by is None:
                final[s] = lst[0]
            else:
                final[s] = GroupedResult(self.by, tuple(gvalues[int(g)] for g in first.groups), tuple(lst))
        return AuditResults(raw=raw_of, **final)

    def finalize(
        self,
        *,
        n_resamples: int = 10_000,
        confidence_level: float = 0.95,
        unit: str = "action-turn",
        rng: Any = None,
        chunk_size: int | None = None,
        workers: int = 1,
    ) -> AuditResults:
        """Bootstrap every requested statistic (one draw of resamples, each statistic its own products)."""
        fams = self.families()
        raws = bootstrap_ratio_families([f for _, f in fams], n_resamples=n_resamples,
                                        confidence_level=confidence_level, unit=unit, rng=rng,
                                        chunk_size=chunk_size, workers=workers)
        return self.results(raws, unit=unit)

    def _clip_moments(self, g_rank: int) -> tuple[float, float]:
        if self.by is None:
            vals = list(self._ratio_moments.values())
            mom = vals[0] if vals else [0.0, math.nan, math.nan]
        else:
            rank, _ = self._groups.order()
            code = int(np.flatnonzero(rank == g_rank)[0])
            mom = self._ratio_moments.get(code, [0.0, math.nan, math.nan])
        n, mean, m2 = mom
        return mean, (math.sqrt(m2 / n) if n > 0 else math.nan)

    def _shift_columns(self, grank: np.ndarray, n_groups: int) -> dict[int, dict[str, Any]]:
        """Cut S+ advantages into equal-frequency bins per group; add per-turn bin sums."""
        nb = self.n_bins
        labels = shift_bin_labels(nb)
        nl = len(labels)
        n = self._n_clusters
        if self._sp["cluster"]:
            cl = np.concatenate(self._sp["cluster"])
            adv = np.concatenate(self._sp["adv"])
            cnt = np.concatenate(self._sp["n"])
            sb = np.concatenate(self._sp["b"])
            sc = np.concatenate(self._sp["c"])
        else:
            cl = np.zeros(0, np.int64)
            adv = np.zeros(0)
            cnt = np.zeros(0, np.int64)
            sb = sc = np.zeros(0)
        g_of = grank[cl]
        bins = np.empty(cl.size, dtype=np.int64)
        meta: dict[int, dict[str, Any]] = {}
        for g in range(n_groups):
            sel = np.flatnonzero(g_of == g)
            a, c = adv[sel], cnt[sel]
            b = np.full(sel.size, nb, dtype=np.int64)  # the zero bin
            neg, pos = a < 0, a > 0
            b[neg] = midrank_bins(a[neg], nb, weights=c[neg])
            b[pos] = nb + 1 + midrank_bins(a[pos], nb, weights=c[pos])
            bins[sel] = b
            ntoks = np.bincount(b, weights=c, minlength=nl).astype(np.int64)
            amin = np.full(nl, np.nan)
            amax = np.full(nl, np.nan)
            if sel.size:
                np.fmin.at(amin, b, a)
                np.fmax.at(amax, b, a)
            meta[g] = {"n_tokens": ntoks, "adv_min": amin, "adv_max": amax, "n_splus": int(c.sum())}
        self._sp = {k: [] for k in self._sp}
        # the bins' per-turn sums (bin_sums: bincount's bits). Rows under NumPy's huge-page size (4 MiB) come
        # as one block, which gets huge pages (no page fault per 4 KB); larger rows get them on their own and
        # stay apart, so each is freed once copied into the bootstrap's matrix (a block would stay whole)
        rows = list(np.zeros((2 * nl, n))) if 8 * n < HUGE_PAGE_BYTES else [np.zeros(n) for _ in range(2 * nl)]
        for j, (side, s) in enumerate((("b", sb), ("c", sc))):
            bin_sums(cl, s, bins, out=rows[j * nl : (j + 1) * nl])
            for i, lab in enumerate(labels):
                self._cols[f"sh_{lab}_{side}"] = [rows[j * nl + i]]
        return meta


def check_weight_names(weights: Weights, base_name: str, compare_name: str) -> None:
    if (weights.base_name, weights.compare_name) != (base_name, compare_name):
        raise ValueError(f"weights are labelled ({weights.base_name}, {weights.compare_name}) but the accumulator "
                         f"compares ({base_name}, {compare_name})")


def midrank_bins(values: np.ndarray, n_bins: int, *, weights: np.ndarray | None = None) -> np.ndarray:
    """Equal-frequency bins by scaled mid-rank: bin = floor(n_bins * (rank - 1/2) / n).

    ``rank`` is the average (mid) rank of the value among all n tokens (``weights``
    gives each value's token count), so tied values always share a bin; with no ties
    the bins hold n / n_bins tokens each (to within one).  Computed in integers:
    floor(n_bins * (2 * below + equal) / (2 * n)).
    """
    v = np.asarray(values)
    if v.size == 0:
        return np.zeros(0, dtype=np.int64)
    w = np.ones(v.size, dtype=np.int64) if weights is None else np.asarray(weights, dtype=np.int64)
    uniq, inv = np.unique(v, return_inverse=True)
    inv = inv.reshape(-1)
    eq = np.bincount(inv, weights=w, minlength=uniq.size).astype(np.int64)
    below = np.concatenate([[0], np.cumsum(eq)[:-1]])
    total = int(eq.sum())
    b = (n_bins * (2 * below + eq)) // (2 * total)
    return np.minimum(b, n_bins - 1)[inv].astype(np.int64)


class _Ctx:
    """Builds one group's result objects from the shared bootstrap."""

    def __init__(self, acc: AuditAccumulator, raw: dict[str, RatioBootstrapResult], gi: int, sel: np.ndarray,
                 cols: dict[str, np.ndarray], ntok: np.ndarray, batch: np.ndarray, unit: str):
        self.acc, self.raw, self.gi, self.sel, self.cols = acc, raw, gi, sel, cols
        first = next(iter(raw.values()))
        self.common = dict(
            base_name=acc.base_name,
            compare_name=acc.compare_name,
            n_tokens=int(ntok[sel].sum()),
            n_turns=int(sel.sum()),
            n_batches=int(np.unique(batch[sel], return_counts=True)[0].size),  # (skips a numpy.ma import)
            n_resamples=first.n_resamples,
            confidence_level=first.confidence_level,
            unit=unit,
        )

    def r(self, name: str) -> BootstrapResult:
        stat = {"q": "quadrants", "s": "shift"}.get(name.split(":", 1)[0], name.split(":", 1)[0])
        return self.raw[stat].result(name, self.gi)

    def paired(self, key: str) -> PairedResult:
        return PairedResult(self.r(f"{key}:b"), self.r(f"{key}:c"), self.r(f"{key}:d"))

    def total(self, col: str) -> float:
        return float(self.cols[col][self.sel].sum())

    def tcm(self) -> TCMResult:
        p = self.paired("tcm")
        return TCMResult(
            **self.common, eps=self.acc.eps, n_active_tokens=int(round(self.total("tcm_active_n"))),
            base=p.base, compare=p.compare, diff=p.diff, n_supported_tokens=int(round(self.total("tcm_supported_n"))),
            n_supported_zero_advantage=int(round(self.total("tcm_supported_adv0_n"))),
        )

    def quadrants(self) -> QuadrantsResult:
        regions = {}
        tb, tc = self.cols["total_b"][self.sel], self.cols["total_c"][self.sel]
        conserved = _mass_matched(tb, tc, self.acc.mass_rtol)
        for r in REGIONS:
            p = self.paired(f"q:{r}")
            if conserved and np.array_equal(self.cols[f"q_{r}_b"][self.sel], self.cols[f"q_{r}_c"][self.sel]):
                # identical region mass under turn-mass-matched weightings: the difference
                # is 0 by construction (e.g. ICSD's c = g on the fallback region); report
                # it as exactly 0 rather than as a rounding residue of the two totals
                p = PairedResult(p.base, p.compare, exact_zero_result(p.diff.n_resamples, p.diff.confidence_level, p.diff.unit))
            regions[r] = p
        counts = {r: int(round(self.total(f"q_{r}_n"))) for r in REGIONS}
        return QuadrantsResult(**self.common, regions=regions, region_tokens=counts)

    def shift(self, meta: dict[str, Any]) -> ShiftResult:
        bins = {}
        for i, lab in enumerate(shift_bin_labels(self.acc.n_bins)):
            p = self.paired(f"s:{lab}")
            bins[lab] = ShiftBin(p.base, p.compare, p.diff, int(meta["n_tokens"][i]),
                                 float(meta["adv_min"][i]), float(meta["adv_max"][i]))
        return ShiftResult(**self.common, n_bins=self.acc.n_bins, n_splus_tokens=meta["n_splus"], bins=bins)

    def clip(self, moments: tuple[float, float]) -> ClipResult:
        sets = {}
        for s in ("out", "flat"):
            sets[s] = ClipSet(
                n_tokens=int(round(self.total(f"clip_{s}_n"))),
                tokens=self.r(f"clip:{s}:tokens"),
                mass=self.paired(f"clip:{s}:mass"),
                abs_delta_mass=self.paired(f"clip:{s}:absd"),
            )
        return ClipResult(
            **self.common, clip_eps=self.acc.clip_eps, dual_clip=self.acc.dual_clip,
            outside=sets["out"], flat=sets["flat"],
            dual_clip_cap_count=int(round(self.total("clip_cap_n"))), dual_clip_cap=self.r("clip:cap:tokens"),
            ratio_mean=moments[0], ratio_std=moments[1],
        )


def _count(cidx: ClusterIndex, mask: np.ndarray) -> np.ndarray:
    """Per-turn token counts of a mask (int32: exact, and half the memory of float64)."""
    return cidx.count_where(mask)


def _splus_clusters(cl: np.ndarray, a: np.ndarray) -> ClusterIndex:
    """The (turn, advantage value) sub-clusters of S+ tokens (turn ids ``cl``, advantages ``a``).

    An advantage is almost always constant over a turn: when the turn ids come as runs
    and no run changes value, the sub-clusters are the turns themselves, the same
    clusters in the same order (first appearance) as with the advantage as a second
    key, without sorting the advantages (np.unique: ~85 ms per 333k tokens).
    """
    if cl.size > 1:
        same = cl[1:] == cl[:-1]
        if (cl[1:] >= cl[:-1]).all() and not (same & (a[1:] != a[:-1])).any():
            return ClusterIndex(cl)
    return ClusterIndex(cl, factorize(a)[0])


def _mass_matched(tb: np.ndarray, tc: np.ndarray, rtol: float) -> bool:
    """Per-turn totals of the two weightings agree (turn mass matching, SPEC 4)."""
    scale = np.maximum(np.abs(tb), np.abs(tc))
    if not (np.abs(tb - tc) <= rtol * scale).all():
        return False
    sb, sc = float(tb.sum()), float(tc.sum())
    return abs(sb - sc) <= rtol * max(abs(sb), abs(sc))


