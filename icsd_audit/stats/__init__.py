"""Audit statistics (SPEC sections 6-7): TCM, quadrant shares, share shift, clipping exposure
and the landscape, with action-turn bootstrap intervals.

- :mod:`~icsd_audit.stats.api` -- the one-call functions (:func:`tcm`, :func:`quadrants`, ...);
- :mod:`~icsd_audit.stats.accumulator` -- :class:`AuditAccumulator`, batch by batch, one
  set of resamples for every statistic;
- :mod:`~icsd_audit.stats.turns` -- per-turn sufficient statistics;
- :mod:`~icsd_audit.stats.bootstrap` and :mod:`~icsd_audit.stats.engine.resample` -- the bootstrap
  engine (:mod:`~icsd_audit.stats.engine.forked`: its worker processes, and BLAS threads pinned);
- :mod:`~icsd_audit.stats.landscape` -- the joint mid-rank grid;
- :mod:`~icsd_audit.stats.results` -- frozen result objects and their JSON;
- :mod:`~icsd_audit.stats.signs` -- the share of mass by the sign of delta (needs no advantage);
- :mod:`~icsd_audit.stats.strata` -- token strata by a per-token covariate (SPEC 11), results
  in :mod:`~icsd_audit.stats.results`.

Everything here imports only numpy (and scipy); reading dumps is the audit layer's (:mod:`icsd_audit.audit`).
"""

from icsd_audit.stats.api import *  # noqa: F401,F403
from icsd_audit.stats.api import __all__  # noqa: F401
