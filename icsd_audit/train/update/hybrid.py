"""The paper's hybrid distillation baselines, Skill-SD and RLSD, as SDAR's public code defines them.

The paper (Table 1, "hybrid distillation baselines") names both methods and keeps
SDAR's published numbers for them; it defines neither.  SDAR's repository does
(jasonchen505/SDAR@aa18336), and this module follows it:

* **RLSD** (``verl/trainer/ppo/rlsd_utils.py``, ``compute_rlsd_token_advantage``, lines
  145-183) replaces each turn's GRPO/GiGPO advantage ``A`` by token advantages

      A_t = A * ((1 - lam) + lam * clip(exp(sign(A) * (teacher_logp_t - old_logp_t)), 1 - eps, 1 + eps))

  computed once per step, without gradient, from the old (rollout-time) student
  log-probs and the step's teacher log-probs; ``sign(0) = 0`` leaves a zero advantage
  at zero.  ``lam`` decays linearly to 0 (``rlsd_ray_trainer.py``, ``_get_rlsd_lambda``,
  lines 179-183): ``lam0 * (1 - t / W)`` at SDAR's global step ``t`` and 0 from ``t = W``
  on.  SDAR counts steps from 1 (``self.global_steps += 1`` before the first batch,
  line 212), so this toolkit's 0-based step ``s`` is SDAR's ``t = s + 1``.  Nothing
  else changes: the PPO surrogate, its clip and dual clip take ``A_t``; there is no
  distillation term.
* **Skill-SD** (``verl/trainer/ppo/skillsd_utils.py``, ``compute_sdl_loss``, lines 14-52,
  added to the actor loss in ``verl/workers/actor/dp_actor.py`` lines 431-444) keeps the
  advantages and adds ``sdl_coef * token-mean(sdl_t)`` with

      sdl_t = rho_t * (exp(min(teacher_logp_t - logp_t, 20)) - 1 - (teacher_logp_t - logp_t)),
      rho_t = exp(min(logp_t - old_logp_t, 10)),

  the teacher and old log-probs detached, the gradient flowing through both ``rho_t``
  and the K3 factor.  Its gradient with respect to ``logp_t`` is ``-rho_t * delta_t``
  (``delta_t = teacher_logp_t - logp_t``) inside the clamps: the same direction as a
  distillation term ``c_t * (sg(teacher_logp_t) - logp_t)`` with the *signed* weight
  ``c_t = rho_t * delta_t``, which is why it is no allocation in SPEC's sense (SPEC 4
  needs ``c >= 0``).  ``sdl_coef`` is constant: SDAR's ``skillsd.warmdown_steps`` only
  changes a logged number (``skillsd_ray_trainer.py`` lines 57-62 and 227-230; the
  actor's coefficient is set once, ``main_skillsd.py`` line 49).

Defaults are SDAR's scripts' values, not its code's fallbacks (warm-down 50 steps,
``sdl_lambda`` 0.1): ``rlsd_lambda=0.5``, ``warmdown_steps=100``, ``clip_eps=0.2``
(``examples/rlsd_trainer/run_alfworld_3b.sh`` and ``run_webshop_3b.sh`` lines 55-57,
``run_search_3b.sh`` lines 51-53) and ``sdl_lambda=0.001``
(``examples/skillsd_trainer/run_alfworld_3b.sh`` and ``run_webshop_3b.sh`` line 55,
``run_search_3b.sh`` line 51); the 7B and Qwen3 scripts of both set the same values.

Each method is a registered name (:func:`get_hybrid` lists them); the loop looks the
run's one up once (:func:`make_hybrid`) and the actor calls what it found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["HYBRID_NONE", "HybridSpec", "register_hybrid", "get_hybrid", "hybrid_names", "rlsd_lambda",
           "rlsd_token_advantage", "sdl_loss", "Hybrid", "make_hybrid", "RLSD_LAMBDA", "RLSD_WARMDOWN_STEPS",
           "RLSD_CLIP_EPS", "SDL_COEF"]

#: SDAR's scripts (see the module docstring for the lines).
RLSD_LAMBDA = 0.5
RLSD_WARMDOWN_STEPS = 100
RLSD_CLIP_EPS = 0.2
SDL_COEF = 0.001
#: The name of "no hybrid baseline".
HYBRID_NONE = "none"

#: SDAR's clamps: the log ratio enters exp() at most 10 (rho), the teacher-student gap at most 20 (K3).
_SDL_LOG_RATIO_MAX = 10.0
_SDL_GAP_MAX = 20.0


# --------------------------------------------------------------------------------------
# The maths (free functions over the valid tokens; no config objects)
# --------------------------------------------------------------------------------------


def rlsd_lambda(step: int, *, lam0: float = RLSD_LAMBDA, warmdown_steps: int = RLSD_WARMDOWN_STEPS) -> float:
    """RLSD's mixing weight at this toolkit's 0-based ``step``: SDAR's linear warm-down at global step ``step + 1``.

    >>> rlsd_lambda(0), rlsd_lambda(49), rlsd_lambda(99)
    (0.495, 0.25, 0.0)
    """
    if warmdown_steps < 1:
        raise ValueError(f"warmdown_steps={warmdown_steps} must be >= 1")
    t = int(step) + 1
    if t >= warmdown_steps:
        return 0.0
    return float(lam0) * (1.0 - t / warmdown_steps)


def rlsd_token_advantage(advantage: Tensor, old_logp: Tensor, teacher_logp: Tensor, *, lam: float,
                         clip_eps: float = RLSD_CLIP_EPS) -> tuple[Tensor, Tensor]:
    """RLSD's token advantages and their clipped weights ``w_t``, per valid token (no gradient).

    ``advantage``: the turn's GRPO/GiGPO advantage broadcast to its tokens; ``old_logp``
    the rollout-time student log-probs; ``teacher_logp`` the teacher's.  Returns
    ``(A * ((1 - lam) + lam * w), w)`` with ``w = clip(exp(sign(A) * (teacher - old)), 1 - eps, 1 + eps)``.
    """
    with torch.no_grad():
        w = torch.exp(torch.sign(advantage) * (teacher_logp - old_logp)).clamp(1.0 - clip_eps, 1.0 + clip_eps)
        return advantage * ((1.0 - lam) + lam * w), w


def sdl_loss(logp: Tensor, teacher_logp: Tensor, old_logp: Tensor) -> Tensor:
    """Skill-SD's per-token self-distillation loss ``rho_t * K3_t`` (SDAR's ``compute_sdl_loss`` before aggregation).

    Differentiable in ``logp`` (through both factors); ``teacher_logp`` and ``old_logp``
    are detached.  The mini-batch loss is its token mean (verl's ``token-mean``).
    """
    teacher_logp, old_logp = teacher_logp.detach(), old_logp.detach()
    gap = teacher_logp - logp
    k3 = torch.exp(gap.clamp(max=_SDL_GAP_MAX)) - 1.0 - gap
    rho = torch.exp((logp - old_logp).clamp(max=_SDL_LOG_RATIO_MAX))
    return rho * k3


# --------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HybridSpec:
    """One hybrid baseline: what it changes in the update and where SDAR defines it."""

    name: str
    #: the turn advantages become token advantages (RLSD)
    reshapes_advantage: bool
    #: an auxiliary loss term joins the actor loss (Skill-SD)
    adds_loss: bool
    #: the paper's row name
    title: str
    #: the SDAR file and function it follows
    reference: str


_REGISTRY: dict[str, HybridSpec] = {}


def register_hybrid(spec: HybridSpec) -> HybridSpec:
    """Add a hybrid baseline; a name may be registered once."""
    if spec.name in _REGISTRY or spec.name == HYBRID_NONE:
        raise ValueError(f"hybrid baseline {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def hybrid_names() -> list[str]:
    """Every valid value of ``TrainConfig.hybrid``: 'none' and the registered names."""
    return [HYBRID_NONE, *_REGISTRY]


def get_hybrid(name: str) -> HybridSpec | None:
    """The registered spec (``None`` for 'none'); an unknown name is a ``ValueError`` listing the valid ones."""
    if name == HYBRID_NONE:
        return None
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"hybrid={name!r}: choose one of {hybrid_names()}") from None


register_hybrid(HybridSpec("rlsd", reshapes_advantage=True, adds_loss=False, title="RLSD",
                           reference="verl/trainer/ppo/rlsd_utils.py: compute_rlsd_token_advantage"))
register_hybrid(HybridSpec("skill-sd", reshapes_advantage=False, adds_loss=True, title="Skill-SD",
                           reference="verl/trainer/ppo/skillsd_utils.py: compute_sdl_loss"))


# --------------------------------------------------------------------------------------
# The deployed baseline
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hybrid:
    """The run's hybrid baseline as the actor applies it (``name='none'``: nothing)."""

    name: str = HYBRID_NONE
    rlsd_lambda: float = RLSD_LAMBDA
    rlsd_warmdown_steps: int = RLSD_WARMDOWN_STEPS
    rlsd_clip_eps: float = RLSD_CLIP_EPS
    sdl_coef: float = SDL_COEF

    def __post_init__(self) -> None:
        get_hybrid(self.name)  # fail early with the list of valid names

    @property
    def enabled(self) -> bool:
        return self.name != HYBRID_NONE

    @property
    def reshapes_advantage(self) -> bool:
        spec = get_hybrid(self.name)
        return spec is not None and spec.reshapes_advantage

    @property
    def loss_coef(self) -> float:
        """The weight of the auxiliary SDL term (0 unless the baseline adds one)."""
        spec = get_hybrid(self.name)
        return self.sdl_coef if spec is not None and spec.adds_loss else 0.0

    def lam(self, step: int) -> float:
        """RLSD's lambda at ``step`` (0 for the other baselines)."""
        if not self.reshapes_advantage:
            return 0.0
        return rlsd_lambda(step, lam0=self.rlsd_lambda, warmdown_steps=self.rlsd_warmdown_steps)

    def token_advantage(self, step: int, advantage: Tensor, old_logp: Tensor,
                        teacher_logp: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The advantages the surrogate takes at ``step``, and the mini-batch's metrics of the baseline."""
        gap = (teacher_logp - old_logp).double()
        stats = {"hybrid/gap_mean": float(gap.mean()), "hybrid/gap_rms": float(gap.square().mean().sqrt())}
        if not self.reshapes_advantage:
            return advantage, stats
        lam = self.lam(step)
        adv, w = rlsd_token_advantage(advantage, old_logp, teacher_logp, lam=lam, clip_eps=self.rlsd_clip_eps)
        raw = torch.exp(torch.sign(advantage) * (teacher_logp - old_logp))
        clipped = (raw < 1.0 - self.rlsd_clip_eps) | (raw > 1.0 + self.rlsd_clip_eps)
        stats.update({"hybrid/rlsd_lambda": lam, "hybrid/rlsd_weight_mean": float(w.double().mean()),
                      "hybrid/rlsd_weight_clip_frac": float(clipped.double().mean())})
        return adv, stats


def make_hybrid(cfg: Any) -> Hybrid:
    """The run's baseline from a :class:`~icsd_audit.train.config.fields.TrainConfig`, looked up once."""
    return Hybrid(name=cfg.hybrid, rlsd_lambda=cfg.rlsd_lambda, rlsd_warmdown_steps=cfg.rlsd_warmdown_steps,
                  rlsd_clip_eps=cfg.rlsd_clip_eps, sdl_coef=cfg.sdl_coef)
