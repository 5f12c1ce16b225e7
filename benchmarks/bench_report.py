"""``icsd audit report`` against ``icsd audit tcm`` on the same dumps: wall time, CPU time, peak RSS.

Usage: python benchmarks/bench_report.py [--tokens 2000000,20000000,50000000] [--repeats 3] [--dir DIR]

Issue 24's scaling criterion: on 50M synthetic tokens (``icsd synth DIR --tokens 50000000
--batches 150 --seed 3``) the report stays under 2 GB of peak RSS and within 2x of
``icsd audit tcm``'s wall time.  For each size the dumps are synthesized once (batches
of ~333k tokens, as in the issue: 60 batches for 20M), then ``tcm --json`` and
``report --out`` run as fresh processes, alternating, ``--repeats`` times; each child's
peak RSS and CPU time (user + system, bootstrap workers included) come from a wrapper
process of its own.  The machine is shared: the load average is printed with every run,
and the ratio of medians taken from the interleaved runs is the figure to quote.

What the report computes on these dumps: ``icsd synth`` writes one step, no ``entropy`` or
``logp`` column and no gradient sketch, so the default report shows the summary, sign
regions, share shift, clipping and landscape, and omits dynamics, alignment and the
token strata (which add about 60 % of the report's CPU where the dumps carry a covariate;
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from childrun import measure as run  # wall, CPU and peak RSS of one command


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2000000,20000000,50000000", help="comma-separated sizes")
    ap.add_argument("--tokens-per-batch", type=int, default=333_334, help="batch size of the synthetic dumps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--dir", type=Path, default=None, help="keep (and reuse) the dumps here: DIR/syn<tokens>")
    args = ap.parse_args()
    icsd = [sys.executable, "-m", "icsd_audit.cli"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-report-"))
    root = args.dir or tmp
    try:
        for n in (int(x) for x in args.tokens.split(",")):
            dumps = root / f"syn{n}"
            if not dumps.exists():
                batches = max(1, round(n / args.tokens_per_batch))
                subprocess.run([*icsd, "synth", str(dumps), "--tokens", str(n), "--batches", str(batches), "--seed", "3"],
                               check=True, stderr=subprocess.DEVNULL)
            out = tmp / "report"
            tcm = [*icsd, "audit", "tcm", str(dumps), "--resamples", str(args.resamples), "--json"]
            rep = [*icsd, "audit", "report", str(dumps), "--resamples", str(args.resamples), "--out", str(out)]
            res: dict[str, list[tuple[float, float, float]]] = {"tcm": [], "report": []}
            for i in range(args.repeats):
                for name, cmd in (("tcm", tcm), ("report", rep)):
                    shutil.rmtree(out, ignore_errors=True)
                    res[name].append(run(cmd))
                    w, c, r = res[name][-1]
                    print(f"  {n:>11,} tokens  run {i + 1}  {name:<6}  wall {w:7.1f} s  cpu {c:7.1f} s  "
                          f"peak RSS {r:7,.0f} MiB  load {os.getloadavg()[0]:.2f}", flush=True)
            med = {k: [statistics.median(x[j] for x in v) for j in range(3)] for k, v in res.items()}
            (tw, tc, tr), (rw, rc, rr) = med["tcm"], med["report"]
            print(f"{n:,} tokens, {args.resamples:,} resamples (medians of {args.repeats}): "
                  f"tcm {tw:.1f} s wall / {tc:.1f} s cpu / {tr:,.0f} MiB; report {rw:.1f} s wall / {rc:.1f} s cpu / "
                  f"{rr:,.0f} MiB; report / tcm: wall {rw / tw:.2f}x, cpu {rc / tc:.2f}x; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
