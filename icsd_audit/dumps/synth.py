"""Synthetic frozen batches shaped like GiGPO agent rollouts.

Tests, benchmarks and docs need token dumps with the awkward features of real
ones: advantages that are constant over a turn with many exact zeros (GiGPO
groups whose returns tie) and heavy tails, teacher-student gaps that are skewed
and heavy-tailed with exact zeros (tokens both branches are sure of), ratios near
one with a few beyond the clip range, and variable turns per trajectory and
tokens per turn.  Every array is generated at once; nothing loops over tokens.
The output is always labelled synthetic in the dump metadata by the writer.
"""

from __future__ import annotations

import numpy as np

__all__ = ["synth_tokens"]


def synth_tokens(
    n_tokens: int,
    *,
    seed: int = 0,
    n_batches: int = 4,
    mean_turn_tokens: float = 40.0,
    max_turns: int = 15,
    group_size: int = 8,
    step: int = 0,
) -> dict[str, np.ndarray]:
    """Return per-token columns (schema v1 names) for ``n_tokens`` tokens.

    Trajectories never straddle a batch; ``traj_id`` is unique within a batch and
    ``task`` groups ``group_size`` consecutive trajectories (a GRPO/GiGPO group).
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if n_batches < 1:
        raise ValueError(f"n_batches must be >= 1, got {n_batches}")
    rng = np.random.default_rng(seed)

    # Turn lengths: log-normal around the mean, at least one token, cut to n_tokens.
    n_turns_guess = int(n_tokens / mean_turn_tokens * 1.3) + 16
    lengths = np.maximum(1, rng.lognormal(np.log(mean_turn_tokens) - 0.32, 0.8, n_turns_guess).astype(np.int64))
    ends = np.cumsum(lengths)
    n_turns = int(np.searchsorted(ends, n_tokens) + 1)
    lengths = lengths[:n_turns]
    lengths[-1] -= int(ends[n_turns - 1] - n_tokens)

    # Turns per trajectory, then turn index within its trajectory.
    per_traj = rng.integers(1, max_turns + 1, n_turns)
    traj_of_turn = np.repeat(np.arange(n_turns), per_traj)[:n_turns]
    first_turn = np.r_[0, np.flatnonzero(np.diff(traj_of_turn)) + 1]
    turn_in_traj = np.arange(n_turns) - np.repeat(first_turn, np.diff(np.r_[first_turn, n_turns]))

    # Batches: cut by token count at trajectory starts.
    turn_start = np.r_[0, np.cumsum(lengths)[:-1]]
    traj_start_tok = turn_start[first_turn]
    batch_of_traj = np.minimum(traj_start_tok * n_batches // n_tokens, n_batches - 1)
    batch_of_turn = batch_of_traj[traj_of_turn]

    # GiGPO-like advantages: an episode part per trajectory plus a step part per turn,
    # each exactly zero with some probability, heavy tailed otherwise.
    n_traj = int(traj_of_turn[-1]) + 1
    episode = np.where(rng.random(n_traj) < 0.3, 0.0, rng.standard_t(3, n_traj) * 0.8)
    step_part = np.where(rng.random(n_turns) < 0.45, 0.0, rng.standard_t(2.5, n_turns) * 0.5)
    adv_turn = episode[traj_of_turn] + step_part

    tok_turn = np.repeat(np.arange(n_turns), lengths)
    pos = np.arange(n_tokens) - np.repeat(turn_start, lengths)

    # Gaps: exact zeros, a skewed heavy-tailed bulk (teacher mostly agrees, rarely strongly).
    bulk = rng.standard_t(3, n_tokens) * 0.35 + rng.gamma(0.6, 0.5, n_tokens) - 0.25
    delta = np.where(rng.random(n_tokens) < 0.15, 0.0, bulk)
    # Ratios near one; about 0.2 % of tokens well outside the clip interval.
    log_ratio = rng.normal(0.0, 0.025, n_tokens)
    outlier = rng.random(n_tokens) < 0.002
    log_ratio[outlier] = rng.normal(0.0, 0.5, int(outlier.sum()))

    return {
        "batch_id": batch_of_turn[tok_turn].astype(np.int64),
        "traj_id": traj_of_turn[tok_turn].astype(np.int64),
        "turn_id": turn_in_traj[tok_turn].astype(np.int32),
        "pos": pos.astype(np.int32),
        "advantage": adv_turn[tok_turn].astype(np.float32),
        "ratio": np.exp(log_ratio).astype(np.float32),
        "delta": delta.astype(np.float32),
        "valid": np.ones(n_tokens, dtype=bool),
        "step": np.full(n_tokens, step, dtype=np.int64),
        "task": (traj_of_turn[tok_turn] // group_size).astype(np.int64),
    }
