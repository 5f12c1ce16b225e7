"""Skill-SD and RLSD (SDAR's definitions): hand-worked values, slow reference loops, the schedule, the update, runs."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.train.update.hybrid import (Hybrid, HybridSpec, get_hybrid, hybrid_names, register_hybrid, rlsd_lambda,
                                     rlsd_token_advantage, sdl_loss)
from icsd_audit.train.update.losses import low_var_kl, ppo_dual_clip_loss, token_losses

LOG = math.log


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# ----------------------------------------------------------------------------- RLSD token advantages


def test_rlsd_token_advantage_by_hand():
    # lam 0.5, eps 0.2; w = clip(exp(sign(A) * (teacher - old)), 0.8, 1.2):
    #  A=2,  gap ln 1.1:  w = 1.1           -> 2 * (0.5 + 0.55) = 2.1
    #  A=2,  gap ln 2:    w = 2 -> 1.2      -> 2 * (0.5 + 0.6)  = 2.2
    #  A=-1, gap ln 2:    w = 0.5 -> 0.8    -> -1 * (0.5 + 0.4) = -0.9
    #  A=-1, gap -ln 1.1: w = 1.1           -> -1 * (0.5 + 0.55) = -1.05
    #  A=0:  sign 0 -> w = exp(0) = 1       -> 0
    old = t(-1.0, -2.0, -0.5, -3.0, -1.0)
    gap = t(LOG(1.1), LOG(2.0), LOG(2.0), -LOG(1.1), 5.0)
    adv, w = rlsd_token_advantage(t(2.0, 2.0, -1.0, -1.0, 0.0), old, old + gap, lam=0.5, clip_eps=0.2)
    assert torch.allclose(w, t(1.1, 1.2, 0.8, 1.1, 1.0), atol=1e-12)
    assert torch.allclose(adv, t(2.1, 2.2, -0.9, -1.05, 0.0), atol=1e-12)
    # lam 0 is GRPO: the advantages come back unchanged, whatever the gap
    adv0, _ = rlsd_token_advantage(t(2.0, -1.0), t(-1.0, -1.0), t(3.0, -9.0), lam=0.0, clip_eps=0.2)
    assert torch.equal(adv0, t(2.0, -1.0))


def _rlsd_slow(a: float, old: float, teacher: float, lam: float, eps: float) -> float:
    s = 1.0 if a > 0 else -1.0 if a < 0 else 0.0
    w = min(max(math.exp(s * (teacher - old)), 1.0 - eps), 1.0 + eps)
    return a * ((1.0 - lam) + lam * w)


def test_rlsd_token_advantage_matches_a_slow_loop():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(400, generator=g, dtype=torch.float64)
    a[::7] = 0.0
    old = -torch.rand(400, generator=g, dtype=torch.float64) * 4
    teacher = old + 0.4 * torch.randn(400, generator=g, dtype=torch.float64)
    for lam, eps in ((0.5, 0.2), (0.13, 0.05), (1.0, 0.5)):
        got, _ = rlsd_token_advantage(a, old, teacher, lam=lam, clip_eps=eps)
        want = [_rlsd_slow(*map(float, x), lam, eps) for x in zip(a, old, teacher)]
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_rlsd_token_advantage_carries_no_gradient():
    teacher = t(-1.0, -2.0).requires_grad_(True)
    old = t(-1.5, -1.0).requires_grad_(True)
    adv, w = rlsd_token_advantage(t(1.0, -1.0), old, teacher, lam=0.5)
    assert not adv.requires_grad and not w.requires_grad


def test_rlsd_lambda_is_sdars_linear_warmdown_at_global_step_s_plus_1():
    # SDAR: lam0 * (1 - t / W) at global step t (counted from 1), 0 from t = W on
    assert rlsd_lambda(0) == pytest.approx(0.5 * (1 - 1 / 100), abs=1e-15)
    assert rlsd_lambda(49) == pytest.approx(0.25, abs=1e-15)
    assert rlsd_lambda(98) == pytest.approx(0.005, abs=1e-15)
    assert rlsd_lambda(99) == 0.0 and rlsd_lambda(149) == 0.0
    assert rlsd_lambda(3, lam0=0.8, warmdown_steps=10) == pytest.approx(0.8 * 0.6, abs=1e-15)
    assert rlsd_lambda(0, lam0=0.5, warmdown_steps=1) == 0.0
    lams = [rlsd_lambda(s) for s in range(120)]
    assert all(x >= y for x, y in zip(lams, lams[1:]))  # non-increasing
    with pytest.raises(ValueError, match="warmdown_steps"):
        rlsd_lambda(0, warmdown_steps=0)


# ----------------------------------------------------------------------------- Skill-SD's loss


def test_sdl_loss_by_hand():
    # rho = exp(logp - old), gap = teacher - logp, sdl = rho * (e^gap - 1 - gap)
    #  logp ln .5, old ln .5, teacher ln .25: rho 1, gap ln .5: .5 - 1 - ln .5 = 0.19314718...
    #  logp ln .4, old ln .2, teacher ln .8:  rho 2, gap ln 2:  2 * (2 - 1 - ln 2) = 0.61370563...
    #  equal log-probs: 0
    logp = t(LOG(0.5), LOG(0.4), -1.0)
    got = sdl_loss(logp, t(LOG(0.25), LOG(0.8), -1.0), t(LOG(0.5), LOG(0.2), -1.0))
    assert torch.allclose(got, t(0.5 - 1 - LOG(0.5), 2 * (1 - LOG(2.0)), 0.0), atol=1e-12)


def test_sdl_loss_clamps_as_sdar():
    # gap above 20 enters exp() as 20; a log ratio above 10 enters exp() as 10 (no lower clamp on either)
    got = sdl_loss(t(0.0, 0.0, 0.0), t(30.0, LOG(2.0), -30.0), t(0.0, -15.0, 15.0))
    want = t(math.exp(20) - 1 - 30, math.exp(10) * (1 - LOG(2.0)), math.exp(-15) * (math.exp(-30) - 1 + 30))
    assert torch.allclose(got, want, rtol=1e-12)


def _sdl_slow(lp: float, te: float, old: float) -> tuple[float, float]:
    """(loss, d loss / d logp) of one token, from the formula written out term by term."""
    gap = te - lp
    e = math.exp(min(gap, 20.0))
    k3 = e - 1.0 - gap
    rho = math.exp(min(lp - old, 10.0))
    d_k3 = (-e if gap < 20.0 else 0.0) + 1.0  # d/dlogp of e^min(gap, 20) - 1 - gap
    d_rho = rho if lp - old < 10.0 else 0.0
    return rho * k3, d_rho * k3 + rho * d_k3


def test_sdl_loss_and_its_gradient_match_a_slow_loop():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(300, generator=g, dtype=torch.float64) * 5
    teacher = (logp + torch.randn(300, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = (logp + 0.3 * torch.randn(300, generator=g, dtype=torch.float64)).requires_grad_(True)
    logp[:3] = torch.tensor([0.0, -1.0, -0.5], dtype=torch.float64)
    with torch.no_grad():
        teacher[:3] = torch.tensor([25.0, -1.0, -0.5], dtype=torch.float64)  # gap clamp
        old[:3] = torch.tensor([0.0, -12.0, -0.5], dtype=torch.float64)  # log-ratio clamp
    logp.requires_grad_(True)
    loss = sdl_loss(logp, teacher, old)
    loss.sum().backward()
    want = [_sdl_slow(*map(float, x)) for x in zip(logp.detach(), teacher.detach(), old.detach())]
    assert torch.allclose(loss.detach(), torch.tensor([w[0] for w in want], dtype=torch.float64), rtol=1e-12)
    assert torch.allclose(logp.grad, torch.tensor([w[1] for w in want], dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert teacher.grad is None and old.grad is None  # both detached, as in SDAR
    # inside the clamps, d sdl / d logp = -rho * gap (a distillation gradient with the signed weight rho * gap)
    inside = (teacher.detach() - logp.detach() < 20) & (logp.detach() - old.detach() < 10)
    rho = torch.exp(logp.detach() - old.detach())
    assert torch.allclose(logp.grad[inside], (-rho * (teacher.detach() - logp.detach()))[inside], atol=1e-10)


def test_token_losses_adds_sdl_with_its_coefficient():
    kw = dict(logp=t(-1.0, -2.0), old_logp=t(-1.1, -1.9), advantage=t(1.0, -1.0), ref_logp=t(-1.2, -2.2),
              teacher_logp=t(-0.5, -2.5), c=None, clip_ratio=0.2, dual_clip=3.0, kl_coef=0.1, distill_coef=0.0)
    plain = token_losses(**kw)
    skill = token_losses(**kw, sdl_coef=0.25)
    sdl = sdl_loss(kw["logp"], kw["teacher_logp"], kw["old_logp"])
    assert torch.equal(plain.sdl, torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(skill.sdl, sdl) and torch.allclose(skill.total, plain.total + 0.25 * sdl)
    with pytest.raises(ValueError, match="teacher"):
        token_losses(**{**kw, "teacher_logp": None}, sdl_coef=0.25)


# ----------------------------------------------------------------------------- registry and config


def test_registry_lists_names_and_rejects_duplicates():
    assert hybrid_names() == ["none", "rlsd", "skill-sd"]
    assert get_hybrid("none") is None and get_hybrid("rlsd").reshapes_advantage
    assert get_hybrid("skill-sd").adds_loss and not get_hybrid("skill-sd").reshapes_advantage
    with pytest.raises(ValueError, match=r"choose one of \['none', 'rlsd', 'skill-sd'\]"):
        get_hybrid("rlsd2")
    for name in ("rlsd", "none"):
        with pytest.raises(ValueError, match="already registered"):
            register_hybrid(HybridSpec(name, reshapes_advantage=False, adds_loss=False, title="x", reference="x"))
    with pytest.raises(ValueError, match="choose one of"):
        Hybrid("rlsd2")
    assert Hybrid("skill-sd", sdl_coef=0.5).loss_coef == 0.5 and Hybrid("rlsd", sdl_coef=0.5).loss_coef == 0.0
    assert Hybrid("skill-sd").lam(0) == 0.0 and Hybrid("rlsd").lam(0) == pytest.approx(0.495)


def test_config_defaults_are_sdars_scripts_and_switches_validate():
    from icsd_audit.train.config import ConfigError, TrainConfig

    c = TrainConfig(model="tiny-random")
    assert (c.hybrid, c.rlsd_lambda, c.rlsd_warmdown_steps, c.rlsd_clip_eps, c.sdl_coef) == ("none", 0.5, 100, 0.2, 0.001)
    assert not c.replace(allocator="none").teacher_enabled
    for h in ("rlsd", "skill-sd"):
        ok = c.replace(allocator="none", hybrid=h).validate()
        assert ok.teacher_enabled and not ok.distill_enabled and ok.effective_distill_coef == 0.0
        with pytest.raises(ConfigError, match="--allocator none"):
            c.replace(hybrid=h).validate()  # allocator icsd: no allocation may join a hybrid baseline
        with pytest.raises(ConfigError, match="teacher_rescore"):
            c.replace(allocator="none", hybrid=h, teacher_rescore=True).validate()
        with pytest.raises(ConfigError, match="student_skills"):
            c.replace(allocator="none", hybrid=h, student_skills="train").validate()
    with pytest.raises(ConfigError, match="hybrid='RLSD'"):
        c.replace(allocator="none", hybrid="RLSD").validate()
    bad = c.replace(allocator="none", hybrid="rlsd", rlsd_lambda=1.5, rlsd_warmdown_steps=0, rlsd_clip_eps=1.0,
                    sdl_coef=-1.0)
    with pytest.raises(ConfigError) as e:
        bad.validate()
    assert [p.split("=")[0] for p in e.value.problems] == ["rlsd_lambda", "rlsd_warmdown_steps", "rlsd_clip_eps",
                                                           "sdl_coef"]


# ----------------------------------------------------------------------------- the actor's update


@pytest.fixture(scope="module")
def tiny():
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    return tiny_random_causal_lm(seed=3, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)


def _data(model, tok, seed: int):
    from tests.train.test_actor import _data as actor_data

    return actor_data(model, tok, seed=seed)


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _by_hand(model, data, *, step: int, hybrid: Hybrid, kl_coef: float, lr: float) -> torch.Tensor:
    """One SGD step on the loss written out row by row from unpadded forwards and the slow formulas."""
    model = copy.deepcopy(model)
    model.zero_grad()
    total, n = 0.0, sum(len(r) for r in data.responses)
    for i, (prompt, resp) in enumerate(zip(data.prompts, data.responses)):
        ids = torch.tensor([prompt + resp])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
        logp = torch.log_softmax(logits, -1)[torch.arange(len(resp)), torch.tensor(resp)]
        old, teacher, ref = data.old_logp[i], data.teacher_logp[i], data.ref_logp[i]
        a = float(data.advantage[i])
        lam = hybrid.lam(step)
        adv = torch.tensor([_rlsd_slow(a, float(o), float(te), lam, hybrid.rlsd_clip_eps) if hybrid.name == "rlsd"
                            else a for o, te in zip(old, teacher)])
        pg = ppo_dual_clip_loss(logp, old, adv, clip_ratio=0.2, dual_clip=3.0)[0]
        loss = pg + kl_coef * low_var_kl(logp, ref)
        if hybrid.loss_coef:
            loss = loss + hybrid.loss_coef * sdl_loss(logp, teacher, old)
        total = total + loss.sum()
    (total / n).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return _params(model)


@pytest.mark.parametrize("hybrid", [Hybrid("rlsd"), Hybrid("rlsd", rlsd_lambda=1.0, rlsd_clip_eps=0.05),
                                    Hybrid("skill-sd", sdl_coef=0.5)], ids=["rlsd", "rlsd-lam1", "skill-sd"])
def test_actor_update_equals_the_loss_written_out(tiny, hybrid):
    from icsd_audit.train.update.actor import Actor, NoDistillation

    model, tok = tiny
    data = _data(model, tok, seed=11)
    m = copy.deepcopy(model)
    actor = Actor(m, torch.optim.SGD(m.parameters(), lr=0.1), distill=NoDistillation(), clip_ratio=0.2, dual_clip=3.0,
                  kl_coef=0.1, temperature=1.0, mini_batch_rows=6, micro_batch_rows=2, ppo_epochs=1, grad_clip=1e9,
                  skip_first_prepass=True, shuffle_rows=False, seed=0, pad_id=tok.pad_token_id,
                  device=torch.device("cpu"), hybrid=hybrid)
    metrics, _, pooled = actor.update(3, data)
    want = _by_hand(model, data, step=3, hybrid=hybrid, kl_coef=0.1, lr=0.1)
    plain = _by_hand(model, data, step=3, hybrid=Hybrid(), kl_coef=0.1, lr=0.1)
    assert torch.allclose(_params(m), want, atol=2e-6, rtol=1e-5)
    assert (_params(m) - plain).abs().max() > 1e-4  # the baseline changed the update
    assert pooled == {}  # no allocation, nothing pooled or dumped
    gap = torch.cat([te - o for te, o in zip(data.teacher_logp, data.old_logp)]).double()
    assert metrics["hybrid/gap_mean"] == pytest.approx(float(gap.mean()), rel=1e-6)
    assert metrics["hybrid/gap_rms"] == pytest.approx(float(gap.square().mean().sqrt()), rel=1e-6)
    if hybrid.name == "rlsd":
        assert metrics["hybrid/rlsd_lambda"] == pytest.approx(hybrid.lam(3))
        assert 0.0 < metrics["hybrid/rlsd_weight_clip_frac"] < 1.0
    else:
        assert "hybrid/rlsd_lambda" not in metrics and metrics["sdl_loss"] > 0


def test_actor_refuses_a_hybrid_with_an_allocation(tiny):
    from icsd_audit.train.update.actor import Actor, Distillation

    model, tok = tiny
    d = Distillation(AllocatorSettings(allocator="icsd", min_group=2), coef=0.5)
    with pytest.raises(ValueError, match="NoDistillation"):
        Actor(model, torch.optim.SGD(model.parameters(), lr=0.1), distill=d, clip_ratio=0.2, dual_clip=3.0,
              kl_coef=0.1, temperature=1.0, mini_batch_rows=6, micro_batch_rows=2, ppo_epochs=1, grad_clip=1e9,
              skip_first_prepass=True, shuffle_rows=False, seed=0, pad_id=tok.pad_token_id,
              device=torch.device("cpu"), hybrid=Hybrid("rlsd"))


# ----------------------------------------------------------------------------- one tiny run per switch


@pytest.mark.parametrize("hybrid", ["rlsd", "skill-sd"])
def test_one_step_run_per_switch(tmp_path, bank, hybrid):
    """One step of each baseline: the teacher runs, nothing is dumped, the run records what it deployed; with
    its weight at 0 (lambda 0 / sdl_coef 0) the step is GRPO's, bit for bit."""
    from icsd_audit.train.loop import train
    from tests.train.test_loop import tiny_cfg, varied_factory

    res = train(tiny_cfg(tmp_path / "run", bank, allocator="none", hybrid=hybrid), env_factory=varied_factory())
    r = res.records[0]
    assert res.dumps_dir is None and not (tmp_path / "run" / "dumps").exists()
    assert r["time/teacher"] > 0 and r["actor/aux_loss"] == 0.0 and "alloc/tcm" not in r
    assert math.isfinite(r["hybrid/gap_mean"]) and r["hybrid/gap_rms"] > 0
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (cfg["allocator"], cfg["hybrid"]) == ("none", hybrid)
    if hybrid == "rlsd":
        assert r["hybrid/rlsd_lambda"] == pytest.approx(0.495)
        off = dict(rlsd_lambda=0.0)
    else:
        assert r["actor/sdl_loss"] > 0
        off = dict(sdl_coef=0.0)
    grpo = train(tiny_cfg(tmp_path / "grpo", bank, allocator="none"), env_factory=varied_factory()).records[0]
    zero = train(tiny_cfg(tmp_path / "zero", bank, allocator="none", hybrid=hybrid, **off),
                 env_factory=varied_factory()).records[0]
    assert grpo["actor/grad_norm"] == zero["actor/grad_norm"] and grpo["actor/pg_loss"] == zero["actor/pg_loss"]
    assert r["actor/grad_norm"] != grpo["actor/grad_norm"]


@pytest.fixture(scope="module")
def bank(tmp_path_factory) -> str:
    from tests.train.test_loop import SKILLS

    p = tmp_path_factory.mktemp("bank") / "bank.json"
    p.write_text(json.dumps(SKILLS))
    return str(p)
