"""verl-agent / SDAR drop-in: compute_icsd_loss against our actor, allocate_dataproto against allocate."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from icsd_audit.alloc.variants import allocate
from icsd_audit.integrations.sdar import C_KEY, allocate_dataproto, compute_icsd_loss, dump_writer, stable_traj_id
from icsd_audit.train.update.losses import token_losses

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


def _flat_reference(dp, rows, **settings):
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
                   traj_id=torch.tensor([k[0] for k in toks]), turn_id=torch.tensor([k[1] for k in toks]),
                   **{"min_group": 3, **settings})
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
    res = allocate_dataproto(dp, mini_batch_rows=size if per_mini_batch else None, min_group=3, step=4,
                             writer=dump_writer(tmp_path / "d", rank=3))
    allocs = res.parts
    assert res.c is dp.batch[C_KEY] and len(res.shards) == len(allocs)
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


def _verl_partition(n: int, mini_batch_rows: int, dp_size: int) -> list[list[int]]:
    """Rows (originals only) of each global mini-batch, as verl dispatches and splits, by a plain loop:
    pad to a multiple of dp_size with copies of the first rows, give rank r the r-th contiguous chunk, cut each
    chunk into pieces of mini_batch_rows // dp_size rows (DataProto.split: the last piece may be short), and
    pool the ranks' k-th pieces."""
    padded = list(range(n)) + list(range((-n) % dp_size))
    per_rank = len(padded) // dp_size
    m = mini_batch_rows // dp_size
    pieces: dict[int, list[int]] = {}
    for r in range(dp_size):
        chunk = list(range(r * per_rank, (r + 1) * per_rank))  # positions in the padded batch
        for k, lo in enumerate(range(0, per_rank, m)):
            pieces.setdefault(k, []).extend(i for i in chunk[lo:lo + m] if i < n)  # copies carry their original's c
    return [rows for _, rows in sorted(pieces.items()) if rows]


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("n_rows,mini_batch_rows", [(24, 8), (24, 16), (40, 16), (26, 8), (30, 12)])
def test_allocate_dataproto_any_row_count_per_rank(dp_size, n_rows, mini_batch_rows):
    """dp 1, 2, 4 with row counts that do and do not divide into mini-batches (and ranks): each global mini-batch
    gets exactly the coefficients of allocating its rows by hand (24 rows, mini-batch 16, 2 ranks: the issue's
    case, 12 rows per rank cut into 8 + 4)."""
    dp, n = _dataproto(7, n_traj=40)
    assert n >= n_rows
    dp = SimpleNamespace(batch={k: v[:n_rows] for k, v in dp.batch.items()},
                         non_tensor_batch={k: v[:n_rows] for k, v in dp.non_tensor_batch.items()})
    res = allocate_dataproto(dp, mini_batch_rows=mini_batch_rows, dp_size=dp_size, min_group=3)
    parts = _verl_partition(n_rows, mini_batch_rows, dp_size)
    assert len(res.parts) == len(parts)
    for k, rows in enumerate(parts):
        assert sorted(np.flatnonzero(res.mini_batch == k).tolist()) == sorted(rows)
        keep = _first_occurrences(dp, rows)
        ref = _flat_reference(dp, keep)
        assert len(ref) == res.parts[k].diagnostics.n_tokens
        for (b, t), v in ref.items():
            assert float(dp.batch[C_KEY][b, t]) == np.float32(v)


def _one_line_error(dp, match: str, **kw):
    from icsd_audit.integrations.checks import BatchInputError

    with pytest.raises(BatchInputError) as e:
        allocate_dataproto(dp, min_group=3, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    assert match in msg, msg
    return msg


def test_allocate_dataproto_refuses_non_finite_values_naming_key_row_and_traj_uid(tmp_path):
    for key, value in (("advantages", float("nan")), ("old_log_probs", float("inf")),
                       ("teacher_log_probs", float("-inf")), ("teacher_log_probs", float("nan"))):
        dp, _ = _dataproto(4)
        row = 3
        tok = int(dp.batch["response_mask"][row].sum()) - 1  # the row's last valid token
        dp.batch[key] = dp.batch[key].clone()
        dp.batch[key][row, tok] = value
        out = tmp_path / key
        msg = _one_line_error(dp, f"{key} is {value} at row {row} (traj_uid '{dp.non_tensor_batch['traj_uid'][row]}'), "
                                  f"response token {tok}", writer=dump_writer(out))
        assert C_KEY not in dp.batch and not list(out.iterdir())  # nothing stored, nothing written
        assert str(stable_traj_id(dp.non_tensor_batch["traj_uid"][row])) not in msg


def test_allocate_dataproto_ignores_non_finite_padding():
    dp, _ = _dataproto(5)
    m = dp.batch["response_mask"].bool()
    for key in ("old_log_probs", "teacher_log_probs"):
        dp.batch[key] = dp.batch[key].masked_fill(~m, float("-inf"))
    ref, _ = _dataproto(5)
    allocate_dataproto(dp, min_group=3)
    allocate_dataproto(ref, min_group=3)
    assert torch.equal(dp.batch[C_KEY], ref.batch[C_KEY])


def test_allocate_dataproto_refuses_bad_shapes_and_ids():
    dp, B = _dataproto(6)
    dp.batch["response_mask"] = dp.batch["response_mask"][:, :-1]
    _one_line_error(dp, "advantages has shape")
    dp, B = _dataproto(6)
    dp.batch["teacher_log_probs"] = dp.batch["teacher_log_probs"][:-1]
    _one_line_error(dp, f"teacher_log_probs has shape ({B - 1}, 7); it must have the mask's shape ({B}, 7)")
    dp, B = _dataproto(6)
    dp.non_tensor_batch["traj_uid"] = dp.non_tensor_batch["traj_uid"][:-1]
    _one_line_error(dp, f"traj_uid has shape ({B - 1},); it must hold one id per row ({B},)")
    dp, B = _dataproto(6)
    steps = dp.non_tensor_batch["turn_step"].astype(object)
    steps[2] = "1"
    dp.non_tensor_batch["turn_step"] = steps
    _one_line_error(dp, f"turn_step must hold integer turn indices, got '1' at row 2 "
                        f"(traj_uid '{dp.non_tensor_batch['traj_uid'][2]}')")
    dp, B = _dataproto(6)
    dp.non_tensor_batch["turn_step"] = dp.non_tensor_batch["turn_step"] + 0.5
    _one_line_error(dp, "turn_step must hold integer turn indices, got 0.5 at row 0")


def test_copies_with_different_masks_name_the_users_traj_uid():
    dp, B = _dataproto(8, dup=(2,))
    dp.batch["response_mask"] = dp.batch["response_mask"].clone()
    dp.batch["response_mask"][B, 0] = 1 - dp.batch["response_mask"][B, 0]
    with pytest.raises(ValueError) as e:
        allocate_dataproto(dp, min_group=3)
    assert f"share traj_uid '{dp.non_tensor_batch['traj_uid'][2]}' and turn" in str(e.value)


def test_turn_steps_count_a_trajectorys_earlier_rows():
    from icsd_audit.integrations.sdar import turn_steps

    uids = np.array(["a", "b", "a", "c", "b", "a", 7, 7], dtype=object)
    assert turn_steps(uids).tolist() == [0, 0, 1, 0, 1, 2, 0, 1]


@pytest.mark.engines
def test_teacher_pass_scores_the_privileged_rows_with_the_actor(tmp_path):
    """A plain verl-agent fork: the SkillBank block goes in front of each row's real prompt ids, the response stays,
    and the actor's compute_log_prob scores the new rows; stored under teacher_log_probs, equal to scoring the
    privileged sequence by hand."""
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    from verl import DataProto

    from icsd_audit.integrations.sdar import teacher_pass
    from icsd_audit.train.models.loading import tiny_random_causal_lm
    from icsd_audit.train.rollout.prompts import skill_block
    from icsd_audit.train.teacher.skills import load_skillbank

    model, tok = tiny_random_causal_lm(seed=2)
    texts = ["buy a red mug", "find blue running shoes under 30 dollars", "open the drawer"]
    resp = [[10, 11, 12], [13, 14], [15, 16, 17]]
    P, R = 48, 3
    prompts = torch.zeros(3, P, dtype=torch.long)
    att = torch.zeros(3, P + R, dtype=torch.long)
    responses = torch.zeros(3, R, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = torch.as_tensor(tok(t, add_special_tokens=False).input_ids)
        prompts[i, P - ids.numel():] = ids
        att[i, P - ids.numel():P] = 1
        responses[i, : len(resp[i])] = torch.as_tensor(resp[i])
        att[i, P:P + len(resp[i])] = 1
    batch = DataProto.from_dict(tensors={"prompts": prompts, "responses": responses, "attention_mask": att},
                                meta_info={"global_steps": 3})

    class Workers:
        world_size = 2

        def compute_log_prob(self, data):
            ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=data.batch["position_ids"]).logits
            lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            return DataProto.from_dict(tensors={"old_log_probs": lp[:, -data.batch["responses"].shape[1]:]})

    bank = load_skillbank("webshop")
    teacher_pass(batch, Workers(), tok, bank)
    got = batch.batch["teacher_log_probs"]
    assert got.shape == (3, R)
    for i, t in enumerate(texts):  # by hand: block + prompt + response, one unpadded sequence
        z = bank.retrieve(t).text
        seq = (list(tok(skill_block(z), add_special_tokens=False).input_ids) + list(tok(t, add_special_tokens=False).input_ids)
               + resp[i])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
        n = len(resp[i])
        want = lp[-n - 1:-1].gather(-1, torch.tensor(resp[i])[:, None])[:, 0]
        assert torch.allclose(got[i, :n], want, atol=1e-5)
    assert set(batch.batch.keys()) == {"prompts", "responses", "attention_mask", "teacher_log_probs"}


def test_allocate_dataproto_takes_every_allocator_setting(tmp_path):
    """trust_eta and influence_eta reach the allocation and the dumps' allocator block as the other settings do."""
    from icsd_audit.dumps.reader import read_metadata

    settings = dict(trust="laplace", trust_eta=0.3, influence_eta=0.6, min_group=3, eps=1e-3)
    dp, n = _dataproto(1)
    res = allocate_dataproto(dp, writer=dump_writer(tmp_path / "d"), **settings)
    ref, default = _flat_reference(dp, range(n), **settings), _flat_reference(dp, range(n), min_group=3, eps=1e-3)
    for (b, t), v in ref.items():
        assert float(dp.batch[C_KEY][b, t]) == np.float32(v)
    assert any(abs(ref[k] - default[k]) > 1e-6 for k in ref)  # the etas change c: the test can fail
    block = read_metadata(res.shards[0])["allocator"]
    assert {k: block[k] for k in settings} == settings


def test_allocate_dataproto_dumps_the_batchs_entropys(tmp_path):
    """Where the batch carries verl's ``entropys`` (the old-log-prob pass's, from the same logits as
    ``old_log_probs``), the dump's float32 ``entropy`` is it: here from a tiny model's logits as verl's
    ``entropy_from_logits`` computes them, checked against a float64 entropy of those logits; without it, no column."""
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    import pyarrow.parquet as pq
    from verl.utils import torch_functional as verl_F

    from icsd_audit.train.models.loading import tiny_random_causal_lm

    dp, B = _dataproto(5)
    T = dp.batch["response_mask"].shape[1]
    model, tok = tiny_random_causal_lm(seed=3)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, len(tok), (B, 4 + T), generator=g)
    with torch.no_grad():
        z = model(input_ids=ids).logits[:, 3:-1].float() / 0.8  # the distributions of the T response tokens
    dp.batch["entropys"] = verl_F.entropy_from_logits(z)
    lp = torch.log_softmax(z.double(), -1)
    ref = -(lp.exp() * lp).sum(-1)
    allocate_dataproto(dp, writer=dump_writer(tmp_path / "d"))
    t = pq.read_table(sorted((tmp_path / "d").glob("*.parquet"))[0])
    row = {stable_traj_id(u): [] for u in dp.non_tensor_batch["traj_uid"]}
    for b, u in enumerate(dp.non_tensor_batch["traj_uid"]):
        row[stable_traj_id(u)].append(b)
    traj, turn, pos = (t.column(k).to_numpy() for k in ("traj_id", "turn_id", "pos"))
    # a trajectory's turn k is its row with turn_step k; its tokens are the row's first ones (pos = column)
    want = [float(ref[row[int(j)][int(k)], int(p)]) for j, k, p in zip(traj, turn, pos)]
    assert t.schema.field("entropy").type == "float" and np.ptp(want) > 1e-3
    np.testing.assert_allclose(t.column("entropy").to_numpy(), want, atol=1e-5, rtol=0)
    del dp.batch["entropys"]
    allocate_dataproto(dp, writer=dump_writer(tmp_path / "e"))
    assert "entropy" not in pq.read_table(sorted((tmp_path / "e").glob("*.parquet"))[0]).column_names
