"""``icsd audit strata`` against ``icsd audit tcm`` on the same dumps: wall time, CPU time, peak RSS.

Usage: python benchmarks/bench_strata.py [--tokens 2000000,5000000,20000000] [--by pos] [--bins 10] [--repeats 3]
       [--dir DIR] [--resamples 10000]

Issue 32's speed target: ``icsd audit strata`` within 1.5x of ``icsd audit tcm`` on 20M
synthetic tokens.  For each size the dumps are synthesized once (``icsd synth DIR --tokens N
--batches N/333,334 --seed 3``), then ``tcm --json`` and ``strata --by BY --bins K --json``
run as fresh processes, alternating, ``--repeats`` times; each child's peak RSS and CPU
time (user + system, bootstrap workers included) come from a wrapper process of its own.
The synthetic dumps carry no ``logp`` or ``entropy`` column: ``--by pos`` (their ``pos``
column; the first pass reads ``pos`` and ``valid`` only) or ``--by abs_delta`` (``delta``
and ``valid``).  The machine is shared: the load
average is printed with every run, and the ratio of medians from the interleaved runs is
the figure to quote.
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
    ap.add_argument("--tokens", default="2000000,5000000,20000000", help="comma-separated sizes")
    ap.add_argument("--tokens-per-batch", type=int, default=333_334, help="batch size of the synthetic dumps")
    ap.add_argument("--by", default="pos", choices=("pos", "abs_delta"))
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--dir", type=Path, default=None, help="keep (and reuse) the dumps here: DIR/syn<tokens>")
    args = ap.parse_args()
    icsd = [sys.executable, "-m", "icsd_audit.cli"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-strata-"))
    root = args.dir or tmp
    try:
        for n in (int(x) for x in args.tokens.split(",")):
            dumps = root / f"syn{n}"
            if not dumps.exists():
                batches = max(1, round(n / args.tokens_per_batch))
                subprocess.run([*icsd, "synth", str(dumps), "--tokens", str(n), "--batches", str(batches), "--seed", "3"],
                               check=True, stderr=subprocess.DEVNULL)
            r = ["--resamples", str(args.resamples), "--json"]
            cmds = {"tcm": [*icsd, "audit", "tcm", str(dumps), *r],
                    "strata": [*icsd, "audit", "strata", str(dumps), "--by", args.by, "--bins", str(args.bins), *r]}
            res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cmds}
            for i in range(args.repeats):
                for name, cmd in cmds.items():
                    res[name].append(run(cmd))
                    w, c, m = res[name][-1]
                    print(f"  {n:>11,} tokens  run {i + 1}  {name:<6}  wall {w:7.1f} s  cpu {c:7.1f} s  "
                          f"peak RSS {m:7,.0f} MiB  load {os.getloadavg()[0]:.2f}", flush=True)
            med = {k: [statistics.median(x[j] for x in v) for j in range(3)] for k, v in res.items()}
            (tw, tc, tr), (sw, sc, sr) = med["tcm"], med["strata"]
            print(f"{n:,} tokens, {args.resamples:,} resamples, --by {args.by} --bins {args.bins} (medians of "
                  f"{args.repeats}): tcm {tw:.1f} s wall / {tc:.1f} s cpu / {tr:,.0f} MiB; strata {sw:.1f} s wall / "
                  f"{sc:.1f} s cpu / {sr:,.0f} MiB; strata / tcm: wall {sw / tw:.2f}x, cpu {sc / tc:.2f}x; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
