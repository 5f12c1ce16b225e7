"""A slow reference of SPEC sections 2-5, written from the text with plain loops.

It shares no code with ``icsd_audit``: dicts of Python lists, ``numpy.median`` and
``math.exp``.  Tests compare the vectorized allocators against it.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np


def fit(values: list[float], eps: float, min_group: int) -> tuple[float, float, float, bool]:
    mu = float(np.median(values)) if values else 0.0
    lower = [mu - x for x in values if x < mu]
    upper = [x - mu for x in values if x >= mu]
    raw_m = sum(lower) / len(lower) if lower else 0.0
    raw_p = sum(upper) / len(upper) if upper else 0.0
    usable = len(values) >= min_group and (raw_m > eps or raw_p > eps)
    return mu, max(raw_m, eps), max(raw_p, eps), usable


def phi(x: float, mu: float, bm: float, bp: float, eta: float) -> float:
    if x < mu:
        return eta * math.exp((x - mu) / bm)
    return 1.0 - (1.0 - eta) * math.exp(-(x - mu) / bp)


def gauss_fit(values: list[float], eps: float, min_group: int) -> tuple[float, float, bool]:
    if not values:
        return 0.0, eps, False
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return mean, max(std, eps), len(values) >= min_group and std > eps


def reference_allocate(
    rows: list[dict],
    *,
    allocator: str = "icsd",
    trust: str = "laplace",
    eps: float = 1e-4,
    min_group: int = 8,
    beta: float = 5.0,
    perm: dict[int, int] | None = None,
) -> list[dict]:
    """rows: dicts with batch, traj, turn, A, rho, delta, valid (and score_norm for fisher)
    -> dicts g, u, m, c, fallback."""
    out = [dict(g=0.0, u=0.0, m=0.0, c=0.0, fallback=False) for _ in rows]
    live = [i for i, r in enumerate(rows) if r["valid"]]
    by_batch: dict[int, list[int]] = defaultdict(list)
    by_group: dict[tuple, list[int]] = defaultdict(list)
    by_turn: dict[tuple, list[int]] = defaultdict(list)
    for i in live:
        r = rows[i]
        by_batch[r["batch"]].append(i)
        by_group[(r["batch"], r["turn"])].append(i)
        by_turn[(r["batch"], r["traj"], r["turn"])].append(i)

    for members in by_batch.values():
        if trust == "laplace" and allocator != "opsd":
            mu, bm, bp, ok = fit([rows[i]["delta"] for i in members], eps, min_group)
            if not ok:
                mu, bm, bp = 0.0, 1.0, 1.0
            for i in members:
                out[i]["g"] = phi(rows[i]["delta"], mu, bm, bp, 0.4)
        elif trust == "sigmoid" and allocator != "opsd":
            for i in members:
                out[i]["g"] = 1.0 / (1.0 + math.exp(-beta * rows[i]["delta"]))
        else:
            for i in members:
                out[i]["g"] = 1.0

    for i in live:
        r = rows[i]
        out[i]["u"] = r["A"] * r["rho"] * r["delta"]
        out[i]["fallback"] = r["A"] < 0 and r["delta"] < 0

    def source(i: int) -> float:
        if allocator == "fisher":
            # SPEC 5: m = Phi_G(|advantage * ratio| * score_norm)
            return abs(rows[i]["A"] * rows[i]["rho"]) * rows[i]["score_norm"]
        return out[i]["u"]

    if allocator in ("icsd", "fisher", "influence-only", "permuted"):
        batch_fit = {b: fit([source(i) for i in mem], eps, min_group) for b, mem in by_batch.items()}
        for (b, _), members in by_group.items():
            params = fit([source(i) for i in members], eps, min_group)
            if not params[3]:
                params = batch_fit[b] if batch_fit[b][3] else (0.0, 1.0, 1.0, True)
            for i in members:
                out[i]["m"] = phi(source(i), params[0], params[1], params[2], 0.5)
        if allocator == "permuted":
            assert perm is not None
            original = {i: out[i]["m"] for i in live}
            for dst, src in perm.items():
                out[dst]["m"] = original[src]
    elif allocator == "sign":
        for i in live:
            u = out[i]["u"]
            out[i]["m"] = 1.0 if u > 0 else (0.5 if u == 0 else 0.0)
    elif allocator == "gaussian":
        batch_fit = {b: gauss_fit([out[i]["u"] for i in mem], eps, min_group) for b, mem in by_batch.items()}
        for (b, _), members in by_group.items():
            mean, std, ok = gauss_fit([out[i]["u"] for i in members], eps, min_group)
            if not ok:
                mean, std, ok = batch_fit[b]
                if not ok:
                    mean, std = 0.0, 1.0
            for i in members:
                z = (out[i]["u"] - mean) / std
                out[i]["m"] = 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
    else:
        for i in live:
            out[i]["m"] = 1.0

    for members in by_turn.values():
        if allocator in ("sdar", "opsd"):
            for i in members:
                out[i]["c"] = out[i]["g"]
            continue
        cq = [i for i in members if not out[i]["fallback"]]
        s_g = sum(out[i]["g"] for i in cq)
        if allocator == "influence-only":
            s_w = sum(out[i]["m"] for i in cq)
        else:
            s_w = sum(out[i]["g"] * out[i]["m"] for i in cq)
        for i in members:
            if s_w > eps and not out[i]["fallback"]:
                w = 1.0 if allocator == "influence-only" else out[i]["g"]
                out[i]["c"] = s_g / s_w * w * out[i]["m"]
            else:
                out[i]["c"] = out[i]["g"]
    return out
