"""Batches reduced on their own and merged in batch order give the bits of one streaming pass (SPEC 12).

What a Ray task computes (:func:`icsd_audit.audit.ray_backend.batch_part`) is run here in
this process, in a shuffled completion order, without Ray: the merge is what is tested.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.audit.ray_backend import batch_part
from icsd_audit.audit.run import deployed_request, run_audit
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import DumpWriter
from icsd_audit.stats.api import AuditAccumulator

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STATS = ("tcm", "quadrants", "shift", "clip")


def _json(res: object) -> dict:
    return {s: json.dumps(getattr(res, s).to_dict(), sort_keys=True) for s in STATS}


def _merged(paths: list, req: object, order: list[int]) -> object:
    from icsd_audit.dumps.reader import DumpReader

    ids = DumpReader(paths).batch_ids
    parts = {ids[i]: batch_part([str(p) for p in paths], req, STATS, ids[i]) for i in order}  # "completion" order
    acc = AuditAccumulator(statistics=STATS, eps=req.eps, clip_eps=req.clip_eps, dual_clip=req.dual_clip,
                           n_bins=req.n_bins, base_name=req.base.allocator, compare_name=req.compare.allocator, by=req.by)
    for b in ids:  # merged in batch order
        acc.merge(parts[b])
    return acc.finalize(n_resamples=req.n_resamples, confidence_level=req.confidence_level, unit=req.unit, rng=req.seed)


@pytest.mark.parametrize("by", [None, "step", "task"])
def test_parts_merged_in_batch_order_are_the_streaming_bits(tmp_path: Path, by: str | None) -> None:
    # three steps of two batches each: groups, ratio moments and S+ clusters merge across batches
    w = DumpWriter(tmp_path, producer="t", synthetic=True)
    for b in range(6):
        t = synth_tokens(3000, n_batches=1, seed=b, step=b // 2)
        t["batch_id"][:] = b
        t["ratio"] = t["ratio"] * np.random.default_rng(b).uniform(0.7, 1.4, t["ratio"].shape)  # clipping to count
        w.write(**t)
    paths = [tmp_path]
    req = dataclasses.replace(deployed_request(paths), n_resamples=300, by=by)
    whole = _json(run_audit(paths, req, statistics=STATS))
    assert _json(_merged(paths, req, [5, 0, 3, 1, 4, 2])) == whole
    assert _json(_merged(paths, req, list(range(6)))) == whole


def test_cpu_demo_parts_merged_are_the_streaming_bits() -> None:
    paths = [EXAMPLES / "cpu-demo" / "dumps"]
    req = dataclasses.replace(deployed_request(paths), n_resamples=300)
    assert _json(_merged(paths, req, [2, 0, 1])) == _json(run_audit(paths, req, statistics=STATS))


@pytest.mark.parametrize("with_env", [False, True])
def test_landscape_parts_merged_in_batch_order_are_the_streaming_bits(tmp_path: Path, with_env: bool) -> None:
    from icsd_audit.audit.ray_backend import landscape_part
    from icsd_audit.audit.run import landscape_ranks, run_landscape
    from icsd_audit.dumps.reader import DumpReader
    from icsd_audit.stats.api import LandscapeAccumulator

    w = DumpWriter(tmp_path, producer="t", synthetic=True)
    for b in range(5):
        t = synth_tokens(2000, n_batches=1, seed=10 + b)
        t["batch_id"][:] = b
        if with_env:  # a batch's trajectories split over two environments
            t["env"] = np.where(t["traj_id"] % 2 == 0, "webshop", "alfworld")
        w.write(**t)
    paths = [tmp_path]
    req = dataclasses.replace(deployed_request(paths), n_resamples=200)
    whole = json.dumps(run_landscape(paths, req, grid=6).to_dict(), sort_keys=True)
    reader = DumpReader(paths, columns=["env"])
    ranks = landscape_ranks(reader, 6)
    parts = {b: landscape_part([str(tmp_path)], req, ranks, 6, b) for b in [3, 1, 4, 0, 2]}
    acc = LandscapeAccumulator(grid=6, base_name=req.base.allocator, compare_name=req.compare.allocator, ranks=ranks)
    for b in reader.batch_ids:
        acc.merge(parts[b])
    merged = acc.finalize(n_resamples=req.n_resamples, confidence_level=req.confidence_level, rng=req.seed)
    assert json.dumps(merged.to_dict(), sort_keys=True) == whole


def test_merge_refuses_a_part_of_other_settings() -> None:
    a, b = AuditAccumulator(statistics=("tcm",)), AuditAccumulator(statistics=("tcm",), eps=1e-3)
    with pytest.raises(ValueError, match="other settings"):
        a.merge(b)
