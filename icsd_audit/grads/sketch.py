"""Per-token gradient sketches for the layers after the last attention (SPEC section 8).

A token's own gradient s_t = grad_theta log pi(a_t | x_t) cannot be read off one
backward of a summed loss in general, because attention carries later tokens'
losses back into earlier positions.  It can for every parameter that sits *after
the last attention*: the last block's attention output projection, its MLP and the
LM head.  From there on every operation is position-wise (linear maps, RMSNorm,
SiLU, residual adds, the final norm, the head), so the layer output y_t at position
t reaches only the logits at position t and hence only log pi(a_t | x_t).  For such
a linear layer y = W x (+ b):

    d log pi(a_t | x_t) / dW = g_t x_t^T,   g_t = d log pi(a_t | x_t) / d y_t,

and g_t is also the gradient of sum_s log pi(a_s | x_s) with respect to y_t (the
cross terms s != t vanish), so one (tail-only) backward gives g_t for all tokens at
once.  For the LM head with sampling temperature T the output factor needs no
backward at all: g_t = (onehot(a_t) - softmax(z_t / T)) / T.

Storing g_t (d_out values) and x_t (d_in values) per token would be too much, so
each is projected with a seeded random matrix:

    u_t = P g_t  (P: k_out x d_out),    v_t = Q x_t  (Q: k_in x d_in),

with P, Q scaled so that E[P^T P] = I and E[Q^T Q] = I (Gaussian N(0, 1/k) or
Rademacher +-1/sqrt(k) entries).  Any weighted sum of per-token gradients is then
sketched offline as

    S(w) = P (sum_t w_t g_t x_t^T) Q^T = U^T diag(w) V,

and <S(w), S(w')>_F is an unbiased estimate of <d(w), d(w')>, because
E[tr(P G Q^T Q H^T P^T)] = tr(G E[Q^T Q] H^T E[P^T P]) = <G, H>_F.  A layer with a
bias is handled by appending a constant 1 to x_t, so the sketch covers (W, b).

:class:`GradientSketcher` attaches opt-in forward hooks; they keep only detached
projections (one small matmul per hook) plus, until :meth:`GradientSketcher.collect`,
a reference to the layer outputs that the autograd graph of the step holds anyway.
Nothing is retained past ``collect``/``reset``.

The stored format (projections, seeds, columns, :class:`SketchResult`) lives in
:mod:`icsd_audit.grads.sketch_format` and is re-exported here.  See ``docs/gradients.md``
for the estimator, its error and the Parquet layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from icsd_audit.grads.sketch_format import (
    DEFAULT_K,
    DENSE_GRAD_COLUMN,
    SKETCH_COLUMN_PREFIX,
    SKETCH_FORMAT_VERSION,
    SKETCH_METADATA_KEY,
    LayerSketchSpec,
    ProjectionKind,
    SketchResult,
    arrow_fixed_size_list,
    layer_seed,
    projection_matrix,
    sketch_column_names,
)

__all__ = [
    "DEFAULT_K",
    "DENSE_GRAD_COLUMN",
    "SKETCH_COLUMN_PREFIX",
    "SKETCH_METADATA_KEY",
    "LayerSketchSpec",
    "SketchResult",
    "GradientSketcher",
    "auto_layers",
    "layer_seed",
    "projection_matrix",
    "sketch_column_names",
    "token_logprobs_from_logits",
    "shift_response_mask",
    "arrow_fixed_size_list",
]

GradSource = Literal["collect", "backward"]

_LM_HEAD = "lm_head"
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
_ATTN_OUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj")
# rows x vocabulary elements per chunk when projecting LM-head output factors
_CHUNK_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------- helpers


def token_logprobs_from_logits(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T)[target] per position, in float32; (B, T, V), (B, T) -> (B, T).

    ``targets`` are aligned with the logit positions (target at t = token t+1);
    negative targets (padding) give 0.
    """
    z = logits.float() / float(temperature)
    safe = targets.clamp_min(0).long()
    lp = torch.log_softmax(z, dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return lp.masked_fill(targets < 0, 0.0)


def shift_response_mask(input_ids: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """From token-level inputs to logit positions: (targets, position_mask).

    ``response_mask[b, j]`` marks token j as a response (action) token; the logit
    that predicts it sits at position j - 1.  Returns ``targets[b, t] = input_ids[b, t+1]``
    (-1 at the last position) and ``position_mask[b, t] = response_mask[b, t+1]``.
    """
    if input_ids.shape != response_mask.shape:
        raise ValueError("input_ids and response_mask must have the same (B, T) shape")
    targets = torch.full_like(input_ids, -1)
    targets[:, :-1] = input_ids[:, 1:]
    pos = torch.zeros_like(response_mask, dtype=torch.bool)
    pos[:, :-1] = response_mask[:, 1:].bool()
    return targets, pos


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder blocks (``...layers`` / ``...h`` / ``...blocks``), longest first."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        is_blocks = isinstance(mod, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks")
        if is_blocks and len(mod) > 0 and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None:
        raise ValueError("could not find the decoder blocks (a ModuleList named layers/h/blocks); pass layers=[...]")
    return best


def _lm_head_name(model: nn.Module) -> str:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, mod in model.named_modules():
        if (head is not None and mod is head) or (head is None and name.split(".")[-1] == _LM_HEAD):
            if not isinstance(mod, nn.Linear):
                raise ValueError(f"output head {name!r} is {type(mod).__name__}, not nn.Linear")
            return name
    raise ValueError("could not find the LM head; pass layers=[...] explicitly")


def auto_layers(model: nn.Module) -> list[str]:
    """LM head + the last block's attention output projection and MLP linears.

    Works for Llama/Qwen/Mistral-style Hugging Face models (``self_attn.o_proj``,
    ``mlp.{gate,up,down}_proj``), also under peft's LoRA wrappers (their ``base_layer``:
    the sketch is then the gradient with respect to the frozen base weight, the same
    direction a full fine-tune would take).  Raises when the last block holds none of them.
    """
    blocks_name, blocks = find_decoder_layers(model)
    last = f"{blocks_name}.{len(blocks) - 1}"
    names: list[str] = []
    for sub, mod in blocks[len(blocks) - 1].named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        parts = sub.split(".")
        if parts[-1] == "base_layer":  # a LoRA-wrapped linear (peft): sketch its frozen base weight
            parts = parts[:-1]
        leaf = parts[-1]
        parent = parts[0] if len(parts) > 1 else ""
        if leaf in _MLP_NAMES or (leaf in _ATTN_OUT_NAMES and "attn" in parent):
            names.append(f"{last}.{sub}")
    if not names:
        raise ValueError(f"no o_proj / MLP linear found in {last}; pass layers=[...] explicitly")
    return [_lm_head_name(model)] + names


# --------------------------------------------------------------------------- the hooks


class GradientSketcher:
    """Opt-in per-token gradient sketches for the layers after the last attention.

    Usage inside a training step (``grad_source="collect"``, the default)::

        sk = GradientSketcher(model, k_out=128, k_in=128, seed=0, temperature=T)
        with sk:                                   # attach(); detach() on exit
            logits = model(input_ids, attention_mask=am).logits
            logp = token_logprobs_from_logits(logits, targets, T)   # the trainer has this
            res = sk.collect(position_mask, targets=targets, logp=logp)  # graph kept
            loss.backward()                           # the trainer's own backward, unchanged

    ``collect`` gets d logp_t / d y_t for the sketched layers' outputs with one
    ``torch.autograd.grad`` over the tail of the network only (from the LM head's
    input when ``targets`` are given, else from ``logp``); it does not touch ``.grad``
    and keeps the graph for the trainer.  When only the LM head is sketched and
    ``targets`` are given, no backward runs at all.

    ``grad_source="backward"``: the output factors are taken by tensor hooks from the
    next backward the caller runs, which must be the backward of sum_t mask_t * logp_t
    (e.g. a dedicated sketch pass); then ``collect(mask)`` only gathers rows.

    Not supported: activation checkpointing of the last block (the recomputed
    forward is not the one the hooks saw) and tensor/pipeline-parallel sharded layers.
    With tied input/output embeddings the LM-head sketch covers the head's use of the
    shared matrix only (``metadata["tied_lm_head"]``).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: str | Iterable[str] = "auto",
        k_out: int = DEFAULT_K,
        k_in: int = DEFAULT_K,
        seed: int = 0,
        temperature: float = 1.0,
        projection: ProjectionKind = "gaussian",
        grad_source: GradSource = "collect",
    ) -> None:
        if temperature <= 0:
            raise ValueError("temperature must be positive")
        if grad_source not in ("collect", "backward"):
            raise ValueError("grad_source must be 'collect' or 'backward'")
        self.model = model
        self.temperature = float(temperature)
        self.projection: ProjectionKind = projection
        self.seed = int(seed)
        self.grad_source: GradSource = grad_source
        names = auto_layers(model) if layers == "auto" else [str(n) for n in layers]  # type: ignore[union-attr]
        if not names:
            raise ValueError("no layers to sketch")
        if len(set(names)) != len(names):
            raise ValueError("duplicate layer names")
        modules = dict(model.named_modules())
        head_name = _lm_head_name(model)
        self._head_name = head_name
        self._modules: dict[str, nn.Linear] = {}
        self.specs: dict[str, LayerSketchSpec] = {}
        for n in names:
            mod = modules.get(n)
            if not isinstance(mod, nn.Linear):
                raise ValueError(f"layer {n!r} is {type(mod).__name__ if mod is not None else 'missing'}, need nn.Linear")
            has_bias = mod.bias is not None
            d_out, d_in = mod.out_features, mod.in_features + int(has_bias)
            ko, ki = (d_out, d_in) if projection == "identity" else (int(k_out), int(k_in))
            self._modules[n] = mod
            self.specs[n] = LayerSketchSpec(
                name=n, d_out=d_out, d_in=d_in, has_bias=has_bias, k_out=ko, k_in=ki,
                seed_out=layer_seed(seed, n, "out"), seed_in=layer_seed(seed, n, "in"),
                is_lm_head=(n == head_name),
            )
        self._head_module = modules[head_name]
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.tied_lm_head = bool(
            emb is not None and getattr(emb, "weight", None) is not None and emb.weight is self._head_module.weight
        )
        self._proj_cpu: dict[tuple[str, str], Tensor] = {}
        self._proj_dev: dict[tuple[str, str, torch.device], Tensor] = {}
        self._handles: list[Any] = []
        self._in: dict[str, Tensor] = {}       # projected inputs (B, T, k_in), detached
        self._out: dict[str, Tensor] = {}      # layer outputs, graph-connected (collect mode)
        self._gout: dict[str, Tensor] = {}     # projected output grads (B, T, k_out) (backward mode)
        self._logits: Tensor | None = None     # LM-head output, detached
        self._head_input: Tensor | None = None  # LM-head input, graph-connected

    # ---------------------------------------------------------------- lifecycle

    @property
    def layer_names(self) -> list[str]:
        return list(self.specs)

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> GradientSketcher:
        if self._handles:
            return self
        for n, mod in self._modules.items():
            self._handles.append(mod.register_forward_hook(self._make_hook(n)))
        if self._head_name not in self._modules:
            self._handles.append(self._head_module.register_forward_hook(self._logits_hook))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()

    def reset(self) -> None:
        """Drop everything captured since the last forward (references to the graph included)."""
        self._in.clear()
        self._out.clear()
        self._gout.clear()
        self._logits = None
        self._head_input = None

    def __enter__(self) -> GradientSketcher:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def parameter_names(self) -> list[str]:
        """Names of the parameters the sketch covers (weights, and biases where present)."""
        out = []
        for n, spec in self.specs.items():
            out.append(f"{n}.weight")
            if spec.has_bias:
                out.append(f"{n}.bias")
        return out

    @property
    def metadata(self) -> dict[str, Any]:
        """Everything an offline reader needs: projection kind, seeds, dims, layer names, T."""
        return {
            "format": "icsd.sketch",
            "version": SKETCH_FORMAT_VERSION,
            "projection": self.projection,
            "projection_scale": "entries have variance 1/k (E[P^T P] = I); identity is exact",
            "seed": self.seed,
            "seed_derivation": "sha256('icsd-sketch:{seed}:{layer}:{side}')[:8] little-endian & (2^63-1)",
            "temperature": self.temperature,
            "estimator": "<d(w), d(w')> ~= sum_layers <U^T diag(w) V, U^T diag(w') V>_F (unbiased)",
            "tied_lm_head": self.tied_lm_head,
            "layers": [s.as_dict() for s in self.specs.values()],
        }

    # ---------------------------------------------------------------- projections

    def projection_for(self, layer: str, side: str, device: torch.device | str | None = None) -> Tensor:
        """The (k, d) float32 projection of ``layer``'s ``side`` ("out" or "in"), cached per device."""
        spec = self.specs[layer]
        key = (layer, side)
        if key not in self._proj_cpu:
            k, d, s = (spec.k_out, spec.d_out, spec.seed_out) if side == "out" else (spec.k_in, spec.d_in, spec.seed_in)
            self._proj_cpu[key] = projection_matrix(self.projection, k, d, s)
        mat = self._proj_cpu[key]
        if device is None or torch.device(device) == mat.device:
            return mat
        dkey = (layer, side, torch.device(device))
        if dkey not in self._proj_dev:
            self._proj_dev[dkey] = mat.to(device)
        return self._proj_dev[dkey]

    # ---------------------------------------------------------------- hooks

    def _project_in(self, layer: str, x: Tensor) -> Tensor:
        spec = self.specs[layer]
        q = self.projection_for(layer, "in", x.device)
        xf = x.detach().float()
        if spec.has_bias:
            return xf @ q[:, :-1].T + q[:, -1]
        return xf @ q.T

    def _project_out(self, layer: str, g: Tensor) -> Tensor:
        """(..., d_out) -> (..., k_out) in float32, in row chunks (LM head rows are vocab-wide)."""
        p = self.projection_for(layer, "out", g.device)
        flat = g.detach().reshape(-1, g.shape[-1])
        rows = max(1, _CHUNK_ELEMENTS // max(1, flat.shape[-1]))
        parts = [flat[i : i + rows].float() @ p.T for i in range(0, flat.shape[0], rows)]
        out = torch.cat(parts) if parts else flat.new_zeros((0, p.shape[0]), dtype=torch.float32)
        return out.reshape(*g.shape[:-1], p.shape[0])

    def _make_hook(self, layer: str):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            x = args[0] if args else None
            if not isinstance(x, Tensor) or not isinstance(output, Tensor):
                raise TypeError(f"sketched layer {layer!r} must be called with a tensor input and return a tensor")
            self._in[layer] = self._project_in(layer, x)
            self._gout.pop(layer, None)
            if layer == self._head_name:
                self._logits = output.detach()
                self._head_input = x
            if self.grad_source == "collect":
                self._out[layer] = output
            elif output.requires_grad:
                def grad_hook(grad: Tensor, _layer: str = layer) -> None:
                    self._gout[_layer] = self._project_out(_layer, grad)
                output.register_hook(grad_hook)
        return hook

    def _logits_hook(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        self._logits = output.detach()
        self._head_input = args[0] if args and isinstance(args[0], Tensor) else None
        if self.grad_source == "collect":
            self._out[self._head_name] = output

    # ---------------------------------------------------------------- collection

    def collect(
        self,
        mask: Tensor | None = None,
        *,
        targets: Tensor | None = None,
        logp: Tensor | None = None,
        retain_graph: bool = True,
    ) -> SketchResult:
        """Per-token factors for the positions in ``mask`` (B, T) of the last forward.

        ``mask`` marks logit positions (see :func:`shift_response_mask`); ``None`` means
        all.  ``targets`` (B, T) are the sampled next tokens at each position; ``logp``
        (B, T) the differentiable log pi(a_t | x_t) at temperature T.  The positions are
        those of the head's output: after a forward with ``logits_to_keep=T`` they are
        the last T positions of the sequence (the other layers are read there).

        With ``targets`` (recommended; pass ``logp`` too when the trainer has it), the
        head works from its forward output alone: one softmax per masked row gives its
        output factor and d logp_t / d h_t = W^T (onehot - p) / T, which is fed into
        ``autograd.grad`` at the head's input, so the tail backward covers only the
        last block's position-wise layers and the masked rows.  ``logp``, when given
        with ``targets``, is checked against the head's output (a model that
        post-processes its logits, e.g. soft-capping, is rejected: call with ``logp``
        only, which differentiates the caller's own log-probs).  Clears the capture.
        """
        if not self._in:
            raise RuntimeError("nothing captured: attach() the sketcher and run a forward pass first")
        try:
            return self._collect(mask, targets, logp, retain_graph)
        finally:
            self.reset()

    def _collect(self, mask, targets, logp, retain_graph) -> SketchResult:
        any_in = next(iter(self._in.values()))
        # the LM head's positions are the sketch's positions: with Hugging Face's
        # ``logits_to_keep`` the head runs on the last positions only (see :meth:`_tail`)
        shape = tuple((self._logits if self._logits is not None else any_in).shape[:-1])
        dev = any_in.device
        if mask is None:
            mask = torch.ones(shape, dtype=torch.bool, device=dev)
        mask = mask.to(dev).bool()
        if tuple(mask.shape) != shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match the captured positions {shape}")
        if targets is not None:
            targets = targets.to(dev)
            if tuple(targets.shape) != shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} does not match {shape}")
            if bool((targets[mask] < 0).any()):
                raise ValueError("a masked position has a negative (padding) target")
        if logp is not None and tuple(logp.shape) != shape:
            raise ValueError(f"logp shape {tuple(logp.shape)} does not match {shape}")

        head = self._head_name
        inner = [n for n in self.specs if n != head]
        sketch_head = head in self.specs
        collect_inner = bool(inner) and self.grad_source == "collect"
        if self.grad_source == "backward":
            missing = [n for n in self.specs if n not in self._gout and not (n == head and targets is not None)]
            if missing:
                raise RuntimeError(f"no backward captured for {missing}; run the backward of sum(mask*logp) first")

        head_u: Tensor | None = None
        grads: dict[str, Tensor] = {}
        if targets is not None:
            # forward-only head: softmax once per row chunk gives the head's output factor,
            # and (for the inner layers) d logp_t / d h_t = W^T (onehot - p) / T on the masked
            # rows only, which is fed into the graph below the head instead of a backward
            # through the vocabulary-wide log-softmax and head for every position
            want_gh = collect_inner and self._head_input is not None and self._head_input.requires_grad
            head_u, g_h, lp_chk = self._head_analytic(mask, targets, want_u=sketch_head, want_gh=want_gh)
            if logp is not None:
                diff = (logp.detach()[mask].float() - lp_chk).abs()
                if diff.numel() and float(diff.max()) > 1e-3 * (1 + float(lp_chk.abs().max())):
                    raise ValueError(
                        "logp does not equal log_softmax(lm_head output / T)[target]: the model post-processes "
                        "its logits, or the temperature/targets differ; call collect(mask, logp=logp) without targets"
                    )
            if want_gh and g_h is not None:
                outs = [self._out[n] for n in inner]
                full = torch.zeros_like(self._head_input)
                full[mask] = g_h.to(full.dtype)
                gs = torch.autograd.grad(self._head_input, outs, grad_outputs=full, retain_graph=retain_graph, allow_unused=True)
                grads = {n: (torch.zeros_like(o) if g is None else g) for n, o, g in zip(inner, outs, gs)}
                collect_inner = False
        need = [n for n in self.specs if n not in grads and not (n == head and head_u is not None)]
        if need and self.grad_source == "collect":
            if logp is None:
                if targets is None or head not in self._out:
                    raise ValueError("collect() needs logp, or targets with the LM head output captured")
                logp = token_logprobs_from_logits(self._out[head], targets, self.temperature)
            outs = [self._out[n] for n in need]
            if not all(o.requires_grad for o in outs):
                raise RuntimeError("sketched layer outputs do not require grad (forward ran under no_grad?)")
            objective = (logp * mask.to(logp.dtype)).sum()
            gs = torch.autograd.grad(objective, outs, retain_graph=retain_graph, allow_unused=True)
            for n, o, g in zip(need, outs, gs):
                grads[n] = torch.zeros_like(o) if g is None else g

        layers: dict[str, tuple[Tensor, Tensor]] = {}
        for n in self.specs:
            v = self._tail(self._in[n], shape)[mask]
            if n == head and head_u is not None:
                u = head_u
            elif n in grads:
                u = self._project_out(n, self._tail(grads[n], shape)[mask])
            else:
                u = self._tail(self._gout[n], shape)[mask]
            layers[n] = (u, v)
        return SketchResult(layers, self.metadata)

    @staticmethod
    def _tail(t: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``t`` (B, T', ...) at the head's (B, T) positions: its last T when T' > T.

        A model called with ``logits_to_keep=T`` (Hugging Face) runs the head on the last
        T positions only, so that the vocabulary projection is paid on the response
        alone, while the last block's layers run on every position.  Position-wise
        layers after the last attention make position T' - T + j of those layers the
        one whose output reaches the head's position j, so that is the row to read.
        """
        if tuple(t.shape[: len(shape)]) == shape:
            return t
        if len(shape) == 2 and t.dim() >= 3 and t.shape[0] == shape[0] and t.shape[1] > shape[1]:
            return t[:, t.shape[1] - shape[1] :]
        raise ValueError(f"a sketched layer saw positions {tuple(t.shape[:-1])}, the LM head {shape}: "
                         "the head may run on the last positions only (logits_to_keep), not on more")

    def _head_analytic(
        self, mask: Tensor, targets: Tensor, want_u: bool, want_gh: bool
    ) -> tuple[Tensor | None, Tensor | None, Tensor]:
        """For the masked rows, from the captured logits z (row chunks, float32):

        u_t = P (onehot(a_t) - softmax(z_t / T)) / T   (the head's output factor),
        g_t = W^T (onehot(a_t) - softmax(z_t / T)) / T (d log pi / d head input),
        log pi(a_t) = z_t[a_t] / T - logsumexp(z_t / T) (a consistency check on logp).
        """
        assert self._logits is not None
        vocab = self._logits.shape[-1]
        flat = self._logits.reshape(-1, vocab)
        idx = mask.reshape(-1).nonzero().squeeze(1)
        a = targets.reshape(-1)[idx].long()
        p_out = self.projection_for(self._head_name, "out", flat.device) if want_u else None  # (k, V)
        # (V, d) in the model's dtype: no float32 copy of a large head; for a bf16/fp16
        # model the product runs at the precision of the trainer's own backward
        w_head = self._head_module.weight.detach() if want_gh else None
        inv_t = 1.0 / self.temperature
        rows = max(1, _CHUNK_ELEMENTS // max(1, vocab))
        us, gs, lps = [], [], []
        for i in range(0, idx.numel(), rows):
            z = flat[idx[i : i + rows]].float()
            if inv_t != 1.0:
                z.mul_(inv_t)
            ai = a[i : i + rows]
            lse = torch.logsumexp(z, dim=-1)
            lps.append(z.gather(1, ai[:, None]).squeeze(1) - lse)
            prob = z.sub_(lse[:, None]).exp_()  # softmax, in place
            if p_out is not None:
                us.append((p_out[:, ai].T - prob @ p_out.T).mul_(inv_t))
            if w_head is not None:
                gs.append((w_head[ai].float() - (prob.to(w_head.dtype) @ w_head).float()).mul_(inv_t))
        k = p_out.shape[0] if p_out is not None else 0
        d = w_head.shape[1] if w_head is not None else 0
        u = (torch.cat(us) if us else flat.new_zeros((0, k), dtype=torch.float32)) if want_u else None
        g = (torch.cat(gs) if gs else flat.new_zeros((0, d), dtype=torch.float32)) if want_gh else None
        lp = torch.cat(lps) if lps else flat.new_zeros((0,), dtype=torch.float32)
        return u, g, lp
