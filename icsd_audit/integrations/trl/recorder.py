"""Record a TRL run as it trains: ``record(trainer, dump_dir)`` for GRPO, SDPO and SDFT (TRL 1.16).

A researcher with a TRL run asks the paper's frozen-batch question ("on these batches, where did the
distillation signal fight the advantage, and what would SDAR's trust or ICSD have done?") without
switching trainers: :func:`record` takes a constructed ``GRPOTrainer``,
``trl.experimental.sdpo.SDPOTrainer`` or ``trl.experimental.sdft.SDFTTrainer`` (or a subclass),
returns the very same object, and from then on writes every optimizer step's completion tokens as
schema-v1 token dumps: ``dump_dir/stepNNNNNN-rRRRRR/part-...parquet``, one committed folder per step
and rank (:meth:`~icsd_audit.dumps.writer.DumpWriter.step`), ``batch_id`` = the optimizer step.

**Training is unchanged.**  Nothing here runs a forward pass, draws a random number, touches a
thread or determinism setting, or alters a tensor the trainer uses: the hooks read what the
trainer computed in its loss (the student's and teacher's completion logits, the per-token
log-probs, advantages, rewards and the per-token distillation term) and derive the columns from
them under ``torch.no_grad()`` on detached copies.  The hooks are instance attributes of the
trainer (its class is not changed) plus pass-through wrappers of the SDPO/SDFT modules'
``compute_*_self_distillation_loss`` and ``apply_importance_sampling_clipping`` functions, which
only look at their output while a recorded loss runs (a context variable says which).

**Columns** (SPEC 1 plus pass-through): ``batch_id`` (the optimizer step), ``traj_id``
(``step << 32 | rank << 20 | row``: one completion, unique within a step over every rank),
``turn_id`` (0; with a multi-turn ``tool_mask`` each run of model tokens is a turn), ``pos``,
``step``, ``token_id``, ``task`` (a 63-bit hash of the prompt's token ids: a GRPO group shares
it), ``valid`` (the trainer's ``completion_mask``: completion tokens up to and including EOS;
padding is not written), ``advantage``, ``ratio`` (``exp(logp - old_logp)`` as TRL forms it, per
completion with ``importance_sampling_level="sequence"``), ``logp`` and ``old_logp`` (``old_logp =
logp`` where TRL trains on-policy and skips it, as TRL does), ``teacher_logp`` (the teacher's log-prob of the sampled token from the teacher logits
the loss computed; null outside the student's top-k in ``topk_logits`` mode and null for GRPO),
``delta = teacher_logp - logp`` (0 where ``teacher_logp`` is null), ``reward`` (the weighted sum
TRL normalizes into advantages; absent for SDFT), ``distill_term`` (the per-token distillation
loss as the trainer computed it, importance-sampling clip included, times its loss mask; 0 for
GRPO), ``entropy`` (SPEC 11: the student's next-token entropy in nats, from the logits that gave ``logp``:
GRPO's from TRL's fused head, which computes it in the loss's own forward; SDPO's and SDFT's from the
student completion logits the loss holds, at their temperature) and ``c`` (the deployed weighting: uniform 1).

**Stand-ins, said in the provenance.**  GRPO has no teacher: ``teacher_logp`` null, ``delta`` 0,
producer key ``no_teacher``.  SDFT has no advantage: ``advantage`` 0, ``ratio`` 1, producer key
``no_advantage``.  The audit reads these keys and reports what needs the missing input as n/a
with that reason.  The SPEC 9 ``allocator`` block is ``opsd`` (uniform, ``alloc_scope``
mini-batch); the ``producer`` block names the trainer, its distillation mode, top-k, alpha and
weight.

Not supported (refused in one line at ``record``): a teacher served by vLLM
(``use_teacher_server``), whose log-probs never reach the loss as logits, and GRPO's Liger loss,
which never materializes per-token log-probs.
"""

from __future__ import annotations

import contextvars
import hashlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from icsd_audit.integrations.checks import check_values
from icsd_audit.integrations.core import dump_writer
from icsd_audit.integrations.trl.logits import (in_topk, sampled_token_logps, student_entropy,
                                                student_logps_and_entropy, teacher_token_logps, token_logps)

__all__ = ["TESTED_TRL", "RECORDED_TRAINERS", "ACTIVE_CAPTURE", "LossCapture", "Recorder", "TrainerKind", "record",
           "recorder_of", "trainer_kind", "prompt_hash", "sampled_token_logps", "student_entropy", "teacher_token_logps",
           "token_logps", "student_logps_and_entropy",
           "in_topk",
           "wrap_term_functions"]

#: [lowest tested, first untested) TRL versions of :func:`record`.
TESTED_TRL = ((1, 16), (1, 17))
#: the TRL trainer classes :func:`record` knows, by the module that defines them
RECORDED_TRAINERS = {"GRPOTrainer": "trl.trainer.grpo_trainer", "SDPOTrainer": "trl.experimental.sdpo.sdpo_trainer",
                     "SDFTTrainer": "trl.experimental.sdft.sdft_trainer"}
#: functions of the SDPO/SDFT modules whose output is the per-token distillation term
_TERM_FUNCS = ("compute_topk_self_distillation_loss", "compute_full_logit_self_distillation_loss",
               "compute_sampled_token_self_distillation_loss")
_CLIP_FUNC = "apply_importance_sampling_clipping"
_ATTR = "_icsd_recorder"

#: the micro-batch being recorded (set only while a recorded trainer's loss runs)
ACTIVE_CAPTURE: contextvars.ContextVar["LossCapture | None"] = contextvars.ContextVar("icsd_trl_record", default=None)


@dataclass(frozen=True)
class TrainerKind:
    """Which TRL trainer a recorder serves: its base class name and module, and what it has."""

    base: str
    module: str
    has_teacher: bool
    has_advantage: bool


def trainer_kind(trainer: Any) -> TrainerKind:
    """The :class:`TrainerKind` of ``trainer`` (a TRL trainer or subclass); ``TypeError`` for anything else."""
    for cls in type(trainer).__mro__:
        mod = RECORDED_TRAINERS.get(cls.__name__)
        if mod is not None and cls.__module__ == mod:
            return TrainerKind(base=cls.__name__, module=mod, has_teacher=cls.__name__ != "GRPOTrainer",
                               has_advantage=cls.__name__ != "SDFTTrainer")
    raise TypeError(f"record: {type(trainer).__name__} is not a TRL GRPOTrainer, SDPOTrainer or SDFTTrainer "
                    "(or a subclass of one)")


def prompt_hash(prompt_ids: Tensor, prompt_mask: Tensor) -> np.ndarray:
    """``[B]`` int64: a 63-bit BLAKE2b hash of each row's prompt token ids (padding left out).

    The same prompt gives the same id on every rank, step and run, so a GRPO group (one prompt,
    ``num_generations`` completions) shares its ``task`` wherever its rows were trained.
    """
    ids = prompt_ids.detach().to("cpu", torch.int64).numpy()
    keep = prompt_mask.detach().to("cpu").numpy().astype(bool)
    out = np.empty(ids.shape[0], dtype=np.int64)
    for r in range(ids.shape[0]):  # one hash per completion (a row), never per token
        d = hashlib.blake2b(ids[r][keep[r]].tobytes(), digest_size=8).digest()
        out[r] = int.from_bytes(d, "little") & ((1 << 63) - 1)
    return out


def _trl_version() -> str:
    import trl

    return str(trl.__version__)


def _check_version(version: str) -> None:
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts >= TESTED_TRL[1]:
        warnings.warn(f"record: TRL {version} is newer than the versions record() was tested with (1.16.x); "
                      "the hooks read TRL's loss internals and may miss a changed one", RuntimeWarning, stacklevel=3)
    elif parts < TESTED_TRL[0]:
        warnings.warn(f"record: TRL {version} is older than 1.16, the version record() was tested with; "
                      "pip install 'icsd-audit[trl]'", RuntimeWarning, stacklevel=3)


@dataclass
class LossCapture:
    """What one recorded loss call saw: filled by the hooks, read when the call returns."""

    student_logits: Tensor | None = None
    teacher_logits: Tensor | None = None
    loss_mask: Tensor | None = None
    term: Tensor | None = None  # the per-token distillation term, after the importance-sampling clip
    logps: Tensor | None = None  # GRPO: per-token log-probs of its loss forward
    entropies: Tensor | None = None  # GRPO: per-token entropies of the same forward (TRL asks for them)
    #: multiplies the divergence's per-token output (ICSDSDPOTrainer's c); None records only
    scale: Callable[[Tensor], Tensor] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def wrap_term_functions(module_name: str) -> None:
    """Install (once per module) pass-through wrappers that hand the per-token term to the active capture."""
    import importlib

    mod = importlib.import_module(module_name)
    for name in (*_TERM_FUNCS, _CLIP_FUNC):
        orig = getattr(mod, name)
        if getattr(orig, "__icsd_wrapped__", None) is not None:
            continue

        def wrapped(*args: Any, __orig: Callable[..., Tensor] = orig, __name: str = name, **kwargs: Any) -> Tensor:
            out = __orig(*args, **kwargs)
            cap = ACTIVE_CAPTURE.get()
            if cap is None:
                return out
            if __name != _CLIP_FUNC and cap.scale is not None:
                out = cap.scale(out)
            cap.term = out
            return out

        wrapped.__icsd_wrapped__ = orig  # type: ignore[attr-defined]
        wrapped.__name__, wrapped.__doc__ = orig.__name__, orig.__doc__
        setattr(mod, name, wrapped)


class Recorder:
    """The per-trainer state :func:`record` attaches (``trainer._icsd_recorder``): writer, pending rows, counters."""

    def __init__(self, trainer: Any, dump_dir: str | Path, kind: TrainerKind, producer: Mapping[str, Any] | None,
                 allocation: Mapping[str, Any] | None = None, compression: str = "snappy"):
        self.trainer, self.kind = trainer, kind
        self.name = type(trainer).__name__
        acc = trainer.accelerator
        self.rank, self.world = int(acc.process_index), int(acc.num_processes)
        self.pending: list[dict[str, np.ndarray]] = []
        self.step: int | None = None
        self.rows_in_step = 0
        self.micro_in_step = 0
        self.writer = dump_writer(dump_dir, rank=self.rank, world_size=self.world, producer=self.producer(producer),
                                  allocation=allocation if allocation is not None else self.allocation(),
                                  null_nan=("teacher_logp", "reward"), compression=compression)

    # ------------------------------------------------------------------ provenance
    def producer(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        a = self.trainer.args
        out: dict[str, Any] = {"name": "icsd.trl.record", "engine": "trl", "engine_version": _trl_version(),
                               "trainer": self.name, "trainer_base": self.kind.base}
        if self.kind.has_teacher:
            mode = getattr(a, "distillation_mode", None)
            out.update(distillation_mode=mode, distillation_topk=getattr(a, "distillation_topk", None),
                       distillation_alpha=getattr(a, "distillation_alpha", None),
                       distillation_add_tail=getattr(a, "distillation_add_tail", None),
                       distillation_is_clip=getattr(a, "distillation_is_clip", None),
                       distillation_weight=float(getattr(a, "distillation_weight", 1.0)),
                       teacher_model_kind=getattr(a, "teacher_model_kind", None))
            if mode == "topk_logits":
                out["teacher_logp_null"] = "the sampled token is outside the student's top-k support"
        else:
            out["no_teacher"] = (f"{self.kind.base} trains without a teacher: teacher_logp is null and delta 0 "
                                 "on every token")
            out["distillation_weight"] = 0.0
        if not self.kind.has_advantage:
            out["no_advantage"] = (f"{self.kind.base} trains without rewards or advantages: advantage is 0 and "
                                   "ratio 1 on every token")
        out.update(dict(extra or {}))
        return out

    def allocation(self) -> dict[str, Any]:
        from icsd_audit.dumps.provenance import deployed_block

        ratio = "own-forward" if self.kind.has_advantage else "fixed-1"
        return deployed_block({"allocator": "opsd", "trust": "uniform"}, alloc_scope="mini-batch",
                              ratio_source=ratio, **{"lambda": self.producer(None)["distillation_weight"]})

    # ------------------------------------------------------------------ rows
    def batch_step(self) -> int:
        """The optimizer step the micro-batch being computed belongs to (``state.global_step``)."""
        step = int(self.trainer.state.global_step)
        if self.step is not None and step != self.step and self.pending:
            self.flush()  # a step left without on_step_end (a skipped optimizer step): publish it first
        if step != self.step:
            self.step, self.rows_in_step, self.micro_in_step = step, 0, 0
        return step

    def add(self, *, inputs: Mapping[str, Any], logp: Tensor, teacher_logp: Tensor | None, term: Tensor | None,
            advantage: Tensor | None, reward: Tensor | None, c: Tensor | None = None,
            batch_id: int | None = None, mask: Tensor | None = None, entropy: Tensor | None = None) -> None:
        """Flat columns of one micro-batch, checked, kept until the optimizer step ends.

        ``entropy``: the student's per-token entropy from the logits that gave ``logp`` (None: no column).
        Every ``[B, T]`` input reaches the host in one transfer and is read at the mask in numpy; a
        column is checked for finite values on its valid tokens in one pass, and only a failing one
        goes through :func:`~icsd_audit.integrations.checks.check_values` for the message naming the
        trainer, key, row and token.
        """
        step = self.batch_step()
        ids, cmask = inputs["completion_ids"], inputs["completion_mask"]
        B, T = ids.shape
        mask = (cmask if "tool_mask" not in inputs else cmask * inputs["tool_mask"]) if mask is None else mask
        old_in = inputs.get("old_per_token_logps")
        grid = {"logp": logp} if old_in is None else {"logp": logp, "old": old_in}
        if self.kind.has_advantage:
            log_ratio = logp.detach().float() - grid.get("old", logp).detach().float()
            if getattr(self.trainer, "importance_sampling_level", "token") == "sequence":  # GSPO: one per completion
                mf = mask.detach().to(log_ratio.dtype)
                log_ratio = ((log_ratio * mf).sum(-1, keepdim=True) / mf.sum(-1, keepdim=True).clamp(min=1.0)
                             ).expand(B, T)
            grid["ratio"] = torch.exp(log_ratio)  # TRL's coef_1 from the same float32 inputs, on the same grid
        for key, x in (("teacher", teacher_logp), ("term", term), ("entropy", entropy), ("c", c)):
            if x is not None:
                grid[key] = x
        host = _to_host({**grid, "ids": ids, "mask": mask})
        m = host.pop("mask").astype(bool)
        rows = np.nonzero(m)[0]
        where = f"{self.name} (record, step {step})"

        def pick(key: str, label: str | None, x: Any) -> np.ndarray:
            """``x`` (``[B, T]`` or one value per row ``[B]``) at the valid tokens; checked unless ``label`` is None."""
            a = np.asarray(x)
            if a.shape == (B, T):
                v = a[m]
            elif a.shape == (B,):
                v = a[rows]
            else:
                v = None
            if label is not None and (v is None or not np.isfinite(v).all()):
                check_values(f"{where}: {label}", torch.as_tensor(a), torch.from_numpy(m))
                raise ValueError(f"{where}: {label} holds a non-finite value on a valid token")  # (not reached)
            if v is None:
                raise ValueError(f"{where}: {key} has shape {a.shape}; it must have the mask's shape {(B, T)}")
            return v

        lp = pick("logp", "per-token log-probs", host["logp"])
        old = lp if old_in is None else pick("old_logp", "inputs['old_per_token_logps']", host["old"])
        n = lp.shape[0]
        if self.kind.has_advantage:
            adv = pick("advantage", "inputs['advantages']", _host_one(advantage))
            ratio = pick("ratio", None, host["ratio"])
        else:
            adv, ratio = np.zeros(n, dtype=np.float32), np.ones(n, dtype=np.float32)
        if "teacher" in host:
            t = pick("teacher_logp", None, host["teacher"])
            known = ~np.isnan(t)  # NaN marks "no teacher value here" (outside a top-k): null in the dump
            if not np.isfinite(t[known]).all():
                pick("teacher_logp", "teacher log-probs", np.where(np.isnan(host["teacher"]), 0.0, host["teacher"]))
            delta = np.where(known, t - lp, np.float32(0.0))
        else:
            t, delta = np.full(n, np.nan, dtype=np.float32), np.zeros(n, dtype=np.float32)
        term_v = np.zeros(n, dtype=np.float32) if "term" not in host else pick(
            "distill_term", "per-token distillation term", host["term"])
        started = m.copy()
        started[:, 1:] &= ~m[:, :-1]  # a turn starts where a run of valid tokens starts
        base = (step << 32) | (self.rank << 20)
        out = {"batch_id": np.full(n, step if batch_id is None else batch_id, dtype=np.int64),
               "traj_id": rows.astype(np.int64) + (base + self.rows_in_step),
               "turn_id": (np.cumsum(started, axis=1, dtype=np.int32) - 1)[m],
               "pos": (np.cumsum(m, axis=1, dtype=np.int32) - 1)[m], "step": np.full(n, step, dtype=np.int64),
               "token_id": host["ids"][m].astype(np.int32),
               "task": prompt_hash(inputs["prompt_ids"], inputs["prompt_mask"])[rows],
               "valid": np.ones(n, dtype=bool), "advantage": adv, "ratio": ratio, "delta": delta, "logp": lp,
               "old_logp": old, "teacher_logp": t, "distill_term": term_v,
               "c": np.ones(n, dtype=np.float32) if "c" not in host else pick("c", None, host["c"])}
        if reward is not None:
            out["reward"] = pick("reward", None, _host_one(reward))
        if "entropy" in host:
            out["entropy"] = pick("entropy", "per-token entropies", host["entropy"])
        self.pending.append(out)
        self.rows_in_step += B
        self.micro_in_step += 1

    def flush(self) -> Path | None:
        """Write the step's rows as one shard in a committed step folder (nothing when the step had none)."""
        if not self.pending or self.step is None:
            return None
        cols = (self.pending[0] if len(self.pending) == 1
                else {k: np.concatenate([p[k] for p in self.pending]) for k in self.pending[0]})
        self.pending = []
        with self.writer.step(self.step) as s:
            self.writer.write(**cols)
        return s.target


def _to_host(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Detached float32 (ids and masks as they are) numpy copies on the host, one transfer per device.

    CPU tensors are viewed without a copy; tensors on an accelerator are stacked there by dtype
    and copied back together, so a step costs one device-to-host synchronisation, not one per column.
    """
    out: dict[str, np.ndarray] = {}
    remote: dict[tuple[Any, Any, tuple[int, ...]], list[tuple[str, Tensor]]] = {}
    for key, x in tensors.items():
        x = x.detach()
        if x.is_floating_point() and x.dtype != torch.float32:
            x = x.float()
        if x.device.type == "cpu":
            out[key] = x.numpy()
        else:
            remote.setdefault((x.device, x.dtype, tuple(x.shape)), []).append((key, x))
    for group in remote.values():
        stacked = torch.stack([x for _, x in group]).cpu().numpy()
        for (key, _), a in zip(group, stacked):
            out[key] = a
    return out


def _host_one(x: Tensor) -> np.ndarray:
    """One small tensor (per-row values) as float32 numpy on the host."""
    return x.detach().float().cpu().numpy()


def recorder_of(trainer: Any) -> Recorder | None:
    """The :class:`Recorder` :func:`record` attached to ``trainer`` (None if it was not recorded)."""
    return getattr(trainer, _ATTR, None)


def _step_callback(rec: Recorder) -> Any:
    from transformers import TrainerCallback

    class _FlushOnStep(TrainerCallback):
        """Publishes the step's rows once its optimizer step is taken (``on_step_end``)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.flush()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.flush()

    return _FlushOnStep()


def record(trainer: Any, dump_dir: str | Path, *, producer: Mapping[str, Any] | None = None,
           compression: str = "snappy") -> Any:
    """Record ``trainer`` (a TRL ``GRPOTrainer``, ``SDPOTrainer`` or ``SDFTTrainer``) into ``dump_dir``; returns it.

    From the next training step on, every optimizer step's completion tokens are written as one
    committed step folder per rank (see the module docstring for the columns and provenance),
    without changing what the trainer computes.  ``producer``: free keys for the dumps' SPEC 9
    ``producer`` block (env, model, seed, ...).  ``compression``: the shards' Parquet codec
    (``snappy``, cheap for one small shard per step; ``zstd`` writes 7-14 % fewer bytes for
    about 1 ms more per step).  A trainer recorded twice, a teacher served by
    vLLM or GRPO's Liger loss is a ``ValueError``; a TRL version outside 1.16.x a warning.
    """
    kind = trainer_kind(trainer)
    _check_version(_trl_version())
    if recorder_of(trainer) is not None:
        raise ValueError(f"record: this {type(trainer).__name__} is already recorded (into "
                         f"{recorder_of(trainer).writer.out_dir})")
    if getattr(trainer, "use_teacher_server", False):
        raise ValueError(f"record: {type(trainer).__name__} with use_teacher_server=True is not supported: the served "
                         "teacher's log-probs never reach the loss as logits")
    if getattr(trainer.args, "use_liger_kernel", False):
        raise ValueError(f"record: {type(trainer).__name__} with use_liger_kernel=True is not supported: the Liger loss "
                         "never materializes per-token log-probs")
    rec = Recorder(trainer, dump_dir, kind, producer, allocation=_allocation_of(trainer), compression=compression)
    if kind.has_teacher:
        wrap_term_functions(kind.module)
        _hook_self_distillation(trainer, rec)
    else:
        _hook_grpo(trainer, rec)
    setattr(trainer, _ATTR, rec)
    trainer.add_callback(_step_callback(rec))
    return trainer


def _allocation_of(trainer: Any) -> Mapping[str, Any] | None:
    """A trainer that deploys its own weighting (ICSDSDPOTrainer) says so through ``icsd_allocation``."""
    block = getattr(trainer, "icsd_allocation", None)
    return block() if callable(block) else None


# ---------------------------------------------------------------------------------------- GRPO


def _hook_grpo(trainer: Any, rec: Recorder) -> None:
    calc, gen = trainer._calculate_rewards, trainer._generate_and_score_completions
    logps_fn, loss_fn = trainer._get_per_token_logps_and_entropies, trainer._compute_loss
    seen: dict[str, Tensor] = {}

    def calculate_rewards(*args: Any, **kwargs: Any) -> Tensor:
        out = calc(*args, **kwargs)
        seen["rewards_per_func"] = out
        return out

    def generate_and_score(inputs: Any) -> dict[str, Any]:
        seen.clear()
        out = gen(inputs)
        rpf = seen.pop("rewards_per_func", None)
        if rpf is not None and trainer.model.training:
            with torch.no_grad():  # TRL's weighted sum (sum_then_normalize), NaN where no function scored the row
                w = trainer.reward_weights.to(rpf.device).unsqueeze(0)
                r = (rpf * w).nansum(dim=1)
                r[torch.isnan(rpf).all(dim=1)] = float("nan")
                B = out["completion_ids"].size(0)
                lo = trainer.accelerator.process_index * B
                # travels with the rows through TRL's shuffle and split (a tensor key, like ICSDGRPOTrainer's)
                out["icsd_record_reward"] = r[lo:lo + B].detach().clone()
        return out

    def per_token_logps(*args: Any, **kwargs: Any) -> Any:
        res = logps_fn(*args, **kwargs)
        cap = ACTIVE_CAPTURE.get()
        if cap is not None and cap.logps is None:
            cap.logps, cap.entropies = res[0], res[1]
        return res

    def compute_loss(model: Any, inputs: dict[str, Any]) -> Tensor:
        if not trainer.model.training:
            return loss_fn(model, inputs)
        cap = LossCapture()
        token = ACTIVE_CAPTURE.set(cap)
        try:
            loss = loss_fn(model, inputs)
        finally:
            ACTIVE_CAPTURE.reset(token)
        if cap.logps is None:
            raise RuntimeError(f"record: {rec.name}'s loss computed no per-token log-probs through "
                               "_get_per_token_logps_and_entropies (a TRL change?)")
        with torch.no_grad():
            rec.add(inputs=inputs, logp=cap.logps, teacher_logp=None, term=None, advantage=inputs["advantages"],
                    reward=inputs.get("icsd_record_reward"), entropy=cap.entropies)
        return loss

    trainer._calculate_rewards = calculate_rewards
    trainer._generate_and_score_completions = generate_and_score
    trainer._get_per_token_logps_and_entropies = per_token_logps
    trainer._compute_loss = compute_loss


# ---------------------------------------------------------------------------------------- SDPO / SDFT


def _hook_self_distillation(trainer: Any, rec: Recorder) -> None:
    loss_fn = trainer.compute_loss
    policy_fn = getattr(trainer, "_compute_policy_loss", None)
    distill_fn = trainer._compute_self_distillation_loss

    def policy_loss(inputs: Any, student_logits: Tensor) -> Tensor:
        cap = ACTIVE_CAPTURE.get()
        if cap is not None:
            cap.student_logits = student_logits
        return policy_fn(inputs, student_logits)

    def self_distillation_loss(model: Any, inputs: Any, dl: Any) -> Tensor:
        cap = ACTIVE_CAPTURE.get()
        if cap is not None:
            cap.student_logits, cap.teacher_logits, cap.loss_mask = dl.student_logits, dl.teacher_logits, dl.loss_mask
        return distill_fn(model, inputs, dl)

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        if not trainer.model.training:
            return loss_fn(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        cap = LossCapture()
        token = ACTIVE_CAPTURE.set(cap)
        try:
            loss = loss_fn(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        finally:
            ACTIVE_CAPTURE.reset(token)
        if cap.student_logits is None:
            raise RuntimeError(f"record: {rec.name}'s loss passed no student logits through its policy or "
                               "self-distillation loss (a TRL change?)")
        ids = inputs["completion_ids"]
        with torch.no_grad():
            logp, ent = student_logps_and_entropy(cap.student_logits, ids)
            if "logp" in cap.extra:  # ICSDSDPOTrainer's allocation read them: record the values c came from
                logp, t = cap.extra["logp"], cap.extra["teacher_logp"]
            else:
                t = None if cap.teacher_logits is None else teacher_token_logps(trainer, cap.student_logits,
                                                                                 cap.teacher_logits, ids)
            term = None if cap.term is None else cap.term.detach() * cap.loss_mask.detach()
            if t is None:  # weight 0: SDPO ran no teacher forward, so there is no teacher signal to record
                t = torch.full_like(logp, float("nan"))
            rec.add(inputs=inputs, logp=logp, teacher_logp=t, term=term,
                    advantage=inputs.get("advantages") if rec.kind.has_advantage else None,
                    reward=inputs.get("rewards"), c=cap.extra.get("c"), batch_id=cap.extra.get("batch_id"),
                    entropy=ent)
        return loss

    if policy_fn is not None:
        trainer._compute_policy_loss = policy_loss
    trainer._compute_self_distillation_loss = self_distillation_loss
    trainer.compute_loss = compute_loss
