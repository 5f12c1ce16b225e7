"""Benchmark: ``run_audit(..., backend="ray")`` with the bootstrap's work units as Ray tasks vs in the driver.

Both runs map the batches on the same local Ray cluster; the first hands the bootstrap's
work units to Ray tasks (``ray_bootstrap``, what ``--backend ray`` does), the second
computes them in the driver (one process). Prints wall time and the driver's CPU time
of each, alternating, after a warm-up that starts the workers.

    python benchmarks/bench_ray_bootstrap.py DUMPS --workers 2 --resamples 4096 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from icsd_audit.alloc.options import AllocatorOptions
from icsd_audit.audit import ray_backend
from icsd_audit.audit.run import AuditRequest, run_audit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dumps")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--resamples", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=args.workers, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
             log_to_driver=False)
    req = AuditRequest(base=AllocatorOptions(allocator="sdar"), compare=AllocatorOptions(allocator="icsd"),
                       n_resamples=args.resamples, workers=1)
    stats = ("tcm", "quadrants", "shift", "clip")
    run_audit([args.dumps], req, statistics=("tcm",), backend="ray")  # warm-up: the workers start and import
    on_ray = ray_backend.ray_bootstrap
    try:
        for _ in range(args.repeats):
            for name in ("units on Ray", "units in the driver"):
                ray_backend.ray_bootstrap = on_ray if name == "units on Ray" else ray_backend.ray_session
                r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                run_audit([args.dumps], req, statistics=stats, backend="ray")
                w, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
                cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
                print(f"{name:20s} workers={args.workers} resamples={args.resamples}: {w:6.2f} s wall, driver CPU "
                      f"{cpu:6.2f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        ray_backend.ray_bootstrap = on_ray
        ray.shutdown()


if __name__ == "__main__":
    main()
