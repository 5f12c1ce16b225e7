"""``icsd audit coeffs`` and ``icsd audit verify`` against a bare Parquet read of the same columns.

Usage: python benchmarks/bench_coeffs.py [--tokens 2000000] [--batches 4] [--threads 1]
Writes synthetic dumps to a temporary directory, then times (median of --repeats):
  read   pq.read_table(files, columns=required)             the floor any tool pays
  coeffs compute_coefficients(...) in process               read + validate + allocate + write
  verify verify_dumps(coeffs output)                         read + validate + allocate + compare g, m, c
and prints the ratios.  The CLI adds interpreter and torch start-up (~1.5 s here).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from icsd_audit.alloc.options import AllocatorOptions

from icsd_audit.audit.coeffs import compute_coefficients
from icsd_audit.audit.verify import verify_dumps
from icsd_audit.dumps.writer import DumpWriter
from icsd_audit.dumps.reader import REQUIRED
from icsd_audit.dumps.synth import synth_tokens


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "dumps"
        cols = synth_tokens(args.tokens, seed=0, n_batches=args.batches)
        w = DumpWriter(src, producer="bench", synthetic=True)
        for b in np.unique(cols["batch_id"]):
            sel = cols["batch_id"] == b
            w.write(**{k: v[sel] for k, v in cols.items()})
        files = sorted(src.glob("*.parquet"))
        t_read = timed(lambda: [pq.read_table(f, columns=list(REQUIRED)) for f in files], args.repeats)
        out = Path(tmp) / "coeffs.parquet"
        t_coeffs = timed(lambda: compute_coefficients([src], out, AllocatorOptions()), args.repeats)
        t_verify = timed(lambda: verify_dumps([out]), args.repeats)
    n = args.tokens
    print(f"tokens={n:,} batches={args.batches} threads={args.threads}")
    print(f"bare read   : {t_read * 1000:8.1f} ms")
    print(f"audit coeffs: {t_coeffs * 1000:8.1f} ms  ({n / t_coeffs / 1e6:.2f} M tokens/s end to end)")
    print(f"ratio       : {t_coeffs / t_read:8.1f}x")
    print(f"audit verify: {t_verify * 1000:8.1f} ms  ({n / t_verify / 1e6:.2f} M tokens/s; {t_verify / t_read:.1f}x the read)")


if __name__ == "__main__":
    main()
