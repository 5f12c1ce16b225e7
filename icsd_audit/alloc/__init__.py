"""The allocators (SPEC sections 2-5): pure, vectorized torch functions over flat token arrays.

- :mod:`~icsd_audit.alloc.settings` -- :class:`AllocatorSettings`, the one settings object (validated once);
- :mod:`~icsd_audit.alloc.variants` -- :func:`allocate`, turn mass matching, :class:`Allocation`;
- :mod:`~icsd_audit.alloc.registry` -- the registries of allocators and trust maps;
- :mod:`~icsd_audit.alloc.trust` and :mod:`~icsd_audit.alloc.scores` -- the trust maps and scores, each
  registered where it is defined;
- :mod:`~icsd_audit.alloc.layout` -- valid-token selection and segment layouts;
- :mod:`~icsd_audit.alloc.calibration` -- the asymmetric Laplace (and Gaussian) maps;
- :mod:`~icsd_audit.alloc.segments` -- per-turn and per-group reductions without loops;
- :mod:`~icsd_audit.alloc.permutation` -- the permuted controls, many shuffles at once;
- :mod:`~icsd_audit.alloc.options` -- one batch's allocation in an audit.

Imports only torch and numpy: training and the offline audit share these functions. The names below load on
first use, so ``icsd_audit.alloc.settings`` (and the CLI's help) imports no torch.
"""

from __future__ import annotations

from icsd_audit.lazy import lazy_getattr

_EXPORTS = {
    "allocate": "icsd_audit.alloc.variants", "Allocation": "icsd_audit.alloc.variants",
    "AllocationDiagnostics": "icsd_audit.alloc.variants",
    "AllocatorSpec": "icsd_audit.alloc.registry", "allocator_names": "icsd_audit.alloc.registry",
    "trust_names": "icsd_audit.alloc.registry", "register_allocator": "icsd_audit.alloc.registry",
    "AllocatorSettings": "icsd_audit.alloc.settings", "AllocatorOptions": "icsd_audit.alloc.options",
    "allocate_batch": "icsd_audit.alloc.options", "weight_pair": "icsd_audit.alloc.options",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
