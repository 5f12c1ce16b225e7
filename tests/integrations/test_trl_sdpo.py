"""ICSDSDPOTrainer: SDPO's per-token distillation term times the allocator's c, on the tiny model (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")

from icsd_audit.integrations.core import AllocationSettings  # noqa: E402
from icsd_audit.integrations.trl import ICSDConfig  # noqa: E402
from tests.integrations.test_trl_record import make_trainer, model_dir, params, read_dump  # noqa: E402,F401

pytestmark = pytest.mark.engines
torch.set_num_threads(1)


def _icsd_cls():
    from icsd_audit.integrations.trl import ICSDSDPOTrainer

    return ICSDSDPOTrainer


@pytest.mark.parametrize("kind", ["sdpo:topk_logits:0.5", "sdpo:sampled_token:1.0"])
def test_opsd_allocation_leaves_sdpo_bit_identical(model_dir, tmp_path, kind):  # noqa: F811
    plain = make_trainer(kind, model_dir, tmp_path / "plain")
    start = params(plain)
    plain.train()
    tr = make_trainer(kind, model_dir, tmp_path / "icsd", cls=_icsd_cls(), icsd=AllocationSettings(allocator="opsd"))
    tr.train()
    a, b = params(plain), params(tr)
    assert any(not torch.equal(start[k], a[k]) for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), "opsd (c = 1) changed SDPO's parameters"
    assert tr.icsd_last is not None and bool((tr.icsd_last.c[tr.icsd_last.pos >= 0] == 1).all())


def test_icsd_weights_the_term_and_its_dumps_verify(model_dir, tmp_path):  # noqa: F811
    from icsd_audit.dumps.reader import read_metadata
    from tests.cli.test_outputs import cli

    kind = "sdpo:sampled_token:1.0"
    plain = make_trainer(kind, model_dir, tmp_path / "plain")
    plain.train()
    icsd = ICSDConfig(allocator="icsd", min_group=4, dump_dir=str(tmp_path / "dumps"))
    tr = make_trainer(kind, model_dir, tmp_path / "icsd", cls=_icsd_cls(), icsd=icsd)
    tr.train()
    a, b = params(plain), params(tr)
    assert any(not torch.equal(a[k], b[k]) for k in a), "ICSD's c changed nothing"
    d = read_dump(tmp_path / "dumps")
    assert sorted(set(d["batch_id"])) == [0, 10**6, 2 * 10**6]  # step * 10**6 + micro-batch 0 on rank 0 of 1
    assert not np.allclose(d["c"], 1.0) and (d["c"] >= 0).all()
    # the recorded term is SDPO's sampled-token surrogate times c on the distilled rows
    want = d["c"].astype(np.float64) * (d["logp"].astype(np.float64) - d["teacher_logp"]) * d["logp"]
    on = d["distill_term"] != 0
    assert on.any() and np.allclose(d["distill_term"][on], want[on], rtol=1e-4, atol=1e-6)
    meta = read_metadata(sorted((tmp_path / "dumps").glob("step*/*.parquet"))[0])
    assert (meta["allocator"]["allocator"], meta["allocator"]["alloc_scope"], meta["allocator"]["min_group"]) == (
        "icsd", "micro-batch", 4)
    assert meta["producer"]["trainer"] == "ICSDSDPOTrainer"
    v = cli("audit", "verify", str(tmp_path / "dumps"))
    assert v.returncode == 0, v.stdout + v.stderr
    assert "every batch agrees" in v.stdout
    # SPEC 11: step 0's entropy is the initial model's, from the student logits SDPO's loss holds (temperature 1)
    from tests.integrations.test_trl_record import _step0_logps

    _, logits = _step0_logps(model_dir, d, None)
    lp = torch.log_softmax(torch.as_tensor(logits), -1)
    ent = (-(lp.exp() * lp).sum(-1)).numpy()
    assert d["entropy"].dtype == np.float32 and np.ptp(ent) > 1e-3
    np.testing.assert_allclose(d["entropy"][d["batch_id"] == 0], ent, atol=1e-5, rtol=0)
