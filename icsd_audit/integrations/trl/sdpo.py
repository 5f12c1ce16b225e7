"""ICSD or SDAR's trust inside TRL's SDPO: ``ICSDSDPOTrainer``.

An ``trl.experimental.sdpo.SDPOTrainer`` whose per-token self-distillation term (top-k, full-logit
or sampled-token divergence, as SDPO computes it) is multiplied by the allocator's coefficient
``c`` before SDPO masks, clips and averages it: SDPO's teacher, loss and weighting stay SDPO's, and
the calibration is switched on by one argument, ``icsd`` (the
:class:`~icsd_audit.integrations.core.AllocationSettings` every engine takes, e.g.
``icsd_audit.integrations.trl.ICSDConfig(allocator="sdar", dump_dir=...)``).

**Where c comes from.**  Per gradient micro-batch, from that micro-batch's own forward: the
student's and teacher's completion logits SDPO has just computed give ``logp`` and the teacher's
log-prob of each sampled token, ``delta = teacher_logp - logp`` (0 where ``distillation_mode`` is
``topk_logits`` and the sampled token is outside the student's top-k, as the dumps record it),
``ratio = exp(logp - old_logp)`` (1 when SDPO trains on-policy), the advantage is SDPO's GRPO
advantage of the row, one completion is one trajectory with one turn, and the valid tokens are
SDPO's ``completion_mask``.  ``allocator="opsd"`` gives ``c = 1`` on every token, which leaves
SDPO's loss bit for bit as it was.  With TRL's defaults (one micro-batch per optimizer step, one
process) the micro-batch is the optimizer step; otherwise each micro-batch is allocated on its own
(``alloc_scope: micro-batch``, ``batch_id = step * 10**6 + j * W + r`` for the j-th micro-batch of
the step on rank r of W, as the verl loss numbers them).

With ``icsd.dump_dir`` set the run is recorded with
:func:`~icsd_audit.integrations.trl.recorder.record` and the ``c`` column is the deployed ``c``, so
``icsd audit verify`` recomputes it from the dump.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from icsd_audit.integrations.core import AllocationSettings, allocate_padded
from icsd_audit.integrations.trl.recorder import (ACTIVE_CAPTURE, LossCapture, wrap_term_functions, record,
                                                sampled_token_logps, teacher_token_logps)

try:
    from trl.experimental.sdpo import SDPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("icsd_audit.integrations.trl.sdpo needs TRL 1.16: pip install 'icsd-audit[trl]'") from e

__all__ = ["ICSDSDPOTrainer", "micro_batch_id"]


def micro_batch_id(step: int, j: int, *, rank: int, world_size: int) -> int:
    """``batch_id`` of the j-th micro-batch of optimizer step ``step`` on rank ``rank`` of ``world_size``."""
    return int(step) * 10**6 + int(j) * int(world_size) + int(rank)


class ICSDSDPOTrainer(SDPOTrainer):
    """``SDPOTrainer`` whose per-token distillation term is weighted by the allocator's ``c`` (see the module).

    Extra arguments: ``icsd`` (allocation settings; default ``AllocationSettings()``: ICSD with
    SPEC defaults; a ``dump_dir`` attribute, as :class:`~icsd_audit.integrations.trl.ICSDConfig`
    has, records the run there) and ``producer`` (free keys for the dumps' ``producer`` block).
    The settings' ``distill_coef`` is not used: SDPO's ``distillation_weight`` weighs the term.
    """

    def __init__(self, *args: Any, icsd: AllocationSettings | None = None,
                 producer: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.icsd = icsd or AllocationSettings()
        self._icsd_counter = (-1, 0)  # (step, micro-batches allocated in it)
        self.icsd_last: Any = None  # the last micro-batch's PaddedAllocation (tests, debugging)
        self.icsd_last_tokens: Any = None  # (logp, teacher_logp) that allocation read
        wrap_term_functions(SDPOTrainer.__module__)
        dump_dir = getattr(self.icsd, "dump_dir", None)
        if dump_dir is not None:
            record(self, dump_dir, producer=producer)

    def icsd_allocation(self) -> dict[str, Any]:
        """The SPEC 9 ``allocator`` block of the deployed weighting (read by ``record``)."""
        from icsd_audit.dumps.provenance import deployed_block

        return deployed_block(self.icsd.allocator_settings(), alloc_scope="micro-batch", ratio_source="own-forward",
                              **{"lambda": float(self.args.distillation_weight)})

    def _icsd_batch_id(self) -> int:
        step = int(self.state.global_step)
        last, j = self._icsd_counter
        j = j if step == last else 0
        self._icsd_counter = (step, j + 1)
        acc = self.accelerator
        return micro_batch_id(step, j, rank=acc.process_index, world_size=acc.num_processes)

    def icsd_coefficients(self, inputs: Mapping[str, Any], dl: Any, *, batch_id: int) -> Tensor:
        """``[B, T]`` float64 ``c`` of one micro-batch from SDPO's completion logits (no forward pass)."""
        ids = dl.completion_ids
        mask = inputs["completion_mask"].bool()
        with torch.no_grad():
            logp = sampled_token_logps(dl.student_logits, ids).float()
            t = teacher_token_logps(self, dl.student_logits, dl.teacher_logits, ids).float()
            delta = torch.where(torch.isnan(t), torch.zeros_like(t), t - logp)
            old = inputs.get("old_per_token_logps")
            ratio: Tensor | float = 1.0 if old is None else torch.exp(logp - old.float())
            B = ids.size(0)
            alloc = allocate_padded(advantage=inputs["advantages"].float(), ratio=ratio, delta=delta,
                                    response_mask=mask, traj_id=torch.arange(B, device=ids.device),
                                    batch_id=batch_id, settings=self.icsd.allocator_settings())
        self.icsd_last = alloc
        self.icsd_last_tokens = (logp, t)  # what c was computed from: record() writes these very values
        return alloc.c

    def _compute_self_distillation_loss(self, model: Any, inputs: Any, distillation_logits: Any) -> Tensor:
        cap = ACTIVE_CAPTURE.get()
        token = None
        if cap is None:  # not recorded: a capture of our own carries the scale to the divergence's output
            cap = LossCapture()
            token = ACTIVE_CAPTURE.set(cap)
        try:
            if self.model.training:
                bid = self._icsd_batch_id()
                c = self.icsd_coefficients(inputs, distillation_logits, batch_id=bid)
                logp, t = self.icsd_last_tokens
                cap.extra.update(c=c, batch_id=bid, logp=logp, teacher_logp=t)
                c32 = c.to(distillation_logits.student_logits.dtype)
                cap.scale = lambda term: term * c32
            return super()._compute_self_distillation_loss(model, inputs, distillation_logits)
        finally:
            cap.scale = None
            if token is not None:
                ACTIVE_CAPTURE.reset(token)
