"""The ``entropy`` dump column (SPEC 11) of verl's worker loss (``icsd_ppo_loss(micro=...)``) and of
``recording(ppo_loss, ...)``: verl's ``model_output['entropy']`` of the forward that gave the log-probs.

The model output is made as verl's engine makes it (``verl.utils.torch_functional``'s ``logprobs_from_logits``
and ``entropy_from_logits`` of a tiny model's temperature-scaled logits, flat per sequence, position i scoring
token i+1); the reference is a float64 entropy of the same model's logits, listed token by token.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")

from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from icsd_audit.integrations.core import stable_traj_id  # noqa: E402
from icsd_audit.integrations.verl.loss import MicroBatchScope, icsd_ppo_loss  # noqa: E402
from icsd_audit.integrations.verl.record import recording  # noqa: E402
from icsd_audit.train.models.loading import tiny_random_causal_lm  # noqa: E402
from tests.integrations.test_verl_micro import _batch, _configs  # noqa: E402
from tests.integrations.test_verl_record import read_dump_flat  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)
TEMP = 0.7


def _model_batch(with_entropy: bool = True, teacher_layout: str = "icsd"):
    """(micro-batch, model output as verl's engine gives it, reference entropies in the dumps' token order)."""
    model, tok = tiny_random_causal_lm(seed=1)
    rows, _, td, _, _ = _batch(4, vocab=len(tok), teacher_layout=teacher_layout)
    lp, ent, ref, turns = [], [], [], {}
    with torch.no_grad():
        for r in rows:
            ids = r["ids"]
            z = model(input_ids=ids[None]).logits[0].float() / TEMP
            lp.append(verl_F.logprobs_from_logits(z, torch.roll(ids, -1)))
            ent.append(verl_F.entropy_from_logits(z))
            z64 = torch.log_softmax(z.double(), -1)
            h = -(z64.exp() * z64).sum(-1)  # float64, position i: the distribution of token i+1
            key = f"{r['uid']}_{r['s']}"
            turn, prev = turns.get(key, 0) - 1, 0
            for j in range(r["R"]):
                if r["mask"][j]:
                    turn += 0 if prev else 1
                    ref.append((stable_traj_id(key), turn, j, float(h[r["P"] - 1 + j])))
                prev = int(r["mask"][j])
            turns[key] = turn + 1
    offs = torch.tensor([0] + [r["P"] + r["R"] for r in rows]).cumsum(0)
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(lp), offs)}
    if with_entropy:
        out["entropy"] = torch.nested.nested_tensor_from_jagged(torch.cat(ent), offs)
    want = np.array([h for *_, h in sorted(ref)])  # dumps: rows by (trajectory, turn, position)
    assert np.ptp(want) > 1e-3  # varying values, not one constant
    return td, out, want


def test_worker_loss_dumps_verls_entropy_of_its_own_forward(tmp_path):
    actor, _ = _configs()
    td, out, want = _model_batch()
    icsd_ppo_loss(copy.deepcopy(actor), out, td, distill_coef=0.1, micro=MicroBatchScope(min_group=3,
                                                                                       dump_dir=str(tmp_path / "d")))
    d = read_dump_flat(tmp_path / "d")
    assert d["entropy"].dtype == np.float32
    np.testing.assert_allclose(d["entropy"], want, atol=1e-5, rtol=0)


def test_recorded_ppo_loss_dumps_verls_entropy(tmp_path):
    actor, _ = _configs()
    td, out, want = _model_batch()
    recording(ppo_loss, tmp_path / "d")(config=copy.deepcopy(actor), model_output=out, data=td, dp_group=None)
    d = read_dump_flat(tmp_path / "d")
    assert d["entropy"].dtype == np.float32
    np.testing.assert_allclose(d["entropy"], want, atol=1e-5, rtol=0)


def test_distillation_registry_loss_dumps_verls_entropy(tmp_path, monkeypatch):
    from verl.trainer.distillation.losses import get_distillation_loss_fn

    from icsd_audit.integrations.verl.distill import register_losses

    register_losses()
    monkeypatch.setenv("ICSD_MIN_GROUP", "3")
    monkeypatch.setenv("ICSD_DUMP_DIR", str(tmp_path / "d"))
    actor, dist = _configs(loss_mode="icsd", use_policy_gradient="true")
    td, out, want = _model_batch(teacher_layout="verl")
    get_distillation_loss_fn("icsd")(config=copy.deepcopy(actor), distillation_config=dist, model_output=out, data=td)
    d = read_dump_flat(tmp_path / "d")
    assert d["entropy"].dtype == np.float32
    np.testing.assert_allclose(d["entropy"], want, atol=1e-5, rtol=0)


def test_no_entropy_in_the_model_output_no_column(tmp_path):
    """verl computes the entropy only with ``calculate_entropy`` (or an entropy bonus): without it, no column."""
    actor, _ = _configs()
    td, out, _ = _model_batch(with_entropy=False)
    icsd_ppo_loss(copy.deepcopy(actor), out, copy.deepcopy(td), distill_coef=0.1,
                  micro=MicroBatchScope(min_group=3, dump_dir=str(tmp_path / "a")))
    recording(ppo_loss, tmp_path / "b")(config=copy.deepcopy(actor), model_output=out, data=td, dp_group=None)
    for name in ("a", "b"):
        d = read_dump_flat(tmp_path / name)
        assert "entropy" not in d and len(d["logp"]) == len(_model_batch()[2])
