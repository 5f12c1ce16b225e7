"""Actor loss pieces on hand-worked numbers, and the mini-batch update's invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.train.update.actor import (
    Actor,
    Distillation,
    NoDistillation,
    StepData,
    batch_id_for,
)
from icsd_audit.train.update.losses import kd_loss, low_var_kl, ppo_dual_clip_loss, token_losses

LOG = math.log


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# ----------------------------------------------------------------------------- PPO surrogate


def test_ppo_positive_advantage_clips_above_one_plus_eps():
    # A = 2: ratio 1.5 -> max(-3.0, -2*1.2 = -2.4) = -2.4, clipped; ratio 1.1 -> -2.2 unclipped;
    # ratio 0.5 -> max(-1.0, -1.6) = -1.0, unclipped (the lower clip never binds for A > 0)
    logp = t(LOG(1.5), LOG(1.1), LOG(0.5))
    loss, ratio, clipped, dual = ppo_dual_clip_loss(logp, torch.zeros(3, dtype=torch.float64), t(2.0, 2.0, 2.0))
    assert torch.allclose(ratio, t(1.5, 1.1, 0.5))
    assert torch.allclose(loss, t(-2.4, -2.2, -1.0))
    assert clipped.tolist() == [True, False, False]
    assert dual.tolist() == [False, False, False]


def test_ppo_negative_advantage_clip_and_dual_clip():
    # A = -1:
    # ratio 0.5: l1 = 0.5, l2 = 0.8 -> clip1 = 0.8 (clipped), cap l3 = 3 -> 0.8
    # ratio 1.5: l1 = 1.5, l2 = 1.2 -> 1.5 (unclipped), below the cap
    # ratio 4.0: l1 = 4.0, l2 = 1.2 -> 4.0, capped by dual clip at 3.0
    logp = t(LOG(0.5), LOG(1.5), LOG(4.0))
    loss, ratio, clipped, dual = ppo_dual_clip_loss(logp, torch.zeros(3, dtype=torch.float64), t(-1.0, -1.0, -1.0),
                                                    clip_ratio=0.2, dual_clip=3.0)
    assert torch.allclose(loss, t(0.8, 1.5, 3.0))
    assert clipped.tolist() == [True, False, False]
    assert dual.tolist() == [False, False, True]


def test_ppo_gradient_vanishes_where_clipped():
    logp = t(LOG(1.5), LOG(1.1), LOG(4.0)).requires_grad_(True)
    loss, *_ = ppo_dual_clip_loss(logp, torch.zeros(3, dtype=torch.float64), t(2.0, 2.0, -1.0))
    loss.sum().backward()
    # clipped (A>0, r>1.2) and dual-capped (A<0, r>3) tokens get no gradient; the middle one gets -A*r
    assert torch.allclose(logp.grad, t(0.0, -2.2, 0.0))


# ----------------------------------------------------------------------------- KL and KD


def test_low_var_kl_k3():
    # ref/pi = 0.25/0.5: log-ratio = log 0.5; k3 = 0.5 - log 0.5 - 1 = 0.19314718...
    v = low_var_kl(t(LOG(0.5)), t(LOG(0.25)))
    assert float(v) == pytest.approx(0.5 - LOG(0.5) - 1.0, abs=1e-12)
    assert float(low_var_kl(t(-1.3), t(-1.3))) == 0.0
    # clamps: log-ratio beyond +-20 is clamped, the value at 10
    assert float(low_var_kl(t(0.0), t(50.0))) == 10.0


def test_kd_loss_is_teacher_minus_student_with_stop_gradient():
    logp = t(-1.0, -2.0).requires_grad_(True)
    teacher = t(-0.5, -3.0).requires_grad_(True)
    kd = kd_loss(logp, teacher)
    assert torch.allclose(kd, t(0.5, -1.0))
    kd.sum().backward()
    assert teacher.grad is None
    assert torch.allclose(logp.grad, t(-1.0, -1.0))


def test_aux_weighting_is_lambda_over_B_sum_c_lkd():
    # |B| = 4 tokens, lambda = 0.01, c = (2, 0, 1, 1), l_KD = teacher - logp = (0.5, 1.0, -0.25, 2.0)
    logp = t(-1.0, -1.0, -1.0, -1.0).requires_grad_(True)
    teacher = t(-0.5, 0.0, -1.25, 1.0)
    c = t(2.0, 0.0, 1.0, 1.0)
    tl = token_losses(logp=logp, old_logp=logp.detach(), advantage=torch.zeros(4, dtype=torch.float64), ref_logp=None,
                      teacher_logp=teacher, c=c, clip_ratio=0.2, dual_clip=3.0, kl_coef=0.0, distill_coef=0.01)
    aux = tl.aux.sum() / 4
    expected = 0.01 / 4 * (2 * 0.5 + 0 * 1.0 + 1 * -0.25 + 1 * 2.0)
    assert float(aux.detach()) == pytest.approx(expected, abs=1e-15)
    (tl.total.sum() / 4).backward()
    # d/dlogp of lambda/|B| * c * (teacher - logp) = -lambda * c / |B| (the PPO term has A = 0)
    assert torch.allclose(logp.grad, -0.01 * c / 4)


def test_total_combines_terms_with_their_coefficients():
    logp = t(LOG(0.5), LOG(0.9))
    old = t(LOG(0.5), LOG(0.5))
    ref = t(LOG(0.25), LOG(0.9))
    tl = token_losses(logp=logp, old_logp=old, advantage=t(1.0, -1.0), ref_logp=ref, teacher_logp=t(0.0, 0.0),
                      c=t(1.0, 3.0), clip_ratio=0.2, dual_clip=3.0, kl_coef=0.01, distill_coef=0.1)
    # token 0: pg = -1 * 1 = -1; kl = 0.5 - log .5 - 1; aux = 0.1 * 1 * (0 - log .5)
    # token 1: ratio 1.8, A = -1: l1 = 1.8, l2 = 1.2 -> 1.8 (< cap 3); kl = 0; aux = 0.1 * 3 * (0 - log .9)
    exp0 = -1.0 + 0.01 * (0.5 - LOG(0.5) - 1.0) + 0.1 * (-LOG(0.5))
    exp1 = 1.8 + 0.0 + 0.3 * (-LOG(0.9))
    assert torch.allclose(tl.total, t(exp0, exp1))


def test_none_inputs_switch_terms_off():
    logp = t(-1.0, -2.0)
    tl = token_losses(logp=logp, old_logp=logp, advantage=t(0.0, 0.0), ref_logp=None, teacher_logp=None, c=None,
                      clip_ratio=0.2, dual_clip=3.0, kl_coef=0.5, distill_coef=0.5)
    assert torch.count_nonzero(tl.kl) == 0 and torch.count_nonzero(tl.aux) == 0


def test_batch_ids_are_unique_across_steps():
    assert batch_id_for(0, 0) == 0 and batch_id_for(3, 7) == 3007
    with pytest.raises(ValueError):
        batch_id_for(1, 1000)


# ----------------------------------------------------------------------------- the mini-batch update


@pytest.fixture(scope="module")
def tiny():
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    return tiny_random_causal_lm(seed=3, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)


def _data(model, tok, n_rows=6, seed=0) -> StepData:
    """Rows with random prompts/responses whose old log-probs are the model's own."""
    from icsd_audit.train.update.logprobs import score_rows

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_rows)]
    responses = [torch.randint(3, 250, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n_rows)]
    old = score_rows(model, prompts, responses, [list(range(n_rows))], pad_id=tok.pad_token_id,
                     device=torch.device("cpu"), temperature=1.0)
    teacher = [o + 0.3 * torch.randn(o.shape, generator=g) for o in (old[i] for i in range(n_rows))]
    ref = [old[i] - 0.05 for i in range(n_rows)]
    return StepData(
        prompts=prompts, responses=responses, old_logp=[old[i] for i in range(n_rows)],
        advantage=torch.randn(n_rows, generator=g), traj=torch.arange(n_rows) // 2, turn=torch.arange(n_rows) % 2,
        teacher_logp=teacher, ref_logp=ref,
    )


def _actor(model, tok, *, micro: int, mini: int, distill=True, skip=True, allocator="icsd", **kw) -> Actor:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = Distillation(AllocatorSettings(allocator=allocator, min_group=2), coef=0.5) \
        if distill else NoDistillation()
    return Actor(model, opt, distill=d, clip_ratio=0.2, dual_clip=3.0, kl_coef=0.1, temperature=1.0,
                 mini_batch_rows=mini, micro_batch_rows=micro, ppo_epochs=1, grad_clip=1e9, skip_first_prepass=skip,
                 shuffle_rows=False, seed=0, pad_id=tok.pad_token_id, device=torch.device("cpu"), **kw)


def test_gradient_accumulation_equals_one_big_batch(tiny):
    """Token mean over the whole mini-batch: micro-batches of 1 row give the update of one batch of 6."""
    import copy

    model, tok = tiny
    data = _data(model, tok)
    params = []
    for micro in (1, 6):
        m = copy.deepcopy(model)
        actor = _actor(m, tok, micro=micro, mini=6)
        actor.update(0, data)
        params.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(params[0], torch.cat([p.detach().flatten() for p in model.parameters()]))


def test_prepass_gives_the_gradient_pass_numbers_and_is_skipped_on_the_first_mini_batch(tiny):
    import copy

    model, tok = tiny
    data = _data(model, tok, seed=1)
    seen: dict[str, dict] = {}
    actor = _actor(copy.deepcopy(model), tok, micro=2, mini=3)
    metrics, timings, pooled = actor.update(5, data, sink=lambda name, cols: seen.__setitem__(name, cols))
    assert sorted(seen) == ["step000005-mb000.parquet", "step000005-mb001.parquet"]
    first, second = seen["step000005-mb000.parquet"], seen["step000005-mb001.parquet"]
    # first mini-batch: no pre-pass, ratio exactly 1, logp = old_logp
    assert (first["ratio"] == 1.0).all()
    assert np.array_equal(first["logp"], first["old_logp"])
    # second mini-batch: the pre-pass reproduces the gradient pass's log-probs bit for bit
    assert np.array_equal(second["logp"], second["train_logp"])
    assert not np.allclose(second["ratio"], 1.0)
    assert metrics["alloc_ratio_gap"] == 0.0
    assert metrics["prepass_skipped"] == 1.0
    assert set(np.unique(first["batch_id"])) == {5000} and set(np.unique(second["batch_id"])) == {5001}
    # the allocation conserves turn mass: sum c == sum g per (traj, turn)
    for cols in (first, second):
        key = cols["traj_id"] * 10 + cols["turn_id"]
        for k in np.unique(key):
            sel = key == k
            assert cols["c"][sel].sum() == pytest.approx(cols["g"][sel].sum(), rel=1e-5)
    assert "prepass" in timings and "allocation" in timings


def test_no_distillation_skips_prepass_and_aux(tiny):
    import copy

    model, tok = tiny
    data = _data(model, tok, seed=2)
    seen: dict = {}
    actor = _actor(copy.deepcopy(model), tok, micro=2, mini=3, distill=False)
    metrics, timings, pooled = actor.update(0, data, sink=lambda n, c: seen.__setitem__(n, c))
    assert seen == {} and pooled == {}
    assert metrics["aux_loss"] == 0.0
    assert "prepass" not in timings and "allocation" not in timings


def _score_norm_by_hand(model, prompt, response):
    """||onehot - softmax|| per response token from one unpadded forward, float64 softmax."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].double()
    p = torch.softmax(logits, -1)
    pa = p[torch.arange(len(response)), torch.tensor(response)]
    return torch.sqrt(1 - 2 * pa + (p * p).sum(-1))


def test_score_norm_is_dumped_from_the_allocation_pass(tiny):
    """SPEC 5's s_t = sqrt(1 - 2 p_a + sum p^2), worked in float64 from a plain forward."""
    import copy

    model, tok = tiny
    data = _data(model, tok, seed=4)
    seen: dict = {}
    m = copy.deepcopy(model)
    ref_model = copy.deepcopy(model)
    actor = _actor(m, tok, micro=2, mini=6)
    actor.update(0, data, sink=lambda n, c: seen.__setitem__(n, c))
    cols = seen["step000000-mb000.parquet"]
    # one mini-batch = the first: pre-pass skipped, score norms from the gradient forward (same weights)
    for r in range(6):
        sel = (cols["traj_id"] == int(data.traj[r])) & (cols["turn_id"] == int(data.turn[r]))
        order = np.argsort(cols["pos"][sel])
        want = _score_norm_by_hand(ref_model, data.prompts[r], data.responses[r]).numpy()
        assert np.allclose(cols["score_norm"][sel][order], want, atol=2e-6)
    assert (cols["score_norm"] >= 0).all() and (cols["score_norm"] <= np.sqrt(2) + 1e-6).all()


def test_fisher_runs_the_first_prepass_and_reproduces_from_the_dump(tiny):
    import copy

    from icsd_audit.alloc.variants import allocate

    model, tok = tiny
    data = _data(model, tok, seed=5)
    seen: dict = {}
    actor = _actor(copy.deepcopy(model), tok, micro=2, mini=3, allocator="fisher")
    metrics, timings, _ = actor.update(1, data, sink=lambda n, c: seen.__setitem__(n, c))
    assert metrics["prepass_skipped"] == 0.0 and "prepass" in timings
    for cols in seen.values():
        assert np.array_equal(cols["logp"], cols["train_logp"])
        canon = np.lexsort((cols["pos"], cols["turn_id"], cols["traj_id"]))
        t = {k: torch.from_numpy(np.asarray(cols[k])[canon]) for k in
             ("advantage", "ratio", "delta", "score_norm", "traj_id", "turn_id", "batch_id")}
        out = allocate(advantage=t["advantage"].double(), ratio=t["ratio"].double(), delta=t["delta"].double(),
                       score_norm=t["score_norm"].double(), traj_id=t["traj_id"], turn_id=t["turn_id"],
                       batch_id=t["batch_id"], allocator="fisher", min_group=2)
        assert np.array_equal(out.c.numpy().astype(np.float32), np.asarray(cols["c"])[canon])


def test_micro_batch_scope_allocates_each_micro_batch_without_a_prepass(tiny):
    import copy

    from icsd_audit.alloc.variants import allocate

    model, tok = tiny
    data = _data(model, tok, seed=6)
    seen: dict = {}
    actor = _actor(copy.deepcopy(model), tok, micro=2, mini=3, alloc_scope="micro-batch")
    metrics, timings, _ = actor.update(2, data, sink=lambda n, c: seen.__setitem__(n, c))
    assert "prepass" not in timings and metrics["alloc_ratio_gap"] == 0.0
    first, second = seen["step000002-mb000.parquet"], seen["step000002-mb001.parquet"]
    # micro-batches of 2 rows and 1 row: batch ids 1000 * mini-batch id + micro index
    assert set(np.unique(first["batch_id"])) == {2000 * 1000, 2000 * 1000 + 1}
    assert set(np.unique(second["batch_id"])) == {2001 * 1000, 2001 * 1000 + 1}
    for cols in (first, second):
        assert np.array_equal(cols["logp"], cols["train_logp"])  # the gradient forward's own numbers
        for b in np.unique(cols["batch_id"]):
            sel = np.flatnonzero(cols["batch_id"] == b)
            sel = sel[np.lexsort((cols["pos"][sel], cols["turn_id"][sel], cols["traj_id"][sel]))]
            t = {k: torch.from_numpy(np.asarray(cols[k])[sel]) for k in
                 ("advantage", "ratio", "delta", "traj_id", "turn_id", "batch_id")}
            out = allocate(advantage=t["advantage"].double(), ratio=t["ratio"].double(), delta=t["delta"].double(),
                           traj_id=t["traj_id"], turn_id=t["turn_id"], batch_id=t["batch_id"], min_group=2)
            assert np.array_equal(out.c.numpy().astype(np.float32), np.asarray(cols["c"])[sel])
    # the second mini-batch's ratios are real (the weights moved), not 1
    assert not np.allclose(second["ratio"], 1.0)


def test_teacher_rescore_uses_current_weights_after_the_first_mini_batch(tiny):
    import copy

    from icsd_audit.train.update.logprobs import score_rows

    model, tok = tiny
    data = _data(model, tok, seed=7)
    # a privileged prompt per row: two extra tokens in front
    data.teacher_prompts = [[5, 6] + p for p in data.prompts]
    seen: dict = {}
    m = copy.deepcopy(model)
    actor = _actor(m, tok, micro=2, mini=3, teacher_rescore=True)
    _, timings, _ = actor.update(0, data, sink=lambda n, c: seen.__setitem__(n, c))
    first, second = seen["step000000-mb000.parquet"], seen["step000000-mb001.parquet"]
    # first mini-batch: the step's teacher log-probs as given
    rows0 = sorted(range(3), key=lambda i: (len(data.prompts[i]) + len(data.responses[i]), i))
    assert np.array_equal(first["teacher_logp"], torch.cat([data.teacher_logp[i] for i in rows0]).numpy())
    assert "teacher_rescore" in timings
    # second: the teacher prompts scored with the weights after the first optimizer step;
    # replay that state: one more actor on a fresh copy, stopped after mini-batch 0
    m2 = copy.deepcopy(model)
    a2 = _actor(m2, tok, micro=2, mini=3)
    a2.update(0, StepData(prompts=data.prompts[:3], responses=data.responses[:3], old_logp=data.old_logp[:3],
                          advantage=data.advantage[:3], traj=data.traj[:3], turn=data.turn[:3],
                          teacher_logp=data.teacher_logp[:3], ref_logp=data.ref_logp[:3]))
    rows1 = sorted(range(3, 6), key=lambda i: (len(data.prompts[i]) + len(data.responses[i]), i))
    want = score_rows(m2, data.teacher_prompts, data.responses, [sorted(rows1, key=lambda i: (len(
        data.teacher_prompts[i]) + len(data.responses[i]), i))], pad_id=tok.pad_token_id,
        device=torch.device("cpu"), temperature=1.0)
    assert np.allclose(second["teacher_logp"], torch.cat([want[i] for i in rows1]).numpy(), atol=1e-5)
    assert not np.allclose(second["teacher_logp"], torch.cat([data.teacher_logp[i] for i in rows1]).numpy())
