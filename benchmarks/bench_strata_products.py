"""The strata bootstrap's products, one work unit at a time: the sorted-tile engine against plain dense products.

Usage: python benchmarks/bench_strata_products.py DUMPS [--by pos,abs_delta] [--bins 10] [--repeats 6]

Reads the dumps once (deployed settings, as ``icsd audit strata``), builds each covariate's
strata family and tcm's, then times, on one thread, one work unit (64 resamples) of: the
draw of the counts; tcm's products; the strata family's products with the plain engine
(every column dense, as for other statistics) and with :class:`SegmentedFamily` (what
``icsd audit strata`` runs). CPU time per (resample, turn), the minimum and median of
``--repeats`` runs, interleaved; and the (row x turn) products each strata engine does per turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from icsd_audit.alloc.options import required_columns, weighted_batches
from icsd_audit.audit.run import deployed_request
from icsd_audit.audit.strata import covariate_sample
from icsd_audit.dumps.reader import DumpReader
from icsd_audit.stats.accumulator import AuditAccumulator
from icsd_audit.stats.bootstrap import _prepare
from icsd_audit.stats.engine.counts import block_counts, block_generator
from icsd_audit.stats.engine.forked import BlasThreads
from icsd_audit.stats.engine.resample import BLOCK, SUPER, Family, Layout, _Engine, stream_seed
from icsd_audit.stats.results import StrataSpec
from icsd_audit.stats.engine.segments import SegmentedFamily
from icsd_audit.stats.strata import StrataAccumulator, covariate_values, strata_edges


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dumps")
    ap.add_argument("--by", default="pos,abs_delta")
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    paths = [args.dumps]
    req = deployed_request(paths)
    reader = DumpReader(paths, columns=[], require=required_columns(req.base.allocator, req.compare.allocator))
    accs = {}
    for by in args.by.split(","):
        spec = StrataSpec(by, args.bins, None)
        accs[by] = StrataAccumulator(spec=spec, edges=strata_edges(covariate_sample(reader, by), spec), eps=req.eps,
                                     base_name=req.base.allocator, compare_name=req.compare.allocator)
    audit = AuditAccumulator(statistics=("tcm",), base_name=req.base.allocator, compare_name=req.compare.allocator)
    for batch, weights, u in weighted_batches(reader, req.base, req.compare):
        tokens = batch.tokens.replace(u=u)
        for by, acc in accs.items():
            acc.add(tokens, weights, x=covariate_values(batch.tokens, by))
        audit.add(tokens, weights)
    tcm = _prepare(audit.families()[0][1])
    lay = Layout(tcm.sizes)
    seed = stream_seed(0)
    counts = np.empty((SUPER, lay.n, BLOCK), np.int8)
    engines = {"tcm products": _Engine(lay, [Family(tcm.ST, tcm.sgroup, 1, lay)], seed)}
    rows = {}
    for by, acc in accs.items():
        p = _prepare(acc.family())
        if p.sizes.tobytes() != tcm.sizes.tobytes():
            raise SystemExit("the strata family's layout is not tcm's")
        seg = SegmentedFamily(p.ST, *p.segments, lay)
        rows[by] = (p.ST.shape[0], sum((q[4] - q[2]) * (q[6] - q[5]) for t in seg.tiles for q in t[2]) / lay.n)
        engines[f"{by} plain"] = _Engine(lay, [Family(p.ST, p.sgroup, 1, lay)], seed)
        engines[f"{by} sorted tiles"] = seg
    times: dict[str, list[float]] = {"draw": [], **{k: [] for k in engines}}
    per = SUPER * BLOCK * lay.n / 1e9
    with BlasThreads(1):
        for _ in range(args.repeats):
            t0 = time.process_time()
            for j in range(SUPER):
                block_counts(block_generator(seed, j), counts[j], lay)
            times["draw"].append(time.process_time() - t0)
            for name, eng in engines.items():
                t0 = time.process_time()
                if isinstance(eng, SegmentedFamily):
                    eng.unit_sums(counts)
                else:  # the plain engine draws its own counts: take the draw off
                    eng.block(0)
                times[name].append(time.process_time() - t0)
    draw = min(times["draw"])
    print(f"{lay.n:,} action turns, one work unit of {SUPER * BLOCK} resamples, CPU ns per (resample, turn), "
          f"min / median of {args.repeats}; load {os.getloadavg()[0]:.2f}")
    for name, t in times.items():
        off = draw if name != "draw" and not isinstance(engines.get(name), SegmentedFamily) else 0.0
        print(f"  {name:<24} {(min(t) - off) / per:6.2f} / {(statistics.median(t) - off) / per:6.2f}")
    for by, (cols, r) in rows.items():
        print(f"  {by}: {cols} columns; the sorted tiles multiply {r:.1f} rows per turn")


if __name__ == "__main__":
    main()
