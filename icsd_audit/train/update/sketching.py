"""Opt-in per-token gradient sketches in the training dumps (``sketch_k > 0``).

The sketch of a dumped mini-batch is taken in the actor's *gradient* micro-batches,
on the forward the trainer runs anyway, at the weights the mini-batch's gradient is
computed at (before its optimizer step).  The no-grad ratio pre-pass cannot serve:
the output factors of the layers inside the last block need autograd.

Per micro-batch, :class:`~icsd_audit.grads.sketch.GradientSketcher` costs (see
docs/gradients.md for the derivation and docs/training.md for measured figures):

* in the forward, one (tokens x d_in) @ (d_in x k) product per sketched layer;
* in :meth:`~icsd_audit.grads.sketch.GradientSketcher.collect`, on the response tokens only:
  one softmax over the vocabulary and the products with the head's output projection
  (k columns) and with W_head (d columns), then one ``torch.autograd.grad`` from the
  head's input back to the last block's o_proj/MLP outputs (position-wise layers
  only; ``.grad`` untouched, the graph kept for the trainer's backward), then one
  (tokens x d_out) @ (d_out x k) product per layer.

The training loss, its gradients and the optimizer step are unchanged (tested bit for
bit).  Rows come out in the gradient pass's token layout (micro-batch order, then row,
then position), which is the layout of every other column the actor hands the dump
writer; the writer sorts all columns together.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from icsd_audit.grads.sketch import GradientSketcher, SketchResult
from icsd_audit.train.config import ConfigError
from icsd_audit.train.update.logprobs import Packed

__all__ = ["dump_sketch_metadata", "make_sketcher", "parse_layers", "response_sketch"]


def parse_layers(text: str) -> str | list[str]:
    """``'auto'`` or a comma-separated list of module names -> the sketcher's ``layers``."""
    t = text.strip()
    if t == "auto":
        return "auto"
    return [n.strip() for n in t.split(",") if n.strip()]


def make_sketcher(cfg: Any, model: Any) -> GradientSketcher | None:
    """The run's sketcher (not attached), or None when ``cfg.sketch_k == 0``.

    Layer-name problems only show once the model is loaded; they are raised as a
    :class:`ConfigError` that lists the model's linear layers to pick from.
    """
    if int(cfg.sketch_k) <= 0:
        return None
    try:
        return GradientSketcher(model, layers=parse_layers(cfg.sketch_layers), k_out=cfg.sketch_k, k_in=cfg.sketch_k,
                                seed=cfg.sketch_seed, temperature=cfg.temperature)
    except ValueError as err:
        linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        tail = ", ".join(linear[-8:])
        raise ConfigError([f"sketch_layers={cfg.sketch_layers!r}: {err}; use 'auto' or names of linear layers after "
                           f"the last attention, e.g. {tail}"]) from None


def dump_sketch_metadata(sketcher: GradientSketcher) -> dict[str, Any]:
    """The ``sketch`` entry of the dump metadata: the sketcher's own, plus where rows come from."""
    return {**sketcher.metadata,
            "rows": ("one per dump row (response token), from the actor's gradient micro-batches at the weights "
                     "before the mini-batch's optimizer step")}


def response_sketch(sketcher: GradientSketcher, packed: Packed, logp: Tensor) -> SketchResult:
    """Sketch of the response tokens of the micro-batch whose forward just ran.

    ``logp`` is :func:`~icsd_audit.train.update.logprobs.response_logprobs`' (B, R) output.
    That forward keeps the last R + 1 logits (``logits_to_keep``); head position j < R
    predicts response token j and position R predicts nothing, so the mask and targets
    get one extra False / -1 column.  ``logp`` only checks that the head's output is what
    the loss used (a model that post-processes its logits is refused).
    """
    b = packed.response_ids.shape[0]
    rmask = packed.response_mask.bool()
    no = torch.zeros((b, 1), dtype=torch.bool, device=rmask.device)
    mask = torch.cat([rmask, no], dim=1)
    targets = torch.cat([packed.response_ids.masked_fill(~rmask, -1), torch.full_like(no, -1, dtype=torch.long)], dim=1)
    lp = torch.cat([logp.detach(), torch.zeros((b, 1), dtype=logp.dtype, device=logp.device)], dim=1)
    return sketcher.collect(mask, targets=targets, logp=lp)
