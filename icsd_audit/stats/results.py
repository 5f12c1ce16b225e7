"""Result objects of the audit statistics and their JSON form (``docs/statistics.md``).

Frozen dataclasses, one per statistic, built by :mod:`icsd_audit.stats.accumulator` and
consumed by the CLI, the report and the figures.  ``to_dict`` gives the JSON contract:
fractions (never percent), ``{"estimate", "ci_low", "ci_high", ...}`` triples under
the base and compare labels and ``"diff"`` (compare minus base).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from icsd_audit.alloc.settings import DEFAULTS
from icsd_audit.stats.bootstrap import BootstrapResult, RatioBootstrapResult

__all__ = ["COVARIATES", "N_STRATA_BINS", "FORKING_TOP", "StrataSpec", "StrataBin", "StrataResult", "triple", 
    "EPS", "CLIP_EPS", "DUAL_CLIP", "N_SHIFT_BINS", "LANDSCAPE_GRID", "MASS_RTOL", "REGIONS", "STATISTICS",
    "shift_bin_labels", "PairedResult", "TCMResult", "QuadrantsResult", "ShiftBin", "ShiftResult",
    "ClipSet", "ClipResult", "GroupedResult", "AuditResults", "check_names", "json_float", "json_key",
    "tcm_undefined_reason",
]

#: TCM's |u| threshold: the allocator's eps (SPEC 6 "eps = 1e-4 unless given")
EPS = DEFAULTS.eps
CLIP_EPS = 0.2
DUAL_CLIP = 3.0
N_SHIFT_BINS = 5
LANDSCAPE_GRID = 20
MASS_RTOL = 1e-5

REGIONS = ("pos_delta_pos_adv", "pos_delta_neg_adv", "neg_delta_pos_adv", "neg_delta_neg_adv", "neutral")
STATISTICS = ("tcm", "quadrants", "shift", "clip")
_RESERVED = {"diff", "regions", "bins", "n_tokens", "n_turns", "n_batches", "base", "compare", "bootstrap"}


def shift_bin_labels(n_bins: int = N_SHIFT_BINS) -> tuple[str, ...]:
    """``neg_1`` (most negative) .. ``neg_n``, ``zero``, ``pos_1`` .. ``pos_n`` (largest)."""
    return tuple(f"neg_{i}" for i in range(1, n_bins + 1)) + ("zero",) + tuple(f"pos_{i}" for i in range(1, n_bins + 1))


# --------------------------------------------------------------------------- results


def json_float(x: float) -> float | None:
    """A JSON-safe float: None for NaN/inf (strict JSON has neither), -0.0 as 0.0."""
    x = float(x) + 0.0
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class PairedResult:
    """One statistic under the base and compare weightings and their difference."""

    base: BootstrapResult
    compare: BootstrapResult
    diff: BootstrapResult

    def to_dict(self, base_name: str = "sdar", compare_name: str = "icsd") -> dict[str, Any]:
        return {base_name: self.base.to_dict(), compare_name: self.compare.to_dict(), "diff": self.diff.to_dict()}


@dataclass(frozen=True)
class _Common:
    base_name: str
    compare_name: str
    n_tokens: int
    n_turns: int
    n_batches: int
    n_resamples: int
    confidence_level: float
    unit: str

    def _head(self) -> dict[str, Any]:
        return {
            "n_tokens": int(self.n_tokens),
            "n_turns": int(self.n_turns),
            "n_batches": int(self.n_batches),
            "base": self.base_name,
            "compare": self.compare_name,
        }

    def _boot(self) -> dict[str, Any]:
        return {
            "n_resamples": int(self.n_resamples),
            "confidence_level": float(self.confidence_level),
            "method": "percentile",
            "unit": self.unit,
        }


def _defined(*results: BootstrapResult) -> bool:
    return all(math.isfinite(r.estimate) for r in results)


def tcm_undefined_reason(*, n_tokens: int, n_active: int, n_supported: int | None,
                         n_supported_zero_advantage: int | None, eps: float) -> str:
    """Why TCM has no value, in words: which part of its denominator set {delta > 0, |u| > eps} is empty."""
    if n_tokens == 0:
        return "no valid token"
    if n_active > 0:
        return f"the weightings put no mass on the {n_active:,} tokens with delta > 0 and |u| > eps"
    if n_supported == 0:
        return "no token has delta > 0, i.e. the teacher rates no sampled token above the student"
    if n_supported is not None and n_supported_zero_advantage == n_supported:
        return ("every token with delta > 0 has advantage 0, as when all rollouts of a group get the same reward "
                "and GRPO/GiGPO give that group no signal")
    return f"no token with delta > 0 has |u| = |advantage x ratio x delta| > eps = {eps:g}"


@dataclass(frozen=True)
class TCMResult(_Common):
    """Trusted-conflict mass (SPEC 6) under both weightings and compare minus base.

    ``n_supported_tokens`` (delta > 0) and ``n_supported_zero_advantage`` (of those, advantage
    0) say why the statistic is undefined when no token is active (:attr:`undefined`).
    """

    eps: float
    n_active_tokens: int
    base: BootstrapResult
    compare: BootstrapResult
    diff: BootstrapResult
    n_supported_tokens: int | None = None
    n_supported_zero_advantage: int | None = None

    @property
    def undefined(self) -> str | None:
        """Why TCM has no value on these tokens, in words; None when it has one."""
        if self.n_active_tokens > 0 and _defined(self.base, self.compare):
            return None
        return tcm_undefined_reason(n_tokens=self.n_tokens, n_active=self.n_active_tokens,
                                    n_supported=self.n_supported_tokens,
                                    n_supported_zero_advantage=self.n_supported_zero_advantage, eps=self.eps)

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d.update(
            {
                "undefined": self.undefined,
                "eps": float(self.eps),
                "n_active_tokens": int(self.n_active_tokens),
                "n_supported_tokens": None if self.n_supported_tokens is None else int(self.n_supported_tokens),
                self.base_name: self.base.to_dict(),
                self.compare_name: self.compare.to_dict(),
                "diff": self.diff.to_dict(),
                "bootstrap": self._boot(),
            }
        )
        return d


@dataclass(frozen=True)
class QuadrantsResult(_Common):
    """Mass share of each sign region (and ``neutral``) of all valid mass."""

    regions: Mapping[str, PairedResult]
    region_tokens: Mapping[str, int]

    @property
    def undefined(self) -> str | None:
        """Why the shares have no value (no valid token, or no mass on any), in words; None when they have one."""
        if any(_defined(p.base, p.compare) for p in self.regions.values()):
            return None
        return "no valid token" if self.n_tokens == 0 else "the weightings put no mass on any valid token"

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["undefined"] = self.undefined
        d["regions"] = {
            name: {**p.to_dict(self.base_name, self.compare_name), "n_tokens": int(self.region_tokens[name])}
            for name, p in self.regions.items()
        }
        d["bootstrap"] = self._boot()
        return d


@dataclass(frozen=True)
class ShiftBin:
    """One advantage bin inside S+: shares of S+ mass and the shift (compare - base)."""

    base: BootstrapResult
    compare: BootstrapResult
    diff: BootstrapResult
    n_tokens: int
    advantage_min: float
    advantage_max: float

    @property
    def shift_pp(self) -> BootstrapResult:
        """The SPEC 6 shift in percentage points: 100 x ``diff``."""
        d = self.diff
        return BootstrapResult(
            100.0 * d.estimate, 100.0 * d.ci_low, 100.0 * d.ci_high, 100.0 * d.standard_error,
            d.n_resamples, d.confidence_level, d.method, d.unit,
        )

    def to_dict(self, base_name: str, compare_name: str) -> dict[str, Any]:
        return {
            base_name: self.base.to_dict(),
            compare_name: self.compare.to_dict(),
            "diff": self.diff.to_dict(),
            "shift_pp": self.shift_pp.to_dict(),
            "n_tokens": int(self.n_tokens),
            "advantage_min": json_float(self.advantage_min),
            "advantage_max": json_float(self.advantage_max),
        }


@dataclass(frozen=True)
class ShiftResult(_Common):
    """Conditional share shift over advantage bins inside S+ = {delta > 0}."""

    n_bins: int
    n_splus_tokens: int
    bins: Mapping[str, ShiftBin]

    @property
    def undefined(self) -> str | None:
        """Why the shift has no value (S+ empty or without mass), in words; None when it has one."""
        if self.n_splus_tokens > 0 and any(_defined(b.base, b.compare) for b in self.bins.values()):
            return None
        if self.n_splus_tokens == 0:
            return "no token has delta > 0, i.e. S+ is empty"
        return f"the weightings put no mass on the {self.n_splus_tokens:,} tokens with delta > 0"

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["undefined"] = self.undefined
        d["n_bins"] = int(self.n_bins)
        d["n_splus_tokens"] = int(self.n_splus_tokens)
        d["bins"] = {k: b.to_dict(self.base_name, self.compare_name) for k, b in self.bins.items()}
        d["bootstrap"] = self._boot()
        return d


@dataclass(frozen=True)
class ClipSet:
    """Tokens of one clipping set: token share, mass share, |delta|-weighted mass share."""

    n_tokens: int
    tokens: BootstrapResult
    mass: PairedResult
    abs_delta_mass: PairedResult

    def to_dict(self, base_name: str, compare_name: str) -> dict[str, Any]:
        return {
            "n_tokens": int(self.n_tokens),
            "tokens": self.tokens.to_dict(),
            "mass": self.mass.to_dict(base_name, compare_name),
            "abs_delta_mass": self.abs_delta_mass.to_dict(base_name, compare_name),
        }


@dataclass(frozen=True)
class ClipResult(_Common):
    """Clipping exposure (SPEC 6): outside the clip interval, flat surrogate, dual-clip cap."""

    clip_eps: float
    dual_clip: float
    outside: ClipSet
    flat: ClipSet
    dual_clip_cap_count: int
    dual_clip_cap: BootstrapResult
    ratio_mean: float
    ratio_std: float

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d.update(
            {
                "clip_eps": float(self.clip_eps),
                "dual_clip": float(self.dual_clip),
                "outside": self.outside.to_dict(self.base_name, self.compare_name),
                "flat": self.flat.to_dict(self.base_name, self.compare_name),
                "dual_clip_cap": {"count": int(self.dual_clip_cap_count), "tokens": self.dual_clip_cap.to_dict()},
                "ratio_mean": json_float(self.ratio_mean),
                "ratio_std": json_float(self.ratio_std),
                "bootstrap": self._boot(),
            }
        )
        return d


@dataclass(frozen=True)
class GroupedResult:
    """One result per value of a grouping key (``by``), in sorted key order."""

    by: str
    keys: tuple[Any, ...]
    results: tuple[Any, ...]

    def __getitem__(self, key: Any) -> Any:
        try:
            return self.results[self.keys.index(key)]
        except ValueError:
            raise KeyError(key) from None

    def __len__(self) -> int:
        return len(self.keys)

    def items(self):
        return zip(self.keys, self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"by": self.by, "groups": [{"key": json_key(k), **r.to_dict()} for k, r in self.items()]}


def json_key(k: Any) -> Any:
    if isinstance(k, (np.generic,)):
        k = k.item()
    if isinstance(k, (int, float, str, bool)) or k is None:
        return k
    return str(k)


@dataclass(frozen=True)
class AuditResults:
    """The statistics computed together by :class:`AuditAccumulator` (None if not asked)."""

    tcm: TCMResult | GroupedResult | None = None
    quadrants: QuadrantsResult | GroupedResult | None = None
    shift: ShiftResult | GroupedResult | None = None
    clip: ClipResult | GroupedResult | None = None
    #: each statistic's bootstrap (replicate summaries per group), by statistic name
    raw: Mapping[str, RatioBootstrapResult] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k).to_dict() for k in STATISTICS if getattr(self, k) is not None}


def check_names(base_name: str, compare_name: str) -> tuple[str, str]:
    if not isinstance(base_name, str) or not isinstance(compare_name, str) or not base_name or not compare_name:
        raise ValueError("base_name and compare_name must be non-empty strings")
    if base_name == compare_name:
        raise ValueError(f"base_name and compare_name must differ, both are {base_name!r}")
    for nm in (base_name, compare_name):
        if nm in _RESERVED:
            raise ValueError(f"{nm!r} is reserved in the JSON output; choose another weighting label")
    return base_name, compare_name


# --------------------------------------------------------------------------- token strata (SPEC 11)
# Fractions throughout, never percent; ``StrataResult.to_dict`` gives SPEC 11's shape, each innermost value
# ``{"estimate", "ci_low", "ci_high"}`` (``null`` where undefined).

#: the per-token covariates of SPEC 11
COVARIATES = ("entropy", "logp", "pos", "abs_delta")
#: SPEC 11's default number of quantile bins
N_STRATA_BINS = 10
#: the share of highest-covariate tokens of the entropy literature's "forking tokens"
FORKING_TOP = 0.2


@dataclass(frozen=True)
class StrataSpec:
    """Which strata: the covariate and either ``bins`` quantile bins (default 10) or the ``top`` share.

    :attr:`name` is the statistic's name for SPEC 7's one-interval rule (it holds the
    covariate and K or q): ``strata:logp:K10``, ``strata:entropy:top0.2``.
    """

    covariate: str
    bins: int | None = None
    top: float | None = None

    def __post_init__(self) -> None:
        if self.covariate not in COVARIATES:
            raise ValueError(f"--by must be one of {', '.join(COVARIATES)}, got {self.covariate!r}")
        if self.bins is not None and self.top is not None:
            raise ValueError("give --bins K or --top q, not both")
        if self.bins is not None and (isinstance(self.bins, bool) or not isinstance(self.bins, int) or self.bins < 1):
            raise ValueError(f"--bins must be an integer >= 1, got {self.bins!r}")
        if self.top is not None:
            top = float(self.top)
            if not (math.isfinite(top) and 0.0 < top < 1.0):
                raise ValueError(f"--top must be a share in (0, 1), got {self.top!r}")

    @property
    def k(self) -> int | None:
        """The number of quantile bins asked for (None with ``top``)."""
        return None if self.top is not None else (N_STRATA_BINS if self.bins is None else self.bins)

    @property
    def name(self) -> str:
        return f"strata:{self.covariate}:" + (f"top{float(self.top):g}" if self.top is not None else f"K{self.k}")

    def quantiles(self) -> list[float]:
        """The quantile levels of the edges: k/K for k = 1..K-1, or 1 - q."""
        if self.top is not None:
            return [1.0 - float(self.top)]
        k = int(self.k or N_STRATA_BINS)
        return [i / k for i in range(1, k)]


def triple(r: BootstrapResult) -> dict[str, float | None]:
    """SPEC 11's innermost value: ``{"estimate", "ci_low", "ci_high"}`` (``null`` where undefined)."""
    return {"estimate": json_float(r.estimate), "ci_low": json_float(r.ci_low), "ci_high": json_float(r.ci_high)}


@dataclass(frozen=True)
class StrataBin:
    """One bin: lo <= x < hi (the last bin: lo <= x <= hi), its tokens and both allocations' numbers.

    ``share`` is the bin's share of all valid mass, ``intensity`` that share over the
    bin's token share, ``tcm`` SPEC 6's trusted-conflict mass over the bin's tokens; each
    under base and compare (``diff``: compare minus base, same resamples).  ``tcm_undefined``
    says why the bin's TCM has no value (None when it has one).
    """

    index: int
    lo: float
    hi: float
    n_tokens: int
    token_share: BootstrapResult
    share: PairedResult
    intensity_base: BootstrapResult
    intensity_compare: BootstrapResult
    tcm: PairedResult
    n_active_tokens: int
    tcm_undefined: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "lo": json_float(self.lo),
            "hi": json_float(self.hi),
            "tokens": int(self.n_tokens),
            "token_share": triple(self.token_share),
            "share": {"base": triple(self.share.base), "compare": triple(self.share.compare),
                      "diff": triple(self.share.diff)},
            "tcm": {"base": triple(self.tcm.base), "compare": triple(self.tcm.compare), "diff": triple(self.tcm.diff)},
        }


@dataclass(frozen=True)
class StrataResult:
    """Where the mass lands by a per-token covariate (SPEC 11), per bin, with action-turn bootstrap CIs."""

    spec: StrataSpec
    edges: tuple[float, ...]
    bins: tuple[StrataBin, ...]
    base_name: str
    compare_name: str
    n_tokens: int
    n_turns: int
    n_batches: int
    eps: float
    n_resamples: int
    confidence_level: float
    unit: str = "action-turn"

    @property
    def covariate(self) -> str:
        return self.spec.covariate

    @property
    def statistic(self) -> str:
        """The name under which SPEC 7's one-interval rule holds (covariate and K or q)."""
        return self.spec.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "by": self.spec.covariate,
            "bins": [b.to_dict() for b in self.bins],
            "statistic": self.spec.name,
            "k": self.spec.k,
            "top": None if self.spec.top is None else float(self.spec.top),
            "edges": [json_float(e) for e in self.edges],
            "base": self.base_name,
            "compare": self.compare_name,
            "n_tokens": int(self.n_tokens),
            "n_turns": int(self.n_turns),
            "n_batches": int(self.n_batches),
            "eps": float(self.eps),
            "tcm_undefined": [b.tcm_undefined for b in self.bins],
            "bootstrap": {"n_resamples": int(self.n_resamples), "confidence_level": float(self.confidence_level),
                          "method": "percentile", "unit": self.unit},
        }
