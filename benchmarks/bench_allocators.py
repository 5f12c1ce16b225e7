"""Allocator throughput on synthetic GiGPO-like batches (issue 2 target: >= 5M tokens/s, icsd, float64, CPU).

Usage: python benchmarks/bench_allocators.py [--tokens 2000000] [--batches 4] [--threads 2] [--repeats 5]
Prints the median wall time and tokens/s per allocator.  Run on an idle machine:
the 2 cores are shared, and a concurrent job halves the figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from icsd_audit.alloc.variants import allocate
from icsd_audit.dumps.synth import synth_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--allocators", default="sdar,icsd,fisher,gaussian,permuted")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cols = synth_tokens(args.tokens, seed=0, n_batches=args.batches)
    t = {k: torch.from_numpy(cols[k]) for k in ("batch_id", "traj_id", "turn_id", "advantage", "ratio", "delta", "valid")}
    t = {k: (v.double() if v.is_floating_point() else v) for k, v in t.items()}
    n = t["advantage"].numel()
    print(f"tokens={n:,} batches={args.batches} threads={torch.get_num_threads()} dtype=float64")
    for name in args.allocators.split(","):
        allocate(**t, allocator=name)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            allocate(**t, allocator=name)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"{name:>15}: {med * 1000:8.1f} ms  {n / med / 1e6:6.2f} M tokens/s")


if __name__ == "__main__":
    main()
