"""GRPO and GiGPO advantages for multi-turn agent rollouts, vectorized.

Input: one record per *action turn* (one training row): the task group it belongs to
(the n tasks x G rollouts layout: the G rollouts of one task share a group), its
trajectory, its turn index, the environment reward received for that turn's action, and
for GiGPO the anchor state (a hashed id of the observation the action was taken from).
Output: one advantage per turn; the trainer broadcasts it to the turn's response tokens.

The estimators reproduce verl-agent (``gigpo/core_gigpo.py``: ``episode_norm_reward``,
``build_step_group``, ``step_norm_reward``, ``compute_step_discounted_returns``; and its
``compute_grpo_outcome_advantage`` in ``verl/trainer/ppo/core_algos.py``), including the
details that are easy to get wrong (docs/advantages.md works through each):

* **Episode score per row.** Every turn row of a trajectory carries the episode return
  ``R`` (sum of that trajectory's step rewards). verl-agent's invalid-action penalty is
  applied *per row*: ``score_row = R - c * invalid_row`` (``invalid_penalty=c``).
* **Group statistics over rows** (``stats_over="steps"``, verl-agent's default
  ``compute_mean_std_cross_steps=True``): the mean and std of a task group are taken over
  all its turn rows, so a trajectory weighs in proportion to its length.
  ``stats_over="trajectories"`` takes one score per trajectory (its first turn's row).
* **std** is the unbiased sample std (``torch.std``, n-1); normalisation is
  ``(x - mean) / (std + epsilon)`` with ``epsilon = 1e-6``.
* **Singleton episode groups** (one entry): mean 0 and std 1, so the advantage is the
  score itself (``score / (1 + epsilon)`` with std normalisation).
* **Step level (GiGPO):** rows of one task group with the same anchor state form a step
  group; the value is the discounted return ``G_t = r_t + gamma * G_{t+1}`` of the row's
  trajectory from that turn on (minus ``c * invalid_row``, as verl-agent's penalty also
  hits ``step_rewards``). **Singleton step groups** get mean = the value itself and std 1,
  hence advantage exactly 0.
* **GiGPO mode** ``"mean_norm"`` (default) subtracts the mean and does *not* divide by
  the std, at both levels; ``"mean_std_norm"`` divides by ``std + epsilon`` at both.
  The final advantage is ``A_episode + step_weight * A_step``.

Everything is computed with segment operations (``torch.unique(return_inverse=True)``,
``bincount``, ``index_add_``) in float64 and returned as float32; there is no Python
loop over groups or trajectories. The only loop-free trick worth noting is the
discounted return, computed as ``R @ M`` with ``M[k, j] = gamma**(k-j)`` for ``k >= j``
on a (trajectories x longest-trajectory) matrix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "AdvantageResult",
    "ESTIMATORS",
    "broadcast_to_tokens",
    "TurnRecords",
    "anchor_id",
    "anchor_id_bytes",
    "anchor_ids",
    "dense_ids",
    "discounted_returns",
    "episode_returns",
    "get_estimator",
    "gigpo_advantages",
    "grpo_advantages",
    "group_normalize",
    "turn_positions",
]

ArrayLike = Any  # torch.Tensor | np.ndarray | Sequence[int | float | bool]
StatsOver = Literal["steps", "trajectories"]
GigpoMode = Literal["mean_norm", "mean_std_norm"]


def anchor_id(text: str) -> int:
    """Stable signed 64-bit id of an observation text (BLAKE2b, 8 bytes).

    Identical texts get identical ids in every process and on every machine (unlike
    Python's salted ``hash``). Two different texts collide with probability ~2**-64.
    """
    return anchor_id_bytes(text.encode("utf-8"))


def anchor_id_bytes(data: bytes | memoryview) -> int:
    """:func:`anchor_id` of raw bytes (engines hash observation *token ids* with it)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def anchor_ids(texts: Iterable[str]) -> torch.Tensor:
    """:func:`anchor_id` of each text, as an int64 tensor."""
    return torch.tensor([anchor_id(t) for t in texts], dtype=torch.int64)


def _as_tensor(x: ArrayLike, dtype: torch.dtype, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu")
    else:
        t = torch.as_tensor(np.asarray(x))
    if t.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one entry per turn row), got shape {tuple(t.shape)}")
    if dtype == torch.int64 and (t.is_floating_point() or t.is_complex()):
        bad = torch.nonzero(t != t.round()).flatten()
        if bad.numel():
            r = int(bad[0])
            raise ValueError(f"column {name} row {r} is {float(t[r])}; ids must be integers")
    return t.to(dtype)


@dataclass(frozen=True)
class TurnRecords:
    """Per-turn records of one rollout batch, all 1-D with one entry per action turn.

    Attributes:
        group: task-group id (the G rollouts of one task share it).
        traj: trajectory id; a trajectory is identified by the pair (group, traj).
        turn: turn index inside the trajectory (0, 1, ...); only the order matters.
            Each (group, traj, turn) must occur once.
        reward: environment reward received for this turn's action (float).
        anchor: hashed id of the observation the action was taken from
            (:func:`anchor_id`); needed by GiGPO only.
        invalid: True where the turn's action was invalid (verl-agent's penalty).
    """

    group: torch.Tensor
    traj: torch.Tensor
    turn: torch.Tensor
    reward: torch.Tensor
    anchor: torch.Tensor | None = None
    invalid: torch.Tensor | None = None

    @classmethod
    def from_arrays(
        cls,
        group: ArrayLike,
        traj: ArrayLike,
        turn: ArrayLike,
        reward: ArrayLike,
        anchor: ArrayLike | None = None,
        invalid: ArrayLike | None = None,
    ) -> TurnRecords:
        """Build and validate records from tensors, arrays or lists."""
        g = _as_tensor(group, torch.int64, "group")
        rec = cls(
            group=g,
            traj=_as_tensor(traj, torch.int64, "traj"),
            turn=_as_tensor(turn, torch.int64, "turn"),
            reward=_as_tensor(reward, torch.float64, "reward"),
            anchor=None if anchor is None else _as_tensor(anchor, torch.int64, "anchor"),
            invalid=None if invalid is None else _as_tensor(invalid, torch.bool, "invalid"),
        )
        rec.validate()
        return rec

    def __len__(self) -> int:
        return int(self.group.shape[0])

    def validate(self) -> None:
        """Raise ``ValueError`` with a fix-it message when the records are inconsistent."""
        n = len(self)
        for name in ("traj", "turn", "reward", "anchor", "invalid"):
            t = getattr(self, name)
            if t is not None and int(t.shape[0]) != n:
                raise ValueError(f"column {name} has {int(t.shape[0])} rows but group has {n}; give one per turn row")
        if n == 0:
            return
        bad = torch.nonzero(~torch.isfinite(self.reward)).flatten()
        if bad.numel():
            r = int(bad[0])
            raise ValueError(f"reward row {r} is {float(self.reward[r])}; rewards must be finite numbers")
        key = dense_ids(self.group, self.traj, self.turn)[0]
        counts = torch.bincount(key)
        if int(counts.max()) > 1:
            rows = torch.nonzero(counts[key] > 1).flatten()[:2].tolist()
            g, t, k = (int(x[rows[0]]) for x in (self.group, self.traj, self.turn))
            raise ValueError(
                f"rows {rows[0]} and {rows[1]} share (group, traj, turn) = ({g}, {t}, {k}); "
                "each action turn must be one row"
            )


def _records(records: TurnRecords | Mapping[str, ArrayLike]) -> TurnRecords:
    if isinstance(records, TurnRecords):
        return records
    return TurnRecords.from_arrays(**records)


def dense_ids(*keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense ids ``0..k-1`` of the distinct tuples of ``keys`` (lexicographic order).

    Equal tuples get equal ids; id order follows the sorted order of the tuples. Each
    combination step is re-densified, so no intermediate value exceeds ``len**2``.
    """
    if not keys:
        raise ValueError("dense_ids needs at least one key")
    n = int(keys[0].shape[0])
    ids = torch.zeros(n, dtype=torch.int64)
    k = 1
    for key in keys:
        uniq, inv = torch.unique(key, return_inverse=True)
        ids = ids * int(uniq.numel()) + inv
        uniq_ids, ids = torch.unique(ids, return_inverse=True)
        k = int(uniq_ids.numel())
    return ids, k


def _segment_mean_std(
    values: torch.Tensor, ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment count, mean and unbiased std (two-pass; std is NaN for count 1)."""
    count = torch.bincount(ids, minlength=k).to(values.dtype)
    total = torch.zeros(k, dtype=values.dtype).index_add_(0, ids, values)
    mean = total / count.clamp_min(1)
    dev = values - mean[ids]
    ss = torch.zeros(k, dtype=values.dtype).index_add_(0, ids, dev * dev)
    std = torch.sqrt(ss / (count - 1))
    return count, mean, std


def group_normalize(
    values: torch.Tensor,
    ids: torch.Tensor,
    k: int,
    *,
    norm_by_std: bool,
    epsilon: float,
    singleton: Literal["zero_mean", "self_mean"],
    stat_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(v - mean_g) / (std_g + eps)`` (or ``v - mean_g``) per row, vectorized.

    ``stat_rows`` (bool mask) restricts which rows enter the statistics; every row is
    still normalised. Singleton segments (one contributing row) use mean 0 / std 1
    (``"zero_mean"``, verl's episode and GRPO rule) or mean = the value / std 1
    (``"self_mean"``, GiGPO's step rule, giving advantage 0).
    """
    if stat_rows is None:
        count, mean, std = _segment_mean_std(values, ids, k)
    else:
        count, mean, std = _segment_mean_std(values[stat_rows], ids[stat_rows], k)
    single = count <= 1
    if singleton == "zero_mean":
        mean = torch.where(single, torch.zeros_like(mean), mean)
    elif singleton != "self_mean":
        raise ValueError(f"unknown singleton rule {singleton!r}")
    # "self_mean": the one-row mean already equals that row's value
    std = torch.where(single, torch.ones_like(std), std)
    centred = values - mean[ids]
    # A group of tied values is exactly centred: sum / n can round off the common
    # value (e.g. 2.8e-17 instead of 0), which would move tokens out of the audit's
    # exact-zero `neutral` region and into a sign region.
    src_v, src_i = (values, ids) if stat_rows is None else (values[stat_rows], ids[stat_rows])
    hi = torch.full((k,), float("-inf"), dtype=values.dtype).scatter_reduce(0, src_i, src_v, "amax")
    lo = torch.full((k,), float("inf"), dtype=values.dtype).scatter_reduce(0, src_i, src_v, "amin")
    tied = ((hi == lo) & ~single)[ids] & (values == hi[ids])
    centred = torch.where(tied, torch.zeros_like(centred), centred)
    if not norm_by_std:
        return centred
    return centred / (std[ids] + epsilon)


def turn_positions(traj_ids: torch.Tensor, n_traj: int, turn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of each row inside its trajectory (0 for the earliest turn) and lengths."""
    n = int(traj_ids.shape[0])
    order_key, _ = dense_ids(traj_ids, turn)  # lexicographic: by trajectory, then turn
    order = torch.argsort(order_key)
    lengths = torch.bincount(traj_ids, minlength=n_traj)
    starts = torch.cumsum(lengths, 0) - lengths
    pos_sorted = torch.arange(n, dtype=torch.int64) - starts[traj_ids[order]]
    pos = torch.empty(n, dtype=torch.int64)
    pos[order] = pos_sorted
    return pos, lengths


def episode_returns(traj_ids: torch.Tensor, n_traj: int, reward: torch.Tensor) -> torch.Tensor:
    """Per row: the undiscounted sum of its trajectory's step rewards."""
    totals = torch.zeros(n_traj, dtype=reward.dtype).index_add_(0, traj_ids, reward)
    return totals[traj_ids]


def discounted_returns(
    traj_ids: torch.Tensor, n_traj: int, pos: torch.Tensor, reward: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Per row: ``G_t = sum_{k >= t} gamma**(k - t) r_k`` over the row's trajectory.

    Trajectories are laid out as rows of an (n_traj, T) matrix (T = longest trajectory,
    zero padded at the end) and multiplied by the upper-triangular discount matrix
    ``M[k, j] = gamma**(k - j)`` (k >= j), so ``G = R @ M``.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    n = int(reward.shape[0])
    if n == 0:
        return reward.clone()
    T = int(pos.max()) + 1
    R = torch.zeros(n_traj, T, dtype=reward.dtype)
    R[traj_ids, pos] = reward
    k = torch.arange(T, dtype=reward.dtype)
    expo = k[:, None] - k[None, :]  # k - j
    powers = torch.as_tensor(gamma, dtype=reward.dtype) ** expo.clamp_min(0)  # 0**0 = 1: gamma=0 gives G = R
    M = torch.where(expo >= 0, powers, torch.zeros((), dtype=reward.dtype))
    G = R @ M
    return G[traj_ids, pos]


@dataclass
class AdvantageResult:
    """Per-turn advantages and the pieces they were built from (all 1-D, one per row)."""

    #: The advantage of each turn, float32: broadcast it to the turn's response tokens.
    advantages: torch.Tensor
    #: Episode-level (group-relative) part, float32.
    episode_advantages: torch.Tensor
    #: The episode-level score of each row: episode return minus the row's penalty.
    scores: torch.Tensor
    #: Name of the estimator that produced this result.
    estimator: str
    #: Step-level part (GiGPO only), float32.
    step_advantages: torch.Tensor | None = None
    #: Discounted return from each turn on, minus the row's penalty (GiGPO only).
    step_returns: torch.Tensor | None = None
    #: Dense id of each row's anchor-state group (GiGPO only).
    step_group: torch.Tensor | None = None
    #: Size of each row's anchor-state group (GiGPO only).
    step_group_size: torch.Tensor | None = None
    #: Options the estimator ran with.
    options: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Scalar summaries for the step metrics file."""
        out: dict[str, float] = {
            "adv/mean": float(self.advantages.mean()) if self.advantages.numel() else 0.0,
            "adv/abs_mean": float(self.advantages.abs().mean()) if self.advantages.numel() else 0.0,
            "adv/episode_abs_mean": float(self.episode_advantages.abs().mean()) if self.advantages.numel() else 0.0,
        }
        if self.step_group is not None and self.step_group_size is not None and self.step_group.numel():
            sizes = torch.bincount(self.step_group).to(torch.float64)
            sizes = sizes[sizes > 0]
            out.update(
                {
                    "adv/step_abs_mean": float(self.step_advantages.abs().mean()),  # type: ignore[union-attr]
                    "adv/step_groups": float(sizes.numel()),
                    "adv/step_group_size_mean": float(sizes.mean()),
                    "adv/step_rows_in_shared_groups": float((self.step_group_size > 1).to(torch.float64).mean()),
                }
            )
        return out


def _penalty(rec: TurnRecords, invalid_penalty: float) -> torch.Tensor:
    if rec.invalid is None or invalid_penalty == 0.0:
        return torch.zeros(len(rec), dtype=torch.float64)
    return rec.invalid.to(torch.float64) * float(invalid_penalty)


def _episode_part(
    rec: TurnRecords,
    *,
    invalid_penalty: float,
    norm_by_std: bool,
    epsilon: float,
    stats_over: StatsOver,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Episode-level advantage per row; also returns scores, traj ids, n_traj, positions."""
    traj_ids, n_traj = dense_ids(rec.group, rec.traj)
    pos, _ = turn_positions(traj_ids, n_traj, rec.turn)
    scores = episode_returns(traj_ids, n_traj, rec.reward) - _penalty(rec, invalid_penalty)
    g_ids, n_g = dense_ids(rec.group)
    if stats_over == "steps":
        stat_rows = None
    elif stats_over == "trajectories":
        stat_rows = pos == 0  # one entry per trajectory: its first turn's row
    else:
        raise ValueError(f"stats_over must be 'steps' or 'trajectories', got {stats_over!r}")
    adv = group_normalize(
        scores, g_ids, n_g, norm_by_std=norm_by_std, epsilon=epsilon, singleton="zero_mean", stat_rows=stat_rows
    )
    return adv, scores, traj_ids, n_traj, pos


def grpo_advantages(
    records: TurnRecords | Mapping[str, ArrayLike],
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    invalid_penalty: float = 0.0,
    stats_over: StatsOver = "steps",
) -> AdvantageResult:
    """GRPO: the episode score normalised within its task group, on every turn of the trajectory.

    ``A_row = (score_row - mean_g) / (std_g + epsilon)`` where ``score_row`` is the episode
    return minus ``invalid_penalty`` on invalid rows, and the group statistics run over the
    group's turn rows (``stats_over="steps"``, verl-agent's default) or over one entry per
    trajectory (``"trajectories"``). ``norm_adv_by_std_in_grpo=False`` keeps only
    ``score_row - mean_g`` (Dr. GRPO). A group with a single entry uses mean 0, std 1.
    """
    rec = _records(records)
    n = len(rec)
    if n == 0:
        z = torch.zeros(0, dtype=torch.float32)
        return AdvantageResult(advantages=z, episode_advantages=z, scores=z.double(), estimator="grpo")
    adv, scores, _, _, _ = _episode_part(
        rec,
        invalid_penalty=invalid_penalty,
        norm_by_std=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
        stats_over=stats_over,
    )
    a32 = adv.to(torch.float32)
    return AdvantageResult(
        advantages=a32,
        episode_advantages=a32.clone(),
        scores=scores,
        estimator="grpo",
        options={
            "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
            "epsilon": epsilon,
            "invalid_penalty": invalid_penalty,
            "stats_over": stats_over,
        },
    )


def gigpo_advantages(
    records: TurnRecords | Mapping[str, ArrayLike],
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    mode: GigpoMode = "mean_norm",
    epsilon: float = 1e-6,
    invalid_penalty: float = 0.0,
    stats_over: StatsOver = "steps",
) -> AdvantageResult:
    """GiGPO: episode-level group advantage plus ``step_weight`` x step-level anchor advantage.

    Episode level: as :func:`grpo_advantages`, except that ``mode`` decides the
    normalisation (``"mean_norm"``: subtract the group mean only; ``"mean_std_norm"``:
    also divide by ``std + epsilon``). Step level: rows of one task group whose anchor ids
    are equal form a step group; each row's discounted return (``gamma``) minus its
    penalty is normalised within the step group the same way; a single-row step group
    gets step advantage 0.
    """
    rec = _records(records)
    if rec.anchor is None:
        raise ValueError("GiGPO needs anchor ids (the hashed observation of each turn); pass anchor=...")
    if mode == "mean_norm":
        norm_by_std = False
    elif mode == "mean_std_norm":
        norm_by_std = True
    else:
        raise ValueError(f"mode must be 'mean_norm' or 'mean_std_norm', got {mode!r}")
    n = len(rec)
    if n == 0:
        z = torch.zeros(0, dtype=torch.float32)
        return AdvantageResult(
            advantages=z,
            episode_advantages=z,
            scores=z.double(),
            estimator="gigpo",
            step_advantages=z,
            step_returns=z.double(),
            step_group=torch.zeros(0, dtype=torch.int64),
            step_group_size=torch.zeros(0, dtype=torch.int64),
        )
    ep_adv, scores, traj_ids, n_traj, pos = _episode_part(
        rec, invalid_penalty=invalid_penalty, norm_by_std=norm_by_std, epsilon=epsilon, stats_over=stats_over
    )
    returns = discounted_returns(traj_ids, n_traj, pos, rec.reward, gamma) - _penalty(rec, invalid_penalty)
    s_ids, n_s = dense_ids(rec.group, rec.anchor)
    step_adv = group_normalize(returns, s_ids, n_s, norm_by_std=norm_by_std, epsilon=epsilon, singleton="self_mean")
    sizes = torch.bincount(s_ids, minlength=n_s)[s_ids]
    total = ep_adv + step_weight * step_adv
    return AdvantageResult(
        advantages=total.to(torch.float32),
        episode_advantages=ep_adv.to(torch.float32),
        scores=scores,
        estimator="gigpo",
        step_advantages=step_adv.to(torch.float32),
        step_returns=returns,
        step_group=s_ids,
        step_group_size=sizes,
        options={
            "gamma": gamma,
            "step_weight": step_weight,
            "mode": mode,
            "epsilon": epsilon,
            "invalid_penalty": invalid_penalty,
            "stats_over": stats_over,
        },
    )


#: Registry: estimator name -> function(records, **options) -> AdvantageResult.
ESTIMATORS: dict[str, Callable[..., AdvantageResult]] = {
    "grpo": grpo_advantages,
    "gigpo": gigpo_advantages,
}


def get_estimator(name: str) -> Callable[..., AdvantageResult]:
    """Look an advantage estimator up by name (``grpo`` or ``gigpo``)."""
    key = name.strip().lower()
    if key not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[key]


def broadcast_to_tokens(turn_values: torch.Tensor, token_turn: torch.Tensor) -> torch.Tensor:
    """Spread per-turn values onto tokens: ``token_turn[i]`` is the row index of token i."""
    return turn_values[token_turn]
