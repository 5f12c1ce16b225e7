"""The audit's thread policy: one torch intra-op thread for its maths, worker threads for its batches.

Torch splits reductions over more than 32768 elements into one chunk per thread, so the summation order, and with
it the last bits of g, c, every estimate and every CI bound, followed the thread count (measured: 1 vs 3 threads on
2 x 300k-token batches changed 85k of 600k ``g`` values by up to 3e-14 relative). Every library entry point of the
audit runs under :func:`one_intra_op_thread`, so a library caller gets the same bits as the CLI whatever
``ICSD_THREADS`` or torch's own setting says; parallelism comes from :func:`audit_workers` batches at once, each
computed by one thread, merged in batch order.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Iterator, TypeVar

from icsd_audit.threads import env_threads

__all__ = ["audit_workers", "one_intra_op_thread", "single_threaded_maths"]

F = TypeVar("F", bound=Callable[..., Any])


def audit_workers() -> int:
    """Audit workers: ``ICSD_THREADS``, else the cores (at most 8); a bad ``ICSD_THREADS`` is one line."""
    return env_threads(default=max(1, min(8, os.cpu_count() or 1)))


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Torch on one intra-op thread for the duration; the caller's setting comes back after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_threaded_maths(fn: F) -> F:
    """Run ``fn`` under :func:`one_intra_op_thread` (an audit entry point's numbers never follow the thread count)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with one_intra_op_thread():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
