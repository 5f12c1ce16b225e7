"""Several families' dense columns in one product per tile, used only where it gives each column its own bits.

Each :class:`~icsd_audit.stats.engine.resample.Family` multiplies its dense columns by a
tile's counts in panels of its own (so that a statistic's sums never depend on what else
is computed, SPEC 7).  A report bootstraps six statistics on one layout: 38 dense columns
in 7 panels of 6 rows (a 4- or 5-row panel costs what a 6-row one does), 30 of them
distinct (the two weightings' totals serve the quadrants and the clipping alike).  One
product of the distinct columns per tile does the same multiply-adds once, in fewer and
taller calls.

OpenBLAS computes each row of a product the same way whatever rows sit beside it (the
k-loop of its micro-kernel runs over the tile's clusters in order for every row), so a
column's sums are the same bits in a panel of 6 rows and in one of 30.  That is a
property of the BLAS, not a promise: :meth:`FusedDense.verified` checks it, in each
process, on random sums of the very shapes both ways would multiply (every family's own
panels, the tail panels included, against the fused ones, at the full and the last
tile's width), and the engine fuses only where every column comes out bit for bit.
Elsewhere each family keeps its own panels.  Either way a statistic's resampled sums are
the bits of its own panels.

Pure numpy.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["FusedDense", "MAX_ROWS"]

#: rows per fused product at most: on the dev box (OpenBLAS 0.3.31, Haswell kernels) one product of the report's 30
#: distinct rows over a (4 x 2,048 x 16) tile did the work of its 7 own panels in 73-79 % of their time (20M and 50M
#: tokens), two of 15 rows in 82-90 %; the BLAS gave every row the same bits at any height from 2 to 30
MAX_ROWS = 30


def _eligible(f: Any) -> bool:
    """A family with dense panels, one group, no own products: its tile products are plain (rows x tile) ones.
    A panel of one row is a matrix-vector product in the BLAS (another summation): such a family keeps its own."""
    return bool(getattr(f, "panels", None)) and not getattr(f, "own_products", False) and not f.narrow \
        and f.n_groups == 1 and all(q1 - q0 >= 2 for _, _, q0, q1 in f.panels)


class FusedDense:
    """The distinct dense rows of the eligible families, multiplied together tile by tile.

    ``members``: positions (in ``families``) of the families fused; ``rows_of[i]``: for
    member i, the fused row of each of its dense columns.  Once this process's BLAS is
    verified, the distinct rows are copied once into one (rows x clusters) matrix
    (:attr:`rows`: 8 bytes per row and cluster, 305 MB for the report's 30 rows at 50M
    tokens), and each tile's products read a view of it: copying the rows into a tile
    buffer, tile after tile and unit after unit, took about 8 % of a work unit there (two
    workers side by side: 0.335 s -> 0.307 s a unit).  The matrix is built where the
    verdict is given (the engine's process: its forked workers share it) and never
    pickled: a Ray worker checks its own BLAS and builds its own.
    """

    def __init__(self, families: Sequence[Any], n: int, tile: int):
        self.n, self.tile = int(n), int(tile)
        self.members: list[int] = []
        self.rows_of: list[np.ndarray] = []
        self.src: list[tuple[int, int]] = []  # fused row -> (family, row of its ST)
        src = self.src
        seen: dict[tuple[int, bytes], list[int]] = {}
        for i, f in enumerate(families):
            if not _eligible(f):
                continue
            idx = []
            for p in range(len(f.dense)):
                row = f.ST[p]
                key = (row.size, row[:: max(1, row.size // 64)].tobytes())  # candidates; equality decides
                hit = next((q for q in seen.get(key, []) if np.array_equal(families[src[q][0]].ST[src[q][1]], row)),
                           None)
                if hit is None:
                    hit = len(src)
                    src.append((i, p))
                    seen.setdefault(key, []).append(hit)
                idx.append(hit)
            self.members.append(i)
            self.rows_of.append(np.asarray(idx, dtype=np.int64))
        self.width = len(src)
        n_panels = -(-self.width // MAX_ROWS) if self.width else 0
        step = -(-self.width // n_panels) if n_panels else 0
        self.panels = [(q, min(self.width, q + step)) for q in range(0, self.width, step)] if step else []
        self._verdict: bool | None = None
        self.rows: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_verdict"] = None  # a process elsewhere (a Ray worker) checks its own BLAS
        state["rows"] = None  # (and builds its own rows, from the families it receives)
        return state

    def worth_it(self) -> bool:
        """Two or more families share the products (one family alone keeps its own panels)."""
        return len(self.members) >= 2

    def verified(self, families: Sequence[Any], super_: int, block: int) -> bool:
        """Whether this BLAS gives every fused column the bits of its family's own panels (checked once per process).

        Random sums and counts of the shapes of a real tile (and of the last, shorter one):
        each member's own panels, exactly as :meth:`Family.add_tile` runs them, against the
        fused products.  The BLAS's kernels do not branch on the values, so shapes decide.
        """
        if self._verdict is None:
            self._verdict = self._check(families, super_, block)
            if self._verdict:
                self.rows = np.empty((self.width, self.n))
                for q, (i, p) in enumerate(self.src):
                    self.rows[q] = families[i].ST[p]
        return self._verdict

    def _check(self, families: Sequence[Any], super_: int, block: int) -> bool:
        rng = np.random.default_rng(12345)
        widths = {min(self.n, self.tile)}
        if self.n % self.tile:
            widths.add(self.n % self.tile)
        for w in sorted(widths):
            # rows as the products read them, views of longer rows (the fused rows' and a family's sums'), here
            # with an odd row stride and an offset start
            X = np.zeros((self.width, w + 3))[:, 1 : w + 1]
            X[:] = rng.standard_normal((self.width, w)) * np.exp(4 * rng.standard_normal((self.width, 1)))
            cf = rng.integers(0, 6, size=(super_, w, block)).astype(np.float64)
            fused = np.empty((super_, self.width, block))
            for q0, q1 in self.panels:
                fused[:, q0:q1] = np.matmul(X[q0:q1], cf)
            for i, rows in zip(self.members, self.rows_of):
                f = families[i]
                own_st = np.zeros((f.ST.shape[0], w + 3))[:, 1 : w + 1]
                own_st[: rows.size] = X[rows]
                for p0, p1, q0, q1 in f.panels:
                    prod = np.matmul(own_st[q0:q1], cf)
                    if not np.array_equal(prod[:, p0 - q0 : p1 - q0], fused[:, rows[p0:p1]]):
                        return False
        return True

    def add_tile(self, cf: np.ndarray, c0: int, c1: int, acc: np.ndarray) -> None:
        """acc (SUPER, width, BLOCK) += the fused rows' products with the tile's counts ``cf`` (clusters c0..c1)
        (once :meth:`verified`: the BLAS packs the rows from a view, as it packs them from a copy)."""
        assert self.rows is not None
        for q0, q1 in self.panels:
            acc[:, q0:q1] += np.matmul(self.rows[q0:q1, c0:c1], cf)

    def scatter(self, acc: np.ndarray, accs: list[Any]) -> None:
        """Each member's (1, SUPER, dense, BLOCK) sums from the fused ones."""
        for i, rows in zip(self.members, self.rows_of):
            accs[i][0] = acc[:, rows]
