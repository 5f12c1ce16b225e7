"""Wall time, CPU time and peak RSS of one command, each under a fresh wrapper process.

RUSAGE_CHILDREN in the benchmark itself would report the largest child it ever waited for
(the synthetic-dump step included), so every measured command gets a wrapper of its own.
Imported by the benchmark scripts beside it (``python benchmarks/bench_*.py`` puts this folder on sys.path).
"""

from __future__ import annotations

import subprocess
import sys
import time

__all__ = ["measure"]

_WRAP = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
         "stderr=subprocess.DEVNULL); r = resource.getrusage(resource.RUSAGE_CHILDREN); "
         "print(r.ru_maxrss, r.ru_utime + r.ru_stime)")


def measure(cmd: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MiB) of ``cmd`` run to completion."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _WRAP, *cmd], check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss, cpu = out.stdout.strip().splitlines()[-1].split()
    return wall, float(cpu), int(rss) / 1024
