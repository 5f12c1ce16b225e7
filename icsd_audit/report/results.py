"""What the audit report holds: its options and the frozen result it renders.

Kept apart from :mod:`icsd_audit.report.build` (which computes a report) so that
the renderers import result types, never the module that calls them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from icsd_audit.alloc.settings import DEFAULTS
from icsd_audit.alloc.options import AllocatorOptions
from icsd_audit.audit.gradcos import GradcosSummary
from icsd_audit.stats import AuditResults, GroupedResult, LandscapeResult
from icsd_audit.stats.results import StrataResult
from icsd_audit.stats.signs import SignSharesResult

__all__ = ["ReportOptions", "AuditReport", "FIGURE_NAMES", "REPORT_SCHEMA", "FIGURE_FORMATS", "REPORT_FILES",
           "report_owns", "figures_own"]

#: figure file stems, in the order the report shows them
FIGURE_NAMES = ("quadrants", "landscape", "shift", "strata", "alignment", "dynamics")
FIGURE_FORMATS = ("png", "pdf", "svg")
REPORT_FILES = ("summary.json", "summary.md", "report.html")
REPORT_SCHEMA = {"schema": "icsd.audit_report", "version": 1}


def _leftover(rel: str) -> bool:
    """A temporary of an interrupted atomic write (``.NAME.<random>.tmp``)."""
    name = rel.rsplit("/", 1)[-1]
    return name.startswith(".") and name.endswith(".tmp")


def figures_own(rel: str) -> bool:
    """Whether ``rel`` (a path inside a figures directory) is a file ``write_figures`` writes."""
    stem, _, ext = rel.rpartition(".")
    return (stem in FIGURE_NAMES and ext in FIGURE_FORMATS) or ("/" not in rel and _leftover(rel))


def report_owns(rel: str) -> bool:
    """Whether ``rel`` (a path inside a report directory) is a file ``write_report`` writes."""
    return (rel in REPORT_FILES or _leftover(rel)
            or (rel.startswith("figures/") and figures_own(rel[len("figures/"):])))


@dataclass(frozen=True)
class ReportOptions:
    """Allocators compared and statistic settings (SPEC defaults).

    ``eps`` is both the allocator scale floor and the TCM activity threshold, as in
    SPEC sections 2 and 6.  ``permutations``: shuffles of the permuted control in
    the gradient compatibility (only when ``compare`` is ICSD, the allocation the
    ``permuted`` variant shuffles).
    """

    base: str = "sdar"
    compare: str = "icsd"
    trust: str = DEFAULTS.trust
    trust_beta: float = DEFAULTS.trust_beta
    trust_eta: float = DEFAULTS.trust_eta
    influence_eta: float = DEFAULTS.influence_eta
    min_group: int = DEFAULTS.min_group
    eps: float = DEFAULTS.eps
    seed: int = 0
    #: seed of the ``permuted`` allocator on either side (``None``: ``seed``, which also seeds the bootstraps)
    alloc_seed: int | None = None
    n_resamples: int = 10_000
    confidence_level: float = 0.95
    grid: int = 20
    n_bins: int = 5
    clip_eps: float = 0.2
    dual_clip: float = 3.0
    permutations: int = 20
    jackknife_blocks: int = 8
    #: quantile bins of the token-strata section (SPEC 11; its top-20 % split comes with it); 0 omits the section
    strata_bins: int = 10

    def __post_init__(self) -> None:
        # fail before streaming gigabytes, not at the bootstrap after it; the allocator settings are checked by
        # the one object that holds them
        for side in ("base", "compare"):
            try:
                self.allocator(getattr(self, side))
            except ValueError as e:
                raise ValueError(f"{side}: {e}") from None
        if self.base == self.compare:
            raise ValueError(f"base and compare must differ, both are {self.base!r}")
        if not 0 < self.confidence_level < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence_level}")
        for name in ("n_resamples", "grid", "n_bins"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.permutations < 0:
            raise ValueError(f"permutations must be >= 0, got {self.permutations}")
        if isinstance(self.strata_bins, bool) or not isinstance(self.strata_bins, int) or self.strata_bins < 0:
            raise ValueError(f"strata_bins must be an integer >= 0, got {self.strata_bins!r}")
        from icsd_audit.stats.budget import LANDSCAPE_STATISTICS, audit_statistic_count, check_bootstrap, check_grid

        check_grid(self.grid)
        check_bootstrap(self.n_resamples, audit_statistic_count(("tcm", "quadrants", "shift", "clip"), self.n_bins)
                        + LANDSCAPE_STATISTICS)

    def allocator(self, name: str, seed: int | None = None) -> AllocatorOptions:
        if seed is None:
            seed = self.seed if self.alloc_seed is None else self.alloc_seed
        return AllocatorOptions(allocator=name, trust=self.trust, trust_beta=self.trust_beta, trust_eta=self.trust_eta,
                                influence_eta=self.influence_eta, min_group=self.min_group, eps=self.eps, seed=seed)

    @classmethod
    def deployed(cls, base: AllocatorOptions, compare: AllocatorOptions, **options: Any) -> "ReportOptions":
        """Report options for the pair of :meth:`~icsd_audit.audit.settings.AuditSettings.pair` (the two share
        every setting); ``options``: the other fields (``n_resamples``, ``seed``, ...)."""
        return cls(base=base.allocator, compare=compare.allocator, trust=compare.trust, trust_beta=compare.trust_beta,
                   trust_eta=compare.trust_eta, influence_eta=compare.influence_eta, min_group=compare.min_group,
                   eps=compare.eps, alloc_seed=compare.seed, **options)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class AuditReport:
    """Everything the report shows: result objects of the statistics plus provenance.

    ``omitted`` maps each section the data cannot support (``alignment``,
    ``dynamics``, ``strata``) to the reason, which the report prints in the
    section's place: a report is never refused for want of one section.
    ``strata``: the token strata by entropy (else log-prob), K = 10 bins then the top 20 %
    (the forking tokens), empty when omitted.
    """

    stats: AuditResults
    landscape: LandscapeResult
    dynamics: GroupedResult | None
    gradcos: GradcosSummary | None
    provenance: Mapping[str, Any]
    options: ReportOptions = field(default_factory=ReportOptions)
    omitted: Mapping[str, str] = field(default_factory=dict)
    strata: tuple[StrataResult, ...] = ()
    #: each weighting's share of the mass by the sign of delta (None when omitted: no teacher)
    signs: SignSharesResult | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            **REPORT_SCHEMA,
            "provenance": dict(self.provenance),
            "options": self.options.to_dict(),
            **self.stats.to_dict(),
            "landscape": self.landscape.to_dict(),
            "dynamics": None if self.dynamics is None else self.dynamics.to_dict(),
            "gradcos": None if self.gradcos is None else self.gradcos.to_dict(),
            "strata": [r.to_dict() for r in self.strata],
            "signs": None if self.signs is None else self.signs.to_dict(),
            "omitted": dict(self.omitted),
        }
