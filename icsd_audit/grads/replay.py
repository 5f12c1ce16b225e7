"""Exact replay of SPEC section 8 through a model: full-parameter gradient cosines.

For validation and small models.  Given a causal LM, a padded batch of token ids
with a response mask and per-token weightings, :func:`replay_cosines` computes the
exact gradient of sum_t w_t log pi(a_t | x_t) for each weighting with one backward
each (after one shared forward) and the cosine of each with the RL direction —
over all trainable parameters or a named subset (e.g. the sketched layers, from
:meth:`icsd_audit.grads.sketch.GradientSketcher.parameter_names`).  Gradients are taken
with ``torch.autograd.grad``: the model's ``.grad`` fields are never touched.

:func:`per_token_gradients` is the slow reference (one backward per token) used by
the tests to check the sketches' exact identity.

Token order: rows of flat weights are the positions of ``position_mask`` in
row-major (batch, position) order, the order :class:`~icsd_audit.grads.sketch.SketchResult`
uses.  Positions are logit positions: position t predicts token t + 1
(:func:`icsd_audit.grads.sketch.shift_response_mask`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from icsd_audit.grads.sketch import shift_response_mask, token_logprobs_from_logits

__all__ = [
    "per_token_gradients",
    "replay_cosines",
    "select_parameters",
    "token_logprobs",
    "weighted_gradients",
]


def _flat(plist: Sequence[Tensor], grads: Sequence[Tensor | None], dtype: torch.dtype) -> Tensor:
    """Concatenate per-parameter gradients into one vector (zeros for unused parameters)."""
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).to(dtype) for p, g in zip(plist, grads)])


def select_parameters(model: nn.Module, names: Iterable[str] | None = None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs: all trainable ones (deduplicated, tied weights once) or ``names``."""
    params = dict(model.named_parameters())  # named_parameters already drops tied duplicates
    if names is None:
        return [(n, p) for n, p in params.items() if p.requires_grad]
    out = []
    all_named = dict(model.named_parameters(remove_duplicate=False))
    for n in names:
        if n not in all_named:
            raise KeyError(f"model has no parameter {n!r}")
        out.append((n, all_named[n]))
    return out


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
    targets: Tensor | None = None,
) -> Tensor:
    """Differentiable log pi(targets | prefix) at every logit position, (B, T).

    ``targets`` default to the next tokens (``input_ids`` shifted left, -1 at the end).
    """
    if targets is None:
        targets, _ = shift_response_mask(input_ids, torch.ones_like(input_ids, dtype=torch.bool))
    kwargs = {"attention_mask": attention_mask} if attention_mask is not None else {}
    logits = model(input_ids=input_ids, **kwargs).logits
    return token_logprobs_from_logits(logits, targets, temperature)


def _position_weights(weights: Tensor, position_mask: Tensor) -> Tensor:
    """Flat (n,) / (n, P) weights (rows = masked positions) or per-position (P, B, T) -> (P, B, T)."""
    w = torch.as_tensor(weights)
    shape = tuple(position_mask.shape)
    if w.dim() == 3:
        if tuple(w.shape[1:]) != shape:
            raise ValueError(f"per-position weights must be (P, {shape[0]}, {shape[1]}), got {tuple(w.shape)}")
        return w * position_mask.to(w.dtype)
    if w.dim() == 1:
        w = w[:, None]
    n = int(position_mask.sum())
    if w.dim() != 2 or w.shape[0] != n:
        raise ValueError(f"weights must be (n,) or (n, P) with n={n} masked positions, or (P, B, T)")
    full = torch.zeros(w.shape[1], *shape, dtype=w.dtype, device=w.device)
    full[:, position_mask.to(w.device)] = w.T
    return full


def weighted_gradients(
    model: nn.Module,
    input_ids: Tensor,
    position_mask: Tensor,
    weights: Tensor,
    *,
    attention_mask: Tensor | None = None,
    params: Iterable[str] | None = None,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Flattened exact gradients of sum_t w_t log pi(a_t | x_t), one row per weighting, (P, n_params).

    Materialises every gradient: meant for small models (see :func:`replay_cosines`
    for the streaming form).
    """
    dev = next(model.parameters()).device
    pm = position_mask.to(dev).bool()
    w = _position_weights(torch.as_tensor(weights).to(dev), pm)
    named = select_parameters(model, params)
    plist = [p for _, p in named]
    logp = token_logprobs(model, input_ids.to(dev), attention_mask, temperature)
    rows = []
    for i in range(w.shape[0]):
        obj = (logp * w[i].to(logp.dtype)).sum()
        gs = torch.autograd.grad(obj, plist, retain_graph=i + 1 < w.shape[0], allow_unused=True)
        rows.append(_flat(plist, gs, dtype))
    return torch.stack(rows)


def replay_cosines(
    model: nn.Module,
    input_ids: Tensor,
    position_mask: Tensor,
    rl_weights: Tensor,
    weight_matrix: Tensor,
    *,
    attention_mask: Tensor | None = None,
    params: Iterable[str] | None = None,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Exact cos(r, d(w_p)) over the chosen parameters, (P,) (scalar for a 1-D weight vector).

    One forward, then one backward for r and one per column of ``weight_matrix``;
    only r and the current d(w) are held, so memory is two parameter-sized vectors.
    """
    w_in = torch.as_tensor(weight_matrix)
    squeeze = w_in.dim() == 1
    dev = next(model.parameters()).device
    pm = position_mask.to(dev).bool()
    a = _position_weights(torch.as_tensor(rl_weights).to(dev), pm)
    if a.shape[0] != 1:
        raise ValueError("rl_weights must be a single weighting")
    w = _position_weights(w_in.to(dev), pm)
    plist = [p for _, p in select_parameters(model, params)]
    logp = token_logprobs(model, input_ids.to(dev), attention_mask, temperature)

    def grad_of(weight: Tensor, keep: bool) -> Tensor:
        gs = torch.autograd.grad((logp * weight.to(logp.dtype)).sum(), plist, retain_graph=keep, allow_unused=True)
        return _flat(plist, gs, dtype)

    r = grad_of(a[0], True)
    rr = r @ r
    out = torch.empty(w.shape[0], dtype=dtype)
    for i in range(w.shape[0]):
        d = grad_of(w[i], i + 1 < w.shape[0])
        den = torch.sqrt(rr * (d @ d))
        out[i] = (r @ d) / den if den > 0 else float("nan")
    return out[0] if squeeze else out


def per_token_gradients(
    model: nn.Module,
    input_ids: Tensor,
    position_mask: Tensor,
    *,
    attention_mask: Tensor | None = None,
    params: Sequence[str] | None = None,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Reference s_t for every masked position, one backward per token: (n, n_params)."""
    dev = next(model.parameters()).device
    pm = position_mask.to(dev).bool()
    plist = [p for _, p in select_parameters(model, params)]
    logp = token_logprobs(model, input_ids.to(dev), attention_mask, temperature)
    idx = pm.nonzero(as_tuple=False)
    rows = []
    for j, (b, t) in enumerate(idx.tolist()):
        gs = torch.autograd.grad(logp[b, t], plist, retain_graph=j + 1 < len(idx), allow_unused=True)
        rows.append(_flat(plist, gs, dtype))
    return torch.stack(rows) if rows else torch.zeros(0, sum(p.numel() for p in plist), dtype=dtype)
