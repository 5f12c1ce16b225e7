"""Where ``icsd audit report`` spends its time and memory: wall, CPU and peak RSS per section, in one process.

Usage: python benchmarks/bench_report_sections.py DUMPS [--workers 2] [--resamples 10000]

Wraps the sections of :func:`icsd_audit.report.build.audit_dumps` (the landscape's first
pass, the per-batch accumulators, building the bootstrap's per-turn matrices, the
bootstrap, the results) and :func:`write_report`, and prints for each its wall and CPU
seconds (this process only: a forked bootstrap worker's CPU is not in the bootstrap's
CPU figure) and the peak resident memory reached inside it (Linux: ``VmHWM``, reset when
the section starts).  The stream's allocation runs in threads beside the accumulators,
so the sections do not add up to the total.  ``benchmarks/bench_report.py`` gives the
end-to-end figures against ``icsd audit tcm``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dumps", type=Path)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--resamples", type=int, default=10_000)
    args = ap.parse_args()
    build = importlib.import_module("icsd_audit.report.build")
    run = importlib.import_module("icsd_audit.audit.run")
    boot = importlib.import_module("icsd_audit.stats.bootstrap")
    acc = importlib.import_module("icsd_audit.stats.accumulator")
    land = importlib.import_module("icsd_audit.stats.landscape")
    from icsd_audit.report.results import ReportOptions

    rows: dict[str, list[float]] = {}

    def timed(owner: Any, name: str, label: str) -> None:
        f: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(f)
        def g(*a: Any, **k: Any) -> Any:
            _reset_peak()
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                r = rows.setdefault(label, [0.0, 0.0, 0.0, 0])
                r[0] += time.perf_counter() - w0
                r[1] += time.process_time() - c0
                r[2] = max(r[2], _status("VmHWM"))
                r[3] += 1

        setattr(owner, name, g)

    # (audit_dumps imports landscape_ranks and bootstrap_ratio_families when called: patched at their source)
    timed(run, "landscape_ranks", "pass 1: landscape ranks")
    timed(acc.AuditAccumulator, "add", "stream: audit accumulators add")
    timed(land.LandscapeAccumulator, "add", "stream: landscape add")
    timed(acc.AuditAccumulator, "families", "per-turn matrices (audit)")
    timed(land.LandscapeAccumulator, "families", "per-turn matrices (landscape)")
    timed(boot, "bootstrap_ratio_families", "bootstrap")
    timed(acc.AuditAccumulator, "results", "results")
    opts = ReportOptions(n_resamples=args.resamples)
    _reset_peak()
    c0, w0 = time.process_time(), time.perf_counter()
    rep = build.audit_dumps([args.dumps], opts, workers=args.workers)
    total = [time.perf_counter() - w0, time.process_time() - c0]
    out = Path(tempfile.mkdtemp(prefix="bench-sections-")) / "report"
    try:
        timed(build, "write_report", "write_report (figures, HTML)")
        build.write_report(rep, out)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    print(f"{'section':34s} {'wall s':>8s} {'cpu s':>8s} {'peak RSS MiB':>13s} calls")
    for label, (w, c, peak, n) in rows.items():
        print(f"{label:34s} {w:8.1f} {c:8.1f} {peak:13,.0f} {n:5d}")
    print(f"{'audit_dumps total':34s} {total[0]:8.1f} {total[1]:8.1f}")
    print(f"forked bootstrap workers: peak RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:,.0f} MiB; "
          f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
