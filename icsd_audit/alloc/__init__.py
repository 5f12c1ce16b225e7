"""The allocators (SPEC sections 2-5): pure, vectorized torch functions over flat token arrays.

- :mod:`~icsd_audit.alloc.variants` -- :func:`allocate`, the registry of allocators and
  trusts (SDAR, ICSD and the ablation variants), :class:`Allocation`;
- :mod:`~icsd_audit.alloc.calibration` -- the asymmetric Laplace (and Gaussian) maps;
- :mod:`~icsd_audit.alloc.segments` -- per-turn and per-group reductions without loops;
- :mod:`~icsd_audit.alloc.permutation` -- the permuted controls, many shuffles at once;
- :mod:`~icsd_audit.alloc.options` -- an audit's allocator settings and one batch's allocation.

Imports only torch and numpy: training and the offline audit share these functions.
"""

from __future__ import annotations

from icsd_audit.alloc.options import AllocatorOptions, allocate_batch, weight_pair
from icsd_audit.alloc.variants import (
    Allocation, AllocationDiagnostics, AllocatorSpec, allocate, allocator_names, register_allocator, trust_names,
)

__all__ = ["allocate", "Allocation", "AllocationDiagnostics", "AllocatorSpec", "allocator_names", "trust_names",
           "register_allocator", "AllocatorOptions", "allocate_batch", "weight_pair"]
