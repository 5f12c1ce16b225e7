"""Gradient compatibility of SPEC section 8: cosines between the RL and distillation directions.

With per-token gradients s_t (or sketches of them), the RL direction is
r = sum_t a_t s_t with a_t = advantage * ratio (0 where the clipped surrogate is flat,
:func:`rl_weights`), the distillation direction for weights w is d(w) = sum_t w_t s_t,
and compatibility is cos(r, d(w)).

Two per-token sources are accepted (both have one row per token):

- a dense matrix ``G`` (n, k), e.g. the ``grad`` column of a dump: d(w) = G^T w;
- Kronecker factors ``{layer: (U (n, k1), V (n, k2))}`` from :mod:`icsd_audit.grads.sketch`:
  the sketched layer gradient is M(w) = U^T diag(w) V (k1 x k2) and
  <d(w), d(w')> = sum_layers <M(w), M(w')>_F, never materialising s_t.

Everything is vectorised over a weight matrix W (n, P) holding many weightings (SDAR,
ICSD, P permutation controls) so one call evaluates them all:

- cross terms: q_t = sum_l (U_l M_l(a) V_l^T)_tt, and <r, d(W)> = W^T q (O(n k1 k2) once);
- norms |d(w)|^2 either directly (M(w) for each column, O(n k1 k2) per column) or via the
  token Gram K = sum_l (U_l U_l^T) o (V_l V_l^T) (O(n^2 sum(k1+k2)) once, O(n^2) per
  column); ``method="auto"`` picks the cheaper for the given n, k and P.

The sketch's own error is estimated by a delete-one-block jackknife over independent
blocks of projection rows (:func:`jackknife_replicates`, :func:`sketch_error_jackknife`).

Pure torch; no model, no allocator, no I/O.  See ``docs/gradients.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from icsd_audit.stats.results import CLIP_EPS, DUAL_CLIP  # the clip settings of SPEC 6, written once

__all__ = [
    "CLIP_EPS",
    "DUAL_CLIP",
    "Factors",
    "Source",
    "as_source",
    "cosines",
    "direction_sketch",
    "factors_from_columns",
    "inner_products",
    "jackknife_replicates",
    "jackknife_se",
    "rl_weights",
    "sketch_error_jackknife",
    "surrogate_flat",
]


Factors = Mapping[str, tuple[Tensor, Tensor]]
Source = Tensor | np.ndarray | Factors | Sequence[tuple[Tensor, Tensor]]
Method = Literal["auto", "direct", "gram"]


# --------------------------------------------------------------------------- RL weights


def surrogate_flat(advantage: Tensor, ratio: Tensor, clip_eps: float = CLIP_EPS, dual_clip: float = DUAL_CLIP) -> Tensor:
    """True where the (dual-)clipped PPO surrogate has zero gradient (SPEC section 6 rule).

    Flat when A > 0 and ratio > 1 + eps, or A < 0 and ratio < 1 - eps, or A < 0 and
    ratio > dual_clip (the dual-clip cap binds).
    """
    a, r = torch.as_tensor(advantage), torch.as_tensor(ratio)
    return ((a > 0) & (r > 1 + clip_eps)) | ((a < 0) & (r < 1 - clip_eps)) | ((a < 0) & (r > dual_clip))


def rl_weights(
    advantage: Tensor,
    ratio: Tensor,
    valid: Tensor | None = None,
    clip_eps: float = CLIP_EPS,
    dual_clip: float = DUAL_CLIP,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """a_t = advantage * ratio over valid tokens, 0 where the clipped surrogate is flat.

    The flat test uses the inputs' dtype (a dump's float32), so a ratio stored as
    float32 1.2 sits exactly on the clip boundary and is not flat.
    """
    adv, rat = torch.as_tensor(advantage), torch.as_tensor(ratio)
    # the rule is evaluated in the inputs' own dtype (float32 ratio 1.2 is not > 1.2 there,
    # but would be after a cast to float64), then the product is formed in ``dtype``
    keep = ~surrogate_flat(adv, rat, clip_eps, dual_clip)
    w = adv.to(dtype) * rat.to(dtype)
    if valid is not None:
        keep = keep & torch.as_tensor(valid, device=w.device).bool()
    return torch.where(keep, w, torch.zeros_like(w))


# --------------------------------------------------------------------------- sources


class _Src:
    """Normalised source: a dense (n, k) matrix, or a list of (name, U, V) layers."""

    def __init__(self, dense: Tensor | None, layers: list[tuple[str, Tensor, Tensor]]):
        self.dense = dense
        self.layers = layers

    @property
    def n(self) -> int:
        return int(self.dense.shape[0]) if self.dense is not None else int(self.layers[0][1].shape[0])

    @property
    def device(self) -> torch.device:
        return self.dense.device if self.dense is not None else self.layers[0][1].device


def _tensor(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    return torch.as_tensor(np.asarray(x))


def as_source(source: Source, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> _Src:
    """Accept a dense (n, k) matrix or a mapping/sequence of (U, V) factor pairs."""
    if isinstance(source, _Src):
        return source
    if isinstance(source, (Tensor, np.ndarray)):
        g = _tensor(source)
        if g.dim() != 2:
            raise ValueError(f"a dense gradient sketch must be (n, k), got shape {tuple(g.shape)}")
        return _Src(g.to(device=device or g.device, dtype=dtype), [])
    items = list(source.items()) if isinstance(source, Mapping) else [(str(i), p) for i, p in enumerate(source)]
    if not items:
        raise ValueError("no sketched layers given")
    layers = []
    n = None
    for name, pair in items:
        if len(pair) != 2:
            raise ValueError(f"layer {name!r}: expected a (U, V) pair")
        u, v = _tensor(pair[0]), _tensor(pair[1])
        if u.dim() != 2 or v.dim() != 2 or u.shape[0] != v.shape[0]:
            raise ValueError(f"layer {name!r}: U and V must be (n, k1) and (n, k2) with the same n")
        if n is None:
            n = u.shape[0]
        elif u.shape[0] != n:
            raise ValueError(f"layer {name!r} has {u.shape[0]} tokens, others {n}")
        dev = device or u.device
        layers.append((name, u.to(device=dev, dtype=dtype), v.to(device=dev, dtype=dtype)))
    return _Src(None, layers)


def factors_from_columns(columns: Mapping[str, Any], prefix: str = "sketch") -> dict[str, tuple[Tensor, Tensor]]:
    """Pair up ``{prefix}.{layer}.out`` / ``{prefix}.{layer}.in`` columns into factors.

    Values may be 2-D arrays/tensors or anything ``np.asarray`` turns into (n, k)
    (e.g. a list of fixed-size lists).  Layers keep the order of their ``.out`` columns.
    """
    head = prefix + "."
    outs = [c for c in columns if c.startswith(head) and c.endswith(".out")]
    factors: dict[str, tuple[Tensor, Tensor]] = {}
    for c in outs:
        layer = c[len(head) : -len(".out")]
        cin = f"{head}{layer}.in"
        if cin not in columns:
            raise ValueError(f"column {c!r} has no matching {cin!r}")
        factors[layer] = (_as_2d(columns[c]), _as_2d(columns[cin]))
    stray = [c for c in columns if c.startswith(head) and c.endswith(".in") and c[len(head) : -3] not in factors]
    if stray:
        raise ValueError(f"sketch input columns without output columns: {stray}")
    return factors


def _as_2d(values: Any) -> Tensor:
    if isinstance(values, Tensor):
        return values
    arr = np.asarray(values)
    if arr.dtype == object:
        arr = np.stack([np.asarray(r, dtype=np.float32) for r in arr])
    # Arrow hands out read-only buffers; torch wants writable memory.
    return torch.from_numpy(np.require(arr, requirements="W"))


def _weights(w: Any, n: int, src: _Src, dtype: torch.dtype) -> tuple[Tensor, bool]:
    t = _tensor(w).to(device=src.device, dtype=dtype)
    squeeze = t.dim() == 1
    if squeeze:
        t = t[:, None]
    if t.dim() != 2 or t.shape[0] != n:
        raise ValueError(f"weights must be (n,) or (n, P) with n = {n} tokens, got {tuple(_tensor(w).shape)}")
    if not torch.isfinite(t).all():
        raise ValueError("weights contain NaN or infinite values")
    return t, squeeze


# --------------------------------------------------------------------------- core maths


def direction_sketch(source: Source, weights: Any, dtype: torch.dtype = torch.float64):
    """The sketched direction d(w) = sum_t w_t s_t.

    Dense source: (k,) for w of shape (n,), (P, k) for (n, P).  Factors: a dict
    ``{layer: U^T diag(w) V}`` of (k1, k2) — (P, k1, k2) for (n, P) weights.
    """
    src = as_source(source, dtype)
    w, squeeze = _weights(weights, src.n, src, dtype)
    if src.dense is not None:
        d = (src.dense.T @ w).T
        return d[0] if squeeze else d
    out = {}
    for name, u, v in src.layers:
        m = torch.einsum("ti,tp,tj->pij", u, w, v)
        out[name] = m[0] if squeeze else m
    return out


def _cost(src: _Src, p: int) -> tuple[float, float]:
    n = src.n
    direct = sum(u.shape[1] * v.shape[1] for _, u, v in src.layers) * n * p
    gram = n * n * (sum(u.shape[1] + v.shape[1] for _, u, v in src.layers) / 2 + p)  # K built in symmetric blocks
    return float(direct), float(gram)


def _factor_norms_direct(src: _Src, w: Tensor, chunk: int) -> Tensor:
    """|d(w)|^2 for each column of w by forming M(w) per column (chunks of columns)."""
    out = torch.zeros(w.shape[1], dtype=w.dtype, device=w.device)
    for _, u, v in src.layers:
        for j in range(0, w.shape[1], chunk):
            wc = w[:, j : j + chunk]
            m = torch.matmul(u.T.unsqueeze(0), wc.T.unsqueeze(-1) * v.unsqueeze(0))  # (p, k1, k2)
            out[j : j + chunk] += m.square().sum(dim=(1, 2))
    return out


def _factor_norms_gram(src: _Src, w: Tensor, row_chunk: int) -> Tensor:
    """|d(w)|^2 = w^T K w with K = sum_l (U U^T) o (V V^T), built in symmetric blocks.

    Only the blocks on and above the diagonal are formed (K is symmetric), each used
    for both of its row blocks, which halves the cost of building K.
    """
    n = src.n
    kw = torch.zeros_like(w)
    starts = list(range(0, n, row_chunk))
    for i in starts:
        si = slice(i, min(i + row_chunk, n))
        for j in starts:
            if j < i:
                continue
            sj = slice(j, min(j + row_chunk, n))
            kb = None
            for _, u, v in src.layers:
                term = (u[si] @ u[sj].T).mul_(v[si] @ v[sj].T)
                kb = term if kb is None else kb.add_(term)
            kw[si] += kb @ w[sj]
            if j != i:
                kw[sj] += kb.T @ w[si]
    return (w * kw).sum(dim=0)


def inner_products(
    source: Source,
    rl_weights: Any,
    weight_matrix: Any,
    *,
    method: Method = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    chunk: int = 64,
    row_chunk: int = 2048,
) -> tuple[Tensor, Tensor, Tensor]:
    """(<r, d(w_p)>, |r|^2, |d(w_p)|^2) for every column p of ``weight_matrix``.

    Returns float tensors of shapes (P,), (), (P,).  ``method`` only affects factor
    sources: ``direct`` forms M(w) per column, ``gram`` uses the token Gram matrix,
    ``auto`` picks the one with fewer multiply-adds.  ``dtype`` is the compute dtype;
    ``None`` means float64 for a dense source (cheap) and the factors' own dtype for
    factors (float32 as dumped: the O(n^2) / O(n k1 k2) work runs about 2x faster
    than in float64, cosines within ~1e-6 of float64).  Results are float64.
    """
    dtype = _compute_dtype(source, dtype)
    src = as_source(source, dtype, device)
    a, _ = _weights(rl_weights, src.n, src, dtype)
    if a.shape[1] != 1:
        raise ValueError("rl_weights must be a single (n,) vector")
    a = a[:, 0]
    w, _ = _weights(weight_matrix, src.n, src, dtype)
    if src.dense is not None:
        g = src.dense
        r = g.T @ a
        d = g.T @ w
        return (r @ d).double(), (r @ r).double(), d.square().sum(dim=0).double()
    rr = torch.zeros((), dtype=dtype, device=src.device)
    q = torch.zeros(src.n, dtype=dtype, device=src.device)
    for _, u, v in src.layers:
        ma = u.T @ (a[:, None] * v)
        rr = rr + ma.square().sum()
        q += ((u @ ma) * v).sum(dim=1)
    rd = w.T @ q
    if method == "auto":
        direct, gram = _cost(src, w.shape[1])
        method = "direct" if direct <= gram else "gram"
    if method == "direct":
        dd = _factor_norms_direct(src, w, chunk)
    elif method == "gram":
        dd = _factor_norms_gram(src, w, row_chunk)
    else:
        raise ValueError(f"unknown method {method!r}; use auto, direct or gram")
    return rd.double(), rr.double(), dd.double()


def _compute_dtype(source: Any, dtype: torch.dtype | None) -> torch.dtype:
    """float64 for dense sources; the factors' own floating dtype (float32 as dumped) for factors."""
    if dtype is not None:
        return dtype
    if isinstance(source, _Src):
        if source.dense is not None:
            return torch.float64
        return source.layers[0][1].dtype
    if isinstance(source, (Tensor, np.ndarray)):
        return torch.float64
    pairs = list(source.values()) if isinstance(source, Mapping) else list(source)
    first = _tensor(pairs[0][0]) if pairs else None
    if first is not None and first.dtype in (torch.float32, torch.float64):
        return first.dtype
    return torch.float64


def _cos(rd: Tensor, rr: Tensor, dd: Tensor) -> Tensor:
    den = torch.sqrt(rr * dd)
    return torch.where(den > 0, rd / torch.where(den > 0, den, torch.ones_like(den)), torch.full_like(rd, float("nan")))


def cosines(
    source: Source,
    rl_weights: Any,
    weight_matrix: Any,
    *,
    method: Method = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    chunk: int = 64,
    row_chunk: int = 2048,
) -> Tensor:
    """cos(r, d(w_p)) for each column of ``weight_matrix`` (n, P) -> (P,); (n,) -> scalar.

    ``rl_weights`` is the (n,) vector a of :func:`rl_weights`; rows of every argument
    are tokens in the same order as the source's rows.  NaN where r or d(w) is zero.
    """
    squeeze = _tensor(weight_matrix).dim() == 1
    rd, rr, dd = inner_products(
        source, rl_weights, weight_matrix, method=method, dtype=dtype, device=device, chunk=chunk, row_chunk=row_chunk
    )
    c = _cos(rd, rr, dd)
    return c[0] if squeeze else c


# --------------------------------------------------------------------------- sketch error


def _block_indicator(k: int, blocks: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(blocks, k) 0/1 matrix of contiguous, nearly equal blocks of the k sketch rows."""
    if blocks < 2:
        raise ValueError("the jackknife needs at least 2 blocks")
    if k < blocks:
        raise ValueError(f"--blocks {blocks}: the gradient sketch has {k} projection dims, fewer than the jackknife "
                         f"blocks; use --blocks {k} or less (0 skips the jackknife)")
    e = torch.zeros(blocks, k, dtype=dtype, device=device)
    for b, idx in enumerate(torch.tensor_split(torch.arange(k, device=device), blocks)):
        e[b, idx] = 1
    return e


def jackknife_replicates(
    source: Source,
    rl_weights: Any,
    weight_matrix: Any,
    *,
    blocks: int = 8,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    chunk: int = 64,
) -> Tensor:
    """Delete-one-block cosines, (blocks, P) (or (blocks,) for an (n,) weight vector).

    The k sketch dimensions are split into ``blocks`` contiguous groups.  For a dense
    source, block b is a group of columns of G (independent projection rows).  For
    factors, block b is the pair (rows b of every layer's P, rows b of every layer's Q):
    these pairs are i.i.d., and dropping one leaves a valid smaller sketch (each layer
    rescaled by k1 k2 / (k1' k2') so the layers stay comparable).  Replicates of
    different batches sketched with the same projections are aligned by block, so any
    smooth function of several cosines (a gain, a mean over batches) can be jackknifed
    by applying it replicate-wise and passing the result to :func:`jackknife_se`.

    Cost: cheap for dense sources; for factors O(n k1 k2) per column (the direct method).
    """
    squeeze = _tensor(weight_matrix).dim() == 1
    dtype = _compute_dtype(source, dtype)
    src = as_source(source, dtype, device)
    a, _ = _weights(rl_weights, src.n, src, dtype)
    a = a[:, 0]
    w, _ = _weights(weight_matrix, src.n, src, dtype)
    nb, p = blocks, w.shape[1]
    if src.dense is not None:
        g = src.dense
        e = _block_indicator(g.shape[1], nb, dtype, g.device)
        r = g.T @ a
        d = g.T @ w
        rd_b = e @ (r[:, None] * d)          # (B, P)
        rr_b = e @ r.square()                # (B,)
        dd_b = e @ d.square()                # (B, P)
        rd = (rd_b.sum(0) - rd_b).double()
        rr = (rr_b.sum(0) - rr_b).double()
        dd = (dd_b.sum(0) - dd_b).double()
        out = _cos(rd, rr[:, None], dd)
        return out[:, 0] if squeeze else out
    rd = torch.zeros(nb, p, dtype=dtype, device=src.device)
    rr = torch.zeros(nb, 1, dtype=dtype, device=src.device)
    dd = torch.zeros(nb, p, dtype=dtype, device=src.device)
    for _, u, v in src.layers:
        k1, k2 = u.shape[1], v.shape[1]
        e1 = _block_indicator(k1, nb, dtype, u.device)
        e2 = _block_indicator(k2, nb, dtype, u.device)
        s1, s2 = e1.sum(1), e2.sum(1)
        scale = (k1 * k2) / ((k1 - s1) * (k2 - s2))  # (B,)
        ma = u.T @ (a[:, None] * v)

        def loo(blocksum: Tensor) -> Tensor:
            # blocksum (..., B, B) of (i, j) blocks -> (..., B) sums over i != b and j != b
            total = blocksum.sum(dim=(-2, -1))
            row = blocksum.sum(dim=-1)
            col = blocksum.sum(dim=-2)
            diag = torch.diagonal(blocksum, dim1=-2, dim2=-1)
            return total[..., None] - row - col + diag

        rr += (scale * loo(e1 @ ma.square() @ e2.T))[:, None]
        for j in range(0, p, chunk):
            wc = w[:, j : j + chunk]
            m = torch.matmul(u.T.unsqueeze(0), wc.T.unsqueeze(-1) * v.unsqueeze(0))  # (c, k1, k2)
            rd[:, j : j + chunk] += (scale * loo(e1 @ (ma * m) @ e2.T)).T
            dd[:, j : j + chunk] += (scale * loo(e1 @ m.square() @ e2.T)).T
    out = _cos(rd.double(), rr.double(), dd.double())
    return out[:, 0] if squeeze else out


def jackknife_se(replicates: Tensor) -> Tensor:
    """Jackknife standard error from delete-one replicates along dim 0: sqrt((B-1)/B sum (x_b - mean)^2)."""
    x = _tensor(replicates)
    b = x.shape[0]
    if b < 2:
        raise ValueError("need at least 2 replicates")
    return torch.sqrt((b - 1) / b * (x - x.mean(dim=0)).square().sum(dim=0))


def sketch_error_jackknife(
    source: Source,
    rl_weights: Any,
    weight_matrix: Any,
    *,
    blocks: int = 8,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    chunk: int = 64,
) -> Tensor:
    """Jackknife standard error of each cosine due to the random projection, (P,) or scalar.

    A sketch of k dims is treated as ``blocks`` independent sub-sketches (see
    :func:`jackknife_replicates`); the result estimates the standard deviation of
    the sketched cosine around the cosine of the full (unsketched) gradients.
    """
    return jackknife_se(
        jackknife_replicates(source, rl_weights, weight_matrix, blocks=blocks, dtype=dtype, device=device, chunk=chunk)
    )
