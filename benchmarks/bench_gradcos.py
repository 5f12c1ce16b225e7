"""``run_gradcos`` end to end: 16 batches x 1,000 permutations on dense ``grad`` dumps.

Usage: python benchmarks/bench_gradcos.py [--batches 16] [--tokens-per-batch 8192] [--k 256] [--permutations 1000]
Prints the wall time of reading, allocating, the bulk permutation controls, the
cosines, the jackknife and the bootstrap together.  Sketch-factor cosines (no
dump round trip) are timed by benchmarks/bench_sketch.py cosines.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from icsd_audit.alloc.options import AllocatorOptions
from icsd_audit.dumps.writer import write_table_atomic
from icsd_audit.audit.gradcos import run_gradcos
from icsd_audit.dumps.synth import synth_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--permutations", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.batches * args.tokens_per_batch
    with tempfile.TemporaryDirectory() as tmp:
        cols = synth_tokens(n, seed=0, n_batches=args.batches)
        rng = np.random.default_rng(0)
        g = (rng.normal(size=(n, args.k)) + np.outer(cols["delta"], rng.normal(size=args.k))).astype(np.float32)
        t = pa.table(cols).append_column("grad", pa.FixedSizeListArray.from_arrays(pa.array(g.ravel()), args.k))
        write_table_atomic(t, Path(tmp) / "g.parquet")
        t0 = time.perf_counter()
        res = run_gradcos([tmp], base=AllocatorOptions(allocator="sdar"), compare=AllocatorOptions(allocator="icsd"),
                          permutations=args.permutations, n_resamples=10_000)
        dt = time.perf_counter() - t0
    print(f"batches={args.batches} tokens={n:,} k={args.k} permutations={args.permutations} threads={args.threads}")
    print(f"run_gradcos: {dt:.1f} s ({dt / args.batches:.2f} s per batch); gain {res.gain.estimate:+.4f} "
          f"[{res.gain.ci_low:+.4f}, {res.gain.ci_high:+.4f}], sketch s.e. {res.sketch_error['gain']:.4f}")


if __name__ == "__main__":
    main()
