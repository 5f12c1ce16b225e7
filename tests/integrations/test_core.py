"""The engine-free core against icsd_audit.alloc.allocate on the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icsd_audit.alloc.variants import allocate
from icsd_audit.integrations.core import (allocate_padded, distillation_loss, dump_rows, duplicate_rows,
                                          turn_ids_from_mask)

torch.set_num_threads(1)


def _batch(seed: int, B: int = 12, T: int = 9):
    """One row per turn (verl-agent layout): right-padded responses of random length."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).view(1, -1) < lens.view(-1, 1)
    traj = torch.randint(0, 4, (B,), generator=g) * 1000 + 7
    turn = torch.randint(0, 3, (B,), generator=g)
    # make (traj, turn) unique per row: otherwise rows would be copies
    key = traj * 10 + turn
    _, first = np.unique(key.numpy(), return_index=True)
    sel = torch.as_tensor(np.sort(first))
    mask, traj, turn = mask[sel], traj[sel], turn[sel]
    B = sel.numel()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ratio = torch.exp(0.05 * torch.randn(B, T, generator=g, dtype=torch.float64))
    delta = torch.randn(B, T, generator=g, dtype=torch.float64)
    return mask, traj, turn, adv, ratio, delta


def _reference(mask, traj, turn, adv, ratio, delta, **kw):
    """Slow loop: list tokens by (traj, turn, pos) and call allocate on them."""
    toks = []
    for b in range(mask.shape[0]):
        p = 0
        for t in range(mask.shape[1]):
            if mask[b, t]:
                toks.append((int(traj[b]), int(turn[b]), p, b, t))
                p += 1
    toks.sort()
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).double()  # noqa: E731
    out = allocate(advantage=f32([float(adv[b]) for *_, b, t in toks]),
                   ratio=f32([float(ratio[b, t]) for *_, b, t in toks]),
                   delta=f32([float(delta[b, t]) for *_, b, t in toks]),
                   traj_id=torch.tensor([k[0] for k in toks]), turn_id=torch.tensor([k[1] for k in toks]), **kw)
    c = torch.zeros(mask.shape, dtype=torch.float64)
    g = torch.zeros(mask.shape, dtype=torch.float64)
    for i, (*_, b, t) in enumerate(toks):
        c[b, t], g[b, t] = out.c[i], out.g[i]
    return c, g


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("allocator", ["icsd", "sdar", "gaussian"])
def test_padded_equals_flat_allocate(seed, allocator):
    mask, traj, turn, adv, ratio, delta = _batch(seed, B=40, T=11)
    out = allocate_padded(advantage=adv, ratio=ratio, delta=delta, response_mask=mask, traj_id=traj, turn_id=turn,
                          allocator=allocator, min_group=3)
    c_ref, g_ref = _reference(mask, traj, turn, adv, ratio, delta, allocator=allocator, min_group=3)
    assert torch.equal(out.c, c_ref)
    assert torch.equal(out.g, g_ref)
    assert bool((out.c[~mask] == 0).all())


def test_row_order_does_not_matter():
    mask, traj, turn, adv, ratio, delta = _batch(5, B=30)
    base = allocate_padded(advantage=adv, ratio=ratio, delta=delta, response_mask=mask, traj_id=traj, turn_id=turn)
    perm = torch.randperm(mask.shape[0], generator=torch.Generator().manual_seed(1))
    out = allocate_padded(advantage=adv[perm], ratio=ratio[perm], delta=delta[perm], response_mask=mask[perm],
                          traj_id=traj[perm], turn_id=turn[perm])
    assert torch.equal(out.c, base.c[perm])


def test_turn_ids_from_mask():
    m = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]]).bool()
    t = turn_ids_from_mask(m, turn_offset=torch.tensor([0, 3, 0]))
    assert t.tolist() == [[-1, 0, 0, -1, -1, 1, -1, 2], [3, 3, 3, 3, -1, -1, -1, -1], [-1] * 8]


def test_multi_turn_rows_equal_one_row_per_turn():
    """A trajectory held as one row with mask runs allocates like the same turns held one per row."""
    g = torch.Generator().manual_seed(3)
    n_traj, T = 6, 14
    mask = torch.zeros(n_traj, T, dtype=torch.bool)
    for i in range(n_traj):  # three turns per row, gaps of env tokens between
        mask[i, 1:4] = True
        mask[i, 6:6 + 1 + i % 3] = True
        mask[i, 10:13] = True
    adv_row = torch.randn(n_traj, generator=g, dtype=torch.float64)
    ratio = torch.exp(0.1 * torch.randn(n_traj, T, generator=g, dtype=torch.float64))
    delta = torch.randn(n_traj, T, generator=g, dtype=torch.float64)
    traj = torch.arange(n_traj) + 100
    multi = allocate_padded(advantage=adv_row, ratio=ratio, delta=delta, response_mask=mask, traj_id=traj, min_group=2)
    # split each row into one row per turn, tokens left-aligned
    turns = turn_ids_from_mask(mask)
    rows, r_adv, r_ratio, r_delta, r_traj, r_turn, r_mask, where = [], [], [], [], [], [], [], []
    for i in range(n_traj):
        for k in range(3):
            cols = torch.nonzero(turns[i] == k).flatten()
            mrow = torch.zeros(T, dtype=torch.bool)
            mrow[: cols.numel()] = True
            rr = torch.ones(T, dtype=torch.float64)
            dd = torch.zeros(T, dtype=torch.float64)
            rr[: cols.numel()] = ratio[i, cols]
            dd[: cols.numel()] = delta[i, cols]
            r_adv.append(adv_row[i]); r_ratio.append(rr); r_delta.append(dd); r_traj.append(traj[i])
            r_turn.append(k); r_mask.append(mrow); where.append((i, cols))
    single = allocate_padded(advantage=torch.stack(r_adv), ratio=torch.stack(r_ratio), delta=torch.stack(r_delta),
                             response_mask=torch.stack(r_mask), traj_id=torch.stack(r_traj),
                             turn_id=torch.tensor(r_turn), min_group=2)
    for j, (i, cols) in enumerate(where):
        assert torch.equal(multi.c[i, cols], single.c[j, : cols.numel()])


def test_duplicate_rows_count_once():
    mask, traj, turn, adv, ratio, delta = _batch(7, B=30)
    base = allocate_padded(advantage=adv, ratio=ratio, delta=delta, response_mask=mask, traj_id=traj, turn_id=turn)
    copies = torch.tensor([2, 0, 2, 5])  # adjust_batch-style: random rows appended again
    idx = torch.cat([torch.arange(mask.shape[0]), copies])
    out = allocate_padded(advantage=adv[idx], ratio=ratio[idx], delta=delta[idx], response_mask=mask[idx],
                          traj_id=traj[idx], turn_id=turn[idx])
    n = mask.shape[0]
    assert torch.equal(out.c[:n], base.c)  # calibration and turn mass untouched by the copies
    assert torch.equal(out.c[n:], base.c[copies])  # copies carry their original's coefficients
    assert out.duplicate_of[n:].tolist() == [2, 0, 2, 5]
    assert out.diagnostics.n_tokens == int(mask.sum())
    # without dedupe the copies shift the statistics (so the test above can fail)
    raw = allocate_padded(advantage=adv[idx], ratio=ratio[idx], delta=delta[idx], response_mask=mask[idx],
                          traj_id=traj[idx], turn_id=turn[idx], dedupe=False)
    assert not torch.equal(raw.c[:n], base.c)


def test_rows_sharing_a_key_with_different_masks_are_an_error():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    with pytest.raises(ValueError, match="rows 0 and 1 share trajectory 4 and turn 0"):
        duplicate_rows(torch.tensor([4, 4]), torch.tensor([0, 0]), mask)


def _loss_ref(s, t, c, m):
    tot = 0.0
    for b in range(s.shape[0]):
        for k in range(s.shape[1]):
            if m[b, k]:
                tot += float(c[b, k]) * (float(t[b, k]) - float(s[b, k].detach()))
    return tot / float(m.sum())


def test_distillation_loss_value_and_micro_batch_accumulation():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    m = torch.rand(B, T, generator=g) > 0.3
    s = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(B, T, generator=g, dtype=torch.float64)
    c = torch.rand(B, T, generator=g, dtype=torch.float64)
    full = distillation_loss(s, t, c, m)
    assert float(full.detach()) == pytest.approx(_loss_ref(s, t, c, m), rel=1e-12)
    (gfull,) = torch.autograd.grad(full, s)
    assert torch.allclose(gfull, -(c * m) / m.sum(), rtol=0, atol=1e-15)  # d/dlogp = -c/|B|
    n = m.sum()
    acc = sum(distillation_loss(s[i:i + 3], t[i:i + 3], c[i:i + 3], m[i:i + 3], batch_num_tokens=n) for i in range(0, B, 3))
    (gacc,) = torch.autograd.grad(acc, s)
    assert float(acc.detach()) == pytest.approx(float(full.detach()), rel=1e-12)
    assert torch.allclose(gacc, gfull, rtol=1e-12, atol=1e-15)
    # two data-parallel ranks: each scales by dp_size, the gradient average restores the mean
    halves = [distillation_loss(s[:4], t[:4], c[:4], m[:4], batch_num_tokens=n, dp_size=2),
              distillation_loss(s[4:], t[4:], c[4:], m[4:], batch_num_tokens=n, dp_size=2)]
    assert float(sum(halves).detach() / 2) == pytest.approx(float(full.detach()), rel=1e-12)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        distillation_loss(s, t, c, m, loss_agg_mode="mean")


def test_dump_rows_round_trip_through_audit_coeffs(tmp_path):
    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.coeffs import compute_coefficients
    from icsd_audit.dumps.reader import read_metadata
    from icsd_audit.integrations.core import dump_writer
    import pyarrow.parquet as pq

    out_c = []
    writers = [dump_writer(tmp_path / "dumps", rank=r, producer="test") for r in (0, 1)]
    for bid, seed in enumerate([11, 12, 13]):
        mask, traj, turn, adv, ratio, delta = _batch(seed, B=40)
        idx = torch.cat([torch.arange(mask.shape[0]), torch.tensor([1, 3])])
        a = allocate_padded(advantage=adv[idx], ratio=ratio[idx], delta=delta[idx], response_mask=mask[idx],
                            traj_id=traj[idx], turn_id=turn[idx], batch_id=bid)
        cols = dump_rows(a, batch_id=bid, traj_id=traj[idx], advantage=adv[idx], ratio=ratio[idx], delta=delta[idx],
                         response_mask=mask[idx], extra={"row": torch.arange(idx.numel())})
        assert cols["c"].size == int(mask.sum())  # copies are not dumped
        writers[bid % 2].write(**cols)
        out_c.append(a)
    names = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert names == ["part-000000-r00000.parquet", "part-000000-r00001.parquet", "part-000001-r00000.parquet"]
    assert read_metadata(tmp_path / "dumps" / names[1])["rank"] == 1
    compute_coefficients([tmp_path / "dumps"], tmp_path / "c.parquet", AllocatorOptions())
    tab = pq.read_table(tmp_path / "c.parquet")
    recomputed = tab.column("c").to_numpy()
    bid, rows, pos = (tab.column(k).to_numpy() for k in ("batch_id", "row", "pos"))
    deployed = np.empty_like(recomputed)  # the float64 c training used, looked up position by position
    for i in range(len(bid)):
        a = out_c[bid[i]]
        col = int(torch.nonzero(a.pos[rows[i]] == pos[i]).flatten()[0])
        deployed[i] = float(a.c[rows[i], col])
    assert np.array_equal(recomputed, deployed)


def test_dump_writer_rejects_negative_ranks(tmp_path):
    from icsd_audit.integrations.core import dump_writer

    with pytest.raises(ValueError):
        dump_writer(tmp_path, rank=-1)
