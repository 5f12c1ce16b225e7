"""verl-agent / SDAR drop-in: compute_icsd_loss against our actor, allocate_dataproto against allocate."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from icsd_audit.alloc.variants import allocate
from icsd_audit.integrations.sdar import C_KEY, allocate_dataproto, compute_icsd_loss, dump_writer, stable_traj_id
from icsd_audit.train.losses import token_losses

torch.set_num_threads(1)


def test_compute_icsd_loss_equals_our_actors_auxiliary_loss():
    g = torch.Generator().manual_seed(0)
    B, T, lam = 6, 9, 0.01
    mask = torch.rand(B, T, generator=g) > 0.25
    logp = (torch.randn(B, T, generator=g) - 2).requires_grad_(True)
    old = logp.detach() + 0.01 * torch.randn(B, T, generator=g)
    teacher = torch.randn(B, T, generator=g) - 2
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    c = torch.rand(B, T, generator=g) * 2
    m = mask
    tl = token_losses(logp=logp[m], old_logp=old[m], advantage=adv[m], ref_logp=None, teacher_logp=teacher[m], c=c[m],
                      clip_ratio=0.2, dual_clip=3.0, kl_coef=0.0, distill_coef=lam)
    ours = tl.aux.sum() / m.sum()  # actor.py: lambda/|B| sum c * kd over the mini-batch
    (g_ours,) = torch.autograd.grad(ours, logp)
    loss, metrics = compute_icsd_loss(logp, teacher, c, mask, "token-mean")
    (g_drop,) = torch.autograd.grad(lam * loss, logp)
    assert float(lam * loss.detach()) == pytest.approx(float(ours.detach()), rel=1e-6)
    assert torch.allclose(g_drop, g_ours, rtol=1e-6, atol=1e-12)
    assert metrics["icsd/aux_loss"] == pytest.approx(float(loss.detach()), rel=1e-7)


def test_with_sdar_gate_as_c_it_is_sdars_loss():
    """SDAR: agg(sigmoid(beta * (T - logp)) * (T - logp)); with c = that gate the two coincide."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 5, generator=g, dtype=torch.float64)
    t = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]).bool()
    gate = torch.sigmoid(5.0 * (t - s))
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        got, _ = compute_icsd_loss(s, t, gate, mask, mode)
        per = gate * (t - s) * mask
        if mode == "token-mean":
            ref = per.sum() / mask.sum()
        elif mode == "seq-mean-token-sum":
            ref = per.sum(-1).mean()
        else:
            ref = (per.sum(-1) / mask.sum(-1)).mean()
        assert float(got) == pytest.approx(float(ref), rel=1e-7), mode


def _dataproto(seed: int, n_traj: int = 8, dup: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    uids, steps = [], []
    for i in range(n_traj):
        for k in range(int(torch.randint(1, 4, (1,), generator=g))):
            uids.append(f"traj-{seed}-{i}")
            steps.append(k)
    B, T = len(uids), 7
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).view(1, -1) < lens.view(-1, 1)).long()
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    old = (torch.randn(B, T, generator=g) - 2) * mask
    teacher = (torch.randn(B, T, generator=g) - 2) * mask
    idx = torch.cat([torch.arange(B), torch.tensor(dup, dtype=torch.long)])
    td = {"advantages": adv[idx], "response_mask": mask[idx], "old_log_probs": old[idx], "teacher_log_probs": teacher[idx]}
    nt = {"traj_uid": np.array([uids[i] for i in idx.tolist()], dtype=object),
          "turn_step": np.array([steps[i] for i in idx.tolist()])}
    return SimpleNamespace(batch=td, non_tensor_batch=nt), B


def _flat_reference(dp, rows):
    """allocate() over the valid tokens of the given rows, listed by (traj id, turn, pos) in a slow loop."""
    td, nt = dp.batch, dp.non_tensor_batch
    toks = []
    for b in rows:
        p = 0
        for t in range(td["response_mask"].shape[1]):
            if td["response_mask"][b, t]:
                toks.append((stable_traj_id(nt["traj_uid"][b]), int(nt["turn_step"][b]), p, b, t))
                p += 1
    toks.sort()
    f = lambda k: torch.tensor([float(td[k][b, t]) for *_, b, t in toks], dtype=torch.float32).double()  # noqa: E731
    delta = torch.tensor([float(td["teacher_log_probs"][b, t] - td["old_log_probs"][b, t]) for *_, b, t in toks],
                         dtype=torch.float32).double()
    out = allocate(advantage=f("advantages"), ratio=torch.ones(len(toks), dtype=torch.float64), delta=delta,
                   traj_id=torch.tensor([k[0] for k in toks]), turn_id=torch.tensor([k[1] for k in toks]), min_group=3)
    return {(b, t): float(out.c[i]) for i, (*_, b, t) in enumerate(toks)}


def _first_occurrences(dp, rows):
    seen, keep = set(), []
    for r in rows:
        key = (dp.non_tensor_batch["traj_uid"][r], int(dp.non_tensor_batch["turn_step"][r]))
        if key not in seen:
            seen.add(key)
            keep.append(r)
    return keep


@pytest.mark.parametrize("per_mini_batch", [False, True])
def test_allocate_dataproto_with_adjust_batch_copies(tmp_path, per_mini_batch):
    """Copies count once per mini-batch; a copy whose original sits in another mini-batch is that turn's only
    instance there (statistics never cross mini-batches), so it counts once in its own."""
    dp, n = _dataproto(0, dup=(0, 3, n_dup := 5))
    del n_dup
    size = (n + 3) // 2 if per_mini_batch else n + 3
    allocs = allocate_dataproto(dp, mini_batch_rows=size if per_mini_batch else None, min_group=3, step=4,
                                writer=dump_writer(tmp_path / "d", rank=3))
    c = dp.batch[C_KEY]
    chunks = [list(range(lo, min(lo + size, n + 3))) for lo in range(0, n + 3, size)]
    for rows in chunks:
        keep = _first_occurrences(dp, rows)
        for (b, t), v in _flat_reference(dp, keep).items():
            assert float(c[b, t]) == np.float32(v)
        for r in rows:
            if r not in keep:  # an in-mini-batch copy carries its original's c
                orig = next(k for k in keep if (dp.non_tensor_batch["traj_uid"][k], dp.non_tensor_batch["turn_step"][k])
                            == (dp.non_tensor_batch["traj_uid"][r], dp.non_tensor_batch["turn_step"][r]))
                assert torch.equal(c[r], c[orig])
    assert [a.diagnostics.n_tokens for a in allocs] == [
        sum(int(dp.batch["response_mask"][r].sum()) for r in _first_occurrences(dp, rows)) for rows in chunks]
    if not per_mini_batch:
        assert torch.equal(c[n], c[0]) and torch.equal(c[n + 1], c[3]) and torch.equal(c[n + 2], c[5])
    names = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert names[0] == "part-000000-r00003.parquet" and len(names) == len(chunks)


def test_allocate_dataproto_needs_turn_step():
    dp, _ = _dataproto(1)
    del dp.non_tensor_batch["turn_step"]
    with pytest.raises(KeyError, match="turn_step"):
        allocate_dataproto(dp)


def test_real_dataproto():
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    from verl import DataProto

    dp, n = _dataproto(2, dup=(1,))
    real = DataProto.from_dict(tensors=dict(dp.batch), non_tensors=dict(dp.non_tensor_batch))
    allocate_dataproto(real, min_group=3)
    allocate_dataproto(dp, min_group=3)
    assert torch.equal(real.batch[C_KEY], dp.batch[C_KEY])
    assert torch.equal(real.batch[C_KEY][n], real.batch[C_KEY][1])


def test_allocate_dataproto_maps_data_parallel_mini_batches():
    """2 ranks, global mini-batch of 4 rows: rank 0 holds rows 0-3, rank 1 rows 4-7, each trains 2 rows per
    mini-batch, so the two optimizer steps see rows {0,1,4,5} and {2,3,6,7}."""
    from icsd_audit.integrations.core import allocate_padded

    dp, n = _dataproto(3, n_traj=12)
    assert n >= 8
    dp = SimpleNamespace(batch={k: v[:8] for k, v in dp.batch.items()},
                         non_tensor_batch={k: v[:8] for k, v in dp.non_tensor_batch.items()})
    allocate_dataproto(dp, mini_batch_rows=4, dp_size=2, min_group=2)
    td, nt = dp.batch, dp.non_tensor_batch
    for rows in ([0, 1, 4, 5], [2, 3, 6, 7]):
        r = torch.as_tensor(rows)
        ref = allocate_padded(advantage=td["advantages"][r], ratio=1.0,
                              delta=(td["teacher_log_probs"] - td["old_log_probs"])[r].float(),
                              response_mask=td["response_mask"][r].bool(),
                              traj_id=torch.as_tensor([stable_traj_id(nt["traj_uid"][i]) for i in rows]),
                              turn_id=torch.as_tensor(nt["turn_step"][rows].astype(np.int64)), min_group=2)
        assert torch.equal(td[C_KEY][r], ref.c.float())
