"""The audit's map over batches on Ray (``icsd audit ... --backend ray``, the ``ray`` extra).

Each batch is one Ray task: read it (from local paths or a store's URLs, which every
worker resolves the same way), allocate it with one torch intra-op thread, and reduce it
to per-turn sums in an :class:`~icsd_audit.stats.accumulator.AuditAccumulator` of its
own. The driver merges those parts in batch order (:meth:`AuditAccumulator.merge`),
whatever order they finish in, and bootstraps once, so the numbers are the bits of
``--backend local`` for any number of workers (SPEC 12). A worker holds one batch at a
time, its part a few floats per turn.

A driver that finds Ray already initialized uses that cluster; otherwise it attaches to
``address`` (``auto``, ``ray://...``, ``HOST:PORT``; the cluster's own settings, such
as ``RAY_AUTH_MODE=token``, apply) or starts a local one on the loopback with
``workers`` CPUs, and shuts down what it started. Ray's logs go to stderr (a ``--json``
stdout stays pure JSON); workers' own warnings stay in the workers (the driver opens
the same dumps and warns once).
"""

from __future__ import annotations

import collections
import contextlib
import re
import warnings
from typing import Any, Callable, Iterator, Sequence

__all__ = ["RayUnavailable", "RayUnits", "batch_part", "landscape_part", "ray_parts", "ray_session", "ray_bootstrap",
           "worker_reader"]

_READERS: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()


class RayUnavailable(OSError):
    """``--backend ray`` without Ray installed, or a cluster that cannot be reached: one line."""


def worker_reader(paths: Sequence[str], columns: tuple[str, ...] | None, require: tuple[str, ...]) -> Any:
    """This worker process's reader of ``paths`` (footers read once per process, not once per batch);
    ``columns=None``: every column."""
    from icsd_audit.dumps.reader import DumpReader

    key = (tuple(paths), columns, require)
    if key not in _READERS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the driver has shown them
            _READERS[key] = DumpReader(list(paths), columns=None if columns is None else list(columns),
                                       require=list(require))
        while len(_READERS) > 2:
            _READERS.popitem(last=False)
    return _READERS[key]


def batch_part(paths: Sequence[str], req: Any, statistics: tuple[str, ...], batch_id: int) -> Any:
    """One batch read, allocated and reduced to its own accumulator (what a Ray task runs)."""
    from icsd_audit.alloc.options import required_columns, weighted_batches
    from icsd_audit.audit.batches import add_batch, new_accumulator
    from icsd_audit.audit.threads import one_intra_op_thread

    reader = worker_reader(paths, (req.by,) if req.by else (), tuple(required_columns(req.base.allocator,
                                                                                 req.compare.allocator)))
    acc = new_accumulator(req, statistics)
    with one_intra_op_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch, weights, u in weighted_batches([reader.batch(batch_id)], req.base, req.compare):
            add_batch(acc, reader, req, batch, weights, u)
    return acc


def landscape_part(paths: Sequence[str], req: Any, ranks: Any, grid: int, batch_id: int) -> Any:
    """One batch read, allocated and reduced to its own landscape accumulator on the driver's rank edges."""
    from icsd_audit.alloc.options import required_columns, weighted_batches
    from icsd_audit.audit.threads import one_intra_op_thread
    from icsd_audit.stats.api import LandscapeAccumulator

    reader = worker_reader(paths, ("env",), tuple(required_columns(req.base.allocator, req.compare.allocator)))
    acc = LandscapeAccumulator(grid=grid, base_name=req.base.allocator, compare_name=req.compare.allocator, ranks=ranks)
    with one_intra_op_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch, weights, _ in weighted_batches([reader.batch(batch_id)], req.base, req.compare):
            acc.add(batch.tokens, weights, env=batch.tokens.columns.get("env"))
    return acc


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--backend ray needs Ray: pip install 'icsd-audit[ray]'") from None
    return ray


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A ``HOST:PORT`` (or ``ray://HOST:PORT``) with nothing listening is one line at once (Ray itself retries for
    minutes); ``auto`` and other forms are left to Ray."""
    import socket

    m = re.fullmatch(r"(?:ray://)?(?P<host>\[[^\]]+\]|[^:/\s]+):(?P<port>\d+)", address.strip())
    if m is None:
        return
    try:
        socket.create_connection((m.group("host").strip("[]"), int(m.group("port"))), timeout=timeout).close()
    except OSError as exc:
        raise RayUnavailable(f"--ray-address {address}: no Ray cluster answers there ({exc})") from None


@contextlib.contextmanager
def ray_session(address: str | None = None, workers: int = 1) -> Iterator[Any]:
    """The Ray module with a cluster attached for the block: one already initialized, else ``address``, else a
    local one of ``workers`` CPUs on the loopback (shut down at the end); :func:`ray_parts` inside it reuse it."""
    ray = _ray()
    if ray.is_initialized():
        yield ray
        return
    opts: dict[str, Any] = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        if address:
            _check_reachable(address)
            ray.init(address=address, **opts)
        else:  # a private cluster on this machine, bound to the loopback
            ray.init(num_cpus=max(1, int(workers)), _node_ip_address="127.0.0.1", **opts)
    except RayUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - Ray raises many types (ConnectionError, RuntimeError, auth errors)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RayUnavailable(f"--backend ray: cannot {'reach ' + address if address else 'start a local cluster'}"
                             f" ({type(exc).__name__}: {first})") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def ray_parts(part: Callable[..., Any], paths: Sequence[Any], args: tuple, batch_ids: Sequence[int], *,
              address: str | None = None, workers: int = 1) -> Iterator[Any]:
    """``part(paths, *args, b)`` of every batch ``b`` (:func:`batch_part`, :func:`landscape_part`), computed by Ray
    tasks and yielded in ``batch_ids`` order.

    At most twice as many tasks as the cluster has CPUs are in flight, so the driver
    holds a bounded number of parts whatever order they finish in.
    """
    names = [str(p) for p in paths]
    with ray_session(address, workers) as ray:
        task = ray.remote(num_cpus=1, max_retries=0)(_run_part)
        shared = ray.put(args)  # sent to the object store once, not once per task
        window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        pending: collections.deque = collections.deque()
        todo = iter(batch_ids)
        for b in todo:
            pending.append(task.remote(part, names, shared, int(b)))
            if len(pending) >= window:
                break
        while pending:
            yield _get(ray, pending.popleft())
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(task.remote(part, names, shared, int(nxt)))


class RayUnits:
    """The bootstrap's work units as Ray tasks (a :data:`~icsd_audit.stats.engine.resample.UnitRunner`): the engine (the
    per-turn sums of every family) goes to the object store once per engine, each unit is one task, results come
    back in unit order."""

    def __init__(self, ray: Any):
        self.ray = ray
        self.task = ray.remote(num_cpus=1, max_retries=0)(_run_unit)
        self.engine: Any = None
        self.ref: Any = None
        #: units per call: twice the cluster's CPUs in flight, as the map keeps
        self.units_at_once = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))

    def __call__(self, engine: Any, units: Sequence[int]) -> list[Any]:
        if engine is not self.engine:
            self.engine, self.ref = engine, self.ray.put(engine)
        refs = [self.task.remote(self.ref, int(u)) for u in units]
        return [_get(self.ray, r) for r in refs]


def _run_unit(engine: Any, unit: int) -> Any:
    """One work unit's resampled sums, OpenBLAS on one thread as in the driver's own pool."""
    from icsd_audit.stats.engine.forked import BlasThreads

    with BlasThreads(1):
        return engine.block(unit)


@contextlib.contextmanager
def ray_bootstrap(address: str | None = None, workers: int = 1) -> Iterator[Any]:
    """:func:`ray_session`, and inside it the bootstrap's work units as Ray tasks (:class:`RayUnits`)."""
    from icsd_audit.stats.engine.resample import unit_runner

    with ray_session(address, workers) as ray, unit_runner(RayUnits(ray)):
        yield ray


def _run_part(part: Callable[..., Any], paths: list[str], args: tuple, batch_id: int) -> Any:
    """What a task runs (Ray resolves ``args``, an object reference, before the call)."""
    return part(paths, *args, batch_id)


def _get(ray: Any, ref: Any) -> Any:
    """A task's result; a task's error is raised as itself (a DumpError stays a one-line DumpError)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
