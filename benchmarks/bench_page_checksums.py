"""What page checksums cost: writing and reading a synthetic dump with and without them.

Usage: python benchmarks/bench_page_checksums.py [--tokens 2000000] [--batches 4] [--repeats 5]

Writes the ``icsd synth`` tokens as one shard per batch exactly as DumpWriter does
(zstd, dictionary ids, 131,072-row groups), once with page checksums (what icsd
writes) and once without, then reads every shard back whole, verifying and not.
Prints the median wall time of each (the two variants run alternately), and the bytes on disk.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from icsd_audit import parquet_io
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import dictionary_columns


def timed(a, b, repeats: int) -> tuple[float, float]:
    """Median seconds of ``a()`` and of ``b()``, run alternately so a change in load hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cols = synth_tokens(args.tokens, seed=0, n_batches=args.batches)
    floats = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in cols.items()}
    tables = [pa.table({k: v[cols["batch_id"] == b] for k, v in floats.items()}) for b in np.unique(cols["batch_id"])]
    opts = dict(row_group_size=1 << 17, compression="zstd", use_dictionary=dictionary_columns(tables[0].schema))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)

        def write(checksums: bool) -> None:
            for i, t in enumerate(tables):
                pq.write_table(t, d / f"{int(checksums)}-{i}.parquet", write_page_checksum=checksums, **opts)

        def read(checksums: bool, verify: bool) -> None:
            for i in range(len(tables)):
                pq.ParquetFile(d / f"{int(checksums)}-{i}.parquet", page_checksum_verification=verify).read()

        w_off, w_on = timed(lambda: write(False), lambda: write(True), args.repeats)
        r_off, r_on = timed(lambda: read(False, False), lambda: read(True, True), args.repeats)
        size = [sum((d / f"{c}-{i}.parquet").stat().st_size for i in range(len(tables))) for c in (0, 1)]
        # the helpers icsd uses write and read what the timed calls did
        parquet_io.write_table(tables[0], d / "h.parquet", **opts)
        assert parquet_io.read_table(d / "h.parquet").equals(tables[0])
    print(f"tokens={args.tokens:,} shards={len(tables)} repeats={args.repeats} (median)")
    print(f"write: {w_off * 1e3:7.1f} ms without checksums, {w_on * 1e3:7.1f} ms with ({w_on / w_off - 1:+.1%})")
    print(f"read:  {r_off * 1e3:7.1f} ms unverified,        {r_on * 1e3:7.1f} ms verified ({r_on / r_off - 1:+.1%})")
    print(f"size:  {size[0] / 1e6:7.2f} MB without checksums, {size[1] / 1e6:7.2f} MB with ({size[1] - size[0]:+,} bytes)")


if __name__ == "__main__":
    main()
