"""Exact mid-rank bin edges of a landscape axis, as value thresholds (SPEC 6), from sorted or unsorted values.

:func:`value_edges` reads sorted values (or distinct values with counts);
:func:`unsorted_value_edges` gives the same edges, threshold and zero rank from unsorted float values
without sorting them all: a histogram of their order-preserving integer keys on 2**20 buckets locates the
few buckets where the answers lie, and only those buckets' values are sorted (the landscape's first
pass at 20M tokens: 0.6 s less than sorting them).  :func:`linear_quantiles` is NumPy's ``quantile``
(method ``linear``) bit for bit from the same kind of histogram: the order statistics it interpolates
between, found without partitioning every value (token strata's edges, SPEC 11).

Pure numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from icsd_audit.stats.pool import on_threads

__all__ = ["REGION_QUANTILE", "value_edges", "unsorted_value_edges", "linear_quantiles", "order_statistics"]

#: "Strongly" trusted / supported: scaled mid-rank at least this (the top fifth).
REGION_QUANTILE = 0.8
#: bits of a value's key that pick its bucket (2**20 buckets: 1/2048 of a binade for float32), values per chunk
_BUCKET_BITS = 20
#: a candidate bucket spans 2**(key bits - 20) keys: counted one by one up to this many bits (float32: 12), sorted above
_KEY_HISTOGRAM_BITS = 12
_CHUNK = 1 << 20
#: buckets of :func:`order_statistics`' histogram (2**16: a chunk's counts, 512 KB, stay in cache and on the heap;
#: 2**20 made each chunk's bincount a fresh 8 MB array, most of its time page faults)
_ORDER_BUCKET_BITS = 16
#: below this many values :func:`linear_quantiles` hands them to NumPy (its partition is as fast there)
_SMALL = 1 << 16


def value_edges(values: np.ndarray, counts: np.ndarray | None, grid: int) -> tuple[np.ndarray, float, float]:
    """Bin edges, region threshold and zero rank of sorted ``values`` (each with ``counts``, or once each).

    Binary search over positions of the monotone f = 2 * below + equal (integers), so
    memory stays at the sorted values themselves.
    """
    if counts is None:
        n = m = values.size

        def f(i: np.ndarray) -> np.ndarray:
            x = values[i]
            return np.searchsorted(values, x, side="left") + np.searchsorted(values, x, side="right")
    else:
        cum = np.cumsum(counts)
        n, m = int(cum[-1]), values.size

        def f(i: np.ndarray) -> np.ndarray:
            return 2 * cum[i] - counts[i]

    def first(cond: Any, k: int) -> np.ndarray:
        """Per entry, the smallest index i in 0..m with cond(i) true (m if none): cond is monotone in i."""
        lo, hi = np.zeros(k, np.int64), np.full(k, m, np.int64)
        while (active := lo < hi).any():
            mid = (lo + hi) // 2
            ok = cond(np.minimum(mid, m - 1))
            hi = np.where(active & ok, mid, hi)
            lo = np.where(active & ~ok, mid + 1, lo)
        return lo

    def value_at(i: np.ndarray) -> np.ndarray:
        return np.where(i < m, values[np.minimum(i, m - 1)].astype(np.float64), np.inf)

    b = np.arange(1, grid, dtype=np.int64)
    edges = value_at(first(lambda i: grid * f(i) >= 2 * n * b, b.size))
    top = float(value_at(first(lambda i: f(i).astype(np.float64) / (2 * n) >= REGION_QUANTILE, 1))[0])
    if counts is None:
        z0 = values.dtype.type(0)  # (a Python 0 would convert every value to float64 first)
        below, equal = np.searchsorted(values, z0, side="left"), np.searchsorted(values, z0, side="right")
    else:
        below = int(counts[values < 0].sum())
        equal = int(counts[values == 0].sum()) + below
    zero = (float(below) + 0.5 * float(equal - below)) / n
    return edges, top, zero


def unsorted_value_edges(values: np.ndarray, grid: int) -> tuple[np.ndarray, float, float]:
    """``value_edges(np.sort(values), None, grid)`` for finite float32/float64 ``values``, without the sort.

    ``values`` is overwritten (with the keys).  An edge is the smallest value v whose
    F(v) = #(< v) + #(<= v) meets its condition; F is monotone in v, and a value in bucket B
    has 2 C(B - 1) < F <= 2 C(B) (C: the cumulative bucket counts), so the answer lies in the
    first bucket whose bound meets the condition or is the least value of the next non-empty
    one: only those buckets' values are sorted, and F is exact for them.  -0.0 counts as 0.0,
    as a comparison counts it.  Other dtypes are sorted.
    """
    if values.dtype not in (np.float32, np.float64) or values.size == 0:
        values.sort()
        return value_edges(values, None, grid)
    n = values.size
    itype = np.int32 if values.dtype == np.float32 else np.int64
    bits = 8 * values.itemsize
    shift, low = bits - _BUCKET_BITS, itype((1 << (bits - 1)) - 1)
    half = 1 << (_BUCKET_BITS - 1)
    keys = values.view(itype)
    counts = np.zeros(1 << _BUCKET_BITS, dtype=np.int64)
    for c0 in range(0, n, _CHUNK):  # keys in place: -0.0 -> 0.0, then negatives' magnitude bits flipped
        v, k = values[c0 : c0 + _CHUNK], keys[c0 : c0 + _CHUNK]
        np.add(v, 0, out=v)
        k ^= (k >> (bits - 1)) & low
        counts += np.bincount((k >> shift) + half, minlength=counts.size)
    cum = np.cumsum(counts)
    before = cum - counts  # values in lower buckets
    b = np.arange(1, grid, dtype=np.int64)
    first = list(np.searchsorted(grid * cum, n * b, side="left"))  # grid * F >= 2 n b can hold from here
    top_ok = (2 * cum).astype(np.float64) / (2 * n) >= REGION_QUANTILE
    first.append(int(np.argmax(top_ok)))
    filled = np.flatnonzero(counts)
    nxt = np.searchsorted(filled, first, side="right")
    cand = np.zeros(counts.size, dtype=bool)
    cand[first] = True
    cand[filled[nxt[nxt < filled.size]]] = True
    # F is the same for every copy of a value: one entry per distinct key of the candidate buckets (a bucket of
    # exact zeros can hold most of the values), s[i] with its copies at positions start[i]:end[i] of those buckets'
    # values in order
    parts, zeros = [], 0
    for c0 in range(0, n, _CHUNK):
        k = keys[c0 : c0 + _CHUNK]
        parts.append(k[cand[(k >> shift) + half]])
        zeros += int(np.count_nonzero(k == 0))
    s = np.concatenate(parts)
    if shift <= _KEY_HISTOGRAM_BITS:
        s, start, end = _distinct_keys(s, cand, shift, half)
    else:
        s.sort()
        start = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]])) if s.size else np.zeros(0, np.int64)
        end = np.append(start[1:], s.size)
        s = s[start]
    # #(< v) for a gathered v: the values of lower buckets not gathered, plus the gathered ones below it
    off = (before - np.cumsum(np.where(cand, counts, 0)) + np.where(cand, counts, 0))[(s >> shift) + half]
    f = 2 * off + start + end

    def value(i: int) -> float:
        if i >= s.size:
            return np.inf
        k = s[i]
        return float(np.array(k ^ ((k >> (bits - 1)) & low), dtype=itype).view(values.dtype))

    edges = np.array([value(int(i)) for i in np.searchsorted(grid * f, 2 * n * b, side="left")], dtype=np.float64)
    hit = f.astype(np.float64) / (2 * n) >= REGION_QUANTILE
    top = value(int(np.argmax(hit)) if hit.any() else s.size)
    below = int(before[half])  # keys < 0: the negative values
    zero = (float(below) + 0.5 * float(zeros)) / n
    return edges, top, zero


def _distinct_keys(s: np.ndarray, cand: np.ndarray, shift: int, half: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct keys of ``s`` (the values of the candidate buckets) in order, and where each one's copies start
    and end in ``s`` sorted: a histogram of the keys' low ``shift`` bits per candidate bucket (2**12 entries each
    for float32), the answer a sort gives, without the sort."""
    ids = np.flatnonzero(cand)
    rank = np.full(cand.size, -1, dtype=np.int64)
    rank[ids] = np.arange(ids.size)
    width = 1 << shift
    hist = np.bincount((rank[(s >> shift) + half] << shift) + (s & (width - 1)), minlength=ids.size * width)
    at = np.flatnonzero(hist)
    cnt = hist[at]
    end = np.cumsum(cnt)
    keys = ((ids[at >> shift] - half) << shift) + (at & (width - 1))
    return keys.astype(s.dtype), end - cnt, end


def _unsigned_keys(values: np.ndarray) -> tuple[np.ndarray, Any] | None:
    """Order-preserving unsigned keys of float32/64 or int32/64 ``values`` (a fresh array), and the map back
    from keys to values; None for another dtype.  -0.0 sorts just below 0.0 (they compare equal)."""
    kind, size = values.dtype.kind, values.dtype.itemsize
    if kind not in "fi" or size not in (4, 8):
        return None
    itype, utype = (np.int32, np.uint32) if size == 4 else (np.int64, np.uint64)
    top = itype(np.iinfo(itype).min)
    k = values.view(itype)
    # floats: negatives (sign bit set) have every bit flipped, the rest only the sign bit; integers: the sign bit
    flip = (k >> (8 * size - 1)) | top if kind == "f" else top
    keys = (k ^ flip).view(utype)

    def back(u: np.ndarray) -> np.ndarray:
        u = np.asarray(u, dtype=utype)
        if kind == "f":
            s = u.view(itype)
            return np.where(s < 0, s ^ top, ~s).astype(itype).view(values.dtype)  # top bit set: was >= 0
        return (u ^ top.view(utype)).view(values.dtype)

    return keys, back


def _chunks(values: np.ndarray) -> list[np.ndarray]:
    return [values[c0 : c0 + _CHUNK] for c0 in range(0, values.size, _CHUNK)]


def order_statistics(values: np.ndarray, ranks: Any, *, workers: int = 1) -> np.ndarray | None:
    """The ``ranks``-th smallest of ``values`` (0-based; finite float32/64 or int32/64), in their dtype, without
    sorting them: a histogram of order-preserving keys on 2**16 buckets of the keys' range gives each rank's
    bucket, and only the values of those buckets are gathered and partitioned (none where a bucket holds one
    key, as for positions).  None for another dtype (the caller sorts).  ``workers`` threads take the chunks
    of both passes (the same answer: counts add exactly, the gathered values keep their order)."""
    got = _unsigned_keys(values[:0])
    if got is None:
        return None
    ranks = np.asarray(ranks, dtype=np.int64)
    n = values.size
    if ranks.size and (ranks.min() < 0 or ranks.max() >= n):
        raise ValueError(f"ranks must lie in 0..{n - 1}")
    lo_hi = _unsigned_keys(np.array([values.min(), values.max()], dtype=values.dtype))
    assert lo_hi is not None
    (lo, hi), back = lo_hi[0].tolist(), lo_hi[1]
    shift = max(0, int(hi - lo).bit_length() - _ORDER_BUCKET_BITS)
    utype = lo_hi[0].dtype
    ulo, ushift = utype.type(lo), utype.type(shift)

    def buckets(chunk: np.ndarray) -> np.ndarray:
        u = _unsigned_keys(np.ascontiguousarray(chunk))[0]  # type: ignore[index]
        u -= ulo
        u >>= ushift
        return u.astype(np.intp)

    size = ((hi - lo) >> shift) + 1
    counts = np.zeros(size, dtype=np.int64)

    def counted(chunks: list[np.ndarray]) -> np.ndarray:  # one running histogram per thread
        mine = np.zeros(size, dtype=np.int64)
        for chunk in chunks:
            mine += np.bincount(buckets(chunk), minlength=size)
        return mine

    every = _chunks(values)
    step = -(-len(every) // max(1, workers))
    for part in on_threads(counted, [every[i : i + step] for i in range(0, len(every), step)], workers):
        counts += part
    cum = np.cumsum(counts)
    where = np.searchsorted(cum, ranks, side="right")  # each rank's bucket
    within = ranks - (cum - counts)[where]
    if shift == 0:  # one key per bucket
        return back(where.astype(utype) + ulo)
    cand = np.zeros(counts.size, dtype=bool)
    cand[where] = True

    def candidates(chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = buckets(chunk)
        sel = cand[b]
        return _unsigned_keys(np.ascontiguousarray(chunk[sel]))[0], b[sel]  # type: ignore[index]

    got = on_threads(candidates, _chunks(values), workers)
    gk, gb = np.concatenate([k for k, _ in got]), np.concatenate([b for _, b in got])
    out = np.empty(ranks.size, dtype=utype)
    for bucket in np.unique(where).tolist():
        mine = where == bucket
        ks = gk[gb == bucket]
        kth = np.unique(within[mine])
        part = np.partition(ks, kth)
        out[mine] = part[within[mine]]
    return back(out)


def linear_quantiles(values: Any, qs: Any, *, workers: int = 1) -> np.ndarray:
    """``np.quantile(values, qs, method="linear")`` as float64, bit for bit, from the two order statistics
    around each level (:func:`order_statistics`) and NumPy's own interpolation.

    Finite float32/64 or int32/64 values of 65,536 or more; anything else goes to NumPy
    itself.  A zero quantile may come back as 0.0 where NumPy gives -0.0 or the reverse
    (they compare equal; NumPy's partition picks either).
    """
    a = np.asarray(values).reshape(-1)
    q = np.asarray(qs, dtype=np.float64)
    n = a.size
    if n < _SMALL or a.dtype.kind not in "fi" or a.dtype.itemsize not in (4, 8) \
            or (q.size and not ((q >= 0) & (q <= 1)).all()):
        return np.quantile(np.asarray(a, dtype=np.float64), q, method="linear")
    if a.dtype.kind == "f" and not (np.isfinite(a.min()) and np.isfinite(a.max())):
        return np.quantile(np.asarray(a, dtype=np.float64), q, method="linear")
    # numpy.lib._function_base_impl: the virtual index (n - 1) q, its floor and the next index (the last value
    # where the index reaches n - 1), gamma = index - floor, and _lerp
    virtual = (n - 1) * q
    prev = np.floor(virtual).astype(np.intp)
    nxt = prev + 1
    top = virtual >= n - 1
    prev[top] = nxt[top] = -1
    vals = order_statistics(a, np.concatenate([prev % n, nxt % n]), workers=workers)
    assert vals is not None
    v = vals.astype(np.float64)
    lo, hi = v[: q.size], v[q.size :]
    gamma = np.asarray(virtual - prev, dtype=np.float64)
    diff = hi - lo
    out = np.add(lo, diff * gamma)
    np.subtract(hi, diff * (1 - gamma), out=out, where=gamma >= 0.5)
    return out
