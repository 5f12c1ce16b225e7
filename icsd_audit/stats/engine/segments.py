"""Resampled sums of a family whose columns come in groups (a statistic's bins), tile by tile in a sorted order.

The bootstrap engine (:mod:`icsd_audit.stats.engine.resample`) multiplies a family's per-cluster
sums by each block's counts.  A family of binned sums (token strata, SPEC 11: per bin the
tokens, both weightings' masses and both TCM sets) has most of its columns zero on many
clusters (a short turn never reaches the late positions) and pairs of columns that are
equal or zero turn by turn (a TCM numerator is its denominator on a turn whose active
tokens all have u < 0, and 0 on one whose active tokens all have u > 0: the advantage is
constant over a turn).  :class:`SegmentedFamily` uses both, with no change to the counts:

* inside each tile of :data:`TILE` clusters (layout order), the clusters are sorted by
  their *class* (no tied pair nonzero; numerators all 0; numerators all equal to their
  denominators; mixed) and then by their highest nonzero group, so each group's nonzero
  clusters lie in one short range of the tile per class (a prefix, where the supports are
  nested as positions are);
* the rows (every group's plain columns, then the denominators, group after group) are
  multiplied in panels of :data:`PANEL_ROWS` or half as many rows (two half panels where their
  ranges are narrow enough to pay for the second call) over the range where the panel's rows
  are nonzero, rows zero on the whole segment skipped; the numerators only on mixed clusters,
  the class giving them elsewhere;
* whole-number columns (a bin's token count) are multiplied two to a row, ``low + 2**26 high``
  (:func:`_packable_pairs`): exact, and split apart after each tile;
* the counts of the tile are gathered into that order (from inside the tile, in cache),
  a work unit's SUPER blocks at once.

A column's resampled sum is therefore the sum of the same products (count times sum) as a
plain product, added in another order: the last bits differ from :class:`~resample.Family`'s,
and depend on this family's own sums only (the order, the classes and the ranges are
functions of them), so the statistic keeps one interval in every command (SPEC 7).

Pure numpy.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from icsd_audit.stats.engine.counts import BLOCK
from icsd_audit.stats.engine.resample import SPAN, SUPER, Layout, ThreadBuffers
from icsd_audit.stats.pool import on_threads

__all__ = ["SegmentedFamily", "TILE", "segment_rows"]

#: clusters per tile (part of the numbers, like the panels: the order of the additions). The tile's float64 counts
#: (8 MB at 8,192) are read a few times per tile from L3; measured per work unit on the 5M benchmark dumps, 8,192
#: beat 2,048 and 4,096 (fewer, longer products) and 16,384 (the counts no longer stay in cache)
TILE = 8192
#: clusters per product at most: (12 x w) @ (w x 16) stays in OpenBLAS's small-matrix kernel (M N K <= 1e6)
WIDTH = 4096
#: rows per product: (r x 4,096) @ (4 x 4,096 x 16) runs at 26-27 G multiply-adds per second on one core here in
#: isolation for r = 6 or 12 (OpenBLAS's small-matrix kernel, AVX-512), 21-24 G for 7-11 rows, 14-16 for
#: 2-5; 45 rows (past the small kernel) at 10-13
PANEL_ROWS = 12
#: cluster classes inside a tile, in sorted order: no tied pair nonzero; numerators all 0 (denominators not);
#: numerators all equal to their denominators; mixed
_NONE, _ZERO, _EQUAL, _MIXED = 0, 1, 2, 3
_CLASSES = 4
#: a cluster's BLOCK counts (16 bytes) as one item to gather: NumPy's take moves 16-byte complex items as bytes,
#: 4x as fast as 16-byte void items here
_ITEM = np.dtype(np.complex128) if BLOCK == 16 else np.dtype((np.void, BLOCK))


class SegmentedFamily(ThreadBuffers):
    """One single-group family's resampled sums (K x clusters ``ST``, layout order) by sorted tiles.

    ``groups``: lists of column indices that share their nonzero clusters (a bin's columns),
    together every column once; ``tied``: pairs (numerator, denominator) whose numerator is,
    on most clusters, either 0 or equal to the denominator (both in the same group).  The
    engine calls :meth:`unit_sums` with a work unit's counts.  ``workers`` threads gather the
    sorted copy of the sums (the same bits whatever their number).  ``own``: ``ST`` is this
    family's to reorder (the caller reads it no more; its rows may be spaced wider than their
    length): its rows are sorted in place, main rows first, and multiplied there, with no copy
    (the same values, so the same bits; packed columns hold their pair's packed row).
    """

    own_products = True  # the engine hands this family its counts (no dense tiles, no parts)
    panels: list = []
    parts: list = []
    n_groups = 1

    def __init__(self, ST: np.ndarray, groups: Sequence[Sequence[int]], tied: Sequence[tuple[int, int]], lay: Layout,
                 *, workers: int = 1, own: bool = False):
        ST = np.asarray(ST, dtype=np.float64)
        if ST.ndim != 2 or ST.shape[1] != lay.n:
            raise ValueError(f"sums must have one column per cluster ({lay.n}), got shape {ST.shape}")
        k, n = ST.shape
        self.k, self.width, self.n = k, k, n
        self.dense = np.zeros(0, dtype=np.int64)
        groups = [[int(c) for c in g] for g in groups]
        flat = sorted(c for g in groups for c in g)
        if flat != list(range(k)):
            raise ValueError("column groups must hold every column exactly once")
        group_of = {c: i for i, g in enumerate(groups) for c in g}
        tied = [(int(a), int(b)) for a, b in tied]
        if any(group_of[a] != group_of[b] or a == b for a, b in tied) or len({a for a, _ in tied}) != len(tied) \
                or {a for a, _ in tied} & {b for _, b in tied}:
            raise ValueError("tied pairs must be (numerator, denominator) of one group, each numerator once")
        num_set, den_set = {a for a, _ in tied}, {b for _, b in tied}
        den_of = dict(tied)
        # rows of the sorted sums: every group's plain columns (neither numerator nor denominator of a pair), group
        # after group (a run of groups is a run of rows); then the denominators, group after group; the
        # numerators apart (multiplied on mixed clusters only)
        m = len(groups)
        plain = [[c for c in g if c not in num_set and c not in den_set] for g in groups]
        # whole-number columns two to a row (:func:`_packable_pairs`), one group per pair after the plain groups
        pairs = _packable_pairs(ST, plain)
        packed = {c for pair in pairs for c in pair}
        kinds = ([[c for c in g if c not in packed] for g in plain] + [[lo] for lo, _ in pairs],
                 [[c for c in g if c in den_set] for g in groups], [[c for c in g if c in num_set] for g in groups])
        self.main = [c for g in kinds[0] for c in g] + [c for g in kinds[1] for c in g]
        self.nums = [c for g in kinds[2] for c in g]
        row_of = {c: r for r, c in enumerate(self.main)}
        self.den_rows = np.array([row_of[den_of[a]] for a in self.nums], dtype=np.int64)
        cuts = [np.cumsum([0] + [len(g) for g in kind]) for kind in kinds]
        # the packed rows (the last of the plain rows), and the columns of their low and high counts
        self.packed = (int(cuts[0][m]), int(cuts[0][-1]), [lo for lo, _ in pairs], [hi for _, hi in pairs])

        # each cluster's class, and each group's support per kind of column
        nzk = [np.zeros((len(kind), n), dtype=bool) for kind in kinds]
        for j, kind in enumerate(kinds):
            for i, g in enumerate(kind):
                for c in g:
                    nzk[j][i] |= ST[c] != 0
        anyg = nzk[0][:m] | nzk[1] | nzk[2]
        for i, (lo_c, hi_c) in enumerate(pairs):  # a packed row is nonzero where either of its counts is
            hi_nz = ST[hi_c] != 0
            anyg[group_of[lo_c]] |= nzk[0][m + i]  # its low count's support so far
            anyg[group_of[hi_c]] |= hi_nz
            nzk[0][m + i] |= hi_nz
        if tied:
            zero, equal = ~nzk[2].any(axis=0), np.ones(n, dtype=bool)
            for a, b in tied:  # pair by pair (no copy of the tied rows)
                equal &= ST[a] == ST[b]
            cls = np.where(zero, np.where(nzk[1].any(axis=0), _ZERO, _NONE), np.where(equal, _EQUAL, _MIXED))
        else:
            cls = np.full(n, _NONE)
        top = np.where(anyg.any(axis=0), m - 1 - np.argmax(anyg[::-1], axis=0), -1)
        del anyg
        tile = np.arange(n, dtype=np.int64) // TILE
        # inside a tile: class, then highest nonzero group first (nested supports, e.g. positions, become prefixes)
        self.order = np.lexsort((-top, cls, tile))
        seg = (tile * _CLASSES + cls)[self.order]
        starts = np.flatnonzero(np.concatenate([[True], seg[1:] != seg[:-1]]))
        stops = np.concatenate([starts[1:], [n]])
        ranges = []
        for j in range(3):  # (groups, segments): each group's first and last nonzero cluster (n, 0: none), per kind
            mj = len(kinds[j])
            lo, hi = np.full((mj, starts.size), n, dtype=np.int64), np.zeros((mj, starts.size), dtype=np.int64)
            for i in range(mj):
                at = np.flatnonzero(nzk[j][i][self.order])  # nonzero positions in sorted order, ascending
                if at.size:
                    first = at[np.minimum(np.searchsorted(at, starts), at.size - 1)]
                    last = at[np.maximum(np.searchsorted(at, stops) - 1, 0)]
                    some = (first >= starts) & (first < stops)
                    lo[i], hi[i] = np.where(some, first, n), np.where(some, last + 1, 0)
            ranges.append((lo, hi))
        del nzk

        # the sums in sorted order: the main rows for every cluster, the numerators for the mixed ones only
        mixed = [(int(a), int(z)) for a, z, s in zip(starts, stops, seg[starts]) if s % _CLASSES == _MIXED]
        if own and ST.strides[1] == ST.itemsize and ST.flags.writeable:  # each row contiguous
            for lo_c, hi_c in pairs:
                ST[lo_c] += ST[hi_c] * _PACK
            _sort_in_place(ST, self.order, self.main + self.nums + [hi_c for _, hi_c in pairs], workers)
            self.S = ST[: len(self.main)]
            nums = list(ST[len(self.main) : len(self.main) + len(self.nums)])  # already in sorted order
            cols = np.concatenate([np.arange(a, z) for a, z in mixed]) if mixed else np.zeros(0, dtype=np.int64)
        else:
            self.S = np.empty((len(self.main), n), dtype=np.float64)

            high = dict(pairs)

            def gather(r: int) -> None:
                c = self.main[r]
                np.take(ST[c] + ST[high[c]] * _PACK if c in high else ST[c], self.order, out=self.S[r])

            on_threads(gather, range(len(self.main)), workers)
            nums = [ST[c] for c in self.nums]
            cols = np.concatenate([self.order[a:z] for a, z in mixed]) if mixed else np.zeros(0, dtype=np.int64)
        self.Snum = np.empty((len(self.nums), cols.size), dtype=np.float64)
        for r in range(len(self.nums)):
            np.take(nums[r], cols, out=self.Snum[r])
        mixed_off: dict[int, int] = {}
        off = 0
        for a, z in mixed:
            mixed_off[a] = off
            off += z - a

        # each row's range per segment: the rows of S (plain, then denominators), and the numerators' (Snum)
        row_group = [np.repeat(np.arange(len(kind)), np.diff(cut)) for kind, cut in zip(kinds, cuts)]
        main_lo = np.concatenate([ranges[0][0][row_group[0]], ranges[1][0][row_group[1]]])
        main_hi = np.concatenate([ranges[0][1][row_group[0]], ranges[1][1][row_group[1]]])
        num_lo, num_hi = ranges[2][0][row_group[2]], ranges[2][1][row_group[2]]

        # the plan: per tile, its products (source, class, first row, first row added, stop row, first cluster,
        # stop, source column); the rows of S in one run (plain and denominators together)
        self.tiles: list[tuple[int, int, list[tuple[int, int, int, int, int, int, int, int]]]] = []
        t_of_seg = seg[starts] // _CLASSES
        for t in range(int(tile[-1]) + 1 if n else 0):
            c0, c1 = t * TILE, min(n, (t + 1) * TILE)
            plan: list[tuple[int, int, int, int, int, int, int, int]] = []
            for s in np.flatnonzero(t_of_seg == t).tolist():
                cl, s0 = int(seg[starts[s]] % _CLASSES), int(starts[s])
                sources = [(0, main_lo[:, s], main_hi[:, s])] + ([(1, num_lo[:, s], num_hi[:, s])] if cl == _MIXED
                                                                 else [])
                for src, lo, hi in sources:
                    for p0, k0, p1, a0, z0 in _panels(lo, hi):
                        for a in range(a0, z0, WIDTH):
                            z = min(z0, a + WIDTH)
                            col = a if src == 0 else mixed_off[s0] + a - s0
                            plan.append((src, cl, p0, k0, p1, a - c0, z - c0, col))
            self.tiles.append((c0, c1, plan))
        self._local = threading.local()

    def _bound(self) -> tuple[np.ndarray, np.ndarray, list]:
        """This thread's accumulators and, per tile, its gather and its products bound to views of this thread's
        buffers: made once per thread, so a work unit runs the plan with no slicing or reshaping per product
        (about 2 us a product, over a thousand products a unit at 20M tokens)."""
        bound = getattr(self._local, "bound", None)
        if bound is None:
            w = min(TILE, self.n)
            cbuf, gbuf = np.empty(SUPER * w * BLOCK), np.empty(SUPER * w, dtype=_ITEM)
            obuf = np.empty(SUPER * PANEL_ROWS * BLOCK)
            acc = np.zeros((_CLASSES, SUPER, len(self.main), BLOCK))
            acc_num = np.zeros((SUPER, len(self.nums), BLOCK))
            split = np.zeros((2, SUPER, len(self.packed[2]), BLOCK))  # the packed rows' low and high counts
            tiles = []
            for c0, c1, plan in self.tiles:
                w = c1 - c0
                got = gbuf[: SUPER * w].reshape(SUPER, w)
                cf = cbuf[: SUPER * w * BLOCK].reshape(SUPER, w, BLOCK)
                steps = []
                for src, cl, r0, k0, r1, a, z, s0 in plan:
                    out = obuf[: SUPER * (r1 - r0) * BLOCK].reshape(SUPER, r1 - r0, BLOCK)
                    steps.append(((self.S if src == 0 else self.Snum)[r0:r1, s0 : s0 + z - a], cf[:, a:z], out,
                                  out[:, k0 - r0 :], acc[cl, :, k0:r1] if src == 0 else acc_num[:, k0:r1]))
                # the tile's order as positions inside the tile: NumPy's take reads a tile's slice by local
                # positions in about 0.15 ns per resample and cluster, the whole row by global ones in 0.23
                tiles.append((slice(c0, c1), self.order[c0:c1] - c0, got, got.view(np.int8).reshape(SUPER, w, BLOCK),
                              cf, steps))
            bound = self._local.bound = (acc, acc_num, split, tiles)
        return bound

    def unit_sums(self, counts: np.ndarray) -> np.ndarray:
        """(SPAN, K): the columns' sums over the resamples of a work unit (``counts``: SUPER x clusters x BLOCK int8)."""
        acc, acc_num, split, tiles = self._bound()
        acc.fill(0.0)
        acc_num.fill(0.0)
        split.fill(0.0)
        p0, p1, low, high = self.packed
        cv = counts.view(_ITEM).reshape(SUPER, -1)  # a cluster's BLOCK counts as one item
        for cols, order, got, got8, cf, steps in tiles:
            # this tile's counts in its sorted order (read from inside the tile, in cache; no index is out of range)
            np.take(cv[:, cols], order, axis=1, out=got, mode="clip")
            np.copyto(cf, got8, casting="unsafe")
            for sums, cnt, out, added, dst in steps:
                np.matmul(sums, cnt, out=out)
                np.add(dst, added, out=dst)
            if p1 > p0:  # the packed rows' sums over this tile, split into their two counts (whole numbers: exact)
                whole = acc[:, :, p0:p1].sum(axis=0)
                high_part = np.floor(whole * (1.0 / _PACK))
                split[1] += high_part
                split[0] += whole - high_part * _PACK
                acc[:, :, p0:p1] = 0.0
        res = np.empty((SUPER, BLOCK, self.k))  # resample j * BLOCK + r
        res[:, :, self.main] = (acc[_NONE] + acc[_ZERO] + acc[_EQUAL] + acc[_MIXED]).transpose(0, 2, 1)
        if self.nums:
            res[:, :, self.nums] = (acc[_EQUAL][:, self.den_rows] + acc_num).transpose(0, 2, 1)
        if low:
            res[:, :, low] = split[0].transpose(0, 2, 1)
            res[:, :, high] = split[1].transpose(0, 2, 1)
        return res.reshape(SPAN, self.k)


#: whole-number columns (the strata's token counts) are multiplied two to a row, the second times 2**_PACK_BITS:
#: each tile's products and their sums stay whole numbers below 2**53 (exact in float64, in any order) and are split
#: apart exactly after the tile, so the counts' sums are the bits of multiplying them apart, for half the products
_PACK_BITS = 26
_PACK = float(2**_PACK_BITS)
#: the largest resample count (the counts are int8)
_MAX_COUNT = int(np.iinfo(np.int8).max)


def _packable_pairs(ST: np.ndarray, plain: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Pairs (low, high) of the plain columns, in group order, to multiply as one row ``low + 2**26 high``: whole
    numbers >= 0 whose sum over every tile, times the largest count, stays below 2**26 (so the low half of a tile's
    sum never reaches the high one, and the whole stays below 2**53)."""
    n = ST.shape[1]
    if n == 0:
        return []
    starts = np.arange(0, n, TILE)
    whole: list[int] = []
    for c in (c for g in plain for c in g):
        row = ST[c]
        head = row[:64]
        if not (head.min() >= 0 and np.array_equal(head, np.floor(head))):  # most float columns fail here
            continue
        if row.min() >= 0 and np.array_equal(row, np.floor(row)) \
                and float(np.add.reduceat(row, starts).max()) * _MAX_COUNT < _PACK:
            whole.append(c)
    return list(zip(whole[0::2], whole[1::2]))


def segment_rows(groups: Sequence[Sequence[int]], tied: Sequence[tuple[int, int]], row_of: dict[int, int],
                 n_rows: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """A family's column groups and tied pairs in the rows its sums are laid out in (``row_of``: column -> row,
    the columns some ratio uses); a row in no group forms a group alone."""
    grouped = [g for g in ([row_of[int(c)] for c in g if int(c) in row_of] for g in groups) if g]
    seen = {r for g in grouped for r in g}
    return (grouped + [[r] for r in range(n_rows) if r not in seen],
            [(row_of[int(a)], row_of[int(b)]) for a, b in tied if int(a) in row_of and int(b) in row_of])


def _panels(lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    """Products (p0, k0, p1, a, z) of one segment: rows p0:p1 of the array multiplied over the clusters [a, z), the
    outputs of rows k0:p1 added.  Row r is nonzero on the segment within [lo[r], hi[r]) only (empty: zero on all of
    it).  Panels hold :data:`PANEL_ROWS` rows, or half as many where the rows left to add end sooner: the small-matrix
    kernel runs slower on other counts (8-10 rows at 75-85 % of the rate of 6 and 12), and a row that is zero on
    the segment costs no more than one of those.  The rows to add are covered once each, in order; a panel that
    would run past the last row starts earlier and drops the rows it repeats (k0 > p0).  A panel whose halves' ranges
    differ enough is multiplied as its halves (:func:`_split_pays`).  A row's sums do not depend on the panel where
    its range fits one product: its nonzero clusters lie inside every range it is multiplied over, and a product
    adds its clusters' terms in cluster order (a longer range is cut every :data:`WIDTH` clusters from its start,
    which may move the last bits; still a function of the family's own sums)."""
    total = int(lo.size)
    live = np.flatnonzero(hi > lo)
    half = PANEL_ROWS // 2
    out: list[tuple[int, int, int, int, int]] = []
    i = 0
    while i < live.size:
        p = int(live[i])
        last = int(live[int(np.searchsorted(live, p + PANEL_ROWS)) - 1])
        size = min(total, PANEL_ROWS if last >= p + half else half)
        p0 = min(p, total - size)
        j = int(np.searchsorted(live, p0 + size))
        rows = live[i:j]
        whole = (p0, p, p0 + size, int(lo[rows].min()), int(hi[rows].max()))
        halves = []
        if size == PANEL_ROWS:
            for h0 in (p0, p0 + half):
                r = rows[(rows >= h0) & (rows < h0 + half)]
                if r.size:
                    halves.append((h0, max(h0, p), h0 + half, int(lo[r].min()), int(hi[r].max())))
        out += halves if halves and _split_pays(whole, halves) else [whole]
        i = j
    return out


#: a product's fixed cost (its Python and BLAS calls), in (row x cluster) multiply-adds of a panel, and the extra
#: cost per multiply-add of a half panel: measured on the dev box, (6 x w) @ (4 x w x 16) runs at 95-97 % of the
#: rate of 12 rows and a product costs about 5 us
_CALL_COST, _HALF_COST = 3072, 1.04


def _split_pays(whole: tuple[int, int, int, int, int], halves: list[tuple[int, int, int, int, int]]) -> bool:
    """Whether the half panels (one or two) cost less than the whole one (the halves' ranges are narrower where the
    groups of one half reach fewer clusters, as later positions do)."""
    def madds(p: tuple[int, int, int, int, int]) -> int:
        return (p[2] - p[0]) * (p[4] - p[3])

    return sum(madds(h) for h in halves) * _HALF_COST + _CALL_COST < madds(whole)


def _sort_in_place(ST: np.ndarray, order: np.ndarray, rows: list[int], workers: int) -> None:
    """Each of ``ST``'s rows reordered by ``order`` (in its own memory, through a row-sized buffer per thread),
    then the rows moved so that row i holds what row ``rows[i]`` held (``rows``: a permutation of them).  No
    matrix-sized copy: a family's sums are sorted where they lie."""
    local = threading.local()

    def sort_row(r: int) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty(ST.shape[1], dtype=np.float64)
        np.take(ST[r], order, out=buf)
        ST[r] = buf

    on_threads(sort_row, rows, workers)
    # row i of the result is row rows[i]: follow each cycle of the permutation with one spare row
    spare = np.empty(ST.shape[1], dtype=np.float64)
    done = [False] * len(rows)
    for i in range(len(rows)):
        if done[i] or rows[i] == i:
            done[i] = True
            continue
        spare[:] = ST[i]
        j = i
        while True:
            done[j] = True
            src = rows[j]
            if src == i:
                ST[j] = spare
                break
            ST[j] = ST[src]
            j = src
