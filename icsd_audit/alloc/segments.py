"""Segment reductions over flat token tensors.

Every allocation statistic is a reduction over a partition of the tokens (a batch,
a calibration group, an action turn).  Tokens arrive flat, in any order, with
integer keys; these helpers turn keys into dense segment ids and reduce over them
with sorts and scatter-adds, so nothing loops over tokens, groups or turns in Python.
All functions are device-agnostic and keep the dtype of their float inputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "select",
    "dense_ids",
    "dense_rank",
    "combine_ranks",
    "order_key",
    "segment_count",
    "segment_sum",
    "segment_mean",
    "segment_median",
    "median",
    "segment_std",
]


def order_key(x: Tensor) -> Tensor:
    """An int64 key whose integer order is the float order of ``x`` (no NaNs).

    Torch sorts integers with a radix sort, several times faster than its float
    comparison sort; flipping the magnitude bits of negative floats makes the
    two's-complement order of the bit patterns match the float order.  The two
    zeros get different keys, which is harmless: equal values are only compared
    as values afterwards.  (``bits ^ ((bits >> 63) & MAX)`` does the flip with one
    allocation: the arithmetic shift is all ones exactly for negative patterns.)
    """
    if x.dtype == torch.float64:
        bits = x.view(torch.int64)
        return ((bits >> 63) & 0x7FFFFFFFFFFFFFFF).bitwise_xor_(bits)
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        bits = x.float().view(torch.int32)
        return ((bits >> 31) & 0x7FFFFFFF).bitwise_xor_(bits).long()
    return x.long()


def dense_rank(key: Tensor) -> tuple[Tensor, int]:
    """Dense ranks of an int64 key, avoiding a sort where the data allow it.

    Ids of batches, turns and trajectories usually span a small range (a lookup
    table, O(n + range)) or arrive sorted (a cumulative sum of changes); only
    wide, unsorted keys pay for a radix sort.
    """
    n_rows = key.numel()
    if n_rows == 0:
        return torch.zeros(0, dtype=torch.long, device=key.device), 0
    lo_t, hi_t = torch.aminmax(key)
    lo, hi = int(lo_t), int(hi_t)
    if lo == hi:
        # a zero-stride view: one segment costs no per-row memory
        return torch.zeros((), dtype=torch.long, device=key.device).expand(n_rows), 1
    span = hi - lo + 1
    if span <= max(4 * n_rows, 1 << 16):
        shifted = key - lo if lo else key
        present = torch.zeros(span, dtype=torch.long, device=key.device)
        present[shifted] = 1
        rank = torch.cumsum(present, 0) - 1
        n = int(rank[-1]) + 1
        if n == span:  # every value in [lo, hi] occurs: the shifted key is its own rank
            return shifted, n
        return rank[shifted], n
    if bool((key[1:] >= key[:-1]).all()):
        new = torch.ones_like(key, dtype=torch.bool)
        new[1:] = key[1:] != key[:-1]
        rank = torch.cumsum(new, 0) - 1
        return rank, int(rank[-1]) + 1
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    new = torch.ones_like(sorted_key, dtype=torch.bool)
    new[1:] = sorted_key[1:] != sorted_key[:-1]
    rank = torch.cumsum(new, 0) - 1
    ids = torch.empty_like(rank)
    ids[order] = rank
    return ids, int(rank[-1]) + 1


def dense_ids(*keys: Tensor) -> tuple[Tensor, int]:
    """Map each row's tuple of integer keys to a dense id in ``[0, n_segments)``.

    Ids follow the lexicographic order of the key tuples.  Keys are combined one at
    a time (dense rank of the previous ids times the next key's cardinality), so
    arbitrary int64 values never overflow a packed code.
    """
    if not keys:
        raise ValueError("dense_ids needs at least one key tensor")
    ids, n = dense_rank(keys[0].long())
    for key in keys[1:]:
        ids, n = combine_ranks(ids, *dense_rank(key.long()))
    return ids, n


def combine_ranks(ids: Tensor, inner: Tensor, n_inner: int, *, n_ids: int | None = None) -> tuple[Tensor, int]:
    """Dense ids of the pairs (ids, inner), given ``inner`` already dense in [0, n_inner).

    With a single outer segment (``n_ids == 1``) the pairs are ``inner`` itself.
    """
    if n_ids == 1:
        return inner, n_inner
    return dense_rank(ids * max(n_inner, 1) + inner)


def narrow(ids: Tensor, n: int) -> Tensor:
    """Segment ids in the narrowest integer dtype that holds ``n``.

    Torch radix-sorts integers one byte per pass, so a stable sort of int16 ids
    runs about 3.5x faster than of int64 ids (measured: 20 ms vs 71 ms, 2M rows).
    """
    if n <= 32767:
        return ids.to(torch.int16)
    if n <= 2**31 - 1:
        return ids.to(torch.int32)
    return ids


def select(per_segment: Tensor, ids: Tensor, n: int, *, out: Tensor) -> Tensor:
    """``per_segment[ids]`` written into ``out`` (a broadcast view for one segment).

    ``index_select`` into an existing buffer is about 3x faster on CPU than
    advanced indexing into a fresh tensor (no page faults, no per-row checks).
    """
    if n == 1:
        return per_segment.reshape(()).expand(ids.shape)
    return torch.index_select(per_segment, 0, ids, out=out)


def segment_count(ids: Tensor, n: int, mask: Tensor | None = None) -> Tensor:
    """Number of rows (optionally where ``mask``) in each segment, as int64."""
    if n == 1:
        total = ids.numel() if mask is None else int(mask.sum())
        return torch.full((1,), total, dtype=torch.long, device=ids.device)
    if mask is None:
        return torch.bincount(ids, minlength=n)
    # A scatter-add of the mask avoids materialising ids[mask] (a compaction pass).
    return torch.zeros(n, dtype=torch.long, device=ids.device).index_add_(0, ids, mask.long())


def segment_sum(values: Tensor, ids: Tensor, n: int) -> Tensor:
    """Sum of ``values`` over each segment (zeros for empty segments)."""
    if n == 1:
        return values.sum().reshape(1)
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    return out.index_add_(0, ids, values)


def segment_mean(values: Tensor, ids: Tensor, n: int) -> Tensor:
    """Mean over each segment; empty segments give 0 rather than NaN."""
    counts = segment_count(ids, n).to(values.dtype)
    return segment_sum(values, ids, n) / counts.clamp(min=1)


def segment_std(values: Tensor, ids: Tensor, n: int) -> Tensor:
    """Population standard deviation (ddof=0, NumPy's default) over each segment."""
    mean = segment_mean(values, ids, n)
    dev = values - mean[ids]
    return segment_mean(dev * dev, ids, n).sqrt()


def segment_median(values: Tensor, ids: Tensor, n: int, *, value_order: Tensor | None = None) -> Tensor:
    """Median of each segment with NumPy's convention for even counts.

    The two middle order statistics are averaged.  Two stable sorts (by value,
    then by segment) give the lexicographic (segment, value) order; only the two
    middle entries of each segment are then read.  Empty segments get 0; callers
    mark them unusable through their counts.  Pass ``value_order`` (a stable
    argsort of ``values``) to share one value sort between several segmentations
    of the same values.
    """
    if values.numel() == 0:
        return torch.zeros(n, dtype=values.dtype, device=values.device)
    if n == 1 and value_order is None:
        return median(values).reshape(1)
    by_value = torch.argsort(order_key(values), stable=True) if value_order is None else value_order
    counts = segment_count(ids, n)
    starts = torch.cumsum(counts, 0) - counts
    last = values.numel() - 1
    lo = (starts + (counts - 1).clamp(min=0) // 2).clamp(max=last)
    hi = (starts + counts // 2).clamp(max=last)
    if n > 1:  # position in (segment, value) order -> position in value order, read only where needed
        by_segment = torch.argsort(torch.index_select(narrow(ids, n), 0, by_value), stable=True)
        lo, hi = by_segment[lo], by_segment[hi]
    med = (values[by_value[lo]] + values[by_value[hi]]) / 2
    return torch.where(counts > 0, med, torch.zeros_like(med))


def median(values: Tensor) -> Tensor:
    """Median of a non-empty 1-D tensor (NumPy's even-count convention), as a 0-d tensor.

    One O(n) selection for the lower middle value; the upper one, when the count is
    even, is that value again if it is repeated there, otherwise the smallest larger
    value (a masked minimum, cheaper than a second selection).
    """
    k = values.numel()
    lo_v = torch.kthvalue(values, (k - 1) // 2 + 1).values
    if k % 2:
        return lo_v
    if int((values <= lo_v).sum()) >= k // 2 + 1:
        return lo_v
    hi_v = torch.where(values > lo_v, values, torch.full((), math.inf, dtype=values.dtype, device=values.device)).min()
    return (lo_v + hi_v) / 2
