"""One batch into an audit accumulator: shared by the local loop (:mod:`icsd_audit.audit.run`) and Ray tasks
(:mod:`icsd_audit.audit.ray_backend`), so both reduce a batch with the same code."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from icsd_audit.dumps.reader import DumpError, DumpReader, TokenBatch
from icsd_audit.stats.api import AuditAccumulator

__all__ = ["new_accumulator", "add_batch"]


def _group_key(batch: TokenBatch, by: str | None, path: str) -> np.ndarray | None:
    if by is None:
        return None
    if by not in batch.tokens.columns:
        raise DumpError(path, f"--by {by} needs this column, which the dump lacks", column=by)
    return batch.tokens.columns[by]


def new_accumulator(req: Any, statistics: Sequence[str]) -> AuditAccumulator:
    """An empty accumulator of ``statistics`` with the request's settings."""
    return AuditAccumulator(statistics=tuple(statistics), eps=req.eps, clip_eps=req.clip_eps,
                            dual_clip=req.dual_clip, n_bins=req.n_bins, base_name=req.base.allocator,
                            compare_name=req.compare.allocator, by=req.by)


def add_batch(acc: AuditAccumulator, reader: DumpReader, req: Any, batch: TokenBatch, weights: Any,
              u: np.ndarray) -> None:
    """One allocated batch into ``acc`` (its ``--by`` key from the batch's column)."""
    acc.add(batch.tokens.replace(u=u), weights,
            group=_group_key(batch, req.by, str(reader.paths[int(batch.file_index[0])])))
