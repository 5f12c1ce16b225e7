"""The shipped example dumps: real cpu-demo allocations recompute exactly; provenance labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from icsd_audit.alloc.options import AllocatorOptions, allocate_batch
from icsd_audit.dumps.reader import DumpReader, read_metadata

ROOT = Path(__file__).resolve().parents[2] / "examples"


def test_cpu_demo_deployed_coefficients_recompute_exactly() -> None:
    reader = DumpReader([ROOT / "cpu-demo" / "dumps"], columns=["g", "c", "m"])
    meta = reader.metadata()[0]
    assert meta["synthetic"] is False and meta["producer"]["name"] == "icsd.train"
    opts = AllocatorOptions(allocator=meta["allocator"]["allocator"], trust=meta["allocator"]["trust"],
                            min_group=meta["allocator"]["min_group"], eps=meta["allocator"]["eps"])
    n = 0
    for batch in reader:
        alloc = allocate_batch(batch.tokens, opts)
        for k in ("g", "m", "c"):
            dumped = batch.table.column(k).to_numpy().astype(np.float64)
            # dumps store float32: recomputed float64 values round to the stored ones
            assert np.array_equal(getattr(alloc, k).numpy().astype(np.float32).astype(np.float64), dumped), k
        n += 1
    assert n == 3  # one mini-batch per step, 3 steps


def test_synthetic_examples_say_so() -> None:
    for f in sorted((ROOT / "synthetic").glob("*.parquet")):
        assert read_metadata(f)["synthetic"] is True
