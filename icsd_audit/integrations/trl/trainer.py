"""ICSD on TRL: ``ICSDGRPOTrainer``, a ``trl.GRPOTrainer`` with a privileged self-teacher.

Needs ``pip install 'icsd-audit[trl]'`` (tested: trl 1.16).  Per generation batch it

1. lets TRL generate and score completions (rewards, GRPO advantages, ...);
2. scores the *same* completion tokens under the privileged prompt (the row's prompt
   with the SkillBank block in front, or a user-supplied ``teacher_prompt``) with the
   policy itself, without gradient (SDAR's self-teacher), and the student's own
   log-probs where TRL skipped them;
3. gathers the rows of every process (``accelerator.gather`` after padding the token
   axis), allocates once over the whole generation batch with
   :func:`~icsd_audit.integrations.core.allocate_padded` in canonical order, and keeps
   each process's slice of ``c``: every process computes the same allocation, so data
   parallelism does not change it;
4. writes one schema-v1 dump shard per generation batch from the main process, its
   ``batch_id`` the training step the batch starts (:meth:`ICSDGRPOTrainer.icsd_batch_id`),
   so a run resumed from a checkpoint numbers its batches on from there: the steps it
   redoes are written again under the same ids, and the reader's rule for re-written
   batches (docs/dumps.md: the latest write counts) keeps each once;
5. adds ``lambda/|B| * sum sg(c) (sg(T) - logp)`` to TRL's loss, with the student
   log-probs of TRL's own forward pass (no second forward).

The dumps' ``entropy`` column (SPEC 11) is the entropy of the student's next-token
distribution from the forward that gave the dumped ``logp`` (TRL's ``old_per_token_logps``
pass, or the student pass of step 2): TRL's fused LM head computes it with the log-probs
(temperature-scaled, as they are), so it costs no forward pass.

**Exact vs approximated.**  The paper allocates per actor mini-batch with the ratio of
that moment.  Here the actor mini-batch is TRL's optimizer step; with TRL's defaults
(``steps_per_generation == gradient_accumulation_steps``, ``num_iterations == 1``) one
generation batch is one optimizer step and the current policy *is* the rollout policy,
so rho = 1 exactly and the allocation is the paper's.  With several optimizer steps per
generation batch, ``c`` is still computed once with rho = 1 (an approximation, logged
as a warning at start).  ``|B|`` is TRL's ``num_items_in_batch`` (valid tokens of the
generation batch over all processes) rescaled like TRL's ``dapo`` normalizer, so the
auxiliary gradient summed over accumulation steps and averaged over processes is the
token mean over the optimizer step exactly when one generation batch is one step.

Multi-turn ``rollout_func`` runs expose turns only as runs of 1s in the environment
mask (``tool_mask``): each run is one action turn.  A completion is one trajectory: the
teacher scores all of it (replies and the environment's observations between them)
behind its privileged prompt, and only reply tokens enter the allocation, the loss and
the dumps.  A ``rollout_func`` may return ``teacher_prompt_ids`` (an extra field, one id
list per completion) to give the privileged prompt as ids; ``teacher_prompt`` is then
not called (:mod:`icsd_audit.integrations.trl.rollout` does this: the SkillBank block in
front of the exact student prompt ids, as the built-in teacher builds it).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

try:
    import trl
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("icsd_audit.integrations.trl.trainer needs TRL: pip install 'icsd-audit[trl]'") from e

#: [lowest tested, first untested) TRL versions.
TESTED_TRL = ((1, 16), (1, 17))
if not TESTED_TRL[0] <= tuple(int(p) for p in trl.__version__.split(".")[:2] if p.isdigit()) < TESTED_TRL[1]:
    warnings.warn(f"TRL {trl.__version__} is outside the range ICSDGRPOTrainer was tested with (1.16.x); "
                  "pip install 'icsd-audit[trl]'", RuntimeWarning, stacklevel=2)

from icsd_audit.integrations.checks import check_mask, check_values
from icsd_audit.integrations.core import (AllocationSettings, PaddedAllocation, allocate_padded, distillation_loss,
                                          dump_writer, tcm, turn_ids_from_mask, write_dump)

__all__ = ["ICSDConfig", "ICSDGRPOTrainer", "skill_teacher_prompt", "tcm"]


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ICSDConfig(AllocationSettings):
    """ICSD settings of a TRL run: the shared allocation settings plus where to dump."""

    #: folder for schema-v1 dumps (one shard per generation batch); ``None``: no dumps.
    dump_dir: str | None = None


def skill_teacher_prompt(bank: Any, *, task_key: str | None = None, mode: str = "match") -> Callable[[dict], Any]:
    """A ``teacher_prompt`` from a :class:`~icsd_audit.train.teacher.skills.SkillBank`.

    The skill is retrieved by keyword match on ``example[task_key]`` (default: the
    prompt's text) and its block (SDAR's ``[Privileged Skill Information]``) goes in
    front of a plain-text prompt, or in front of the first user message of a chat prompt.
    """
    from icsd_audit.train.rollout.prompts import skill_block

    def build(example: dict) -> Any:
        prompt = example["prompt"]
        if isinstance(prompt, str):
            task = example.get(task_key, prompt) if task_key else prompt
            return skill_block(bank.retrieve(str(task), mode=mode).text) + prompt
        msgs = [dict(m) for m in prompt]
        user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        task = example.get(task_key, msgs[user]["content"]) if task_key else msgs[user]["content"]
        msgs[user]["content"] = skill_block(bank.retrieve(str(task), mode=mode).text) + msgs[user]["content"]
        return msgs

    return build


#: the dataset column a trainer built without ``teacher_prompt`` reads the privileged prompt from
TEACHER_COLUMN = "teacher_prompt"
_TEACHER_FIX = ("add that column, pass teacher_prompt= (a function of an example; skill_teacher_prompt(bank) builds "
                "SDAR's), or a rollout_func that returns teacher_prompt_ids")


def _describe(dataset: Any) -> str:
    name = getattr(getattr(dataset, "info", None), "dataset_name", None)
    cols = getattr(dataset, "column_names", None)
    rows = f"{len(dataset)} rows, " if hasattr(dataset, "__len__") else ""
    return f"train_dataset{f' {name!r}' if name else ''} ({rows}columns {', '.join(map(str, cols or []))})"


def _check_teacher_column(dataset: Any, *, rollout: Any) -> None:
    """Without ``teacher_prompt``, the training dataset must hold :data:`TEACHER_COLUMN` (checked when built).

    A ``rollout_func`` may supply ``teacher_prompt_ids`` instead; that is checked at its
    first batch (:func:`_teacher_column`), the earliest point its output exists.
    """
    cols = getattr(dataset, "column_names", None)
    if rollout is None and cols is not None and TEACHER_COLUMN not in cols:
        raise ValueError(f"ICSDGRPOTrainer: {_describe(dataset)} has no {TEACHER_COLUMN!r} column for the privileged "
                         f"teacher's prompt; {_TEACHER_FIX}")


def _teacher_column(example: dict) -> Any:
    if TEACHER_COLUMN not in example:  # a rollout_func that returned no teacher_prompt_ids
        raise ValueError(f"ICSDGRPOTrainer: a training example (keys {', '.join(map(str, example))}) has no "
                         f"{TEACHER_COLUMN!r} column for the privileged teacher's prompt and the rollout_func returned "
                         f"no teacher_prompt_ids; {_TEACHER_FIX}")
    return example[TEACHER_COLUMN]


def _traj_base(step: int) -> int:
    """Run-unique trajectory ids: step in the high bits, row index in the low ones."""
    return int(step) << 24


class ICSDGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` + privileged self-teacher + ICSD allocation + auxiliary loss + dumps.

    Extra arguments: ``icsd`` (:class:`ICSDConfig`), ``teacher_prompt``, a function of a
    dataset example returning the privileged prompt in the example's prompt format
    (default: the example's ``teacher_prompt`` column; unused for rows whose rollout
    supplied ``teacher_prompt_ids``), and ``producer``, free keys (env, model, seed, ...)
    for the dumps' SPEC 9 ``producer`` block.  Everything else is TRL's.
    """

    def __init__(self, *args: Any, icsd: ICSDConfig | None = None,
                 teacher_prompt: Callable[[dict], Any] | None = None, producer: dict[str, Any] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.icsd = icsd or ICSDConfig()
        if teacher_prompt is None:
            _check_teacher_column(self.train_dataset, rollout=self.rollout_func)
        self.teacher_prompt = teacher_prompt or _teacher_column
        self._icsd_capture = False
        self._icsd_logps: torch.Tensor | None = None
        #: while TRL scores a generation batch: (log-probs, entropies) of each policy pass it makes
        self._icsd_passes: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.icsd_last: PaddedAllocation | None = None  # the last allocation (tests, debugging)
        self._writer = None
        if self.args.steps_per_generation != self.args.gradient_accumulation_steps or self.num_iterations != 1:
            warnings.warn("ICSDGRPOTrainer allocates once per generation batch with ratio 1; with "
                          f"steps_per_generation={self.args.steps_per_generation} != gradient_accumulation_steps="
                          f"{self.args.gradient_accumulation_steps} or num_iterations={self.num_iterations} != 1 the "
                          "later optimizer steps use that allocation (docs/engines.md)", stacklevel=2)
        if self.icsd.dump_dir is not None and self.accelerator.is_main_process:
            # one allocation per generation batch: one actor mini-batch with TRL's defaults, else several
            one_step = self.args.steps_per_generation == self.args.gradient_accumulation_steps and self.num_iterations == 1
            self._writer = dump_writer(self.icsd.dump_dir, rank=self.accelerator.process_index,
                                       world_size=self.accelerator.num_processes,
                                       producer={"name": "icsd.trl", "engine": "trl", "engine_version": trl.__version__,
                                                 **(producer or {})},
                                       allocation=self.icsd.allocator_block(
                                           alloc_scope="mini-batch" if one_step else "global", ratio_source="fixed-1"))

    def icsd_batch_id(self) -> int:
        """The dumps' ``batch_id`` of the generation batch about to be allocated: from the training step.

        One generation batch per optimizer step or fewer (TRL's default): the optimizer step
        it starts (``state.global_step``), which a resumed run (``resume_from_checkpoint``,
        ``icsd train --engine trl --resume``) restores, so ids never restart at 0. Several
        per optimizer step: the micro-step's number, ``global_step * gradient_accumulation_steps
        + i``. Either way unique within a run and the same on a redone step.
        """
        ga = self.args.gradient_accumulation_steps
        if (self.args.steps_per_generation * self.num_iterations) % ga == 0:
            return int(self.state.global_step)
        return int(self.state.global_step) * ga + self._step % ga

    # ------------------------------------------------------------------ teacher pass + allocation
    def _score(self, prompt_ids: list[list[int]], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
               batch_size: int, *, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropies or None) of the completions behind ``prompt_ids``, from one no-grad pass."""
        from trl.trainer.utils import pad

        dev = completion_ids.device
        p = pad([torch.tensor(x) for x in prompt_ids], padding_value=self._tokenizer.pad_token_id, padding_side="left").to(dev)
        pm = pad([torch.ones(len(x), dtype=torch.long) for x in prompt_ids], padding_value=0, padding_side="left").to(dev)
        with torch.no_grad():
            logps, ent, _ = self._get_per_token_logps_and_entropies(
                self.model, torch.cat([p, completion_ids], 1), torch.cat([pm, completion_mask], 1),
                completion_ids.size(1), batch_size, compute_entropy=entropy)
        return logps, ent

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._icsd_passes = [] if self.model.training else None
        try:
            out = super()._generate_and_score_completions(inputs)
            passes = self._icsd_passes
        finally:
            self._icsd_passes = None
        if not self.model.training:
            return out
        acc = self.accelerator
        comp, cmask = out["completion_ids"], out["completion_mask"]
        mask = cmask if out.get("tool_mask") is None else cmask * out["tool_mask"]
        bs = self.args.per_device_train_batch_size
        if "teacher_prompt_ids" in inputs[0]:  # the rollout_func built them (the engine's episodes, trl_rollout)
            t_ids = [list(x["teacher_prompt_ids"]) for x in inputs]
        else:
            t_ids, _, _ = self._tokenize_prompts([self.teacher_prompt(x) for x in inputs])
        teacher, _ = self._score(t_ids, comp, cmask, bs)
        student = out.get("old_per_token_logps")
        # the entropy of the pass that gave the student log-probs (None: that pass was not TRL's policy pass)
        entropy = next((e for lp, e in passes or () if lp is student), None) if student is not None else None
        if student is None:  # TRL skips it on-policy; the allocation needs delta = T - logp
            p_ids = [row[m.bool()].tolist() for row, m in zip(out["prompt_ids"], out["prompt_mask"])]
            student, entropy = self._score(p_ids, comp, cmask, bs, entropy=True)
        adv = out["advantages"]

        # gather the generation batch of every process, allocate it once, keep our slice
        T_local, B_local = comp.size(1), comp.size(0)
        g_mask = acc.gather(acc.pad_across_processes(mask, dim=1, pad_index=0))
        g_adv = acc.gather(adv if adv.dim() == 1 else acc.pad_across_processes(adv, dim=1))
        g_stu = acc.gather(acc.pad_across_processes(student, dim=1))
        g_tea = acc.gather(acc.pad_across_processes(teacher, dim=1))
        g_ent = None if entropy is None else acc.gather(acc.pad_across_processes(entropy.float(), dim=1))
        B = g_mask.size(0)
        batch_id = self.icsd_batch_id()
        traj = torch.arange(B, device=g_mask.device) + _traj_base(batch_id)
        # bad values stop here, naming the input and the generation batch's row, before anything is written
        gm = check_mask("completion_mask", g_mask)
        for name, x in (("advantages", g_adv), ("student log-probs", g_stu), ("teacher log-probs", g_tea)):
            check_values(name, x, gm)
        if g_ent is not None:
            check_values("student entropies", g_ent, gm)
        delta = (g_tea - g_stu).float()
        turns = turn_ids_from_mask(g_mask.bool())
        alloc = allocate_padded(advantage=g_adv, ratio=1.0, delta=delta, response_mask=g_mask.bool(), traj_id=traj,
                                turn_id=turns, batch_id=batch_id, settings=self.icsd)
        lo = acc.process_index * B_local
        out["icsd_c"] = alloc.c[lo:lo + B_local, :T_local].to(student.dtype)
        out["icsd_teacher_logps"] = teacher
        self.icsd_last = alloc
        mode = "train"
        self._metrics[mode]["icsd/tcm_icsd"].append(tcm(alloc.c, alloc.u, delta, gm, self.icsd.eps))
        self._metrics[mode]["icsd/tcm_sdar"].append(tcm(alloc.g, alloc.u, delta, gm, self.icsd.eps))
        self._metrics[mode]["icsd/delta_mean"].append(float(delta[gm].mean()) if gm.any() else 0.0)
        self._metrics[mode]["icsd/fallback_share"].append(alloc.diagnostics.fallback_share)
        if self._writer is not None:
            extra = {"logp": g_stu.float(), "teacher_logp": g_tea.float(),
                     "step": torch.full((B,), int(self.state.global_step)), "row": torch.arange(B)}
            if g_ent is not None:
                extra["entropy"] = g_ent
            write_dump(self._writer, alloc, batch_id=batch_id, traj_id=traj, advantage=g_adv, ratio=1.0,
                       delta=delta, response_mask=gm, extra=extra)
        return out

    # ------------------------------------------------------------------ loss
    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any):  # type: ignore[override]
        if self._icsd_passes is not None and model is self.model and len(args) < 5 and not kwargs.get("compute_entropy"):
            # TRL scoring a generation batch with the policy: its fused head computes the entropy with the
            # log-probs anyway, so keep it for the dump and hand TRL what it asked for
            res = super()._get_per_token_logps_and_entropies(model, *args, **{**kwargs, "compute_entropy": True})
            self._icsd_passes.append((res[0], res[1]))
            return res[0], None, res[2]
        res = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if self._icsd_capture:
            self._icsd_logps = res[0]
        return res

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if "icsd_c" not in inputs:
            return super()._compute_loss(model, inputs)
        self._icsd_capture, self._icsd_logps = True, None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._icsd_capture = False
        logps, self._icsd_logps = self._icsd_logps, None
        assert logps is not None, "TRL's loss did not compute per-token log-probs through _get_per_token_logps_and_entropies"
        cmask = inputs["completion_mask"]
        mask = cmask if "tool_mask" not in inputs else cmask * inputs["tool_mask"]
        aux = distillation_loss(logps, inputs["icsd_teacher_logps"], inputs["icsd_c"], mask,
                                batch_num_tokens=self._aux_normalizer(inputs))
        self._metrics["train" if self.model.training else "eval"]["icsd/aux_loss"].append(
            float(self.accelerator.gather(aux.detach()).sum()))
        return loss + self.icsd.distill_coef * aux

    def _aux_normalizer(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Per-process share of |B|: TRL's ``dapo`` normalizer (exact when one generation batch is one step)."""
        n = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if self.model.training:
            n = n * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return n

