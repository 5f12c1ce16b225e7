"""Exact stratified multinomial resampling of per-cluster sums (the bootstrap's engine).

A stratified action-turn resample is, per stratum s of n_s clusters, a vector of
multiplicities distributed Multinomial(n_s, 1/n_s); the resampled sums of K columns
are ``counts @ sums``.  Drawing those counts by sampling n_s indices and counting
them costs two slow passes per element; here they come from *Poissonization with
an exact correction*:

1. iid Poisson(lambda) counts per cluster, lambda = 1 - 3 / sqrt(2**floor(log2 n_s)),
   :data:`TUPLE` clusters at a time by table lookup on one 16-bit uniform (the
   lexicographic inverse CDF of the tuple; buckets that straddle a CDF step are
   decided by a uniform double inside the bucket, so the draw is exact to double
   precision);
2. given their total M, Poisson counts are Multinomial(M, uniform): adding n_s - M
   further uniform draws gives exactly Multinomial(n_s, uniform);
3. where M > n_s (probability about Phi(-3)) the stratum is redrawn directly.

Clusters whose sums are all zero are dropped first: the kept k of a stratum receive
a Binomial(n_s, k / n_s) number of draws (:func:`_drop_zero_rows`).

Resamples come in blocks of :data:`BLOCK`, each drawn from its own child generator
(SFC64, seeded from the caller's generator through a SeedSequence), so results do not
depend on memory chunking or on the number of workers, and the first R resamples do
not depend on how many are drawn in total.  Each worker reuses one counts buffer
(1 byte per cluster and resample of a block) and one float64 tile.  Extra workers are
forked processes on Linux (:mod:`icsd_audit.stats.forked`: the engine holds the GIL
too often for threads to help), threads elsewhere.

Pure numpy.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from icsd_audit.stats.blas import BlasThreads
from icsd_audit.stats.forked import ForkedBlocks, fork_available

__all__ = ["BLOCK", "TUPLE", "resampled_sums", "batch_resampled_sums", "check_rng"]

#: resamples per random block; part of the definition of the random stream
#: (changing it changes the resamples drawn for a given seed)
BLOCK = 16

_TABLE_BITS = 16
_TABLE_SIZE = 1 << _TABLE_BITS
#: clusters per 16-bit lookup (their Poisson counts packed one byte each); part of
#: the definition of the random stream
TUPLE = 4
_CODE = np.dtype(f"=i{TUPLE}")
_FLAG = np.iinfo(_CODE).min  # sign bit: marks a bucket that straddles a CDF step
_SLACK = 3.0  # Poisson rate lambda = 1 - _SLACK / sqrt(2**floor(log2 n))
_TAKE_ELEMENTS = 1 << 16  # lookups per tile (keeps the intp temporary of np.take in cache)
_GEMM_ELEMENTS = 1 << 16  # float64 counts per matrix product: a 512 KB tile that stays in a 1 MB L2 cache


def check_rng(rng: Any) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, (int, np.integer, np.random.SeedSequence, np.random.BitGenerator)):
        if isinstance(rng, (int, np.integer)) and rng < 0:
            raise ValueError(f"rng seed must be non-negative, got {rng}")
        return np.random.default_rng(rng)
    raise TypeError(f"rng must be a numpy Generator, a seed or None, got {type(rng).__name__}")



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


class _Level:
    """Inverse-CDF lookup of :data:`TUPLE` iid Poisson(lambda) counts from one 16-bit uniform.

    The tuples (c_1, ..., c_T), each c_j in 0..K-1, are ordered lexicographically; their
    CDF is F(c_1 - 1) + p(c_1) (F(c_2 - 1) + p(c_2) (...)) (a few roundings, made
    monotone), so the tuple at u is the nested 1-D inverse CDF and its counts are
    exactly iid Poisson(lambda) (to double precision).  A bucket b covers u in
    [b, b+1) / 2**16; ``table[b]`` holds the tuple's counts packed one byte each
    (memory order = cluster order; every count is below 64, so a code is positive)
    where the tuple is constant on the bucket, otherwise it is negative (the sign bit
    :data:`_FLAG` set) and a uniform double inside the bucket decides (:meth:`resolve`).
    """

    def __init__(self, level: int):
        lam = 0.0 if level == 0 else 1.0 - _SLACK * 2.0 ** (-level / 2.0)
        F = _poisson_cdf(lam)
        k = len(F)
        p = np.diff(np.concatenate([[0.0], F]))
        below = np.concatenate([[0.0], F[:-1]])
        cdf = F
        for _ in range(TUPLE - 1):  # prepend one leading count per step
            cdf = (below[:, None] + p[:, None] * cdf[None, :]).reshape(-1)
        cdf = np.minimum(np.maximum.accumulate(cdf), 1.0)
        cdf[-1] = 1.0
        digits = np.arange(k**TUPLE)[:, None] // (k ** np.arange(TUPLE - 1, -1, -1))[None, :] % k
        # tuples of zero width (a repeated CDF value) are never drawn: keep the others
        keep = np.flatnonzero(np.diff(np.concatenate([[0.0], cdf])) > 0)
        self.codes = np.ascontiguousarray(digits[keep].astype(np.uint8)).view(_CODE).reshape(-1)
        self.cdf = cdf = cdf[keep]
        lo = np.searchsorted(cdf, np.arange(_TABLE_SIZE, dtype=np.float64) / _TABLE_SIZE, side="right")
        hi = np.searchsorted(cdf, (np.arange(_TABLE_SIZE, dtype=np.float64) + 1) / _TABLE_SIZE, side="left")
        if int(digits.max(initial=0)) >= 64:  # pragma: no cover - lambda <= 1 keeps counts tiny
            raise RuntimeError("Poisson table overflow")
        table = self.codes[np.minimum(lo, cdf.size - 1)]
        self.table = np.where(lo == hi, table, table | _FLAG).astype(_CODE)
        # candidates of a straddling bucket: tuples lo .. lo + width
        self.lo = lo.astype(np.int32)
        self.width = np.minimum(hi - lo, 127).astype(np.int8)

    def resolve(self, bucket: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Packed counts of the tuples at u = (bucket + v) / 2**16 (``v`` doubles in [0, 1)).

        A bucket straddling one CDF step (most) needs one comparison; wider ones a
        binary search.
        """
        x = (bucket + v) / _TABLE_SIZE
        i = self.lo[bucket].astype(np.int64)
        i += self.cdf[i] <= x
        wide = np.flatnonzero(self.width[bucket] > 1)
        if wide.size:
            i[wide] = np.searchsorted(self.cdf, x[wide], side="right")
        return self.codes[np.minimum(i, len(self.codes) - 1)]


@functools.cache
def _level(level: int) -> _Level:
    return _Level(level)


def _levels(sizes: np.ndarray) -> np.ndarray:
    """Poisson level of each stratum size: floor(log2 n), 0 (lambda = 0) below 16."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return np.where(sizes >= 16, np.floor(np.log2(np.maximum(sizes, 1))).astype(np.int64), 0)


def _level_segments(starts: np.ndarray, sizes: np.ndarray, levels: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive strata sharing a Poisson level: (start, stop, level)."""
    out: list[tuple[int, int, int]] = []
    for s, n, lv in zip(starts.tolist(), sizes.tolist(), levels.tolist()):
        if out and out[-1][2] == lv and out[-1][1] == s:
            out[-1] = (out[-1][0], s + n, lv)
        else:
            out.append((s, s + n, lv))
    return out


class _Layout:
    """Column layout of the counts: each level run padded to a multiple of :data:`TUPLE`.

    A lookup fills TUPLE adjacent columns of one level; the padding columns get
    counts too (discarded: set to 0, and their rows of the sums are 0), so every
    cluster's count stays iid Poisson.
    """

    def __init__(self, sizes: np.ndarray, totals: np.ndarray | None = None):
        self.sizes = sizes
        self.totals = totals  # draws per stratum where they exceed its clusters (zero rows dropped)
        levels = _levels(sizes)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        segs = _level_segments(starts, sizes, levels)
        shift = np.zeros(len(sizes), dtype=np.int64)
        self.col = np.empty(int(sizes.sum()), dtype=np.int64)  # padded column of each cluster
        self.segments: list[tuple[int, int, int]] = []  # (first lookup, stop lookup, level)
        pads: list[np.ndarray] = []
        pad, s0 = 0, 0
        for a, b, lv in segs:
            n_strata = int(np.searchsorted(starts, b, side="left")) - s0
            shift[s0 : s0 + n_strata] = pad
            self.col[a:b] = np.arange(a, b) + pad
            width = -(-(b - a) // TUPLE) * TUPLE
            self.segments.append(((a + pad) // TUPLE, (a + pad + width) // TUPLE, lv))
            pads.append(np.arange(b + pad, a + pad + width))
            pad += width - (b - a)
            s0 += n_strata
        self.starts = starts + shift
        self.n = int(sizes.sum()) + pad
        self.dummy = np.concatenate(pads).astype(np.int64)
        self.levels = {lv: _level(lv) for _, _, lv in self.segments}


def _block_counts(gen: np.random.Generator, out: np.ndarray, lay: _Layout) -> None:
    """Fill ``out`` (BLOCK x padded columns, int8) with exact stratified multinomial counts.

    For each row and stratum s (columns starts[s]:starts[s]+n_s) the multiplicities
    are Multinomial(n_s, uniform).  Drawn by Poissonization: iid Poisson(lambda)
    counts (:class:`_Level`, TUPLE per 16-bit uniform), which given their total M are
    Multinomial(M, uniform); then n_s - M further uniform draws are added, and where
    M > n_s (probability about Phi(-3)) the row's stratum is redrawn directly.
    Random stream of the block, in order: 16-bit uniforms chunk by chunk (one level:
    row-major over rows x lookups; several: column tiles of :data:`_TAKE_ELEMENTS` //
    rows lookups within each level run, row-major inside a tile), doubles for the
    flagged buckets (in that order), the added uniform draws
    (row-major over (row, stratum)), the redrawn strata.  Tiles keep every temporary
    small: no page faults, and the table lookups stay in cache.
    """
    rows, n_cols = out.shape
    sizes, starts = lay.sizes, lay.starts
    if lay.totals is None:
        want = np.broadcast_to(sizes[None, :], (rows, sizes.size))
    else:  # draws landing on the kept clusters: Binomial(total, kept / total)
        want = gen.binomial(lay.totals, sizes / lay.totals, size=(rows, sizes.size))
    packed = out.view(_CODE)  # (rows, lookups)
    n_look = packed.shape[1]
    flat = packed.reshape(-1)
    flagged: list[tuple[np.ndarray, np.ndarray, int]] = []  # (flat position, bucket, level)
    bitgen = gen.bit_generator
    if len(lay.segments) == 1:  # one level: row-major chunks, looked up in place
        lv = lay.segments[0][2]
        table = lay.levels[lv].table
        for f0 in range(0, flat.size, _TAKE_ELEMENTS):
            w = min(flat.size, f0 + _TAKE_ELEMENTS) - f0
            u = bitgen.random_raw((w + 3) // 4).view(np.uint16)[:w]
            dst = flat[f0 : f0 + w]
            np.take(table, u, out=dst, mode="clip")  # (mode="raise" would buffer out)
            fl = np.flatnonzero(dst < 0)  # buckets straddling a CDF step
            if fl.size:
                flagged.append((fl + f0, u[fl], lv))
    else:  # column tiles within each level run, row-major inside a tile
        width = max(1, _TAKE_ELEMENTS // rows)
        for a, b, lv in lay.segments:
            table = lay.levels[lv].table
            for c0 in range(a, b, width):
                w = min(b, c0 + width) - c0
                u = bitgen.random_raw((rows * w + 3) // 4).view(np.uint16)[: rows * w]
                codes = np.take(table, u)
                fl = np.flatnonzero(codes < 0)
                if fl.size:
                    flagged.append(((fl // w) * n_look + fl % w + c0, u[fl], lv))
                packed[:, c0 : c0 + w] = codes.reshape(rows, w)
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
    if lay.dummy.size:
        out[:, lay.dummy] = 0
    # totals per (row, stratum) and the exact correction to the wanted number of draws
    m = np.add.reduceat(out, starts, axis=1, dtype=np.int32)
    short = want - m  # (rows, strata)
    add = np.maximum(short, 0).reshape(-1)
    total = int(add.sum())
    if total:
        # per (row, stratum): flat offset of the stratum's first column, and its size
        base = (np.arange(rows, dtype=np.int64)[:, None] * n_cols + starts[None, :]).reshape(-1)
        size_of = np.broadcast_to(sizes[None, :], short.shape).reshape(-1)
        # uniform in 0..n_s-1: floor(U * n_s), U a double (bias below n_s / 2**53)
        u = gen.random(total)
        u *= np.repeat(size_of, add)
        target = np.repeat(base, add) + u.astype(np.int64)
        np.add.at(out.reshape(-1), target, np.int8(1))  # (a Python int 1 takes a slow path)
    over = np.argwhere(short < 0)  # row-major order
    for r, s in over.tolist():
        a, n = int(starts[s]), int(sizes[s])
        draws = gen.integers(0, n, size=int(want[r, s]))
        out[r, a : a + n] = np.bincount(draws, minlength=n).astype(np.int8)


def _block_generator(seed_seq: np.random.SeedSequence, b: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed_seq.entropy, spawn_key=(b,))))


class _Engine:
    """Per-block resampled group sums for a sorted cluster table."""

    def __init__(self, S: np.ndarray, sizes: np.ndarray, sgroup: np.ndarray, n_groups: int,
                 seed_seq: np.random.SeedSequence, totals: np.ndarray | None = None):
        self.lay = _Layout(sizes, totals)
        self.n, self.k = self.lay.n, S.shape[1]
        if self.n == S.shape[0]:
            self.S = S
        else:  # zero rows at the padding columns
            self.S = np.zeros((self.n, self.k), dtype=np.float64)
            self.S[self.lay.col] = S
        self.n_groups = n_groups
        self.seed_seq = seed_seq
        starts = self.lay.starts
        gstart = np.zeros(n_groups, np.int64)
        gstop = np.zeros(n_groups, np.int64)
        first = np.full(n_groups, -1)
        for s in range(len(sizes)):
            g = int(sgroup[s])
            if first[g] < 0:
                first[g] = s
                gstart[g] = starts[s]
            gstop[g] = starts[s] + sizes[s]
        self.gstart, self.gstop = gstart, gstop
        # many narrow groups: one segment sum per tile instead of one product per group
        self.narrow = n_groups > 8 and self.n / n_groups < 256
        self.col_tile = max(256, _GEMM_ELEMENTS // (BLOCK * (self.k if self.narrow else 1)))
        self._local = threading.local()

    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """This thread's counts and float64 tile, reused block after block.

        Fresh arrays of megabytes would each cost page faults (and NumPy's huge-page
        advice on arrays of 4 MB or more can stall the fault on compaction).
        """
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = (np.empty((BLOCK, self.n), dtype=np.int8),
                                     np.empty((BLOCK, min(self.n, self.col_tile)), dtype=np.float64))
        return buf

    def block(self, b: int) -> np.ndarray:
        gen = _block_generator(self.seed_seq, b)
        counts, cbuf = self._buffers()
        _block_counts(gen, counts, self.lay)
        T = np.zeros((BLOCK, self.n_groups, self.k), dtype=np.float64)
        S = self.S
        for c0 in range(0, self.n, self.col_tile):
            c1 = min(self.n, c0 + self.col_tile)
            cf = cbuf[:, : c1 - c0]
            np.copyto(cf, counts[:, c0:c1], casting="unsafe")
            # the groups meeting columns c0..c1 (groups are contiguous, in order)
            g_lo = int(np.searchsorted(self.gstop, c0, side="right"))
            g_hi = int(np.searchsorted(self.gstart, c1, side="left"))
            if self.narrow:
                cuts = np.clip(self.gstart[g_lo:g_hi], c0, c1) - c0
                prod = cf[:, :, None] * S[None, c0:c1, :]
                T[:, g_lo:g_hi, :] += np.add.reduceat(prod, cuts, axis=1)
            else:
                for g in range(g_lo, g_hi):
                    a, z = max(c0, int(self.gstart[g])), min(c1, int(self.gstop[g]))
                    T[:, g, :] += cf[:, a - c0 : z - c0] @ S[a:z]
        return T


def _drop_zero_rows(S: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Clusters whose sums are all 0, dropped (each stratum keeps at least one cluster).

    They add nothing to any resampled sum, only their multiplicities matter, and
    those are not needed: of Multinomial(n_s, uniform) counts, the ones on a subset of
    k clusters are exactly Multinomial(N, uniform over the k) with N ~ Binomial(n_s,
    k / n_s).  So the kept clusters are resampled with a Binomial number of draws,
    saving work in proportion (turns without active tokens are common: zero advantage).
    Returns the kept rows, clusters per stratum, and the draws per stratum (None when
    nothing was dropped).
    """
    zero = ~(S != 0).any(axis=1)
    if not zero.any():
        return S, sizes, None
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    keep = ~zero
    keep[starts[np.add.reduceat(keep, starts, dtype=np.int64) == 0]] = True  # an all-zero stratum keeps its first
    kept = np.add.reduceat(keep, starts, dtype=np.int64)
    return np.ascontiguousarray(S[keep]), kept, sizes


def resampled_sums(
    sums: np.ndarray,
    strata_sizes: Sequence[int],
    strata_group: Sequence[int],
    n_groups: int,
    n_resamples: int,
    *,
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Stratified action-turn resamples of per-group column sums, chunk by chunk.

    ``sums`` (n_clusters x K) is sorted by group then stratum; stratum s covers the
    next ``strata_sizes[s]`` rows and belongs to group ``strata_group[s]`` (groups
    contiguous and non-decreasing).  Yields ``(r0, r1, T)`` with T of shape
    (r1 - r0, n_groups, K): the column sums over the resampled clusters of each
    group, for resamples r0..r1-1.  Resamples come in blocks of :data:`BLOCK`, each
    from its own child generator, so neither ``chunk_size`` (resamples per yielded
    chunk) nor ``workers`` (forked processes on Linux, threads elsewhere) changes any value.  Working memory
    is about 1 byte per cluster per block in flight, plus a 512 KB tile per worker.
    """
    gen0 = check_rng(rng)
    S = np.ascontiguousarray(sums, dtype=np.float64)
    n, _ = S.shape
    sizes = np.asarray(strata_sizes, dtype=np.int64)
    sgroup = np.asarray(strata_group, dtype=np.int64)
    if sizes.sum() != n or (sizes <= 0).any():
        raise ValueError("strata sizes must be positive and sum to the number of clusters")
    if len(sgroup) != len(sizes) or (np.diff(sgroup) < 0).any() or (sgroup < 0).any() or (sgroup >= n_groups).any():
        raise ValueError("strata must be sorted by group, with group codes in 0..n_groups-1")
    seed_seq = np.random.SeedSequence(gen0.integers(0, 2**63, size=4).tolist())
    S, kept, totals = _drop_zero_rows(S, sizes)
    eng = _Engine(S, kept, sgroup, n_groups, seed_seq, totals)
    n_blocks = -(-n_resamples // BLOCK)
    per_chunk = max(1, (chunk_size if chunk_size is not None else 1024) // BLOCK)
    chunks = [range(b0, min(n_blocks, b0 + per_chunk)) for b0 in range(0, n_blocks, per_chunk)]
    workers = max(1, min(int(workers), n_blocks))
    with contextlib.ExitStack() as stack:
        stack.enter_context(BlasThreads(1))
        if workers > 1 and fork_available(n_blocks):  # processes: the block engine holds the GIL too often for threads
            forked = stack.enter_context(ForkedBlocks(eng.block, n_blocks, workers, shape=(BLOCK, eng.n_groups, eng.k)))
            compute = forked.take
        elif workers > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = stack.enter_context(ThreadPoolExecutor(max_workers=workers))
            compute = lambda blocks: list(pool.map(eng.block, blocks))  # noqa: E731
        else:
            compute = lambda blocks: [eng.block(b) for b in blocks]  # noqa: E731
        for blocks in chunks:
            T = np.concatenate(compute(blocks), axis=0)
            r0 = blocks[0] * BLOCK
            r1 = min(n_resamples, r0 + T.shape[0])
            yield r0, r1, T[: r1 - r0]


def batch_resampled_sums(
    bsums: np.ndarray,
    bgroup: np.ndarray,
    n_groups: int,
    n_resamples: int,
    gen: np.random.Generator,
    *,
    chunk_size: int = 1024,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Resample whole batches (rows of ``bsums``) with replacement within each group.

    Yields ``(r0, r1, T)`` like :func:`resampled_sums`, T of shape (r1 - r0, G, K).
    All multiplicities are drawn first (R x n_batches integers, group by group), so
    ``chunk_size`` does not change the result.
    """
    counts: list[tuple[np.ndarray, np.ndarray]] = []
    for g in range(n_groups):
        sel = np.flatnonzero(bgroup == g)
        nb = sel.size
        if nb == 0:
            continue
        idx = gen.integers(0, nb, size=(n_resamples, nb))
        cnt = np.bincount((idx + (np.arange(n_resamples) * nb)[:, None]).ravel(), minlength=n_resamples * nb)
        counts.append((sel, cnt.reshape(n_resamples, nb).astype(np.float64)))
    step = max(1, int(chunk_size))
    for r0 in range(0, n_resamples, step):
        r1 = min(n_resamples, r0 + step)
        out = np.zeros((r1 - r0, n_groups, bsums.shape[1]), dtype=np.float64)
        for sel, cnt in counts:
            out[:, int(bgroup[sel[0]]), :] = cnt[r0:r1] @ bsums[sel]
        yield r0, r1, out
