"""Exact stratified multinomial resampling of per-cluster sums (the bootstrap's engine).

A stratified action-turn resample is, per stratum s of n_s clusters, a vector of
multiplicities distributed Multinomial(n_s, 1/n_s); the resampled sums of K columns
are ``counts @ sums``.

**One stream per layout** (SPEC 7, "one interval per statistic").  The counts are a
function of the seed and of the *layout* only: the sequence of stratum sizes (turns
per batch, batches in their canonical order).  They never depend on the sums, on which
statistics are computed, or on how many; every statistic on a layout reads the same
resamples.  Resamples come in blocks of :data:`BLOCK`, each drawn from its own child
generator (SFC64, seeded from the caller's seed through a SeedSequence and the block
number), so neither memory chunking nor the number of workers changes a value, and the
first R resamples do not depend on how many are drawn (work units of :data:`SUPER`
blocks are always computed whole).

The counts of a block are drawn by *Poissonization with an exact correction*:

1. iid Poisson(lambda) counts, lambda = 1 - 3 / sqrt(2**floor(log2 n_s)), by table
   lookup: one 16-bit uniform gives :data:`TUPLE` counts (the same cluster in TUPLE
   consecutive resamples; the lexicographic inverse CDF of the tuple; a bucket that
   straddles a CDF step is decided by a uniform double inside it, exact to double
   precision); one 64-bit word per cluster and block;
2. given their total M, iid Poisson counts are Multinomial(M, uniform): adding
   n_s - M further uniform draws gives exactly Multinomial(n_s, uniform);
3. where M > n_s (probability about Phi(-3)) the stratum is redrawn directly.

Random stream of a block, in order: one word per cluster (clusters in layout order),
a double per straddling bucket (in cluster, then resample order), the added draws
(stratum by stratum, resample by resample), the redrawn (stratum, resample) pairs.
Counts are held cluster-major (a cluster's BLOCK counts side by side, 1 byte each).

**Products** (:class:`Family`, one per statistic): the family's columns times each
block's counts, tile by tile (:data:`TILE` clusters) and :data:`PANEL` columns per
product; columns that are nonzero on few clusters (a share-shift bin, the clipped
tokens) are multiplied by those clusters' gathered counts only.  Every shape and every
such choice depends on the family's own sums, so a statistic's resampled sums are the
same bits whatever other statistics share the draw.  Two ways of sharing work keep them:
the parts of every family are gathered in one pass over the counts (a copy), and the
dense columns of several families are multiplied in shared products
(:mod:`icsd_audit.stats.engine.fused`) only where this process's BLAS is checked to give
each column the bits of its family's own panels.  A tile of sums is read once per
work unit of SUPER blocks (then from cache), which matters once they outgrow the
caches.  Extra workers are forked processes on Linux (:mod:`icsd_audit.stats.engine.forked`:
the engine holds the GIL too often for threads to help), threads elsewhere; inside
:func:`unit_runner` the work units go to the runner given (Ray tasks on a cluster,
:mod:`icsd_audit.audit.ray_backend`). A unit's resamples are a function of the engine and
the unit's number alone, so whoever computes them, they are the same bits.

Pure numpy.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from icsd_audit.stats.engine.counts import BLOCK, TUPLE, Layout, block_counts, block_generator
from icsd_audit.stats.engine.forked import BlasThreads, ForkedBlocks, fork_available
from icsd_audit.stats.engine.fused import FusedDense

__all__ = ["BLOCK", "TUPLE", "TILE", "PANEL", "Layout", "Family", "family_sums", "resampled_sums",
           "batch_resampled_sums", "check_rng", "stream_seed", "unit_runner", "UnitRunner", "ThreadBuffers"]

#: clusters per matrix-product tile, and columns per product: fixed shapes, so that a
#: statistic's resampled sums are the same bits whatever else is computed beside it
TILE = 2048
PANEL = 6
#: blocks in a work unit: a tile of sums is read once for SUPER blocks (one (P x TILE) slice, then
#: from cache), not once per block: the sums outgrow the caches on large inputs
SUPER = 4
SPAN = BLOCK * SUPER


#: ``run(engine, units)``: each unit's ``engine.block(u)``, in the order of ``units``
UnitRunner = Callable[[Any, Sequence[int]], Sequence[np.ndarray]]
_RUNNER: contextvars.ContextVar[UnitRunner | None] = contextvars.ContextVar("icsd_unit_runner", default=None)


@contextlib.contextmanager
def unit_runner(run: UnitRunner) -> Iterator[None]:
    """Inside the block, :func:`family_sums` hands its work units to ``run`` (not to this process and its
    forked workers): ``run(engine, units)`` returns ``engine.block(u)`` for each unit in order, computed
    anywhere (the engine pickles; compute it with OpenBLAS on one thread, :class:`BlasThreads`). A runner's
    ``units_at_once`` attribute, when it has one, is how many units it is given per call at least."""
    token = _RUNNER.set(run)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def check_rng(rng: Any) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, (int, np.integer, np.random.SeedSequence, np.random.BitGenerator)):
        if isinstance(rng, (int, np.integer)) and rng < 0:
            raise ValueError(f"rng seed must be non-negative, got {rng}")
        return np.random.default_rng(rng)
    raise TypeError(f"rng must be a numpy Generator, a seed or None, got {type(rng).__name__}")


def stream_seed(rng: Any) -> np.random.SeedSequence:
    """The SeedSequence of a bootstrap's stream: from a seed (always the same), or drawn once from a Generator."""
    return np.random.SeedSequence(check_rng(rng).integers(0, 2**63, size=4).tolist())


#: relative costs per (resample, cluster) behind the choice of a family's sparse parts: a gathered
#: and converted row of counts, and one column of a product (measured on the dev box).  They are part
#: of the numbers: a column gathered is summed in another order than the same column multiplied
#: densely (the last bits of its resampled sums differ, 1e-13 relative), so changing them changes
#: the intervals' last bits, in every command alike (the choice reads the family's own sums only)
_GATHER_COST, _COLUMN_COST = 0.33, 0.077
#: fixed cost of a part (its calls), in clusters of gathering
_PART_OVERHEAD = 2048
#: rows per slice of the parts' gather (its index slices stay in cache)
_GATHER_SLICE = 65536


class _Part:
    """Columns of a family whose sums are nonzero on a few clusters only: those clusters' counts, gathered."""

    def __init__(self, ST: np.ndarray, cols: list[int], rows: np.ndarray, gstart: np.ndarray, gstop: np.ndarray):
        self.cols, self.rows = np.asarray(cols), rows
        self.ST = np.ascontiguousarray(ST[np.ix_(self.cols, rows)])  # (columns, rows)
        # group g owns rows gcut[g]:gcut[g + 1] (rows ascend, groups are contiguous in the layout)
        self.glo = np.searchsorted(rows, gstart, side="left")
        self.ghi = np.searchsorted(rows, gstop, side="left")


class Family:
    """One statistic's per-cluster sums on a layout: ST (K x clusters, layout order), strata grouped.

    Groups (e.g. training steps) are contiguous runs of strata; the resampled sums of a
    group add only its own clusters.  Products run tile by tile (:data:`TILE` clusters)
    and :data:`PANEL` columns at a time.  Columns that are nonzero on few clusters (a
    share-shift bin, the clipped tokens) form *parts*: columns with the same nonzero
    clusters, multiplied by those clusters' counts only.  Which columns go where depends
    on this family's sums alone, so a column's sums depend only on this family.
    """

    def __init__(self, ST: np.ndarray, strata_group: Sequence[int], n_groups: int, lay: Layout):
        ST = np.ascontiguousarray(ST, dtype=np.float64)
        if ST.ndim != 2 or ST.shape[1] != lay.n:
            raise ValueError(f"sums must have one column per cluster ({lay.n}), got shape {ST.shape}")
        sgroup = np.asarray(strata_group, dtype=np.int64)
        if len(sgroup) != lay.sizes.size or (np.diff(sgroup) < 0).any() or (sgroup < 0).any() or (sgroup >= n_groups).any():
            raise ValueError("strata must be sorted by group, with group codes in 0..n_groups-1")
        self.k, self.n_groups = ST.shape[0], int(n_groups)
        ends = lay.starts + lay.sizes
        self.gstart = np.zeros(self.n_groups, np.int64)
        self.gstop = np.zeros(self.n_groups, np.int64)
        for g in range(self.n_groups):
            sel = np.flatnonzero(sgroup == g)
            if sel.size:
                self.gstart[g], self.gstop[g] = lay.starts[sel[0]], ends[sel[-1]]
            elif g:
                self.gstart[g] = self.gstop[g] = self.gstop[g - 1]
        # many narrow groups: one segment sum per sub-tile instead of products per group
        self.narrow = self.n_groups > 8 and lay.n / self.n_groups < 256
        self.parts: list[_Part] = []
        dense = list(range(self.k))
        if not self.narrow:
            dense = self._split_sparse(ST, lay.n)
        self.dense = np.asarray(dense, dtype=np.int64)
        kd = len(dense)
        # (p0, p1, q0, q1): columns p0..p1 from the product of rows q0..q1. A last panel of PANEL - 1 columns is
        # multiplied as a full one (OpenBLAS: 5 rows cost about 1.4x what 6 do, and give those 5 the same bits):
        # one row up, over the previous panel's last row, or with a zero row under the family's own dense copy
        self.panels = [(p, min(kd, p + PANEL), p, min(kd, p + PANEL)) for p in range(0, kd, PANEL)]
        tail = not self.narrow and kd % PANEL == PANEL - 1
        pad = tail and kd < PANEL and kd < self.k  # (a family's own sums are never copied for this alone)
        if kd == self.k:
            self.ST = ST
        else:
            # row by row into fresh pages (np.take with out= buffers the whole copy: 4x as slow at 1.27M turns)
            self.ST = np.empty((kd + pad, ST.shape[1]))
            for q, c in enumerate(self.dense.tolist()):
                self.ST[q] = ST[c]
            self.ST[kd:] = 0.0
        if tail and kd > PANEL:
            self.panels[-1] = (kd - PANEL + 1, kd, kd - PANEL, kd)
        elif pad:
            self.panels[-1] = (0, kd, 0, kd + 1)
        self.sub = max(16, (1 << 16) // (SPAN * max(kd, 1)))

    def _split_sparse(self, ST: np.ndarray, n: int) -> list[int]:
        """Group the columns by their nonzero clusters; keep as parts those cheaper gathered."""
        by_support: dict[tuple[int, int], list[tuple[np.ndarray, list[int]]]] = {}
        for c in range(self.k):
            if np.count_nonzero(ST[c]) > n * _COLUMN_COST / _GATHER_COST:
                continue  # too dense for a part even alone (counted: no index array of a dense column)
            nz = np.flatnonzero(ST[c])
            bucket = by_support.setdefault((nz.size, hash(nz.tobytes())), [])
            for rows, cols in bucket:
                if np.array_equal(rows, nz):
                    cols.append(c)
                    break
            else:
                bucket.append((nz, [c]))
        in_parts: set[int] = set()
        for bucket in by_support.values():
            for rows, cols in bucket:
                w = len(cols)
                gathered = (rows.size + _PART_OVERHEAD) * _GATHER_COST + rows.size * _COLUMN_COST * w
                if rows.size and gathered < n * _COLUMN_COST * w:
                    self.parts.append(_Part(ST, cols, rows, self.gstart, self.gstop))
                    in_parts.update(cols)
                elif not rows.size:
                    in_parts.update(cols)  # all zero: sums stay 0
        self.parts.sort(key=lambda p: int(p.cols[0]))
        return [c for c in range(self.k) if c not in in_parts]

    @property
    def part_rows(self) -> np.ndarray:
        """Every part's clusters, part after part (their counts are gathered in this order)."""
        if not hasattr(self, "_part_rows"):
            self._part_rows = np.concatenate([p.rows for p in self.parts]) if self.parts else np.zeros(0, np.int64)
            self.part_off = np.concatenate([[0], np.cumsum([p.rows.size for p in self.parts])[:-1]]).astype(int).tolist()
        return self._part_rows

    @property
    def width(self) -> int:
        return self.n_groups * self.k

    @property
    def gathered(self) -> int:
        """Clusters the parts gather per block (their counts buffer)."""
        return int(self.part_rows.size)

    def add_tile(self, cf: np.ndarray, c0: int, c1: int, acc: np.ndarray) -> None:
        """acc (groups, SUPER, dense K, BLOCK) += the dense columns' sums over clusters c0..c1, weighted by
        their counts ``cf`` (SUPER, c1 - c0, BLOCK): one (P x w) @ (w x BLOCK) product per block."""
        if self.narrow:
            for s0 in range(c0, c1, self.sub):
                s1 = min(c1, s0 + self.sub)
                lo = int(np.searchsorted(self.gstop, s0, side="right"))
                hi = int(np.searchsorted(self.gstart, s1, side="left"))
                cuts = np.clip(self.gstart[lo:hi], s0, s1) - s0
                prod = self.ST[None, :, s0:s1, None] * cf[:, None, s0 - c0 : s1 - c0, :]  # (SUPER, K, w, BLOCK)
                acc[lo:hi] += np.add.reduceat(prod, cuts, axis=2).transpose(2, 0, 1, 3)
            return
        g_lo = int(np.searchsorted(self.gstop, c0, side="right"))
        g_hi = int(np.searchsorted(self.gstart, c1, side="left"))
        for g in range(g_lo, g_hi):
            a, z = max(c0, int(self.gstart[g])), min(c1, int(self.gstop[g]))
            if z <= a:
                continue
            for p0, p1, q0, q1 in self.panels:
                prod = np.matmul(self.ST[q0:q1, a:z], cf[:, a - c0 : z - c0])
                acc[g, :, p0:p1] += prod if q0 == p0 and q1 == p1 else prod[:, p0 - q0 : p1 - q0]

    def add_parts(self, got: np.ndarray, cf: np.ndarray, acc_of: Any) -> None:
        """Every part's sums from its clusters' counts ``got`` (SUPER, :attr:`part_rows`, BLOCK; gathered by
        the engine), converted tile by tile and multiplied part by part (and group by group) where they meet a tile."""
        if not self.parts:
            return
        for t0 in range(0, got.shape[1], TILE):
            t1 = min(got.shape[1], t0 + TILE)
            x = cf[:, : t1 - t0]
            np.copyto(x, got[:, t0:t1], casting="unsafe")
            for part, off in zip(self.parts, self.part_off):
                a0, z0 = max(t0, off), min(t1, off + part.rows.size)  # this part's rows in the tile
                if z0 <= a0:
                    continue
                acc = acc_of(part)
                for g in range(self.n_groups):
                    a, z = max(a0, off + int(part.glo[g])), min(z0, off + int(part.ghi[g]))
                    if z <= a:
                        continue
                    for p0 in range(0, part.cols.size, PANEL):
                        p1 = min(part.cols.size, p0 + PANEL)
                        acc[g, :, p0:p1] += np.matmul(part.ST[p0:p1, a - off : z - off], x[:, a - t0 : z - t0])


class _Gather:
    """Every family's part rows, family after family (each family's :attr:`Family.part_rows` in one stretch,
    ``span[i]`` for the i-th family), gathered in one pass per block: the clusters read once, in ascending
    order, whichever families need them (a copy: the same bytes as a gather of each family's own)."""

    def __init__(self, families: Sequence[Family]):
        mine = [i for i, f in enumerate(families) if f.parts]  # (a family with products of its own has none)
        rows = [families[i].part_rows for i in mine]
        ends = np.cumsum([r.size for r in rows]).astype(int).tolist()
        self.span = {i: (e - r.size, e) for i, r, e in zip(mine, rows, ends)}
        self.size = ends[-1] if ends else 0
        both = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        self.to = np.argsort(both, kind="stable")  # the gather reads the counts in ascending order
        self.src = both[self.to]

    def __call__(self, counts: np.ndarray, gbuf: np.ndarray) -> np.ndarray:
        got = gbuf[:, : self.size]
        for j in range(counts.shape[0]):
            _gather_rows(counts[j], self.src, self.to, got[j])
        return got


def _gather_rows(src: np.ndarray, rows: np.ndarray, to: np.ndarray, out: np.ndarray) -> None:
    """``out[to] = src[rows]`` for rows of BLOCK bytes, ``rows`` ascending, a slice at a time.

    One pass over ``src`` in order, written in as many sequential streams as there are parts,
    where a gather part after part would read ``src`` once per part (the share shift's 11 bins
    cover every turn, and the clipped tokens' and the landscape's parts meet the same clusters):
    about 2.5x as fast as ``np.take``, the same bytes.
    """
    row = np.dtype((np.void, src.shape[1]))
    s, o = src.view(row).reshape(-1), out.view(row).reshape(-1)
    for c0 in range(0, rows.size, _GATHER_SLICE):
        o[to[c0 : c0 + _GATHER_SLICE]] = s[rows[c0 : c0 + _GATHER_SLICE]]


class ThreadBuffers:
    """Per-thread scratch buffers (``self._local``, a ``threading.local``) that are never pickled: a unit
    runner's worker process gets the object without them and makes its own."""

    _local: threading.local

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_local")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()


class _Engine(ThreadBuffers):
    """Per-block resampled sums of several families on one layout (one draw of counts for all)."""

    def __init__(self, lay: Layout, families: Sequence[Family], seed_seq: np.random.SeedSequence):
        self.lay, self.families, self.seed_seq = lay, list(families), seed_seq
        self.width = sum(f.width for f in self.families)
        self._local = threading.local()
        fused = FusedDense(self.families, lay.n, TILE)
        self.fused = fused if fused.worth_it() else None
        self.gather = _Gather(self.families)

    def prepare(self) -> None:
        """Check this process's BLAS for the fused products (and build their rows) now, before workers are forked
        to share them (:meth:`block` does it in a process that has not, e.g. a Ray worker)."""
        if self.fused is not None:
            self.fused.verified(self.families, SUPER, BLOCK)

    def _buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This thread's counts (one slab per block), float64 tile and gathered counts, reused unit after unit.

        Fresh arrays of megabytes would each cost page faults (and NumPy's huge-page
        advice on arrays of 4 MB or more can stall the fault on compaction).
        """
        buf = getattr(self._local, "buf", None)
        if buf is None:
            gathered = self.gather.size
            buf = self._local.buf = (np.empty((SUPER, self.lay.n, BLOCK), dtype=np.int8),
                                     np.empty((SUPER, min(max(self.lay.n, gathered), TILE), BLOCK), dtype=np.float64),
                                     np.empty((SUPER, gathered, BLOCK), dtype=np.int8))
        return buf

    def block(self, u: int) -> np.ndarray:
        """(SPAN, total width): every family's (groups x K) sums over the resamples of work unit u (SUPER blocks)."""
        counts, cbuf, gbuf = self._buffers()
        for j in range(SUPER):
            block_counts(block_generator(self.seed_seq, u * SUPER + j), counts[j], self.lay)
        # a family with products of its own (:class:`icsd_audit.stats.engine.segments.SegmentedFamily`) takes the counts
        accs = [None if getattr(f, "own_products", False) else np.zeros((f.n_groups, SUPER, len(f.dense), BLOCK))
                for f in self.families]
        # several families' dense columns in shared products, where this process's BLAS gives them their own bits
        fused = self.fused if self.fused is not None and self.fused.verified(self.families, SUPER, BLOCK) else None
        own = [f.panels and (fused is None or i not in fused.members) for i, f in enumerate(self.families)]
        facc = np.zeros((SUPER, fused.width, BLOCK)) if fused is not None else None
        if any(f.panels for f in self.families):
            for c0 in range(0, self.lay.n, TILE):
                c1 = min(self.lay.n, c0 + TILE)
                cf = cbuf[:, : c1 - c0]
                np.copyto(cf, counts[:, c0:c1], casting="unsafe")
                if fused is not None:
                    fused.add_tile(cf, c0, c1, facc)
                for f, acc, mine in zip(self.families, accs, own):
                    if mine:
                        f.add_tile(cf, c0, c1, acc)
        if fused is not None:
            fused.scatter(facc, accs)
        got = self.gather(counts, gbuf)  # every family's parts' counts, in one pass
        out = []
        for i, (f, acc) in enumerate(zip(self.families, accs)):
            if acc is None:
                out.append(f.unit_sums(counts))
                continue
            T = np.zeros((f.n_groups, SUPER, f.k, BLOCK))
            T[:, :, f.dense] = acc
            part_acc: dict[int, np.ndarray] = {}

            def acc_of(part: _Part, part_acc: dict = part_acc, f: Family = f) -> np.ndarray:
                return part_acc.setdefault(id(part), np.zeros((f.n_groups, SUPER, part.cols.size, BLOCK)))

            if f.parts:
                a, z = self.gather.span[i]
                f.add_parts(got[:, a:z], cbuf, acc_of)
            for part in f.parts:
                if id(part) in part_acc:
                    T[:, :, part.cols] = part_acc[id(part)]
            out.append(T.transpose(1, 3, 0, 2).reshape(SPAN, -1))  # resample j * BLOCK + r
        return np.concatenate(out, axis=1)

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        out, j = [], 0
        for f in self.families:
            out.append(flat[:, j : j + f.width].reshape(flat.shape[0], f.n_groups, f.k))
            j += f.width
        return out


def family_sums(
    lay: Layout,
    families: Sequence[Family],
    n_resamples: int,
    *,
    seed: np.random.SeedSequence,
    chunk_size: int | None = None,
    workers: int = 1,
) -> Iterator[tuple[int, int, list[np.ndarray]]]:
    """Resampled group sums of every family on ``lay``, chunk by chunk: ``(r0, r1, [T per family])``.

    T has shape (r1 - r0, groups, K) for resamples r0..r1-1.  One draw of counts per
    block serves every family; neither ``chunk_size`` (resamples per yielded chunk) nor
    ``workers`` (forked processes on Linux, threads elsewhere) changes any value.
    Working memory per worker: SPAN bytes per cluster and per gathered cluster of the sparse
    parts, and a 1 MB tile.
    """
    eng = _Engine(lay, families, seed)
    n_units = -(-n_resamples // SPAN)  # whole units: the first R resamples never depend on how many are drawn
    per_chunk = max(1, (chunk_size if chunk_size is not None else 1024) // SPAN)
    runner = _RUNNER.get()
    if runner is not None:  # as many units per call as the runner computes at once (no value depends on it)
        per_chunk = max(per_chunk, int(getattr(runner, "units_at_once", 1)))
    chunks = [range(b0, min(n_units, b0 + per_chunk)) for b0 in range(0, n_units, per_chunk)]
    workers = max(1, min(int(workers), n_units))
    with contextlib.ExitStack() as stack:
        stack.enter_context(BlasThreads(1))
        if runner is None:  # before any fork: the workers share the fused rows (a runner's processes build their own)
            eng.prepare()
        if runner is not None:
            compute = lambda units: list(runner(eng, units))  # noqa: E731
        elif workers > 1 and fork_available(n_units):  # processes: the block engine holds the GIL too often for threads
            forked = stack.enter_context(ForkedBlocks(eng.block, n_units, workers, shape=(SPAN, eng.width)))
            compute = forked.take
        elif workers > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = stack.enter_context(ThreadPoolExecutor(max_workers=workers))
            compute = lambda units: list(pool.map(eng.block, units))  # noqa: E731
        else:
            compute = lambda units: [eng.block(u) for u in units]  # noqa: E731
        for units in chunks:
            flat = np.concatenate(compute(units), axis=0)
            r0 = units[0] * SPAN
            r1 = min(n_resamples, r0 + flat.shape[0])
            yield r0, r1, [T[: r1 - r0] for T in eng.split(flat)]


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
    (r1 - r0, n_groups, K): the column sums over the resampled clusters of each group,
    for resamples r0..r1-1 (:func:`family_sums` for one family).
    """
    S = np.ascontiguousarray(sums, dtype=np.float64)
    sizes = np.asarray(strata_sizes, dtype=np.int64)
    if sizes.sum() != S.shape[0] or (sizes <= 0).any():
        raise ValueError("strata sizes must be positive and sum to the number of clusters")
    lay = Layout(sizes)
    fam = Family(S.T, strata_group, n_groups, lay)
    for r0, r1, (T,) in family_sums(lay, [fam], n_resamples, seed=stream_seed(rng), chunk_size=chunk_size,
                                    workers=workers):
        yield r0, r1, T


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
