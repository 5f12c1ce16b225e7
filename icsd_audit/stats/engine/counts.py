"""The bootstrap's resample counts: exact stratified multinomial counts by Poissonization with a correction.

A block of :data:`BLOCK` resamples is drawn from its own generator (:func:`block_generator`, seeded from the
stream's SeedSequence and the block number); :func:`block_counts` fills its counts, one byte per (cluster,
resample), cluster-major. The stream and the method are described in :mod:`icsd_audit.stats.engine.resample`, which
multiplies these counts with each statistic's per-cluster sums. Pure numpy.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Sequence

import numpy as np

__all__ = ["BLOCK", "TUPLE", "Layout", "block_counts", "block_generator"]

#: resamples per random block; part of the definition of the random stream
BLOCK = 16
#: resamples per 16-bit lookup (a cluster's Poisson counts packed one byte each); part of the stream
TUPLE = 4
_TABLE_BITS = 16
_TABLE_SIZE = 1 << _TABLE_BITS
_CODE = np.dtype(f"=i{TUPLE}")
_FLAG = np.iinfo(_CODE).min  # sign bit: marks a bucket that straddles a CDF step
_SLACK = 3.0  # Poisson rate lambda = 1 - _SLACK / sqrt(2**floor(log2 n))
_CHUNK = 1 << 14  # clusters per lookup chunk (keeps np.take's index temporary in cache)
_LANE_ROWS = 1024  # clusters per 16-bit lane sum: 1024 * 63 < 2**16 (every table count is below 64)
_LANES = np.uint64(0x00FF00FF00FF00FF)
_LITTLE = sys.byteorder == "little"


# --------------------------------------------------------------------------- exact stratified multinomial counts


def _poisson_cdf(lam: float) -> np.ndarray:
    """CDF of Poisson(lam) at 0, 1, ..., up to where it rounds to 1 (then set to 1).

    Terms by the recurrence p_k = p_(k-1) lam / k, partial sums with ``math.fsum``
    (correctly rounded), so each value is within a few ulps of the exact CDF; the
    tail cut off is below 2**-53.
    """
    if lam <= 0:
        return np.array([1.0])
    terms = [math.exp(-lam)]
    cdf = [terms[0]]
    while cdf[-1] < 1.0 and len(terms) < 60:
        terms.append(terms[-1] * lam / len(terms))
        cdf.append(math.fsum(terms))
    out = np.minimum(np.array(cdf), 1.0)
    out[-1] = 1.0
    return out


def _tuples(F: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The :data:`TUPLE`-tuples of iid counts with CDF ``F`` that can be drawn, in lexicographic order.

    Returns (digits (tuples x TUPLE), cdf): the tuple CDF F(c_1 - 1) + p(c_1) (F(c_2 - 1) +
    p(c_2) (...)), made monotone, at each tuple of positive width.  Only counts of positive
    probability are enumerated: a tuple holding any other count has the width 0 and is never
    drawn.  Where the CDF's partial sums stall one ulp below 1 (levels 7, 17, 19, ...: 60
    terms, of which ~18 have mass), that is 130k tuples instead of 60**4 (~890 MB and 5 s);
    the tuples kept and their CDF values are the same bits as the full enumeration's
    (tests/stats/test_bootstrap.py compares the two).
    """
    p = np.diff(np.concatenate([[0.0], F]))
    below = np.concatenate([[0.0], F[:-1]])
    support = np.flatnonzero(p > 0)
    if int(support[-1]) >= 64:  # pragma: no cover - lambda <= 1 keeps counts tiny
        raise RuntimeError("Poisson table overflow")
    k = support.size
    p, below = p[support], below[support]
    cdf = F[support]
    for _ in range(TUPLE - 1):  # prepend one leading count per step
        cdf = (below[:, None] + p[:, None] * cdf[None, :]).reshape(-1)
    cdf = np.minimum(np.maximum.accumulate(cdf), 1.0)
    cdf[-1] = 1.0
    digits = support[np.arange(k**TUPLE)[:, None] // (k ** np.arange(TUPLE - 1, -1, -1))[None, :] % k]
    # tuples of zero width (a repeated CDF value) are never drawn: keep the others
    keep = np.flatnonzero(np.diff(np.concatenate([[0.0], cdf])) > 0)
    return digits[keep], cdf[keep]


class _Level:
    """Inverse-CDF lookup of :data:`TUPLE` iid Poisson(lambda) counts from one 16-bit uniform.

    The tuples (c_1, ..., c_T), each c_j in 0..K-1, are ordered lexicographically; their
    CDF is F(c_1 - 1) + p(c_1) (F(c_2 - 1) + p(c_2) (...)) (a few roundings, made
    monotone), so the tuple at u is the nested 1-D inverse CDF and its counts are
    exactly iid Poisson(lambda) (to double precision).  A bucket b covers u in
    [b, b+1) / 2**16; ``table[b]`` holds the tuple's counts packed one byte each
    (memory order = resample order; every count is below 64, so a code is positive)
    where the tuple is constant on the bucket, otherwise it is negative (the sign bit
    :data:`_FLAG` set) and a uniform double inside the bucket decides (:meth:`resolve`).
    """

    def __init__(self, level: int):
        lam = 0.0 if level == 0 else 1.0 - _SLACK * 2.0 ** (-level / 2.0)
        digits, cdf = _tuples(_poisson_cdf(lam))
        self.codes = np.ascontiguousarray(digits.astype(np.uint8)).view(_CODE).reshape(-1)
        self.cdf = cdf
        lo = np.searchsorted(cdf, np.arange(_TABLE_SIZE, dtype=np.float64) / _TABLE_SIZE, side="right")
        hi = np.searchsorted(cdf, (np.arange(_TABLE_SIZE, dtype=np.float64) + 1) / _TABLE_SIZE, side="left")
        table = self.codes[np.minimum(lo, cdf.size - 1)]
        self.table = np.where(lo == hi, table, table | _FLAG).astype(_CODE)
        # candidates of a straddling bucket: tuples lo .. lo + width
        self.lo = lo.astype(np.int32)
        self.width = (hi - lo).astype(np.int32)
        # a bucket straddling one step (most): u = (b + v) / 2**16 passes the step cdf[lo] iff
        # v >= cdf[lo] * 2**16 - b, a difference computed exactly (both in [b, b + 1))
        lo_c = np.minimum(lo, cdf.size - 1)
        self.step = np.where(hi > lo, cdf[lo_c] * _TABLE_SIZE - np.arange(_TABLE_SIZE), 0.0)
        self.after = self.codes[np.minimum(lo + 1, cdf.size - 1)]

    def resolve(self, bucket: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Packed counts of the tuples at u = (bucket + v) / 2**16 (``v`` doubles in [0, 1)).

        A bucket straddling one CDF step (most) needs one comparison; wider ones a
        binary search.
        """
        out = np.where(v >= self.step[bucket], self.after[bucket], self.table[bucket] & ~_FLAG)
        wide = np.flatnonzero(self.width[bucket] > 1)
        if wide.size:  # the first tuple whose CDF exceeds u, among lo .. lo + width (bisection)
            b = bucket[wide]
            x = (b + v[wide]) / _TABLE_SIZE
            lo = self.lo[b].astype(np.int64)
            hi = lo + self.width[b]
            while (active := lo < hi).any():
                mid = (lo + hi) // 2
                past = self.cdf[np.minimum(mid, len(self.cdf) - 1)] <= x
                lo = np.where(active & past, mid + 1, lo)
                hi = np.where(active & ~past, mid, hi)
            out[wide] = self.codes[np.minimum(lo, len(self.codes) - 1)]
        return out


@functools.cache
def _level(level: int) -> _Level:
    return _Level(level)


def _levels(sizes: np.ndarray) -> np.ndarray:
    """Poisson level of each stratum size: floor(log2 n), 0 (lambda = 0) below 16."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return np.where(sizes >= 16, np.floor(np.log2(np.maximum(sizes, 1))).astype(np.int64), 0)


class Layout:
    """The resampling layout: stratum sizes in canonical order (all the stream depends on, with the seed)."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        if self.sizes.size == 0 or (self.sizes <= 0).any():
            raise ValueError("strata sizes must be positive")
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.n = int(self.sizes.sum())
        levels = _levels(self.sizes)
        # runs of consecutive strata sharing a Poisson level: (first cluster, stop, level)
        self.segments: list[tuple[int, int, int]] = []
        for s, n, lv in zip(self.starts.tolist(), self.sizes.tolist(), levels.tolist()):
            if self.segments and self.segments[-1][2] == lv and self.segments[-1][1] == s:
                self.segments[-1] = (self.segments[-1][0], s + n, lv)
            else:
                self.segments.append((s, s + n, lv))
        self.levels = {lv: _level(lv) for _, _, lv in self.segments}
        # exact 16-bit lane sums: cut every stratum into pieces of at most _LANE_ROWS clusters
        pieces = [np.arange(a, a + n, _LANE_ROWS) for a, n in zip(self.starts.tolist(), self.sizes.tolist())]
        self.cuts = np.concatenate(pieces).astype(np.int64)
        self.first_cut = np.concatenate([[0], np.cumsum([p.size for p in pieces])[:-1]]).astype(np.int64)

        # per (stratum, resample), row-major: the stratum's size, and its first cluster's flat count index
        self.size_sr = np.repeat(self.sizes.astype(np.float64), BLOCK)
        self.base_sr = (self.starts[:, None] * BLOCK + np.arange(BLOCK)[None, :]).reshape(-1)

    @property
    def key(self) -> bytes:
        return self.sizes.tobytes()


def _totals(out: np.ndarray, lay: Layout) -> np.ndarray:
    """Per (stratum, resample) sums of the int8 counts (clusters x BLOCK), exactly, as int64."""
    if not _LITTLE:  # pragma: no cover - the lane trick below assumes little-endian bytes
        return np.add.reduceat(out, lay.starts, axis=0, dtype=np.int64)
    x = out.view(np.uint64)  # (clusters, BLOCK / 8): 8 resamples per word
    even = np.add.reduceat(x & _LANES, lay.cuts, axis=0)  # resamples 0, 2, 4, 6 of each word in 16-bit lanes
    odd = np.add.reduceat((x >> np.uint64(8)) & _LANES, lay.cuts, axis=0)
    part = np.empty((lay.cuts.size, BLOCK), dtype=np.int64)
    part[:, 0::2] = even.view(np.uint16)
    part[:, 1::2] = odd.view(np.uint16)
    return np.add.reduceat(part, lay.first_cut, axis=0)


def block_counts(gen: np.random.Generator, out: np.ndarray, lay: Layout) -> None:
    """Fill ``out`` (clusters x BLOCK, int8) with exact stratified multinomial counts.

    For each resample (column) and stratum s the multiplicities of its n_s clusters
    are Multinomial(n_s, uniform); see the module docstring for the draw and its stream.
    """
    n, rows = out.shape
    flat = out.view(_CODE).reshape(-1)  # (clusters * BLOCK / TUPLE) lookups
    per = rows // TUPLE
    bitgen = gen.bit_generator
    flagged: list[tuple[np.ndarray, np.ndarray, int]] = []  # (lookup position, bucket, level)
    for a, b, lv in lay.segments:
        table = lay.levels[lv].table
        for t0 in range(a, b, _CHUNK):
            t1 = min(b, t0 + _CHUNK)
            u = bitgen.random_raw((t1 - t0) * per // 4).view(np.uint16)
            dst = flat[t0 * per : t1 * per]
            np.take(table, u, out=dst, mode="wrap")  # (u < 2**16 = table size; mode="raise" would buffer out)
            fl = np.flatnonzero(dst < 0)  # buckets straddling a CDF step
            if fl.size:
                flagged.append((fl + t0 * per, u[fl], lv))
    if flagged:  # decide flagged buckets with a double inside the bucket
        pos, bucket = (np.concatenate([f[i] for f in flagged]) for i in range(2))
        v = gen.random(bucket.size)
        if len(lay.levels) == 1:
            flat[pos] = lay.levels[flagged[0][2]].resolve(bucket, v)
        else:
            lv_of = np.concatenate([np.full(f[0].size, f[2]) for f in flagged])
            for lv in np.unique(lv_of).tolist():
                sel = np.flatnonzero(lv_of == lv)
                flat[pos[sel]] = lay.levels[lv].resolve(bucket[sel], v[sel])
    # the exact correction to n_s draws per (stratum, resample)
    sizes, starts = lay.sizes, lay.starts
    short = sizes[:, None] - _totals(out, lay)  # (strata, BLOCK)
    add = np.maximum(short, 0).reshape(-1)
    total = int(add.sum())
    if total:
        # uniform cluster in 0..n_s-1: floor(U * n_s), U a double (bias below n_s / 2**53)
        u = gen.random(total)
        u *= np.repeat(lay.size_sr, add)
        target = u.astype(np.int64)
        target *= rows
        target += np.repeat(lay.base_sr, add)  # the stratum's first count of this resample
        np.add.at(out.reshape(-1), target, np.int8(1))  # (a Python int 1 takes a slow path)
    for s, r in np.argwhere(short < 0).tolist():  # (stratum, resample) order
        a, m = int(starts[s]), int(sizes[s])
        out[a : a + m, r] = np.bincount(gen.integers(0, m, size=m), minlength=m).astype(np.int8)


def block_generator(seed_seq: np.random.SeedSequence, b: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed_seq.entropy, spawn_key=(b,))))


# --------------------------------------------------------------------------- resampled sums of a statistic
