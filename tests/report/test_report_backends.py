"""``icsd audit report --backend ray``: the report's stream as per-batch parts merged in batch order gives the numbers
of the local stream. The parts are computed here, in a shuffled order, by the function a Ray task runs (Ray itself
is replaced by a loop; tests/cli/test_ray_backend.py runs the real cluster)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from icsd_audit.audit import ray_backend
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import DumpWriter
from icsd_audit.report.build import audit_dumps
from icsd_audit.report.results import ReportOptions


def _shuffled_parts(part: Any, paths: Any, args: tuple, batch_ids: Any, **_: Any) -> Iterator[Any]:
    names = [str(p) for p in paths]
    order = list(batch_ids)
    np.random.default_rng(7).shuffle(order)  # "completion" order
    done = {b: part(names, *args, b) for b in order}
    for b in batch_ids:
        yield done[b]


def _numbers(rep: Any) -> str:
    d = rep.to_dict()
    d["provenance"].pop("generated_at")
    return json.dumps(d, sort_keys=True, default=str)


def test_report_parts_merged_in_batch_order_give_the_local_numbers(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    w = DumpWriter(tmp_path, producer="t", synthetic=True)
    for b in range(6):  # three steps (the per-step curve), two environments per batch (the landscape per env)
        t = synth_tokens(2500, n_batches=1, seed=20 + b, step=b // 2)
        t["batch_id"][:] = b
        t["env"] = np.where(t["traj_id"] % 2 == 0, "webshop", "alfworld")
        t["entropy"] = np.random.default_rng(b).gamma(1.0, 1.0, t["delta"].shape).astype(np.float32)  # the strata
        w.write(**t)
    opts = ReportOptions(n_resamples=200, grid=6)
    local = _numbers(audit_dumps([tmp_path], opts))
    monkeypatch.setattr(ray_backend, "ray_parts", _shuffled_parts)
    merged = audit_dumps([tmp_path], opts, backend="ray")
    assert merged.dynamics is not None and merged.strata  # the per-step and strata accumulators took part
    assert _numbers(merged) == local
