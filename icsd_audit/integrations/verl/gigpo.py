"""GiGPO (verl-agent semantics) as a verl advantage estimator over verl v1's multi-turn rows.

verl 0.9.1's v1 trainer stores one agent-loop output per row under the key
``{uid}_{session}_{index}``: ``uid`` is the task (prompt) group, the rows of one
``{uid}_{session}`` are one trajectory ordered by ``index``, and inside a row each run
of 1s in ``response_mask`` is one assistant turn while the 0-runs between are the
environment / tool observations the agent loop appended.  verl-agent keeps one row per
turn with the observation text as ``anchor_obs``; here the same records are read off
the padded grid:

* **turns**: the runs of 1s of a row, numbered on across the session's rows
  (``turn_offset``, :meth:`Sessions.turn_offsets`);
* **reward of a turn**: the sum of ``token_level_rewards`` over its span, from its first
  assistant token to just before the next turn's first assistant token (tokens before a
  row's first turn count for that turn).  verl puts an outcome score on the last response
  token, so it lands in the final turn: verl-agent's outcome-reward semantics;
* **anchor state of a turn** (:func:`turn_anchors`): a row's first turn is taken from the
  row's prompt (plus any observation tokens in front of the turn); every later turn from
  the observation tokens right before it.  The id is BLAKE2b over the int64 token ids,
  as :func:`~icsd_audit.train.update.advantages.anchor_id` does for text, so identical
  observations get identical ids in every process;
* **advantages**: :func:`~icsd_audit.train.update.advantages.gigpo_advantages` on those
  records (episode level + ``step_weight`` x anchor-state level), broadcast to each turn's
  assistant tokens, 0 elsewhere; returns = advantages, as verl's GRPO returns them.

:func:`compute_gigpo_advantage` has verl's estimator signature and is registered as
``gigpo`` by the plug-in (:func:`register_estimator`).  Plain verl calls it with
``token_level_rewards``, ``response_mask``, ``config`` and ``index`` only; without the
anchors the ``icsd_sync`` trainer supplies it stops with one line.

Imports only torch and numpy (and verl inside :func:`register_estimator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from icsd_audit.integrations.core import stable_traj_id, turn_ids_from_mask
from icsd_audit.train.update.advantages import AdvantageResult, TurnRecords, anchor_id_bytes, gigpo_advantages

__all__ = ["NEEDS_ICSD_SYNC", "Sessions", "turn_anchors", "turn_records", "gigpo_token_advantages",
           "compute_gigpo_advantage", "register_estimator"]

NEEDS_ICSD_SYNC = ("algorithm.adv_estimator=gigpo needs trainer.v1.trainer_mode=icsd_sync, which supplies per-turn "
                   "anchor states (traj_id, turn_offset, anchor); plain verl passes none")


@dataclass(frozen=True)
class Sessions:
    """Per-row layout of verl v1 keys ``{uid}_{session}_{index}``."""

    #: ``[B]`` object array: the task-group uid of each row.
    uid: np.ndarray
    #: ``[B]`` int64: stable id of the row's ``{uid}_{session}`` (its trajectory).
    traj: Tensor
    #: ``[B]`` int64: the row's output index inside its session.
    index: Tensor

    @staticmethod
    def from_keys(keys: Sequence[str]) -> "Sessions":
        uids, sessions, index = [], [], []
        for k in keys:
            parts = str(k).rsplit("_", 2)
            if len(parts) != 3 or not parts[2].lstrip("-").isdigit():
                raise ValueError(f"unexpected verl key {k!r}: expected '{{uid}}_{{session}}_{{index}}'")
            uids.append(parts[0])
            sessions.append(f"{parts[0]}_{parts[1]}")
            index.append(int(parts[2]))
        traj = torch.as_tensor([stable_traj_id(s) for s in sessions], dtype=torch.long)
        return Sessions(uid=np.asarray(uids, dtype=object), traj=traj, index=torch.as_tensor(index, dtype=torch.long))

    @property
    def final(self) -> Tensor:
        """``[B]`` bool: the row is its session's last output (highest index)."""
        _, inv = torch.unique(self.traj, return_inverse=True)
        last = torch.full((int(inv.max()) + 1 if inv.numel() else 0,), torch.iinfo(torch.long).min,
                          dtype=torch.long).scatter_reduce(0, inv, self.index, "amax")
        return self.index == last[inv]

    def turn_offsets(self, response_mask: Tensor) -> Tensor:
        """``[B]`` int64: turns of the same session's earlier rows (by index), so turn ids run on across rows."""
        n = self.traj.numel()
        _, runs = _last_turn(response_mask.bool().cpu())
        order = torch.as_tensor(np.lexsort((self.index.numpy(), self.traj.numpy())), dtype=torch.long)
        t_sorted, r_sorted = self.traj[order], runs[order]
        csum = torch.cumsum(r_sorted, 0) - r_sorted
        first = torch.ones(n, dtype=torch.bool)
        first[1:] = t_sorted[1:] != t_sorted[:-1]
        start = torch.cummax(torch.where(first, torch.arange(n), torch.zeros(n, dtype=torch.long)), 0).values
        offset = torch.zeros(n, dtype=torch.long)
        offset[order] = csum - csum[start]
        return offset


def _last_turn(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(``[B, T]`` local index of the last turn started at or before each position, -1 before the first;
    ``[B]`` turns per row)."""
    local = turn_ids_from_mask(mask)
    if local.shape[1] == 0:
        return local, torch.zeros(local.shape[0], dtype=torch.long)
    last = torch.cummax(local, dim=1).values
    return last, last[:, -1] + 1


def turn_anchors(prompts: Tensor, prompt_lengths: Tensor, responses: Tensor, response_mask: Tensor) -> Tensor:
    """``[B, T]`` int64 anchor-state id of the turn each assistant token belongs to (0 off the mask).

    ``prompts`` is ``[B, P]`` right-padded with ``prompt_lengths`` real tokens per row;
    ``responses`` and ``response_mask`` are ``[B, T]``.  A row's first turn hashes the
    prompt ids followed by any response tokens before that turn; a later turn hashes the
    0-run of the mask right before it (the observation the action answers).
    """
    mask = response_mask.bool().cpu()
    B, T = mask.shape
    last, n_turns = _last_turn(mask)
    K = int(n_turns.max()) if B else 0
    if K == 0:
        return torch.zeros(B, T, dtype=torch.long)
    # observation segment (local turn it precedes) of every token of [prompt | response]; -1: none
    plen = torch.as_tensor(prompt_lengths).cpu().view(-1, 1)
    in_prompt = (torch.arange(prompts.shape[1]).view(1, -1) < plen) & (n_turns > 0).view(-1, 1)
    p_seg = torch.where(in_prompt, 0, -1)
    nxt = last + 1  # a 0-token's observation belongs to the next turn, if the row has one
    r_seg = torch.where(~mask & (nxt < n_turns.view(-1, 1)), nxt, -1)
    seg = torch.cat([p_seg, r_seg], dim=1)
    keep = seg >= 0
    # row-major selection keeps every segment's tokens contiguous and in slot order
    slot = (torch.arange(B).view(-1, 1) * K + seg)[keep]
    tokens = torch.cat([prompts.long().cpu(), responses.long().cpu()], dim=1)[keep]
    counts = torch.bincount(slot, minlength=B * K)
    ends = torch.cumsum(counts, 0)
    starts, ends = (ends - counts).tolist(), ends.tolist()
    buf = memoryview(np.ascontiguousarray(tokens.numpy(), dtype="<i8")).cast("B")
    used = torch.nonzero((torch.arange(K).view(1, -1) < n_turns.view(-1, 1)).reshape(-1)).flatten().tolist()
    ids = torch.zeros(B * K, dtype=torch.long)
    # one BLAKE2b call per turn (hashlib has no batched form); every call reads a slice of the one buffer
    ids[used] = torch.as_tensor([anchor_id_bytes(buf[8 * starts[s]:8 * ends[s]]) for s in used], dtype=torch.long)
    per_turn = ids.view(B, K).gather(1, last.clamp(min=0))
    return torch.where(mask, per_turn, torch.zeros_like(per_turn))


def turn_records(token_level_rewards: Tensor, response_mask: Tensor, *, group: Tensor, traj_id: Tensor,
                 turn_offset: Tensor, anchor: Tensor) -> tuple[TurnRecords, Tensor]:
    """One GiGPO record per turn of a padded batch, and ``[B, T]`` the record of each assistant token (-1 elsewhere).

    ``group``, ``traj_id``, ``turn_offset`` are ``[B]``; ``anchor`` is ``[B, T]`` (read at
    each turn's first assistant token).  Records are ordered by (row, turn).  Rows
    without an assistant token carry no turn (verl's padding rows) and their rewards
    are dropped.
    """
    mask = response_mask.bool().cpu()
    B, T = mask.shape
    last, n_turns = _last_turn(mask)
    first_rec = torch.cumsum(n_turns, 0) - n_turns
    prev = torch.cat([torch.full((B, 1), -1, dtype=torch.long), last[:, :-1]], dim=1)
    rb, rt = torch.nonzero(last > prev, as_tuple=True)  # each turn's first assistant token
    # span of a turn: its first assistant token up to the next turn's; tokens before the row's first turn go to it
    has = (n_turns > 0).view(-1, 1).expand(B, T)
    span_rec = (first_rec.view(-1, 1) + last.clamp(min=0))[has]
    reward = torch.zeros(rb.numel(), dtype=torch.float64).index_add_(
        0, span_rec, token_level_rewards.detach().to("cpu", torch.float64)[has])
    group, traj_id, turn_offset, anchor = (torch.as_tensor(x).cpu() for x in (group, traj_id, turn_offset, anchor))
    rec = TurnRecords.from_arrays(group=group[rb], traj=traj_id[rb], turn=turn_offset[rb] + last[rb, rt],
                                  reward=reward, anchor=anchor[rb, rt])
    token_rec = torch.where(mask, first_rec.view(-1, 1) + last, torch.full_like(last, -1))
    return rec, token_rec


def gigpo_token_advantages(token_level_rewards: Tensor, response_mask: Tensor, *, group: Tensor, traj_id: Tensor,
                           turn_offset: Tensor, anchor: Tensor, gamma: float, step_weight: float, mode: str,
                           epsilon: float) -> tuple[Tensor, AdvantageResult]:
    """``[B, T]`` GiGPO advantages (each turn's value on its assistant tokens, 0 elsewhere) and the per-turn result."""
    rec, token_rec = turn_records(token_level_rewards, response_mask, group=group, traj_id=traj_id,
                                  turn_offset=turn_offset, anchor=anchor)
    res = gigpo_advantages(rec, gamma=gamma, step_weight=step_weight, mode=mode,  # type: ignore[arg-type]
                           epsilon=epsilon)
    out = torch.zeros(token_rec.shape, dtype=token_level_rewards.dtype)
    on = token_rec >= 0
    out[on] = res.advantages[token_rec[on]].to(out.dtype)
    return out.to(token_level_rewards.device), res


def compute_gigpo_advantage(token_level_rewards: Tensor, response_mask: Tensor, index: np.ndarray | None = None,
                            config: Any = None, *, traj_id: Tensor | None = None, turn_offset: Tensor | None = None,
                            anchor: Tensor | None = None, gamma: float | None = None, step_weight: float = 1.0,
                            mode: str = "mean_norm", epsilon: float = 1e-6, metrics: dict | None = None,
                            **kwargs: Any) -> tuple[Tensor, Tensor]:
    """verl estimator ``gigpo``: ``(advantages, returns)`` ``[B, T]``, both the GiGPO advantage.

    ``index`` is verl's ``uid`` array (task groups); ``traj_id`` / ``turn_offset`` ``[B]``
    and ``anchor`` ``[B, T]`` come from the ``icsd_sync`` trainer (:class:`Sessions`,
    :func:`turn_anchors`).  ``gamma`` defaults to ``config.gamma`` (verl's
    ``algorithm.gamma``); ``step_weight``, ``mode``, ``epsilon`` are verl-agent's
    ``step_advantage_w``, ``gigpo.mode`` and epsilon.  ``metrics``, when given, receives
    ``icsd/gigpo_*`` step-group summaries.  Other keywords verl passes
    (``reward_baselines``) are not used.
    """
    if traj_id is None or turn_offset is None or anchor is None:
        raise ValueError(NEEDS_ICSD_SYNC)
    if index is None:
        raise ValueError("gigpo needs index: the uid (task group) of every row")
    if gamma is None:
        gamma = float(config.gamma)
    _, group = np.unique(np.asarray(index, dtype=object), return_inverse=True)
    adv, res = gigpo_token_advantages(token_level_rewards, response_mask, group=torch.as_tensor(group.reshape(-1)),
                                      traj_id=torch.as_tensor(traj_id), turn_offset=torch.as_tensor(turn_offset),
                                      anchor=torch.as_tensor(anchor), gamma=float(gamma),
                                      step_weight=float(step_weight), mode=mode, epsilon=float(epsilon))
    if metrics is not None:
        metrics.update({f"icsd/gigpo_{k.split('/', 1)[1]}": v for k, v in res.metrics().items()})
    return adv, adv.clone()


def register_estimator() -> Callable[..., tuple[Tensor, Tensor]]:
    """Register :func:`compute_gigpo_advantage` as verl's ``gigpo`` estimator (idempotent)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

    from icsd_audit.integrations.verl.compat import VerlCompatError

    have = ADV_ESTIMATOR_REGISTRY.get("gigpo")
    if have is not None and have is not compute_gigpo_advantage:
        raise VerlCompatError(f"verl already has an advantage estimator 'gigpo' ({have.__module__}.{have.__name__}); "
                              "icsd's cannot register")
    return register_adv_est("gigpo")(compute_gigpo_advantage)
