"""The report's token-strata section (SPEC 11): which covariate, its two strata, fed from the report's stream.

The report shows the strata by the student's next-token entropy where every input file
has that column, else by the token's log-probability, else omits the section with the
reason.  Two statistics: the covariate's K quantile bins (``ReportOptions.strata_bins``,
default SPEC 11's 10: the same statistic as ``icsd audit strata DUMPS --by COVARIATE``;
0 omits the section) and the split at the top 20 %
(the "forking tokens", ``--top 0.2``).  Their accumulators are fed from the report's one
stream and bootstrapped with every other statistic, each on its own columns, so each
interval is the one ``icsd audit strata`` prints (SPEC 7).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from icsd_audit.dumps.reader import DumpReader, TokenBatch
from icsd_audit.stats.bootstrap import RatioBootstrapResult, RatioFamily
from icsd_audit.stats.strata import StrataAccumulator, covariate_values, strata_edges
from icsd_audit.stats.results import FORKING_TOP, StrataResult, StrataSpec
from icsd_audit.audit.strata import check_covariate, covariate_sample
from icsd_audit.tokens import Weights

__all__ = ["ReportStrata", "STRATA_COLUMNS", "choose_covariate"]

#: optional dump columns the report reads for its strata (where a file has them)
STRATA_COLUMNS = ("entropy", "logp")


def choose_covariate(reader: DumpReader) -> tuple[str | None, str | None]:
    """(covariate, None), or (None, why the section is omitted): entropy if every file has it, else logp."""
    names = [set(s.names) for s in reader.schemas]
    for cov in STRATA_COLUMNS:
        if all(cov in n for n in names):
            return cov, None
    return None, ("the dumps carry neither an 'entropy' nor a 'logp' column in every file (SPEC 11: the strata "
                  "are by the student's next-token entropy, else by the token's log-probability)")


class ReportStrata:
    """The strata accumulators of one report: K = 10 bins and the top 20 %, or none with a reason."""

    def __init__(self, reader: DumpReader, *, eps: float, base_name: str, compare_name: str, bins: int = 10):
        self.covariate, self.reason = choose_covariate(reader) if bins else (None, "not asked for (--strata-bins 0)")
        self.accs: list[StrataAccumulator] = []
        if self.covariate is None:
            return
        x = covariate_sample(reader, self.covariate)
        for spec in (StrataSpec(self.covariate, bins=bins), StrataSpec(self.covariate, top=FORKING_TOP)):
            self.accs.append(StrataAccumulator(spec=spec, edges=strata_edges(x, spec), eps=eps, base_name=base_name,
                                               compare_name=compare_name))
            self.accs[-1].reserve(reader.n_rows)
        del x

    def add(self, reader: DumpReader, batch: TokenBatch, weights: Weights, u: np.ndarray) -> None:
        if not self.accs:
            return
        x = covariate_values(batch.tokens, str(self.covariate))
        check_covariate(reader, batch, x, str(self.covariate))
        tokens = batch.tokens.replace(u=u)  # as icsd audit strata: the allocation's u
        for acc in self.accs:
            acc.add(tokens, weights, x=x)

    def fresh(self) -> "ReportStrata":
        """An empty copy on the same covariate and edges, read from nothing (a Ray task's part of the stream)."""
        out = object.__new__(ReportStrata)
        out.covariate, out.reason = self.covariate, self.reason
        out.accs = [StrataAccumulator(spec=a.spec, edges=a.edges, eps=a.eps, base_name=a.base_name,
                                      compare_name=a.compare_name) for a in self.accs]
        return out

    def merge(self, part: "ReportStrata") -> None:
        """A one-batch part's sums after these (the bits of adding that batch here)."""
        for acc, p in zip(self.accs, part.accs):
            acc.merge(p)

    def families(self) -> list[RatioFamily]:
        return [acc.family(donate=True) for acc in self.accs]  # handed to the bootstrap only

    def results(self, raws: Sequence[RatioBootstrapResult]) -> tuple[StrataResult, ...]:
        return tuple(acc.results(raw) for acc, raw in zip(self.accs, raws))
