"""What a gradient sketch stores, and how to rebuild it: projections, seeds, columns, results.

Split from :mod:`icsd_audit.grads.sketch` (the hooks) so that a reader of dumps needs only
this and numpy/torch: the seeded projections can be regenerated from the Parquet
metadata alone (:func:`projection_matrix` with a layer's kind, k, d and seed), and
:class:`SketchResult` is the per-step product the trainer writes.  Everything here is
re-exported by :mod:`icsd_audit.grads.sketch`; see ``docs/gradients.md``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DEFAULT_K",
    "DENSE_GRAD_COLUMN",
    "SKETCH_COLUMN_PREFIX",
    "SKETCH_METADATA_KEY",
    "SKETCH_FORMAT_VERSION",
    "ProjectionKind",
    "LayerSketchSpec",
    "SketchResult",
    "layer_seed",
    "projection_matrix",
    "sketch_column_names",
    "arrow_fixed_size_list",
]

DEFAULT_K = 128
SKETCH_COLUMN_PREFIX = "sketch"
DENSE_GRAD_COLUMN = "grad"
SKETCH_METADATA_KEY = "icsd.sketch"
SKETCH_FORMAT_VERSION = 1

ProjectionKind = Literal["gaussian", "rademacher", "identity"]


# --------------------------------------------------------------------------- projections


def layer_seed(seed: int, layer: str, side: str) -> int:
    """Stable 63-bit seed for one side ("out"/"in") of one layer.

    Derived from the base seed and the layer's name (not its position in a list), so
    adding or removing sketched layers never changes another layer's projection.
    """
    digest = hashlib.sha256(f"icsd-sketch:{int(seed)}:{layer}:{side}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def projection_matrix(
    kind: ProjectionKind, k: int, d: int, seed: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """A (k, d) projection with E[P^T P] = I_d, generated on CPU from ``seed``.

    ``gaussian``: i.i.d. N(0, 1/k); ``rademacher``: i.i.d. +-1/sqrt(k);
    ``identity``: the d x d identity (requires k == d; exact, for validation).
    """
    if k <= 0 or d <= 0:
        raise ValueError(f"projection dims must be positive, got k={k}, d={d}")
    if kind == "identity":
        if k != d:
            raise ValueError(f"identity projection needs k == d, got k={k}, d={d}")
        return torch.eye(d, dtype=dtype)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    if kind == "gaussian":
        mat = torch.randn(k, d, generator=gen, dtype=torch.float64)
    elif kind == "rademacher":
        mat = torch.randint(0, 2, (k, d), generator=gen, dtype=torch.int8).to(torch.float64) * 2 - 1
    else:
        raise ValueError(f"unknown projection kind {kind!r}; use gaussian, rademacher or identity")
    return (mat / math.sqrt(k)).to(dtype)


# --------------------------------------------------------------------------- columns


def sketch_column_names(layer: str, prefix: str = SKETCH_COLUMN_PREFIX) -> tuple[str, str]:
    """Parquet column names of one layer's output-side and input-side factors."""
    return f"{prefix}.{layer}.out", f"{prefix}.{layer}.in"


def arrow_fixed_size_list(values: Any):
    """A (n, k) float array as a pyarrow ``fixed_size_list<float32>[k]`` array (lazy import)."""
    import pyarrow as pa

    arr = np.ascontiguousarray(_to_numpy(values), dtype=np.float32)
    if arr.ndim != 2:
        raise ValueError(f"expected a 2-D (n, k) array, got shape {arr.shape}")
    return pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1), type=pa.float32()), arr.shape[1])


def _to_numpy(values: Any) -> np.ndarray:
    if isinstance(values, Tensor):
        return values.detach().to("cpu", torch.float32).numpy()
    return np.asarray(values)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class LayerSketchSpec:
    """One sketched linear layer: dims (input side includes the bias column) and seeds."""

    name: str
    d_out: int
    d_in: int
    has_bias: bool
    k_out: int
    k_in: int
    seed_out: int
    seed_in: int
    is_lm_head: bool

    def as_dict(self) -> dict[str, Any]:
        out_col, in_col = sketch_column_names(self.name)
        return {
            "name": self.name,
            "d_out": self.d_out,
            "d_in": self.d_in,
            "has_bias": self.has_bias,
            "k_out": self.k_out,
            "k_in": self.k_in,
            "seed_out": self.seed_out,
            "seed_in": self.seed_in,
            "is_lm_head": self.is_lm_head,
            "column_out": out_col,
            "column_in": in_col,
        }


@dataclass
class SketchResult:
    """Per-token factors of one step: ``layers[name] = (U (n, k_out), V (n, k_in))``.

    Rows are the selected positions in row-major (batch, position) order.  The
    sketched gradient of sum_t w_t log pi(a_t | x_t) for layer l is U_l^T diag(w) V_l.
    """

    layers: dict[str, tuple[Tensor, Tensor]]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        for u, _ in self.layers.values():
            return int(u.shape[0])
        return 0

    def to(self, device: torch.device | str) -> SketchResult:
        return SketchResult({k: (u.to(device), v.to(device)) for k, (u, v) in self.layers.items()}, dict(self.metadata))

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """The mapping :func:`icsd_audit.grads.compat.cosines` takes."""
        return dict(self.layers)

    def columns(self, prefix: str = SKETCH_COLUMN_PREFIX) -> dict[str, np.ndarray]:
        """Parquet-friendly columns: ``{prefix}.{layer}.out`` / ``.in`` as float32 (n, k) arrays."""
        cols: dict[str, np.ndarray] = {}
        for name, (u, v) in self.layers.items():
            out_col, in_col = sketch_column_names(name, prefix)
            cols[out_col] = np.ascontiguousarray(_to_numpy(u), dtype=np.float32)
            cols[in_col] = np.ascontiguousarray(_to_numpy(v), dtype=np.float32)
        return cols

    def arrow_columns(self, prefix: str = SKETCH_COLUMN_PREFIX) -> dict[str, Any]:
        """As :meth:`columns`, as pyarrow ``fixed_size_list<float32>`` arrays."""
        return {k: arrow_fixed_size_list(v) for k, v in self.columns(prefix).items()}

    def metadata_json(self) -> str:
        """The value to store under the Parquet key-value metadata key ``icsd.sketch``."""
        return json.dumps(self.metadata, sort_keys=True)

    @staticmethod
    def cat(results: Sequence[SketchResult]) -> SketchResult:
        """Concatenate the tokens of several steps/micro-batches sketched with the same projections."""
        if not results:
            raise ValueError("nothing to concatenate")
        names = list(results[0].layers)
        for r in results[1:]:
            if list(r.layers) != names:
                raise ValueError("results sketch different layers")
        layers = {
            n: (torch.cat([r.layers[n][0] for r in results]), torch.cat([r.layers[n][1] for r in results]))
            for n in names
        }
        return SketchResult(layers, dict(results[0].metadata))
