"""Bootstrap blocks in forked worker processes (Linux): parallel where threads are not.

The block engine (:mod:`icsd_audit.stats.engine.resample`) is many NumPy calls on arrays of
64k elements; several of them hold the GIL (``np.add.at``, ``flatnonzero``, the
Generator's draws), so worker *threads* ran no faster than one thread on the 2-core
dev box (1.34 s vs 1.40 s for 10,000 resamples of 48k clusters), while two
*processes* ran the same blocks about 1.6x as fast.  So each extra worker is a child
forked once, after the engine is built: it inherits the engine's arrays copy-on-write
and takes block numbers from a shared queue (a pipe holding every block number as one
8-byte record, read 8 bytes at a time: a pipe read is served whole under the pipe's
lock), as the parent does, so a slower core simply takes fewer blocks.  A child works out ``block(b)`` (the same function on the
same inputs as in the parent, so the same bits) and streams ``(b, bytes)`` back
through its pipe; the parent hands out the blocks in order, whoever computed them.
A child touches nothing else and leaves with ``os._exit``.

:class:`BlasThreads` pins OpenBLAS's thread count around the blocks' many thin products (a no-op where NumPy's
OpenBLAS cannot be found; numpy + ctypes).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import struct
import sys
import warnings
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["fork_available", "ForkedBlocks", "BlasThreads"]

_HEADER = struct.Struct("<qq")  # block number, payload bytes
_RECORD = struct.Struct("<q")  # one block number in the work queue
_MAX_QUEUE = 1 << 20  # Linux's default pipe-max-size: up to 131,072 blocks (2M resamples) per run


def fork_available(n_blocks: int = 0) -> bool:
    """Whether blocks may run in forked children: Linux only (fork is unsafe on macOS, absent on
    Windows), and a work queue of ``n_blocks`` records that fits one pipe."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and n_blocks * _RECORD.size <= _MAX_QUEUE


class ForkedBlocks:
    """``block(b) -> ndarray`` (of ``shape`` and ``dtype``) for b = 0 .. n_blocks-1, shared with ``workers - 1`` children.

    :meth:`take` returns the arrays of the requested blocks, which must be asked for in
    increasing order (chunk after chunk).  Use as a context manager: leaving it early
    (an error, a consumer that stops) kills and reaps the children.
    """

    def __init__(self, block: Callable[[int], np.ndarray], n_blocks: int, workers: int, *,
                 shape: tuple[int, ...], dtype: np.dtype | type = np.float64):
        self.block, self.n_blocks, self.workers = block, int(n_blocks), max(1, int(workers))
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.children: dict[int, int] = {}  # read end -> pid
        self.open: set[int] = set()  # read ends not at end-of-file yet
        self.pending: dict[int, bytearray] = {}  # read end -> bytes received and not yet parsed
        self.ready: dict[int, np.ndarray] = {}  # block -> result, until handed out
        self.queue: int | None = None  # read end of the work queue
        self.exhausted = False

    # ------------------------------------------------------------------ work queue
    def _grab(self) -> int:
        """The next block number nobody has taken; ``n_blocks`` once the queue is empty."""
        data = os.read(self.queue, _RECORD.size) if not self.exhausted else b""
        if len(data) != _RECORD.size:  # end of file: every block has been taken
            self.exhausted = True
            return self.n_blocks
        return _RECORD.unpack(data)[0]

    def _fill_queue(self) -> None:
        r, w = os.pipe()
        size = self.n_blocks * _RECORD.size
        if size > 1 << 16:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
        payload = np.arange(self.n_blocks, dtype="<i8").tobytes()
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view):]
        os.close(w)  # readers see end-of-file once the records are gone
        self.queue = r

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> "ForkedBlocks":
        self._fill_queue()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python >= 3.12: "process is multi-threaded"
            for _ in range(1, self.workers):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(r)
                    self._child(w)  # never returns
                os.close(w)
                self.children[r] = pid
                self.open.add(r)
                self.pending[r] = bytearray()
        return self

    def _child(self, w: int) -> None:
        status = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a child quietly; the parent cleans up
            for fd in list(self.children):  # the read ends of earlier children's pipes are not ours
                os.close(fd)
            with os.fdopen(w, "wb", buffering=1 << 16) as out:
                while (b := self._grab()) < self.n_blocks:
                    a = np.ascontiguousarray(self.block(b), dtype=self.dtype)
                    out.write(_HEADER.pack(b, a.nbytes))
                    out.write(a.data)
                    out.flush()  # the parent may be waiting for exactly this block
        except BaseException:  # noqa: BLE001 - the parent reports the failure; a child must never unwind
            status = 1
        os._exit(status)

    def __exit__(self, *exc: object) -> None:
        done = exc[0] is None and self.exhausted
        failed = []
        for fd, pid in self.children.items():
            os.close(fd)
            if not done:
                with contextlib.suppress(ProcessLookupError):  # it has already ended
                    os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            if done and status != 0:
                failed.append(status)
        self.children, self.open, self.pending = {}, set(), {}
        if self.queue is not None:
            os.close(self.queue)
            self.queue = None
        if failed:
            raise RuntimeError(f"a bootstrap worker process failed (wait status {failed[0]})")

    # ------------------------------------------------------------------ results
    def _receive(self, timeout: float | None) -> None:
        """Read what the children have sent (waiting up to ``timeout`` s; None: until something comes)."""
        if not self.open:
            raise RuntimeError("a bootstrap worker process ended without sending a block it took (killed, or out of memory)")
        # poll, not select: select cannot watch a descriptor numbered 1024 or more, and a report over a long
        # run's dumps holds over a thousand shard files open before the workers' pipes are made
        poller = select.poll()
        for fd in self.open:
            poller.register(fd, select.POLLIN)
        events = poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
        for fd in sorted({fd for fd, _ in events}):
            data = os.read(fd, 1 << 20)
            if not data:  # this child has no blocks left (or died: then a block stays missing, see above)
                self.open.discard(fd)
                continue
            buf = self.pending[fd]
            buf += data
            while len(buf) >= _HEADER.size:
                b, size = _HEADER.unpack_from(buf)
                if size != self.nbytes:
                    raise RuntimeError(f"a bootstrap worker process sent {size} bytes for a block, expected {self.nbytes}")
                if len(buf) < _HEADER.size + size:
                    break
                self.ready[b] = np.frombuffer(bytes(buf[_HEADER.size:_HEADER.size + size]), dtype=self.dtype).reshape(self.shape)
                del buf[:_HEADER.size + size]

    def take(self, blocks: Sequence[int]) -> list[np.ndarray]:
        """The results of ``blocks`` in that order: computed here, or received from a child."""
        missing = [b for b in blocks if b not in self.ready]
        while missing:
            b = self._grab()
            if b < self.n_blocks:
                self.ready[b] = self.block(b)
                if self.open:
                    self._receive(0.0)  # keep the children's pipes flowing
            else:
                self._receive(None)
            missing = [b for b in missing if b not in self.ready]
        return [self.ready.pop(b) for b in blocks]


class BlasThreads:
    """Pin OpenBLAS (as loaded by NumPy) to a number of threads, restoring it after.

    The resampled sums are many thin products (16 x n) @ (n x K); multi-threaded
    OpenBLAS spends more on synchronisation than on them (and collapses on a busy
    machine), while one thread runs them at memory speed.  A no-op where the
    library cannot be found.
    """

    _lib: Any = None
    _looked = False

    @classmethod
    def _find(cls) -> Any:
        if not cls._looked:
            cls._looked = True
            try:
                import ctypes
                import glob
                import os

                base = os.path.dirname(np.__file__)
                cands = []
                for d in (os.path.join(base, os.pardir, "numpy.libs"), os.path.join(base, ".dylibs"), base):
                    cands += glob.glob(os.path.join(d, "*openblas*"))
                for path in cands:
                    lib = ctypes.CDLL(path)
                    for suffix in ("scipy_openblas_{}_num_threads64_", "openblas_{}_num_threads64_", "openblas_{}_num_threads"):
                        get, set_ = suffix.format("get"), suffix.format("set")
                        if hasattr(lib, get) and hasattr(lib, set_):
                            getf, setf = getattr(lib, get), getattr(lib, set_)
                            getf.restype = ctypes.c_int
                            cls._lib = (getf, setf)
                            return cls._lib
            except Exception:  # pragma: no cover - platform dependent
                cls._lib = None
        return cls._lib

    def __init__(self, n: int = 1):
        self.n = n
        self.saved: int | None = None

    def __enter__(self) -> "BlasThreads":
        lib = self._find()
        if lib is not None:
            try:
                self.saved = int(lib[0]())
                lib[1](self.n)
            except Exception:  # pragma: no cover
                self.saved = None
        return self

    def __exit__(self, *exc: Any) -> None:
        lib = self._find()
        if lib is not None and self.saved is not None:
            lib[1](self.saved)
