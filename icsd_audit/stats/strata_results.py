"""Result objects of the token strata (SPEC 11) and their JSON form.

Frozen dataclasses built by :class:`icsd_audit.stats.strata.StrataAccumulator` and read by
the CLI (``icsd audit strata``), the report and its figure.  Fractions throughout, never
percent; ``to_dict`` gives SPEC 11's shape: ``{"by", "bins": [{"lo", "hi", "tokens",
"token_share", "share": {"base", "compare", "diff"}, "tcm": {"base", "compare", "diff"}}]}``,
each innermost value ``{"estimate", "ci_low", "ci_high"}`` (``null`` where undefined), and
beside ``by`` and ``bins`` the statistic's name, the edges, the counts, the n/a reasons and
the bootstrap settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from icsd_audit.stats.bootstrap import BootstrapResult
from icsd_audit.stats.results import PairedResult, json_float

__all__ = ["COVARIATES", "N_STRATA_BINS", "FORKING_TOP", "StrataSpec", "StrataBin", "StrataResult", "triple"]

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
