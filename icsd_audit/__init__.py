"""icsd: Influence Calibration for Self-Distillation.

The public surface, in the order data flows through it::

    from icsd_audit import read_dumps, allocate, Weights, tcm

    for tokens in read_dumps("runs/cpu-demo/dumps"):
        out = allocate(tokens, allocator="icsd")
        print(tcm(tokens, Weights(out.g.numpy(), out.c.numpy()), n_resamples=2000, rng=0))

Where things live (each a subpackage):

- ``alloc`` -- the allocators (SDAR trust, ICSD, ablations), calibration, segment maths;
- ``dumps`` -- the Parquet dump schema, reader, writer, synthetic generator, coefficients;
- ``stats`` -- TCM, quadrant shares, share shift, clipping, landscape, token strata, the bootstrap;
- ``grads`` -- gradient sketches and the gradient-cosine compatibility audit;
- ``report`` -- the audit report, its renderers and the paper's figures;
- ``train`` and ``envs`` -- the training loop, models, and the text environments.

The core maths (``alloc``, ``stats`` but ``stats.run`` and ``stats.strata_run``, ``grads.compat``, ``tokens``)
imports only torch, numpy and scipy; I/O, plotting, training and the CLI sit on top.
Names below are imported on first use, so ``import icsd_audit`` stays cheap and pulls
in no I/O or plotting package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from icsd_audit.moved import install as _install_moved
from icsd_audit.version import __version__

_install_moved()  # an old module path says where it moved

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Tokens": "icsd_audit.tokens",
    "Weights": "icsd_audit.tokens",
    "allocate": "icsd_audit.alloc.variants",
    "Allocation": "icsd_audit.alloc.variants",
    "allocator_names": "icsd_audit.alloc.variants",
    "trust_names": "icsd_audit.alloc.variants",
    "AllocatorSettings": "icsd_audit.alloc.settings",
    "AllocatorOptions": "icsd_audit.alloc.options",
    "weight_pair": "icsd_audit.alloc.options",
    "permuted_coefficients": "icsd_audit.alloc.permutation",
    "read_dumps": "icsd_audit.dumps.reader",
    "DumpReader": "icsd_audit.dumps.reader",
    "DumpError": "icsd_audit.dumps.reader",
    "DumpWriter": "icsd_audit.dumps.writer",
    "compute_coefficients": "icsd_audit.audit.coeffs",
    "tcm": "icsd_audit.stats.api",
    "quadrants": "icsd_audit.stats.api",
    "quadrant_shares": "icsd_audit.stats.api",
    "share_shift": "icsd_audit.stats.api",
    "clip_exposure": "icsd_audit.stats.api",
    "audit": "icsd_audit.stats.api",
    "strata": "icsd_audit.stats.strata",
    "StrataResult": "icsd_audit.stats.results",
    "StrataBin": "icsd_audit.stats.results",
    "StrataAccumulator": "icsd_audit.stats.strata",
    "run_strata": "icsd_audit.audit.strata",
    "landscape": "icsd_audit.stats.landscape",
    "AuditAccumulator": "icsd_audit.stats.accumulator",
    "LandscapeAccumulator": "icsd_audit.stats.landscape",
    "run_gradcos": "icsd_audit.audit.gradcos",
    "audit_dumps": "icsd_audit.report.build",
    "write_report": "icsd_audit.report.build",
    "ReportOptions": "icsd_audit.report.results",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'icsd_audit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from icsd_audit.alloc.options import AllocatorOptions, weight_pair
    from icsd_audit.alloc.permutation import permuted_coefficients
    from icsd_audit.alloc.settings import AllocatorSettings
    from icsd_audit.alloc.variants import Allocation, allocate, allocator_names, trust_names
    from icsd_audit.audit.coeffs import compute_coefficients
    from icsd_audit.dumps.reader import DumpError, DumpReader, read_dumps
    from icsd_audit.dumps.writer import DumpWriter
    from icsd_audit.audit.gradcos import run_gradcos
    from icsd_audit.report.build import audit_dumps, write_report
    from icsd_audit.report.results import ReportOptions
    from icsd_audit.stats.accumulator import AuditAccumulator
    from icsd_audit.stats.api import audit, clip_exposure, quadrant_shares, quadrants, share_shift, tcm
    from icsd_audit.stats.landscape import LandscapeAccumulator, landscape
    from icsd_audit.stats.strata import StrataAccumulator, strata
    from icsd_audit.stats.results import StrataBin, StrataResult
    from icsd_audit.audit.strata import run_strata
    from icsd_audit.tokens import Tokens, Weights
