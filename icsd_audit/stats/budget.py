"""What a request costs in memory, checked against what the machine has before the work starts.

Why one module: a request such as ``--resamples 1000000000`` or ``--grid 100000`` used
to fail with a memory traceback after the dumps had been read (or, ``--grid 5000``,
ran for hours); every entry point now asks here first and refuses in one line giving
the estimate and the limit.  The estimates follow the current memory model of the
bootstrap (:mod:`icsd_audit.stats.bootstrap`: replicates of every statistic kept, then
a percentile pass over blocks of columns in float64), of the landscape (grids and
their JSON form per environment) and of batch allocation (a batch's rows and its
allocation temporaries, ``workers + 2`` batches in flight); they are "about" figures
(within a factor of about two, measured on the dev box), enough to tell a request
that fits from one that cannot.  Pure Python: nothing here allocates.

The limit is ``ICSD_MEMORY_LIMIT`` (bytes, or with a K/M/G/T suffix) when set, else
the smaller of the memory available now (``MemAvailable`` on Linux, else the
physical memory) and the cgroup's limit less its usage.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import re
from typing import Any

__all__ = ["ResourceError", "MAX_GRID", "memory_limit", "check_memory", "bootstrap_bytes",
           "landscape_bytes", "check_grid", "check_bootstrap", "check_batches", "check_permutations",
           "audit_statistic_count", "BATCH_ROW_BYTES", "LANDSCAPE_STATISTICS", "GRADCOS_STATISTICS", "check_resources", "check_families"]

#: the largest landscape grid (bins per axis): its cells grow as grid^2 and its smoothing as grid^3
MAX_GRID = 1000
#: bootstrapped quantities of the landscape per environment: 2 regions x (base, compare, ratio)
LANDSCAPE_STATISTICS = 6
#: bootstrapped quantities of the gradient compatibility (3 means and 3 gains), resampling whole batches
GRADCOS_STATISTICS = 6
#: bytes per row of a batch while it is allocated (token arrays, Arrow table, g/u/m/c and temporaries;
#: measured 166-264 on 1M- and 2M-row batches)
BATCH_ROW_BYTES = 300
#: bytes per landscape cell per environment: grids, smoothing, their JSON and, in a report, the figure and the
#: HTML (measured at grid 1000: 1 GB per environment for a report, 0.1 GB for ``landscape --json``)
_CELL_BYTES = 1000
#: bytes per valid token of the landscape's first pass (delta as stored, float32, and its sorted copy)
_LANDSCAPE_ROW_BYTES = 8
_ENV = "ICSD_MEMORY_LIMIT"


class ResourceError(ValueError):
    """A request whose memory (or size) exceeds what this machine has: one line with estimate and limit."""


def _size(n: float) -> str:
    if n >= 1 << 60:
        return f"{n / (1 << 30):.2e} GiB"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1024:,.1f} KiB"


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"{_ENV}={text!r}: expected bytes or a number with K, M, G or T (e.g. 8G)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory_limit() -> tuple[int, str]:
    """(bytes this process may still use, what sets that limit)."""
    if os.environ.get(_ENV):  # the user's word replaces what is detected (a machine shared with others, swap)
        return _parse_size(os.environ[_ENV]), _ENV
    found: list[tuple[int, str]] = []
    with contextlib.suppress(OSError):  # no /proc (not Linux): the cgroup and physical-memory sources decide
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "available"))
                    break
    cap, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if cap is not None:
        found.append((max(cap - (used or 0), 0), "left under the cgroup's memory.max"))
    if not any(src == "available" for _, src in found):
        with contextlib.suppress(ValueError, OSError, AttributeError):  # no sysconf names: limit stays unknown
            found.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of physical memory"))
    return min(found) if found else (1 << 62, "unknown")


def check_memory(what: str, need: int, detail: str = "") -> None:
    """Refuse ``what`` (e.g. ``--resamples 1000000000``) when ``need`` bytes exceed the limit."""
    limit, source = memory_limit()
    if need > limit:
        how = f" ({detail})" if detail else ""
        where = f"the {_size(limit)} {source}" if source != _ENV else f"{_ENV}={_size(limit)}"
        raise ResourceError(f"{what}: needs about {_size(need)} of memory{how}, more than {where}")


# --------------------------------------------------------------------------- estimates


def audit_statistic_count(statistics: tuple[str, ...] | list[str], n_bins: int = 5) -> int:
    """Bootstrapped quantities of :class:`~icsd_audit.stats.accumulator.AuditAccumulator` (base, compare, diff each)."""
    per = {"tcm": 3, "quadrants": 15, "shift": 3 * (2 * n_bins + 1), "clip": 15}
    return sum(per[s] for s in statistics)


def bootstrap_bytes(n_resamples: int, n_statistics: int, n_groups: int = 1) -> int:
    """Replicates (resamples x groups x statistics; float32 above 256 MiB) plus the percentile pass.

    The pass sorts blocks of about 4M values in float64 with five temporaries of the
    same size; one column at a time once the resamples alone exceed that.
    """
    cells = n_resamples * n_groups * n_statistics
    item = 8 if cells * 8 <= 1 << 28 else 4
    block = n_resamples * min(n_groups * n_statistics, max(1, (1 << 22) // max(n_resamples, 1)))
    return cells * item + 6 * 8 * block


def landscape_bytes(grid: int, n_envs: int = 1, n_tokens: int = 0) -> int:
    """Grids of every environment and the per-token columns pooled for the mid-ranks."""
    return _CELL_BYTES * grid * grid * n_envs + _LANDSCAPE_ROW_BYTES * n_tokens


# --------------------------------------------------------------------------- checks


def _whole(option: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ResourceError(f"{option} {value!r}: expected an integer >= {low}")
    v = int(value)
    if v < low:
        raise ResourceError(f"{option} {v}: expected an integer >= {low}")
    return v


def check_grid(grid: int, n_envs: int = 1) -> None:
    """``--grid``: at most :data:`MAX_GRID` bins per axis, and the grids must fit in memory."""
    g = _whole("--grid", grid, 1)
    if g > MAX_GRID:
        raise ResourceError(f"--grid {g}: at most {MAX_GRID:,} bins per axis; {g:,} x {g:,} = {g * g:,} cells per "
                            f"environment would need about {_size(landscape_bytes(g, n_envs))} of memory and "
                            f"{4 * 2 * g ** 3:.1e} floating-point operations of smoothing")
    check_memory(f"--grid {g}", landscape_bytes(g, n_envs), f"{g * g:,} cells x {n_envs} environment(s)")


def check_bootstrap(n_resamples: int, n_statistics: int, n_groups: int = 1, *, n_batches: int = 0) -> None:
    """``--resamples``: the replicates of ``n_statistics`` quantities in ``n_groups`` groups must fit.

    ``n_batches``: for whole-batch resampling, the R x batches draws as well.
    """
    r = _whole("--resamples", n_resamples, 1)
    need = bootstrap_bytes(r, n_statistics, n_groups) + (3 * 8 * r * n_batches if n_batches else 0)
    check_memory(f"--resamples {r}", need, f"{r:,} resamples x {n_statistics} statistics"
                 + (f" x {n_groups:,} groups" if n_groups > 1 else "")
                 + (f", {n_batches:,} batches drawn per resample" if n_batches else ""))


def check_families(n_resamples: int, shapes: list[tuple[int, int]]) -> None:
    """The exact check once the data are read: ``shapes`` holds (groups, statistics) of each bootstrapped family."""
    r = _whole("--resamples", n_resamples, 1)
    need = sum(bootstrap_bytes(r, k, g) for g, k in shapes)
    k_all, g_max = sum(k for _, k in shapes), max((g for g, _ in shapes), default=1)
    check_memory(f"--resamples {r}", need, f"{r:,} resamples x {k_all} statistics"
                 + (f" in up to {g_max:,} groups, {sum(g * k for g, k in shapes):,} values per resample"
                    if g_max > 1 else ""))


def check_permutations(permutations: int, batch_rows: int) -> None:
    """``--permutations``: P shuffled coefficient columns of the largest batch (float64, with two copies)."""
    p = _whole("--permutations", permutations, 0)
    check_memory(f"--permutations {p}", 3 * 8 * batch_rows * (p + 2),
                 f"{p + 2:,} coefficient columns of the largest batch, {batch_rows:,} rows")


def check_batches(batch_rows: int, batch_id: int, workers: int, *, pooled_tokens: int = 0) -> None:
    """The largest batch, ``workers + 2`` of them in flight (plus the landscape's pooled tokens) must fit."""
    need = BATCH_ROW_BYTES * batch_rows * (workers + 2) + _LANDSCAPE_ROW_BYTES * pooled_tokens
    if need > memory_limit()[0]:
        check_memory(f"batch {batch_id} ({batch_rows:,} rows, the largest)", need,
                     f"{workers + 2} batches in flight"
                     + (f" with ICSD_THREADS={workers}" if workers > 1 else "")
                     + (f", plus {pooled_tokens:,} tokens pooled for the landscape" if pooled_tokens else "")
                     + ("; set ICSD_THREADS lower or write smaller batches" if workers > 1 else
                        "; write smaller batches"))


def check_resources(reader: Any, *, workers: int, landscape: bool = False, permutations: int | None = None,
                    n_resamples: int | None = None) -> None:
    """The checks that need the opened dumps: the largest batch in flight, and for gradient cosines the
    permutation columns of that batch and the whole-batch bootstrap of the per-batch cosines."""
    batch_id, rows = reader.largest_batch()
    check_batches(rows, batch_id, workers, pooled_tokens=reader.n_rows if landscape else 0)
    if permutations is not None:
        check_permutations(permutations, rows)
        if n_resamples is not None:
            check_bootstrap(n_resamples, GRADCOS_STATISTICS, n_batches=len(reader.batch_ids))
