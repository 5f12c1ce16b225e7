"""Benchmark: what moving every resample's partial sums onto batch workers would cost, with today's stream.

SPEC 7's stream draws, per block of 16 resamples, one random word per turn in layout order across every batch
(:mod:`icsd_audit.stats.engine.counts`), so a batch's counts in a block depend on the draws of the batches before it. A
batch worker that keeps the stream must draw the whole block's counts (every cluster) and multiply only its own
clusters. This prints, per cluster and resample (CPU time of this process: the box is shared):

- the cost of drawing the counts (``block_counts``), the part every batch worker would repeat in full;
- the cost of the products for a family of K columns (the block engine's work minus the draw);

and the speed-up that split gives on W workers, (draw + products) / (draw + products / W), next to the
speed-up of splitting the work units (blocks of resamples) instead, which keeps the stream and repeats nothing
(each block has its own generator): measured here with icsd's fork pool on ``--workers`` processes.

    python benchmarks/bench_stream_split.py --clusters 48000 --batches 20 --columns 6 24 --resamples 4096
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import numpy as np

from icsd_audit.stats.engine.counts import BLOCK, block_counts, block_generator
from icsd_audit.stats.engine.forked import ForkedBlocks
from icsd_audit.stats.engine.resample import SPAN, SUPER, Family, Layout, _Engine


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def _best(fn, repeats: int) -> tuple[float, float]:
    """(best wall, CPU of that run) over ``repeats`` calls."""
    out = (float("inf"), 0.0)
    for _ in range(repeats):
        c, t = _cpu(), time.perf_counter()
        fn()
        w = time.perf_counter() - t
        if w < out[0]:
            out = (w, _cpu() - c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=48_000)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--columns", type=int, nargs="+", default=[6, 24])
    ap.add_argument("--resamples", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sizes = np.full(args.batches, args.clusters // args.batches)
    lay = Layout(sizes)
    n_units = -(-args.resamples // SPAN)
    blocks = n_units * SUPER
    cells = lay.n * blocks * BLOCK  # (cluster, resample) pairs
    print(f"clusters={lay.n} batches={args.batches} resamples={blocks * BLOCK} cpus={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.1f}")
    seed = np.random.SeedSequence(0)
    counts = np.empty((lay.n, BLOCK), dtype=np.int8)

    def draw() -> None:
        for b in range(blocks):
            block_counts(block_generator(seed, b), counts, lay)

    n_gen = 20_000
    w_gen, _ = _best(lambda: [block_generator(seed, b) for b in range(n_gen)], args.repeats)
    print(f"one block generator (SeedSequence + SFC64): {w_gen / n_gen * 1e6:.2f} us (a per-batch stream needs one "
          f"per batch and block: {args.batches} x {blocks} here)")
    w_draw, c_draw = _best(draw, args.repeats)
    g = c_draw / cells * 1e9
    print(f"draw (block_counts, every cluster): {w_draw:.3f} s wall, {c_draw:.3f} s CPU = {g:.2f} ns per "
          "cluster-resample")
    for k in args.columns:
        fam = Family(rng.gamma(1.0, 1.0, (k, lay.n)), np.zeros(sizes.size, int), 1, lay)
        eng = _Engine(lay, [fam], seed)
        w_all, c_all = _best(lambda: [eng.block(u) for u in range(n_units)], args.repeats)
        p = max(c_all - c_draw, 0.0) / cells * 1e9
        print(f"K={k:3d}: draw + products {w_all:.3f} s wall, {c_all:.3f} s CPU; products {p:.2f} ns per "
              f"cluster-resample ({p / k:.3f} ns per column); draw share {g / (g + p):.0%}")
        for wk in (2, 4, 8, 16, 64):
            print(f"        W={wk:3d}: batch split (every worker draws every cluster) x{(g + p) / (g + p / wk):.2f};"
                  f" block split x{wk} at most")
        if args.workers > 1:
            ref = np.concatenate([eng.block(u) for u in range(n_units)])

            def forked() -> None:
                with ForkedBlocks(eng.block, n_units, args.workers, shape=(SPAN, eng.width)) as fb:
                    forked.out = np.concatenate(fb.take(list(range(n_units))))  # type: ignore[attr-defined]

            w_f, c_f = _best(forked, args.repeats)
            same = forked.out.tobytes() == ref.tobytes()  # type: ignore[attr-defined]
            print(f"        block split measured, fork pool of {args.workers}: {w_f:.3f} s wall, {c_f:.3f} s CPU "
                  f"(x{w_all / w_f:.2f} on wall), same bits: {same}")
        print(f"        per-turn sums a block-split worker needs: {k * lay.n * 8 / 2**20:.1f} MiB "
              f"({k} x {lay.n} float64)")


if __name__ == "__main__":
    main()
