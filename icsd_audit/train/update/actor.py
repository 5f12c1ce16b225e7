"""The actor update: PPO dual-clip surrogate + k3 KL to the initial policy + allocated distillation.

The per-token terms are the functions of :mod:`icsd_audit.train.update.losses`; this module runs them
over mini-batches and micro-batches and deploys the allocation.

Per token ``t`` of an actor mini-batch ``B`` (valid response tokens only), the loss is

    L = 1/|B| * sum_t [ pg_t + kl_coef * kl_t + lambda * sg(c_t) * l_KD_t ]

* ``pg_t``: verl's ``compute_policy_loss`` with dual clip: ``max(-A r, -A clip(r, 1-e, 1+e))``,
  and for ``A < 0`` additionally capped at ``-A * dual_clip``; ``r = exp(clamp(logp -
  old_logp, -20, 20))``.
* ``kl_t``: verl's ``low_var_kl`` (k3): ``exp(ref - logp) - (ref - logp) - 1``, the log
  ratio clamped to [-20, 20] and the result to [-10, 10].
* ``l_KD_t = sg(teacher_logp_t) - logp_t`` and ``c_t`` the allocator's coefficient
  (SPEC 3-5), detached; with ``lambda / |B|`` in front this is exactly the paper's
  allocation objective (Eq. allocation_form).
* The hybrid baselines (:mod:`.hybrid`, ``allocator='none'``): RLSD gives the surrogate
  token advantages ``A_t`` made from the step's teacher and old log-probs; Skill-SD adds
  ``sdl_coef * sdl_t`` to the bracket.

``1/|B|`` is the token count of the whole mini-batch, so gradient accumulation over
micro-batches reproduces a single big-batch token mean exactly (verl averages per
micro-batch and divides by the number of micro-batches, which weights tokens of short
micro-batches more).

**Where the ratio for the allocation comes from** (``alloc_scope``). ``c`` depends,
through ``u = A * rho * delta``, on the current ratio of the tokens it is fitted over,
but the gradient pass sees one micro-batch at a time. Two scopes:

* ``mini-batch`` (default; the SPEC's ``batch_id`` = actor mini-batch): before the
  gradient micro-batches, a no-grad forward pass over the same micro-batches (same rows,
  padding and order, so the numbers are the ones the gradient pass will compute) gives
  the current log-probs; ``rho = exp(logp - old_logp)``, ``delta = teacher_logp - logp``;
  one allocation over the whole mini-batch; then the gradient micro-batches run with
  ``c`` fixed. On a step's first mini-batch the weights are still the rollout weights, so
  ``rho = 1`` exactly and ``logp = old_logp``: the pass is skipped
  (``skip_first_prepass``), except for an allocator that reads the score norm
  (``fisher``), which only a forward gives. Cost: one extra no-grad forward per
  mini-batch after the first (docs/benchmarks.md has the measured figures).
* ``micro-batch`` (the paper's "no extra forward or backward pass"; where SDAR's code
  computes its weights, since verl's actor computes the loss per micro-batch): each gradient
  micro-batch allocates from its own forward (detached log-probs and score norms), with
  ``batch_id = 1000 * mini-batch id + micro-batch index`` (:func:`micro_batch_id`). What
  changes: the trust fit of SDAR's ``g``, the calibration groups (a turn index pooled
  across trajectories) and the batch-wide fallback fit see only the micro-batch's rows
  (``micro_batch_rows``, rows sorted by length), so groups are smaller and fall back to
  the micro-batch fit more often; the turn mass matching is unchanged (a turn is one row,
  never split). The ratio is the gradient pass's own, so ``alloc_ratio_gap`` is 0.

The per-token score norm ``s_t = ||onehot(a_t) - softmax(z_t)||`` (SPEC 1, ``fisher``)
comes from the logits of the pass that gave ``logp`` (pre-pass, or the gradient forward
in micro-batch scope); on a skipped pre-pass, from the gradient forward (the rollout
weights). It costs no extra pass. The student's next-token entropy (SPEC 11, the dumps'
``entropy`` column, nats) comes from the same logits as the score norm. The teacher log-probs are the step's (rollout
weights, SDAR's timing) unless ``teacher_rescore`` re-scores the teacher rows of every
mini-batch after the first with the current weights (one more no-grad forward over the
teacher prompts per mini-batch).

The dump records the ``ratio``, ``delta``, ``score_norm``, ``entropy`` and ``logp`` that entered the
allocation, and ``train_logp`` from the gradient pass. With a ``sketcher`` (``sketch_k >
0``), a dumped mini-batch's gradient micro-batches also yield per-token gradient
sketches (:mod:`.sketching`), dumped as ``sketch.<layer>.out|in`` in the same row layout.

The allocation itself runs in float64 on the float32-rounded inputs, in the dump's row
order (batch, trajectory, turn, position), so ``icsd audit coeffs`` on the dump
recomputes the deployed ``c`` bit for bit before float32 storage.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from icsd_audit.alloc.registry import get_allocator
from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.alloc.variants import Allocation, allocate
from icsd_audit.grads.sketch import GradientSketcher, SketchResult
from icsd_audit.train.update.hybrid import Hybrid
from icsd_audit.train.update.losses import token_losses
from icsd_audit.train.update.logprobs import autocast_for, pack, response_logprobs, score_rows, split_rows
from icsd_audit.train.models.memory import OptimizerSpill, checkpointed_blocks, mapped_large_allocations
from icsd_audit.train.update.sketching import response_sketch

__all__ = [
    "Distillation",
    "NoDistillation",
    "make_distillation",
    "StepData",
    "Actor",
    "batch_id_for",
    "micro_batch_id",
    "ALLOC_SCOPES",
]


# --------------------------------------------------------------------------------------
# Distillation: the allocator as deployed
# --------------------------------------------------------------------------------------


class Distillation:
    """The run's allocator, looked up once; allocates one whole mini-batch at a time."""

    enabled = True

    def __init__(self, settings: AllocatorSettings, *, coef: float):
        self.settings = settings  # validated when it was built, names included
        self.coef = float(coef)
        spec = get_allocator(settings.allocator)
        #: The allocator reads the per-token score norm (``fisher``): it must exist before allocating.
        self.needs_score_norm = "score_norm" in spec.requires

    def allocate(self, *, advantage: Tensor, ratio: Tensor, delta: Tensor, traj_id: Tensor, turn_id: Tensor,
                 batch_id: int, score_norm: Tensor | None = None) -> Allocation:
        """float64 allocation of float32-rounded inputs (what the dump stores)."""
        a = advantage.float().double()
        r = ratio.float().double()
        d = delta.float().double()
        sn = None if score_norm is None else score_norm.float().double()
        b = torch.full_like(traj_id, int(batch_id))
        return allocate(settings=self.settings, advantage=a, ratio=r, delta=d, traj_id=traj_id, turn_id=turn_id,
                        batch_id=b, score_norm=sn)


class NoDistillation:
    """``allocator='none'``: no teacher term, no allocation, no ratio pre-pass."""

    enabled = False
    coef = 0.0
    needs_score_norm = False


def make_distillation(cfg: Any) -> Distillation | NoDistillation:
    if not cfg.distill_enabled:
        return NoDistillation()
    return Distillation(cfg.allocation(), coef=cfg.effective_distill_coef)


# --------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------


def _concat_allocations(parts: list[tuple[slice, Allocation]], n: int) -> Allocation:
    """One layout-order Allocation from the allocations of consecutive token slices."""
    if len(parts) == 1:
        return parts[0][1]
    first = parts[0][1]
    out = {k: torch.empty(n, dtype=getattr(first, k).dtype) for k in ("g", "u", "m", "c", "fallback")}
    for sl, a in parts:
        for k in out:
            out[k][sl] = getattr(a, k)
    return Allocation(diagnostics=first.diagnostics, **out)


@dataclass
class StepData:
    """One step's rows as the actor needs them (row-indexed lists, float32 CPU tensors)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    old_logp: list[Tensor]
    advantage: Tensor  # (rows,) float32
    traj: Tensor  # (rows,) int64
    turn: Tensor  # (rows,) int64
    teacher_logp: list[Tensor] | None = None
    ref_logp: list[Tensor] | None = None
    #: The teacher's prompt ids per row (only needed for ``teacher_rescore``).
    teacher_prompts: list[list[int]] | None = None
    #: Per-row values copied onto every token of the row in the dump (task, rollout, reward, ...).
    row_columns: dict[str, Sequence[Any]] = field(default_factory=dict)

    @property
    def n_rows(self) -> int:
        return len(self.prompts)


def batch_id_for(step: int, index_in_step: int) -> int:
    """Run-unique ``batch_id`` of the ``index_in_step``-th actor mini-batch of ``step``."""
    if not 0 <= index_in_step < 1000:
        raise ValueError(f"at most 1000 actor mini-batches per step (epochs x mini-batches); got index {index_in_step}")
    return int(step) * 1000 + int(index_in_step)


class _Timer:
    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def add(self, name: str, dt: float) -> None:
        self.t[name] = self.t.get(name, 0.0) + dt


DumpSink = Callable[[str, dict[str, Any]], None]

#: Where the allocation is computed (see the module docstring).
ALLOC_SCOPES = ("mini-batch", "micro-batch")


def micro_batch_id(mini_batch_id: int, j: int) -> int:
    """``batch_id`` of the j-th micro-batch of a mini-batch under ``alloc_scope='micro-batch'``."""
    if not 0 <= j < 1000:
        raise ValueError(f"at most 1000 micro-batches per mini-batch; got index {j}")
    return int(mini_batch_id) * 1000 + int(j)


class Actor:
    """Runs the PPO epochs of one step over mini-batches with gradient accumulation."""

    def __init__(self, model: Any, optimizer: Any, *, distill: Distillation | NoDistillation, clip_ratio: float,
                 dual_clip: float, kl_coef: float, temperature: float, mini_batch_rows: int, micro_batch_rows: int,
                 ppo_epochs: int, grad_clip: float, skip_first_prepass: bool, shuffle_rows: bool, seed: int,
                 pad_id: int, device: torch.device, precision: str = "float32",
                 sketcher: GradientSketcher | None = None, alloc_scope: str = "mini-batch",
                 teacher_rescore: bool = False, pg_coef: float = 1.0, recompute_activations: bool = True,
                 spill: OptimizerSpill | None = None, hybrid: Hybrid | None = None,
                 lr_schedule: Callable[[int], float] | None = None, trim_memory: bool = True):
        if alloc_scope not in ALLOC_SCOPES:
            raise ValueError(f"alloc_scope={alloc_scope!r}: choose one of {list(ALLOC_SCOPES)}")
        self.alloc_scope, self.teacher_rescore, self.pg_coef = alloc_scope, teacher_rescore, float(pg_coef)
        self.model, self.opt, self.distill = model, optimizer, distill
        self.hybrid = hybrid if hybrid is not None else Hybrid()  # Skill-SD / RLSD, or nothing
        if self.hybrid.enabled and (distill.enabled or teacher_rescore):
            raise ValueError(f"hybrid={self.hybrid.name!r} uses the step's teacher without an allocation: pass "
                             "NoDistillation() and teacher_rescore=False")
        # optimizer state on disk between steps (None: always in memory)
        self.spill = spill if spill is not None else OptimizerSpill(optimizer, enabled=False)
        self.recompute_activations = recompute_activations  # activation checkpointing (:mod:`.memory`)
        self.trim_memory = trim_memory  # the gradient pass's large blocks in their own mmaps (:mod:`.memory`)
        self.sketcher = sketcher  # per-token gradient sketches of dumped mini-batches (None: off)
        self.clip_ratio, self.dual_clip, self.kl_coef = clip_ratio, dual_clip, kl_coef
        self.temperature = temperature
        self.mini_batch_rows, self.micro_batch_rows, self.ppo_epochs = mini_batch_rows, micro_batch_rows, ppo_epochs
        self.grad_clip, self.skip_first_prepass, self.shuffle_rows, self.seed = grad_clip, skip_first_prepass, shuffle_rows, seed
        self.pad_id, self.device, self.precision = pad_id, device, precision
        self.lr_schedule = lr_schedule  # step -> learning rate (None: the optimizer's own, unchanged)

    # -------------------------------------------------------------- layout
    def mini_batches(self, step: int, data: StepData) -> list[list[int]]:
        order = list(range(data.n_rows))
        if self.shuffle_rows:
            g = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(step))
            order = torch.randperm(data.n_rows, generator=g).tolist()
        return split_rows(order, self.mini_batch_rows)

    def micro_batches(self, rows: Sequence[int], data: StepData) -> list[list[int]]:
        """Micro-batches of a mini-batch: rows sorted by length to cut padding."""
        srt = sorted(rows, key=lambda i: (len(data.prompts[i]) + len(data.responses[i]), i))
        return split_rows(srt, self.micro_batch_rows)

    def recompute_old_logp(self, step: int, data: StepData) -> list[Tensor]:
        """verl's old-log-prob pass: score every row with the current (rollout) weights.

        Uses the exact micro-batch partition of the step's first epoch, so the first
        mini-batch's gradient pass reproduces these numbers and its ratio is 1 exactly.
        """
        out: dict[int, Tensor] = {}
        for mb in self.mini_batches(step, data):
            out.update(score_rows(self.model, data.prompts, data.responses, self.micro_batches(mb, data),
                                  pad_id=self.pad_id, device=self.device, temperature=self.temperature,
                                  precision=self.precision))
        return [out[i] for i in range(data.n_rows)]

    # -------------------------------------------------------------- update
    def update(self, step: int, data: StepData, *, sink: DumpSink | None = None,
               dump_columns: dict[str, Any] | None = None, progress: Callable[[int, int], None] | None = None,
               ) -> tuple[dict[str, float], dict[str, float], dict[str, np.ndarray]]:
        """All epochs and mini-batches of one step.

        Returns ``(metrics, timings, alloc_arrays)``; ``alloc_arrays`` pools the
        per-token delta, advantage, ratio, g, c, traj, turn and batch ids of every
        mini-batch (for the step's TCM). ``sink(name, columns)`` receives each
        mini-batch's dump columns; ``progress(done, total)`` hears of each finished
        mini-batch (epochs x mini-batches in all).
        """
        timer = _Timer()
        if self.lr_schedule is not None:
            lr = self.lr_schedule(step)
            for group in self.opt.param_groups:
                group["lr"] = lr
        acc: dict[str, list[float]] = {}
        pooled: dict[str, list[np.ndarray]] = {}
        mbs = self.mini_batches(step, data)
        index = 0
        steps_taken = 0
        for epoch in range(self.ppo_epochs):
            for k, mb in enumerate(mbs):
                bid = batch_id_for(step, index)
                first = steps_taken == 0
                m, cols = self._mini_batch(step, epoch, k, bid, mb, data, first, timer, sketch=sink is not None)
                steps_taken += 1
                index += 1
                for key, v in m.items():
                    acc.setdefault(key, []).append(v)
                if cols is not None:
                    for key in ("delta", "advantage", "ratio", "g", "c", "traj_id", "turn_id", "batch_id"):
                        pooled.setdefault(key, []).append(np.asarray(cols[key]))
                    if sink is not None:
                        t0 = time.perf_counter()
                        sink(f"step{step:06d}-mb{index - 1:03d}.parquet", {**cols, **(dump_columns or {})})
                        timer.add("dump", time.perf_counter() - t0)
                if progress is not None:
                    progress(index, self.ppo_epochs * len(mbs))
        metrics = self._finish_metrics(acc)
        metrics["lr"] = float(self.opt.param_groups[0]["lr"])  # verl's actor/lr: the rate this step used
        arrays = {k: np.concatenate(v) for k, v in pooled.items()}
        return metrics, timer.t, arrays

    def _gather(self, rows: Sequence[int], per_row: list[Tensor]) -> Tensor:
        return torch.cat([per_row[i] for i in rows]) if rows else torch.zeros(0)

    def _teacher_now(self, rows: list[int], data: StepData, timer: _Timer) -> Tensor:
        """``teacher_rescore``: the teacher's log-probs of ``rows`` under the current weights."""
        assert data.teacher_prompts is not None, "teacher_rescore needs StepData.teacher_prompts"
        t0 = time.perf_counter()
        tp = data.teacher_prompts
        order = sorted(rows, key=lambda i: (len(tp[i]) + len(data.responses[i]), i))
        per_row = score_rows(self.model, tp, data.responses, split_rows(order, self.micro_batch_rows),
                             pad_id=self.pad_id, device=self.device, temperature=self.temperature,
                             precision=self.precision)
        timer.add("teacher_rescore", time.perf_counter() - t0)
        return self._gather(rows, per_row)

    def _allocate_canonical(self, *, adv: Tensor, ratio: Tensor, delta: Tensor, traj: Tensor, turn: Tensor,
                            pos: Tensor, bid: int, score_norm: Tensor | None) -> Allocation:
        """Allocate in the canonical (dump) order trajectory, turn, position; return in layout order."""
        canon = torch.from_numpy(np.lexsort((pos.numpy(), turn.numpy(), traj.numpy())))
        a = self.distill.allocate(advantage=adv[canon], ratio=ratio[canon], delta=delta[canon], traj_id=traj[canon],
                                  turn_id=turn[canon], batch_id=bid,
                                  score_norm=None if score_norm is None else score_norm[canon])
        inv = torch.empty_like(canon)
        inv[canon] = torch.arange(canon.numel())
        return Allocation(g=a.g[inv], u=a.u[inv], m=a.m[inv], c=a.c[inv], fallback=a.fallback[inv],
                          diagnostics=a.diagnostics)

    def _mini_batch(self, step: int, epoch: int, k: int, bid: int, mb: list[int], data: StepData, first: bool,
                    timer: _Timer, sketch: bool = False) -> tuple[dict[str, float], dict[str, Any] | None]:
        micro = self.micro_batches(mb, data)
        rows = [i for m in micro for i in m]  # token layout = micro-batch order
        lens = torch.as_tensor([len(data.responses[i]) for i in rows], dtype=torch.long)
        old = self._gather(rows, data.old_logp)
        n_tok = int(old.numel())
        if n_tok == 0:
            return {}, None
        row_of_tok = torch.repeat_interleave(torch.arange(len(rows)), lens)
        rows_t = torch.as_tensor(rows, dtype=torch.long)
        adv = data.advantage[rows_t][row_of_tok].float()
        traj = data.traj[rows_t][row_of_tok]
        turn = data.turn[rows_t][row_of_tok]
        teacher = self._gather(rows, data.teacher_logp) if data.teacher_logp is not None else None
        adv_pg, hybrid_m = adv, {}
        if self.hybrid.enabled:  # from the step's teacher and old log-probs, as SDAR's trainers
            if teacher is None:
                raise ValueError(f"hybrid={self.hybrid.name!r} needs the teacher's log-probs (StepData.teacher_logp)")
            adv_pg, hybrid_m = self.hybrid.token_advantage(step, adv, old, teacher)
        if teacher is not None and self.teacher_rescore and not first:
            teacher = self._teacher_now(rows, data, timer)
        ref = self._gather(rows, data.ref_logp) if data.ref_logp is not None else None
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(n_tok) - starts[row_of_tok]
        micro_scope = self.distill.enabled and self.alloc_scope == "micro-batch"

        # ---- ratio, delta and score norm at the moment of allocation
        c: Tensor | None = None
        cur = old.clone()
        ratio_alloc = torch.ones_like(old)
        score_norm = torch.zeros_like(old)
        entropy = torch.zeros_like(old)  # SPEC 11: from the same logits as the score norm, no extra pass
        delta: Tensor | None = None
        allocs: list[tuple[slice, Allocation]] = []
        batch_ids = np.full(n_tok, bid, dtype=np.int64)
        prepass = False
        if self.distill.enabled and not micro_scope:
            # mini-batch scope: one allocation over the whole mini-batch. The pre-pass is
            # skipped on a step's first mini-batch (ratio = 1 exactly) unless the allocator
            # needs the score norm, which only a forward pass gives.
            prepass = not (first and self.skip_first_prepass and not self.distill.needs_score_norm)
            if prepass:
                t0 = time.perf_counter()
                sn_rows: dict[int, Tensor] = {}
                ent_rows: dict[int, Tensor] = {}
                per_row = score_rows(self.model, data.prompts, data.responses, micro, pad_id=self.pad_id,
                                     device=self.device, temperature=self.temperature, precision=self.precision,
                                     score_norms=sn_rows, entropies=ent_rows)
                cur = self._gather(rows, per_row)
                score_norm = self._gather(rows, sn_rows)
                entropy = self._gather(rows, ent_rows)
                ratio_alloc = torch.exp((cur - old).clamp(-20.0, 20.0))
                timer.add("prepass", time.perf_counter() - t0)
            assert teacher is not None
            delta = (teacher - cur).float()
            t0 = time.perf_counter()
            whole = self._allocate_canonical(adv=adv, ratio=ratio_alloc, delta=delta, traj=traj, turn=turn, pos=pos,
                                             bid=bid, score_norm=score_norm if self.distill.needs_score_norm else None)
            allocs.append((slice(0, n_tok), whole))
            c = whole.c.float()
            timer.add("allocation", time.perf_counter() - t0)
        elif micro_scope:
            c = torch.zeros_like(old)
            delta = torch.zeros_like(old)

        # ---- gradient micro-batches (in micro-batch scope each one allocates from its own forward)
        # activations in their own mmaps: no heap fragmentation
        with mapped_large_allocations() if self.trim_memory else nullcontext():
            t0 = time.perf_counter()
            self.model.train(False)  # no dropout: the pre-pass and the gradient pass see the same function
            self.opt.zero_grad(set_to_none=True)
            dev = self.device
            train_logp = torch.empty_like(old)
            # the gradient forward's score norms are kept where no earlier pass gave them
            want_sn = self.distill.enabled and not prepass
            sums = dict(pg=0.0, kl=0.0, kd=0.0, aux=0.0, sdl=0.0, clipped=0.0, dual=0.0, ppo_kl=0.0, loss=0.0)
            off = 0
            sketcher = self.sketcher if (sketch and self.distill.enabled) else None
            sketches: list[SketchResult] = []
            hooks = sketcher if sketcher is not None else nullcontext()
            # the sketcher's hooked layers must run (and fire) once: their blocks are not recomputed
            keep = sketcher.layer_names if sketcher is not None else []
            for j, m in enumerate(micro):
                packed = pack([data.prompts[i] for i in m], [data.responses[i] for i in m], pad_id=self.pad_id,
                              device=dev)
                recompute = checkpointed_blocks(self.model, skip=keep) if self.recompute_activations else nullcontext()
                with hooks, recompute:  # attached for this forward only
                    with autocast_for(dev, self.precision):
                        out = response_logprobs(self.model, packed, temperature=self.temperature,
                                                with_score_norm=want_sn, with_entropy=want_sn)
                        lp2d, sn2d, ent2d = out if want_sn else (out, None, None)
                    if sketcher is not None:  # before the backward: collect reads the graph, keeps it
                        t1 = time.perf_counter()
                        sketches.append(response_sketch(sketcher, packed, lp2d).to("cpu"))
                        timer.add("sketch", time.perf_counter() - t1)
                logp = lp2d[packed.response_mask]
                sl = slice(off, off + logp.numel())
                off += logp.numel()
                if sn2d is not None:
                    score_norm[sl] = sn2d[packed.response_mask].float().cpu()
                    entropy[sl] = ent2d[packed.response_mask].float().cpu()
                if micro_scope:
                    # allocation from this micro-batch's own forward: no extra pass
                    t1 = time.perf_counter()
                    assert teacher is not None and c is not None and delta is not None
                    cur[sl] = logp.detach().float().cpu()
                    ratio_alloc[sl] = torch.exp((cur[sl] - old[sl]).clamp(-20.0, 20.0))
                    delta[sl] = (teacher[sl] - cur[sl]).float()
                    mbid = micro_batch_id(bid, j)
                    sn_sl = score_norm[sl] if self.distill.needs_score_norm else None
                    part = self._allocate_canonical(adv=adv[sl], ratio=ratio_alloc[sl], delta=delta[sl], traj=traj[sl],
                                                    turn=turn[sl], pos=pos[sl], bid=mbid, score_norm=sn_sl)
                    allocs.append((sl, part))
                    c[sl] = part.c.float()
                    batch_ids[sl] = mbid
                    timer.add("allocation", time.perf_counter() - t1)
                tl = token_losses(
                    logp=logp, old_logp=old[sl].to(dev), advantage=adv_pg[sl].to(dev),
                    ref_logp=None if ref is None else ref[sl].to(dev),
                    teacher_logp=None if teacher is None else teacher[sl].to(dev),
                    c=None if c is None else c[sl].to(dev),
                    clip_ratio=self.clip_ratio, dual_clip=self.dual_clip, kl_coef=self.kl_coef,
                    distill_coef=self.distill.coef, pg_coef=self.pg_coef, sdl_coef=self.hybrid.loss_coef,
                )
                loss = tl.total.sum() / n_tok
                loss.backward()
                with torch.no_grad():
                    train_logp[sl] = logp.detach().float().cpu()
                    sums["pg"] += float(tl.pg.sum())
                    sums["kl"] += float(tl.kl.sum())
                    sums["kd"] += float(tl.kd.sum())
                    sums["aux"] += float(tl.aux.sum())
                    sums["sdl"] += float(tl.sdl.sum())
                    sums["clipped"] += float(tl.clipped.float().sum())
                    sums["dual"] += float(tl.dual_clipped.float().sum())
                    sums["ppo_kl"] += float((old[sl].to(dev) - logp).sum())
                    sums["loss"] += float(loss) * n_tok
            assert off == n_tok, "token layout mismatch between the pre-pass and the gradient pass"
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
            stepped = math.isfinite(grad_norm)
            if stepped:
                with self.spill.resident():
                    self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            timer.add("grad", time.perf_counter() - t0)

        ratio_train = torch.exp((train_logp - old).clamp(-20.0, 20.0))
        mm: dict[str, float] = {
            "tokens": float(n_tok),
            "pg_loss": sums["pg"] / n_tok,
            "kl": sums["kl"] / n_tok,
            "kd_mean": sums["kd"] / n_tok,
            "aux_loss": sums["aux"] / n_tok,
            "loss": sums["loss"] / n_tok,
            "clip_frac": sums["clipped"] / n_tok,
            "dual_clip_frac": sums["dual"] / n_tok,
            "ppo_kl": sums["ppo_kl"] / n_tok,
            "grad_norm": grad_norm,
            "skipped_updates": float(not stepped),
            "ratio_mean": float(ratio_train.mean()),
            "ratio_max": float(ratio_train.max()),
            "ratio_min": float(ratio_train.min()),
            "mini_batches": 1.0,
        }
        if self.hybrid.loss_coef:
            mm["sdl_loss"] = sums["sdl"] / n_tok  # SDAR's actor/sdl_loss (before sdl_coef)
        mm.update(hybrid_m)
        gap = float((ratio_train - ratio_alloc).abs().max())
        # max |train ratio - allocation ratio|: 0 when the allocation saw the gradient pass's
        # numbers (pre-pass or micro-batch scope); on a skipped pre-pass, the sampler-vs-
        # forward numeric difference
        skipped = self.distill.enabled and not micro_scope and not prepass
        mm["alloc_ratio_gap_skipped" if skipped else "alloc_ratio_gap"] = gap
        if not allocs:
            return mm, None
        assert delta is not None and teacher is not None
        alloc = _concat_allocations(allocs, n_tok)
        mm.update({
            "fallback_share": float(alloc.fallback.float().mean()),
            "degenerate_turns": float(sum(a.diagnostics.degenerate_turns for _, a in allocs)),
            "groups_batch_stats": float(sum(a.diagnostics.groups_batch_stats for _, a in allocs)),
            "groups_fixed_map": float(sum(a.diagnostics.groups_fixed_map for _, a in allocs)),
            "c_over_g": float(alloc.c.sum() / alloc.g.sum()) if float(alloc.g.sum()) > 0 else float("nan"),
            "delta_mean": float(delta.mean()),
            "delta_pos_share": float((delta > 0).float().mean()),
            "prepass_skipped": float(skipped),
        })
        cols: dict[str, Any] = {
            "batch_id": batch_ids,
            "traj_id": traj.numpy(),
            "turn_id": turn.numpy().astype(np.int32),
            "advantage": adv.numpy().astype(np.float32),
            "ratio": ratio_alloc.numpy().astype(np.float32),
            "delta": delta.numpy().astype(np.float32),
            "score_norm": score_norm.numpy().astype(np.float32),
            "entropy": entropy.numpy().astype(np.float32),
            "valid": np.ones(n_tok, dtype=bool),
            "pos": pos.numpy().astype(np.int32),
            "token_id": np.concatenate([np.asarray(data.responses[i], dtype=np.int32) for i in rows]),
            "logp": cur.numpy().astype(np.float32),
            "old_logp": old.numpy().astype(np.float32),
            "teacher_logp": teacher.numpy().astype(np.float32),
            "train_logp": train_logp.numpy().astype(np.float32),
            "g": alloc.g.numpy().astype(np.float32),
            "u": alloc.u.numpy().astype(np.float32),
            "m": alloc.m.numpy().astype(np.float32),
            "c": alloc.c.numpy().astype(np.float32),
            "fallback": alloc.fallback.numpy().astype(bool),
            "step": np.full(n_tok, step, dtype=np.int64),
            "epoch": np.full(n_tok, epoch, dtype=np.int32),
            "minibatch": np.full(n_tok, k, dtype=np.int32),
        }
        if ref is not None:
            cols["ref_logp"] = ref.numpy().astype(np.float32)
        if sketches:
            sk = SketchResult.cat(sketches)
            assert sk.n_tokens == n_tok, "sketch rows do not match the mini-batch's tokens"
            cols.update(sk.columns())
        for name, values in data.row_columns.items():
            per_row = np.asarray([values[i] for i in rows])
            cols[name] = per_row[row_of_tok.numpy()]
        return mm, cols

    #: How per-mini-batch values combine into the step's value (default: token-weighted mean).
    _SUM = ("tokens", "mini_batches", "skipped_updates", "degenerate_turns", "groups_batch_stats", "groups_fixed_map",
            "prepass_skipped")
    _MAX = ("ratio_max", "alloc_ratio_gap", "alloc_ratio_gap_skipped", "grad_norm_max")
    _MIN = ("ratio_min",)
    _PLAIN_MEAN = ("grad_norm", "c_over_g")

    @classmethod
    def _finish_metrics(cls, acc: dict[str, list[float]]) -> dict[str, float]:
        if not acc:
            return {}
        w = np.asarray(acc["tokens"], dtype=np.float64)
        out: dict[str, float] = {}
        for key, vals in acc.items():
            v = np.asarray(vals, dtype=np.float64)
            if key in cls._SUM:
                out[key] = float(v.sum())
            elif key in cls._MAX:
                out[key] = float(v.max())
            elif key in cls._MIN:
                out[key] = float(v.min())
            elif key in cls._PLAIN_MEAN or v.size != w.size:
                out[key] = float(np.nanmean(v)) if v.size else float("nan")
            else:
                out[key] = float((v * w).sum() / w.sum())
        if "grad_norm" in acc:
            out["grad_norm_max"] = float(np.max(acc["grad_norm"]))
        return out
