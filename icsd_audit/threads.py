"""The ``ICSD_THREADS`` setting, parsed in one place (torch-free, so the CLI can use it).

Callers choose their own default because the workloads differ: model matmuls on a
shared 2-core box run 2-5x slower with a descheduled second OpenMP thread
(docs/models.md), so training defaults to the cores that are idle when it starts
(:func:`idle_cores`: 1 on a busy box, both on an idle one); the audit's sorts and
bootstrap blocks gain from every core, so the audit CLI defaults to the cores (at most 8).
"""

from __future__ import annotations

import os

__all__ = ["env_threads", "idle_cores"]


def env_threads(default: int) -> int:
    """``ICSD_THREADS`` as a positive int, else ``default``; a bad value is a clear error."""
    env = os.environ.get("ICSD_THREADS", "").strip()
    if not env:
        return default
    try:
        n = int(env)
    except ValueError as exc:
        raise ValueError(f"ICSD_THREADS={env!r} is not an integer; set it to e.g. 1") from exc
    if n < 1:
        raise ValueError(f"ICSD_THREADS must be >= 1, got {n}")
    return n


def idle_cores(*, cap: int = 8) -> int:
    """The cores this process may use less the whole part of the 1-minute load average, 1 to ``cap``.

    A matmul thread that shares its core with another busy process stalls the others at
    every barrier, so a busy core is worth less than none; the load average counts the
    processes running or waiting, which on an idle machine is below 1. Where the load
    cannot be read, 1.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform: every core counts
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1
    return max(1, min(cap, cores - int(load)))
