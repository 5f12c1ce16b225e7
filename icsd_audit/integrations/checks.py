"""Input checks every engine entry point runs before it allocates or writes anything.

An engine batch reaches the allocator as padded tensors plus per-row ids.  A NaN
advantage on one valid token silently moves ``c`` on every token of its calibration
group, and a NaN or ``-inf`` teacher log-prob makes ``c`` (and the loss) NaN, so bad
values are refused here, in one line that names the batch key the user filled, the
row, the response token and the user's own trajectory id (``traj_uid``, verl's key,
...), never the 63-bit hash the dumps store.

Only valid tokens (mask 1) are checked for finiteness: padding may hold anything.

Imports only torch and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["EngineUnavailable", "BatchInputError", "TrajNames", "check_mask", "check_values", "check_row_ids", "check_turn_ids"]


class BatchInputError(ValueError):
    """A batch handed to an engine entry point holds a value the allocation cannot use (one line)."""


@dataclass(frozen=True)
class TrajNames:
    """How the user names each row's trajectory: the key (``traj_uid``, ``key``, ...) and one value per row.

    Formatting happens only when an error is raised, so building one costs nothing.
    """

    key: str
    values: Sequence[Any]

    def __call__(self, row: int) -> str:
        return f"{self.key} {self.values[row]!r}"


def _where(row: int, names: TrajNames | None) -> str:
    return f"row {row}" + (f" ({names(row)})" if names is not None else "")


def check_mask(name: str, mask: Any) -> Tensor:
    """The response mask as a ``[B, T]`` bool tensor; anything else is a one-line error naming ``name``."""
    m = torch.as_tensor(mask)
    if m.dim() != 2:
        raise BatchInputError(f"{name} must be a [rows, tokens] mask, got shape {tuple(m.shape)}")
    if m.dtype != torch.bool:
        bad = (m != 0) & (m != 1)
        if bool(bad.any()):
            r, t = (int(i) for i in torch.nonzero(bad)[0])
            raise BatchInputError(f"{name} must hold 0/1, got {m[r, t].item()!r} at row {r}, token {t}")
        m = m.bool()
    return m


def check_values(name: str, x: Any, mask: Tensor, *, names: TrajNames | None = None,
                 allow_rows: bool = True, allow_scalar: bool = False) -> Tensor:
    """``x`` checked against the ``[B, T]`` mask: its shape, then finiteness on every valid token.

    ``x`` may be ``[B, T]``, ``[B]`` (one value per row) when ``allow_rows``, or a scalar
    when ``allow_scalar``.  Returns it as a tensor (not copied when it already is one).
    """
    B, T = mask.shape
    t = torch.as_tensor(x)
    if t.dim() == 0 and allow_scalar:
        if not bool(torch.isfinite(t)):
            raise BatchInputError(f"{name} is {t.item()}: it must be finite")
        return t
    if t.shape == (B, T):
        if not t.is_floating_point():
            return t
        bad = ~torch.isfinite(t) & mask.to(t.device)
    elif allow_rows and t.shape == (B,):
        if not t.is_floating_point():
            return t
        bad = (~torch.isfinite(t) & mask.any(dim=1).to(t.device)).view(-1, 1) & mask.to(t.device)
    else:
        fits = f"the mask's shape {(B, T)}" + (f" or one value per row ({B},)" if allow_rows else "")
        raise BatchInputError(f"{name} has shape {tuple(t.shape)}; it must have {fits}")
    if bool(bad.any()):
        r, k = (int(i) for i in torch.nonzero(bad)[0])
        v = (t[r, k] if t.dim() == 2 else t[r]).item()
        pos = int(mask[r, :k].sum())
        raise BatchInputError(f"{name} is {v} at {_where(r, names)}, response token {pos}: values on valid tokens "
                              "must be finite")
    return t


def check_row_ids(name: str, ids: Any, n_rows: int) -> np.ndarray:
    """Per-row trajectory ids (any hashable values: strings, ints) as a 1-D array of ``n_rows``."""
    a = np.asarray(ids, dtype=object) if not isinstance(ids, np.ndarray) else ids
    if a.ndim != 1 or a.shape[0] != n_rows:
        raise BatchInputError(f"{name} has shape {tuple(a.shape)}; it must hold one id per row ({n_rows},)")
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise BatchInputError(f"{name} must hold whole numbers or strings, got {a[r]!r} at row {r}")
    elif a.dtype.kind == "O":
        for r, v in enumerate(a.tolist()):  # once per row, to name the first bad one
            if v is None or (isinstance(v, float) and (not np.isfinite(v) or v != int(v))):
                raise BatchInputError(f"{name} must hold whole numbers or strings, got {v!r} at row {r}")
    return a


def _whole(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    return isinstance(v, (float, np.floating)) and bool(np.isfinite(v)) and float(v) == int(v)


def check_turn_ids(name: str, ids: Any, n_rows: int, *, names: TrajNames | None = None) -> np.ndarray:
    """Per-row 0-based turn indices as an int64 array of ``n_rows`` (integers only: ``'1'`` or ``1.5`` is an error)."""
    a = np.asarray(ids)
    if a.ndim != 1 or a.shape[0] != n_rows:
        raise BatchInputError(f"{name} has shape {tuple(a.shape)}; it must hold one turn index per row ({n_rows},)")
    if a.dtype.kind in "iu":
        out = a.astype(np.int64)
    else:  # floats holding whole numbers pass; strings, bools, None and fractions do not
        values = a.tolist()
        ok = [_whole(v) for v in values]
        if not all(ok):
            r = ok.index(False)
            raise BatchInputError(f"{name} must hold integer turn indices, got {values[r]!r} at {_where(r, names)}")
        out = np.asarray([int(v) for v in values], dtype=np.int64)
    if out.size and int(out.min()) < 0:
        r = int(np.flatnonzero(out < 0)[0])
        raise BatchInputError(f"{name} must hold turn indices >= 0, got {int(out[r])} at {_where(r, names)}")
    return out


class EngineUnavailable(ValueError):
    """The engine cannot run here (missing package or hardware); the message says what it needs."""
