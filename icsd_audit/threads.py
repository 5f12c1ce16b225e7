"""The ``ICSD_THREADS`` setting and the automatic thread choice, in one place (torch-free, so the CLI can use it).

Callers choose their own default because the workloads differ: model matmuls on a
shared 2-core box run 2-5x slower with a descheduled second OpenMP thread
(docs/models.md), so training defaults to the cores that are idle when it starts
(:func:`idle_cores`: 1 on a busy box, both on an idle one); the audit's sorts and
bootstrap blocks gain from every core, so the audit CLI defaults to the cores (at most 8).

``ICSD_THREADS`` may not exceed :data:`MAX_THREADS`: each audit worker is a forked
process, so a typo such as 10000 would otherwise fork until the machine refuses.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["MAX_THREADS", "env_threads", "idle_cores", "busy_cores", "ThreadChoice", "choose_threads",
           "check_environment"]

#: the most threads (and audit worker processes) ``ICSD_THREADS`` may ask for
MAX_THREADS = 256
#: how long :func:`busy_cores` watches the cores
SAMPLE_SECONDS = 0.3


def env_threads(default: int) -> int:
    """``ICSD_THREADS`` as an int in 1..MAX_THREADS, else ``default``; a bad value is a one-line error naming it."""
    env = os.environ.get("ICSD_THREADS", "").strip()
    if not env:
        return default
    try:
        n = int(env)
    except ValueError:
        raise ValueError(f"ICSD_THREADS={env!r} is not an integer; set it to e.g. 1") from None
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"ICSD_THREADS={n}: must lie in 1..{MAX_THREADS} (this machine has {os.cpu_count()} cores)")
    return n


def check_environment() -> None:
    """Validate every ``ICSD_*`` variable icsd reads at start, so a bad one fails before any work."""
    env_threads(1)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform: every core counts
        return os.cpu_count() or 1


def _read_proc_stat() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot from /proc/stat's first line; None where it cannot be read."""
    try:
        with open("/proc/stat", "rb") as fh:
            first = fh.readline().split()
    except OSError:
        return None
    if not first or first[0] != b"cpu" or len(first) < 5:
        return None
    ticks = [int(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return sum(ticks) - idle, sum(ticks)


def busy_cores(*, read: Callable[[], tuple[int, int] | None] = _read_proc_stat,
               sleep: Callable[[float], None] = time.sleep, seconds: float = SAMPLE_SECONDS,
               cores: int | None = None) -> float | None:
    """How many cores were busy over the last ``seconds`` (two reads of /proc/stat); None where it cannot be read.

    The machine's whole count of cores (``os.cpu_count()``) times the busy share of the interval.
    """
    a = read()
    if a is None:
        return None
    sleep(seconds)
    b = read()
    if b is None or b[1] <= a[1]:
        return None
    share = (b[0] - a[0]) / (b[1] - a[1])
    return max(0.0, min(1.0, share)) * (cores if cores is not None else os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadChoice:
    """How many threads, and why (the run log's line)."""

    n: int
    why: str


def idle_cores(*, cap: int = 8, busy: Callable[[], float | None] | None = None) -> ThreadChoice:
    """The cores this process may use less those busy now, 1 to ``cap``.

    A matmul thread that shares its core with another busy process stalls the others at
    every barrier, so a busy core is worth less than none. "Busy now" is a short sample of
    /proc/stat (:func:`busy_cores`); where there is none, the 1-minute load average (which
    lags a minute behind); where neither can be read, 1. ``busy`` replaces :func:`busy_cores` (tests).
    """
    cores = _usable_cores()
    now = (busy or busy_cores)()
    if now is not None:
        n = max(1, min(cap, cores - int(now + 0.5)))
        return ThreadChoice(n, f"the cores idle now: {now:.1f} of {os.cpu_count() or cores} busy over "
                               f"{SAMPLE_SECONDS:g} s")
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ThreadChoice(1, "no /proc/stat and no load average to read")
    return ThreadChoice(max(1, min(cap, cores - int(load))), f"no /proc/stat: 1-minute load average {load:.2f}")


def choose_threads(requested: int | None) -> ThreadChoice:
    """A config's ``threads``, else ``ICSD_THREADS``, else :func:`idle_cores`, with the reason."""
    if requested:
        return ThreadChoice(int(requested), f"threads={requested}")
    if os.environ.get("ICSD_THREADS", "").strip():
        return ThreadChoice(env_threads(1), "ICSD_THREADS")
    return idle_cores()
