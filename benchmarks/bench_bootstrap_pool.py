"""Benchmark: the bootstrap's block engine on icsd's own fork pool vs concurrent.futures' process pool.

The same engine (:mod:`icsd_audit.stats.engine.resample`), the same work units, three ways:
one process; ``workers`` processes of :class:`icsd_audit.stats.engine.forked.ForkedBlocks`
(the parent computes too, children fork once and share a pipe queue); and
``concurrent.futures.ProcessPoolExecutor`` with the fork context (``workers`` children,
the engine inherited through the initializer, units handed out by ``map``). Prints the
wall time of each (best of ``--repeats``) and checks that all three give the same bits.

    python benchmarks/bench_bootstrap_pool.py --clusters 48000 --resamples 10000 --workers 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from icsd_audit.stats.engine.resample import SPAN, Family, Layout, _Engine
from icsd_audit.stats.engine.forked import ForkedBlocks

_ENGINE: _Engine | None = None


def _adopt(engine: _Engine) -> None:
    global _ENGINE
    _ENGINE = engine


def _block(u: int) -> np.ndarray:
    return _ENGINE.block(u)  # type: ignore[union-attr]


def run_serial(eng: _Engine, n_units: int) -> np.ndarray:
    return np.concatenate([eng.block(u) for u in range(n_units)])


def run_forked(eng: _Engine, n_units: int, workers: int) -> np.ndarray:
    with ForkedBlocks(eng.block, n_units, workers, shape=(SPAN, eng.width)) as fb:
        return np.concatenate(fb.take(list(range(n_units))))


def run_executor(eng: _Engine, n_units: int, workers: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process (Python >= 3.12)
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_adopt, initargs=(eng,)) as pool:
            return np.concatenate(list(pool.map(_block, range(n_units), chunksize=1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=48_000)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--columns", type=int, default=8)
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sizes = np.full(args.batches, args.clusters // args.batches)
    lay = Layout(sizes)
    ST = rng.gamma(1.0, 1.0, (args.columns, lay.n))
    fam = Family(ST, np.zeros(sizes.size, int), 1, lay)
    eng = _Engine(lay, [fam], np.random.SeedSequence(0))
    n_units = -(-args.resamples // SPAN)
    print(f"clusters={lay.n} batches={args.batches} columns={args.columns} resamples={n_units * SPAN} "
          f"workers={args.workers} cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}")
    ref = run_serial(eng, n_units)
    for name, fn in (("serial", lambda: run_serial(eng, n_units)),
                     ("icsd fork pool", lambda: run_forked(eng, n_units, args.workers)),
                     ("ProcessPoolExecutor(fork)", lambda: run_executor(eng, n_units, args.workers))):
        best, same = float("inf"), True
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t)
            same &= out.tobytes() == ref.tobytes()
        print(f"{name:28s} best of {args.repeats}: {best:7.3f} s   same bits as serial: {same}")


if __name__ == "__main__":
    main()
