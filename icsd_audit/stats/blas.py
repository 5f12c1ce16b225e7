"""Pinning OpenBLAS's thread count around the bootstrap's many thin matrix products.

Pure numpy + ctypes; a no-op where NumPy's OpenBLAS cannot be found.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["BlasThreads"]


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
