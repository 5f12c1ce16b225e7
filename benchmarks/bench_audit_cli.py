"""``icsd audit tcm`` wall time and peak RSS against a bare torch + Parquet read.

Usage: python benchmarks/bench_audit_cli.py [--tokens 2200000] [--batches 4] [--repeats 3] [--resamples 10000]
The issue-3 speed criterion: the CLI at most 2x a bare
``python -c "import torch, pyarrow.parquet as pq; pq.read_table(...)"`` of the same files.
Both run as fresh subprocesses, alternating, so start-up costs count on both sides;
the medians and the ratio are printed, with each child's peak RSS (ru_maxrss).
For the 50M-token memory check: --tokens 50000000 --batches 150 --repeats 1.
``--baseline-python PY`` times a second install's ``icsd audit`` (e.g. a worktree of an
older commit with its own virtualenv) in the same alternating loop, so a change is
measured side by side with what it replaces on the same machine state.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


_WRAP = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one child, measured by a wrapper of its own.

    RUSAGE_CHILDREN in this process would report the largest child ever waited
    for (the synth step included), so each command runs under a fresh wrapper.
    """
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _WRAP, *cmd], check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    return wall, int(out.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2_200_000)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--statistic", default="tcm")
    ap.add_argument("--dumps", type=Path, default=None, help="reuse (or create) synthetic dumps here")
    ap.add_argument("--baseline-python", default=None, help="python of another install to time side by side")
    args = ap.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        dumps = args.dumps or Path(tmp) / "dumps"
        if not dumps.exists():
            subprocess.run([sys.executable, "-m", "icsd_audit.cli", "synth", str(dumps), "--tokens", str(args.tokens),
                            "--batches", str(args.batches)], check=True, stderr=subprocess.DEVNULL)
        bare = [sys.executable, "-c", "import glob, torch, pyarrow.parquet as pq; "
                f"[pq.read_table(f) for f in sorted(glob.glob('{dumps}/*.parquet'))]"]
        audit = [sys.executable, "-m", "icsd_audit.cli", "audit", args.statistic, str(dumps),
                 "--resamples", str(args.resamples), "--json"]
        t_bare, t_audit, t_base, rss, rss_bare = [], [], [], 0.0, 0.0
        for _ in range(args.repeats):
            wall, peak = run(bare, env)
            t_bare.append(wall)
            rss_bare = max(rss_bare, peak)
            wall, peak = run(audit, env)
            t_audit.append(wall)
            rss = max(rss, peak)
            extra = ""
            if args.baseline_python:
                t_base.append(run([args.baseline_python, *audit[1:]], env)[0])
                extra = f"  baseline {t_base[-1]:5.2f} s ({t_base[-1] / t_bare[-1]:4.2f}x)"
            print(f"  run {len(t_audit)}: bare {t_bare[-1]:5.2f} s  audit {wall:5.2f} s  ratio {wall / t_bare[-1]:4.2f}x"
                  f"{extra}  load {os.getloadavg()[0]:.2f}", flush=True)
    b, a = statistics.median(t_bare), statistics.median(t_audit)
    print(f"tokens={args.tokens:,} batches={args.batches} resamples={args.resamples} load={os.getloadavg()[0]:.2f}")
    print(f"bare torch import + read : {b:6.2f} s (median of {args.repeats})  peak RSS {rss_bare:,.0f} MiB")
    print(f"icsd audit {args.statistic:<14}: {a:6.2f} s  peak RSS {rss:,.0f} MiB")
    print(f"ratio                    : {a / b:6.2f}x (of medians); per run: median "
          f"{statistics.median(x / y for x, y in zip(t_audit, t_bare)):.2f}x, max {max(x / y for x, y in zip(t_audit, t_bare)):.2f}x")
    if t_base:
        r = [x / y for x, y in zip(t_base, t_bare)]
        print(f"baseline ({args.baseline_python}): {statistics.median(t_base):6.2f} s; per run: median "
              f"{statistics.median(r):.2f}x, max {max(r):.2f}x")


if __name__ == "__main__":
    main()
