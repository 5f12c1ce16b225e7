"""Where ``icsd audit strata``'s time goes, phase by phase, beside ``icsd audit tcm``'s: one process each.

Usage: python benchmarks/bench_strata_phases.py DUMPS [--by pos] [--bins 10] [--resamples 10000]

Runs :func:`icsd_audit.audit.strata.run_strata` and :func:`icsd_audit.audit.run.run_audit` (``tcm``) in
fresh child processes with the CLI's workers (``ICSD_THREADS``, else the cores, at most 8) and the dumps'
deployed settings, each library function of a phase wrapped by a timer: wall seconds and CPU seconds
(user + system of the process, its threads and its forked bootstrap worker) per phase.  The CLI's own
start (imports, settings: about 1.5 s) is outside and the same for both commands.  Phases that run
in worker threads (the stream) overlap others; the stream's wall is the time the consuming loop waits.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any, Callable

_ROWS: dict[str, list[float]] = {}


def _clock() -> tuple[float, float]:
    t = os.times()
    return time.perf_counter(), t.user + t.system + t.children_user + t.children_system


def _timed(mod: Any, name: str, label: str, generator: bool = False) -> None:
    """Replace ``mod.name`` by a wrapper adding its wall and CPU time to the phase ``label``."""
    fn: Callable[..., Any] = getattr(mod, name)

    def add(t0: tuple[float, float]) -> None:
        t1 = _clock()
        row = _ROWS.setdefault(label, [0.0, 0.0])
        row[0] += t1[0] - t0[0]
        row[1] += t1[1] - t0[1]

    def call(*a: Any, **k: Any) -> Any:
        t0 = _clock()
        try:
            return fn(*a, **k)
        finally:
            add(t0)

    def gen(*a: Any, **k: Any) -> Any:
        it = fn(*a, **k)
        while True:
            t0 = _clock()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                add(t0)
            yield item

    setattr(mod, name, gen if generator else call)


def child(command: str, dumps: str, by: str, bins: int, resamples: int) -> None:
    import dataclasses

    import icsd_audit.audit.run as run
    import icsd_audit.audit.strata as audit_strata
    import icsd_audit.stats.bootstrap as bootstrap
    import icsd_audit.stats.strata as strata
    from icsd_audit.audit.threads import audit_workers

    req = dataclasses.replace(run.deployed_request([dumps]), workers=audit_workers(), n_resamples=resamples)
    _timed(audit_strata, "covariate_sample", "covariate's first pass")
    _timed(audit_strata, "strata_edges", "edges")
    _timed(audit_strata, "reduced_batches", "stream (allocation, per-turn sums)", generator=True)
    _timed(run, "weighted_batches", "stream (allocation)", generator=True)
    _timed(run, "add_batch", "stream (per-turn sums)")
    _timed(strata.StrataAccumulator, "merge", "batches' sums into the matrix (merge)")
    _timed(strata.StrataAccumulator, "family", "family's matrix")
    _timed(bootstrap, "_prepare", "point estimates, layout")
    _timed(bootstrap, "SegmentedFamily", "sorted tiles' plan and copy")
    _timed(bootstrap, "family_sums", "bootstrap products (workers)", generator=True)
    _timed(bootstrap, "summarize_bootstrap", "percentiles")
    t0 = _clock()
    if command == "strata":
        audit_strata.run_strata([dumps], req, by=by, bins=bins)
    else:
        run.run_audit([dumps], req, statistics=("tcm",))
    t1 = _clock()
    print(f"{command} (workers {req.workers}): total {t1[0] - t0[0]:.2f} s wall / {t1[1] - t0[1]:.2f} s CPU")
    for label, (w, c) in _ROWS.items():
        print(f"  {label:<38} {w:6.2f} s wall  {c:6.2f} s CPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dumps")
    ap.add_argument("--by", default="pos", choices=("pos", "abs_delta", "logp", "entropy"))
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--child", choices=("strata", "tcm"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.dumps, args.by, args.bins, args.resamples)
        return
    for command in ("tcm", "strata"):
        subprocess.run([sys.executable, __file__, args.dumps, "--by", args.by, "--bins", str(args.bins),
                        "--resamples", str(args.resamples), "--child", command], check=True)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
