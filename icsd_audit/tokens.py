"""The token object that travels through the audit: the reader yields it, the allocator
consumes it, the statistics take it.

Why one object: every statistic, the allocator and the gradient cosines read the same
aligned per-token arrays (ids, advantage, ratio, delta, the valid mask).  Passing them as
one frozen value keeps call sites from spelling ten arrays and keeps the arrays aligned
by construction: :class:`Tokens` checks once that every array is 1-D and of one length.

Arrays may be numpy arrays or torch tensors; :meth:`Tokens.numpy` and
:meth:`Tokens.torch` convert without copying where the dtype allows.  This module
imports numpy only (torch lazily), so it sits in the core with the maths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["Tokens", "Weights", "REQUIRED_FIELDS"]

#: the per-token arrays every token object carries (``batch_id`` and ``valid`` get defaults)
REQUIRED_FIELDS = ("advantage", "ratio", "delta", "traj_id", "turn_id")
_ARRAY_FIELDS = (*REQUIRED_FIELDS, "batch_id", "valid", "u")


def _length(name: str, x: Any) -> int:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected a 1-D numpy array or torch tensor, got {type(x).__name__}")
    if len(shape) != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {tuple(shape)}")
    return int(shape[0])


@dataclass(frozen=True)
class Tokens:
    """Aligned 1-D per-token arrays of one or more batches.

    An action turn is (batch_id, traj_id, turn_id); statistics never cross batches.

    Attributes:
        advantage, ratio, delta: per-token floats (A, rho, delta = teacher - student log-prob).
        traj_id, turn_id: integer ids of the trajectory and of the turn inside it.
        batch_id: integer batch ids; ``None`` means one batch.
        valid: bool mask; ``None`` means every row is valid.  Invalid rows enter no
            allocation and no statistic.
        u: the influence A * rho * delta when already computed (by the allocator that
            produced the weights); ``None`` lets each consumer compute it in float64.
        columns: optional aligned per-token columns by name (``pos``, ``step``, ``env``,
            ``task``, ...): what the reader was asked for and found.
    """

    advantage: Any
    ratio: Any
    delta: Any
    traj_id: Any
    turn_id: Any
    batch_id: Any = None
    valid: Any = None
    u: Any = None
    columns: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = _length("advantage", self.advantage)
        for name in _ARRAY_FIELDS[1:]:
            x = getattr(self, name)
            if x is not None and _length(name, x) != n:
                raise ValueError(f"{name}: length {_length(name, x)} differs from advantage's {n}")
        for name, x in self.columns.items():
            if _length(name, x) != n:
                raise ValueError(f"column {name!r}: length {_length(name, x)} differs from advantage's {n}")

    def __len__(self) -> int:
        return _length("advantage", self.advantage)

    @property
    def n(self) -> int:
        """Number of rows (valid or not)."""
        return len(self)

    def column(self, name: str) -> Any:
        """Optional column ``name``; a one-line KeyError naming what is there when absent."""
        try:
            return self.columns[name]
        except KeyError:
            have = ", ".join(sorted(self.columns)) or "none"
            raise KeyError(f"tokens carry no {name!r} column (have: {have})") from None

    def replace(self, **changes: Any) -> Tokens:
        """A copy with some fields replaced (e.g. ``tokens.replace(u=alloc.u)``)."""
        return dataclasses.replace(self, **changes)

    def numpy(self) -> Tokens:
        """The same tokens as numpy arrays (zero-copy for CPU tensors)."""
        conv = {k: _to_numpy(getattr(self, k)) for k in _ARRAY_FIELDS}
        return Tokens(**conv, columns={k: _to_numpy(v) for k, v in self.columns.items()})

    def torch(self) -> Tokens:
        """The same tokens as CPU torch tensors (zero-copy from numpy); optional columns kept as they are."""
        return Tokens(**{k: _to_torch(getattr(self, k)) for k in _ARRAY_FIELDS}, columns=self.columns)

    @classmethod
    def from_mapping(cls, arrays: Mapping[str, Any], *, columns: Mapping[str, Any] | None = None) -> Tokens:
        """Tokens from a mapping holding at least :data:`REQUIRED_FIELDS`; other known fields are taken too."""
        missing = [k for k in REQUIRED_FIELDS if k not in arrays]
        if missing:
            raise KeyError(f"missing token arrays: {', '.join(missing)}")
        return cls(**{k: arrays[k] for k in _ARRAY_FIELDS if k in arrays}, columns=dict(columns or {}))


@dataclass(frozen=True)
class Weights:
    """Two non-negative per-token weightings the statistics compare, with their labels.

    ``base`` is the reference side of every difference (SDAR's trust ``g`` by default),
    ``compare`` the weighting under study (ICSD's ``c``); any two allocators' weights work.
    """

    base: Any
    compare: Any
    base_name: str = "sdar"
    compare_name: str = "icsd"


def _to_numpy(x: Any) -> Any:
    if x is None or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _to_torch(x: Any) -> torch.Tensor | None:
    import torch

    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.ascontiguousarray(x))
