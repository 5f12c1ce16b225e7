"""Where the report's bootstrap time goes beyond ``icsd audit tcm``'s, statistic by statistic, and what fusing
their products gives (the engine fuses them where its BLAS check passes: ``icsd_audit.stats.engine.fused``).

Usage: python benchmarks/bench_report_products.py DUMPS [--units 4] [--repeats 3]
       python benchmarks/bench_report_products.py --widths

Builds the per-turn matrices the report bootstraps (``audit_dumps`` up to the bootstrap) and times, on one
thread, ``--units`` work units of the resample stream (64 resamples each; 10,000 resamples are 157 units):

* the draw of counts alone (a statistic with no column), which every command pays once;
* each statistic alone (its products = its time less the draw), and all of them on one draw, as the report
  runs them;
* the engine's fused products, by hand: every statistic's dense columns (the distinct ones, a
  column two statistics share once) in one fused product per tile (at most 30 columns per call), against the
  statistics' own products on the same counts, with a bit-for-bit comparison of the sums;
* ``--widths``: whether the BLAS gives a column the same bits in a product of P columns (P = 1..40, random data,
  2,048 turns x 16 resamples) as in a product of 6, the statistics' own panel width;
* ``--panels N``: what one panel of P = 1..8 rows costs per work unit over N turns (random data, the engine's
  tiles: (P x 2,048) @ (4 x 2,048 x 16) per tile), the counts' conversion excluded.

CPU seconds (``time.process_time``), the minimum over ``--repeats``: the machine is shared, and the minimum is the
figure least moved by other jobs.  Prints the load average.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def capture_families(dumps: Path) -> list[Any]:
    """The report's bootstrap requests (RatioFamily list) for ``dumps``, without running the bootstrap."""
    import icsd_audit.stats.bootstrap as boot
    from icsd_audit.report.build import audit_dumps

    got: list[Any] = []

    class Captured(Exception):
        pass

    def capture(fams: Any, **_: Any) -> Any:
        got.extend(fams)
        raise Captured

    real, boot.bootstrap_ratio_families = boot.bootstrap_ratio_families, capture
    try:
        audit_dumps([str(dumps)], workers=1)
    except Captured:
        pass
    finally:
        boot.bootstrap_ratio_families = real
    return got


def cpu(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dumps", type=Path, nargs="?")
    ap.add_argument("--widths", action="store_true", help="only the BLAS width check (no dumps needed)")
    ap.add_argument("--panels", type=int, default=0, metavar="N", help="only the cost of a panel of P rows over N turns")
    ap.add_argument("--units", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.widths:
        return widths()
    if args.panels:
        return panels(args.panels, args.repeats)
    if args.dumps is None:
        ap.error("DUMPS is needed (or --widths)")
    from icsd_audit.stats.engine import resample as R
    from icsd_audit.stats.engine.forked import BlasThreads
    from icsd_audit.stats.bootstrap import _prepare  # (a benchmark may look inside)

    fams = capture_families(args.dumps)
    stem = {"tcm": "tcm", "q": "quadrants", "s": "shift", "clip": "clip", "signs": "signs", "strata": "strata"}
    names = [stem.get(str(f.names[0]).split(":")[0], str(f.names[0])) if f.names else "landscape" for f in fams]
    preps = [_prepare(f) for f in fams]
    lay = R.Layout(preps[0].sizes)
    F = [R.Family(p.ST, p.sgroup, len(p.gvalues), lay) for p in preps]
    seed = R.stream_seed(0)
    n_res = args.units * R.SPAN

    def run(families: list[Any]) -> Callable[[], None]:
        return lambda: [None for _ in R.family_sums(lay, families, n_res, seed=seed, chunk_size=n_res)]

    print(f"{lay.n:,} action turns in {lay.sizes.size} strata; {args.units} work units of {R.SPAN} resamples; "
          f"CPU s per unit, min of {args.repeats}")
    with BlasThreads(1):
        draw = cpu(run([R.Family(np.zeros((0, lay.n)), preps[0].sgroup, 1, lay)]), args.repeats) / args.units
        print(f"  draw of counts: {draw:.4f}")
        own = 0.0
        for name, f in zip(names, F):
            t = cpu(run([f]), args.repeats) / args.units - draw
            own += t
            print(f"  {name:<10} columns {f.k:>2} (dense {len(f.dense):>2}, in sparse parts {f.k - len(f.dense):>2}, "
                  f"gathered rows {f.gathered:>9,}): products {t:.4f}")
        both = cpu(run(F), args.repeats) / args.units
        print(f"  all on one draw: {both:.4f} (products {both - draw:.4f}; each alone summed: {own:.4f})")
        fused_experiment(R, lay, F, seed, args)
    print(f"load average {os.getloadavg()[0]:.2f}")


def fused_experiment(R: Any, lay: Any, F: list[Any], seed: Any, args: argparse.Namespace) -> None:
    """The families' dense products tile by tile, own (PANEL columns per call) against fused (distinct columns,
    up to 30 per call), on the same counts: CPU per unit and whether the sums are the same bits."""
    dense = [f for f in F if f.panels and not f.narrow and f.n_groups == 1]
    distinct: dict[bytes, int] = {}
    rows_of = []
    cols = []
    for f in dense:
        idx = []
        for r in range(len(f.dense)):
            key = f.ST[r].tobytes()
            if key not in distinct:
                distinct[key] = len(cols)
                cols.append(f.ST[r])
            idx.append(distinct[key])
        rows_of.append(np.asarray(idx))
    width = len(cols)
    calls = [(q, min(width, q + 30)) for q in range(0, width, 30)]
    counts = np.empty((R.SUPER, lay.n, R.BLOCK), dtype=np.int8)
    cf = np.empty((R.SUPER, R.TILE, R.BLOCK))
    A = np.empty((width, R.TILE))

    def tiles(fused: bool) -> list[np.ndarray]:
        accs = [np.zeros((1, R.SUPER, len(f.dense), R.BLOCK)) for f in dense]
        for c0 in range(0, lay.n, R.TILE):
            c1 = min(lay.n, c0 + R.TILE)
            x = cf[:, : c1 - c0]
            np.copyto(x, counts[:, c0:c1], casting="unsafe")
            if not fused:
                for f, acc in zip(dense, accs):
                    f.add_tile(x, c0, c1, acc)
                continue
            for j, col in enumerate(cols):
                A[j, : c1 - c0] = col[c0:c1]
            prod = np.concatenate([np.matmul(A[q0:q1, : c1 - c0], x) for q0, q1 in calls], axis=1)
            for acc, idx in zip(accs, rows_of):
                acc[0] += prod[:, idx]
        return accs

    same = True
    t_own = t_fused = 0.0
    for u in range(args.units):
        for j in range(R.SUPER):
            R.block_counts(R.block_generator(seed, u * R.SUPER + j), counts[j], lay)
        t_own += cpu(lambda: tiles(False), args.repeats)
        t_fused += cpu(lambda: tiles(True), args.repeats)
        same &= all(np.array_equal(a, b) for a, b in zip(tiles(False), tiles(True)))
    n_dense = sum(len(f.dense) for f in dense)
    print(f"  dense products of {len(dense)} statistics ({n_dense} columns, {width} distinct), conversion included: "
          f"own {t_own / args.units:.4f}, fused {t_fused / args.units:.4f}; same bits: {same}")


def widths() -> None:
    """Columns 0..5 of a (P x 2048) @ (4 x 2048 x 16) product against the same columns in a product of 6."""
    from icsd_audit.stats.engine.forked import BlasThreads

    rng = np.random.default_rng(1)
    X = rng.standard_normal((40, 2048)) * np.exp(5 * rng.standard_normal((40, 1)))
    cf = rng.integers(0, 5, size=(4, 2048, 16)).astype(np.float64)
    with BlasThreads(1):
        ref = np.matmul(X[:6], cf)
        differ = [P for P in range(1, 41) if not np.array_equal(np.matmul(X[:P], cf)[:, : min(P, 6)], ref[:, : min(P, 6)])]
    print(f"products of P columns whose first columns differ in bits from a product of 6: P = {differ or 'none'}")


def panels(n: int, repeats: int) -> None:
    """CPU per work unit of one panel of P rows multiplied over ``n`` turns, tile by tile as the engine does."""
    from icsd_audit.stats.engine import resample as R
    from icsd_audit.stats.engine.forked import BlasThreads

    rng = np.random.default_rng(2)
    S = rng.random((8, n))
    # one tile of converted counts, reused (in the engine each tile's are fresh, and in cache just the same)
    cf = rng.poisson(1.0, size=(R.SUPER, R.TILE, R.BLOCK)).astype(np.float64)

    def run(P: int) -> None:
        for c0 in range(0, n, R.TILE):
            c1 = min(n, c0 + R.TILE)
            np.matmul(S[:P, c0:c1], cf[:, : c1 - c0])

    with BlasThreads(1):
        costs = {P: cpu(lambda: run(P), repeats) * 1e3 for P in range(1, 9)}
    print(f"one panel of P rows over {n:,} turns, ms per work unit ({R.SPAN} resamples), min of {repeats}: "
          + ", ".join(f"P={P} {c:.1f}" for P, c in costs.items()) + f"; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
