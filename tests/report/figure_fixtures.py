"""Small fixed result objects for the figure and report tests.

Every number is written out by hand (not computed by the statistics code), so a
test that finds it again in a plotted artist checks the drawing, independently of
the statistics implementation.
"""

from __future__ import annotations

import numpy as np

from icsd_audit.stats.bootstrap import BootstrapResult
from icsd_audit.report.results import AuditReport, ReportOptions
from icsd_audit.report.build import GradcosSummary
from icsd_audit.stats.api import (
    AuditResults,
    ClipResult,
    ClipSet,
    GroupedResult,
    LandscapeGrid,
    LandscapeResult,
    PairedResult,
    QuadrantsResult,
    ShiftBin,
    ShiftResult,
    TCMResult,
)

NAN = float("nan")


def br(est: float, lo: float, hi: float, se: float = 0.01, unit: str = "action-turn") -> BootstrapResult:
    return BootstrapResult(est, lo, hi, se, 1000, 0.95, "percentile", unit)


def common(n_tokens: int = 1000) -> dict:
    return dict(base_name="sdar", compare_name="icsd", n_tokens=n_tokens, n_turns=80, n_batches=4,
                n_resamples=1000, confidence_level=0.95, unit="action-turn")


#: region -> (base (est, lo, hi), compare (est, lo, hi), diff (est, lo, hi)); fractions
QUAD = {
    "pos_delta_pos_adv": ((0.300, 0.290, 0.312), (0.362, 0.350, 0.371), (0.062, 0.058, 0.066)),
    "pos_delta_neg_adv": ((0.350, 0.341, 0.360), (0.275, 0.266, 0.283), (-0.075, -0.079, -0.071)),
    "neg_delta_pos_adv": ((0.100, 0.095, 0.104), (0.085, 0.081, 0.090), (-0.015, -0.017, -0.013)),
    "neg_delta_neg_adv": ((0.150, 0.146, 0.155), (0.150, 0.146, 0.155), (0.0, 0.0, 0.0)),
    "neutral": ((0.100, 0.094, 0.107), (0.128, 0.120, 0.135), (0.028, 0.024, 0.031)),
}


def quadrants_result() -> QuadrantsResult:
    regions = {r: PairedResult(br(*b), br(*c), br(*d, se=0.0 if d == (0.0, 0.0, 0.0) else 0.01))
               for r, (b, c, d) in QUAD.items()}
    return QuadrantsResult(**common(), regions=regions, region_tokens={r: 200 for r in QUAD})


def tcm_result(base: float = 0.601, compare: float = 0.378, n_tokens: int = 1000) -> TCMResult:
    d = compare - base
    return TCMResult(**common(n_tokens), eps=1e-4, n_active_tokens=n_tokens // 2, base=br(base, base - 0.02, base + 0.02),
                     compare=br(compare, compare - 0.02, compare + 0.02), diff=br(d, d - 0.003, d + 0.003))


#: bin -> (diff (est, lo, hi), n_tokens); pos_3 is empty and must not be drawn
SHIFT = {
    "neg_1": ((-0.031, -0.036, -0.026), 40), "neg_2": ((-0.020, -0.024, -0.017), 40),
    "neg_3": ((-0.012, -0.015, -0.009), 40), "neg_4": ((-0.006, -0.008, -0.004), 40),
    "neg_5": ((-0.002, -0.003, -0.001), 40), "zero": ((0.001, -0.001, 0.003), 25),
    "pos_1": ((0.006, 0.004, 0.008), 40), "pos_2": ((0.012, 0.010, 0.015), 40),
    "pos_3": ((NAN, NAN, NAN), 0), "pos_4": ((0.017, 0.014, 0.020), 40), "pos_5": ((0.021, 0.017, 0.025), 40),
}


def shift_result() -> ShiftResult:
    bins = {k: ShiftBin(br(0.1, 0.09, 0.11), br(0.1 + d[0] if d[0] == d[0] else NAN, 0.0, 0.2), br(*d), n,
                        -1.0 + i * 0.2, -0.9 + i * 0.2)
            for i, (k, (d, n)) in enumerate(SHIFT.items())}
    return ShiftResult(**common(), n_bins=5, n_splus_tokens=425, bins=bins)


def landscape_result(two_envs: bool = True) -> LandscapeResult:
    """G = 3 grids with hand-set intensities (one empty cell each) and densities."""
    g = 3
    base = np.array([[0.5, 0.8, 1.0], [0.9, np.nan, 1.1], [1.2, 1.4, 1.6]])
    comp = np.array([[0.2, 0.6, 1.3], [0.7, np.nan, 1.5], [0.8, 2.1, 2.9]])
    counts = np.array([[2, 2, 2], [2, 0, 2], [2, 80, 8]])  # tokens concentrate in one cell
    envs = {}
    for k, (env, zr) in enumerate([("alfworld", (0.40, 0.55)), ("webshop", (0.45, 0.35))][: 2 if two_envs else 1]):
        key = env if two_envs else None
        envs[key] = LandscapeGrid(env=key, n_tokens=int(counts.sum()), grid=g,
                                  intensity={"sdar": base + k, "icsd": comp + k}, mean={"sdar": 0.5, "icsd": 0.5},
                                  density=counts / counts.sum(), counts=counts,
                                  zero_rank={"delta": zr[0], "advantage": zr[1]})
    return LandscapeResult("sdar", "icsd", g, envs)


COS = {"base": (0.10, 0.22, -0.05, 0.31, 0.18), "compare": (0.30, 0.41, 0.12, 0.52, 0.33),
       "perm": (0.12, 0.25, -0.03, 0.33, 0.20)}


def gradcos_summary(perm: bool = True) -> GradcosSummary:
    b = br(0.152, 0.05, 0.25, unit="batch")
    return GradcosSummary(
        base_name="sdar", compare_name="icsd", batch_ids=(0, 1, 2, 3, 4),
        cos_base=COS["base"], cos_compare=COS["compare"], cos_perm=COS["perm"] if perm else None,
        n_permutations=20 if perm else 0, mean_base=b, mean_compare=br(0.336, 0.22, 0.45, unit="batch"),
        mean_perm=br(0.174, 0.07, 0.27, unit="batch") if perm else None,
        gain=br(0.184, 0.16, 0.21, unit="batch"), perm_gain=br(0.022, 0.018, 0.027, unit="batch") if perm else None,
        pairing_gain=br(0.162, 0.14, 0.19, unit="batch") if perm else None,
    )


#: step -> (base TCM, compare TCM); keys deliberately out of order, step 6 missing
STEPS = {3: (0.55, 0.45), 0: (0.60, 0.52), 1: (0.58, 0.47), 2: (0.62, 0.44), 4: (0.50, 0.41),
         5: (0.57, 0.46), 7: (0.54, 0.40), 8: (0.59, 0.43)}


def dynamics_result() -> GroupedResult:
    return GroupedResult("step", tuple(STEPS), tuple(tcm_result(b, c, 100) for b, c in STEPS.values()))


def clip_result() -> ClipResult:
    def cs(n: int, t: float) -> ClipSet:
        return ClipSet(n, br(t, t * 0.9, t * 1.1), PairedResult(br(0.02, 0.018, 0.022), br(0.018, 0.016, 0.02),
                                                                br(-0.002, -0.003, -0.001)),
                       PairedResult(br(0.03, 0.027, 0.033), br(0.025, 0.022, 0.028), br(-0.005, -0.006, -0.004)))
    return ClipResult(**common(), clip_eps=0.2, dual_clip=3.0, outside=cs(12, 0.012), flat=cs(7, 0.007),
                      dual_clip_cap_count=1, dual_clip_cap=br(0.001, 0.0, 0.003), ratio_mean=1.0012, ratio_std=0.031)


def audit_report(synthetic: bool = True) -> AuditReport:
    stats = AuditResults(tcm=tcm_result(), quadrants=quadrants_result(), shift=shift_result(), clip=clip_result())
    prov = {"files": ["runs/a/part-000000.parquet"], "n_files": 1, "n_rows": 1000, "n_tokens": 1000, "n_batches": 4,
            "producers": [{"name": "fixture-trainer", "run": "r1"}], "schemas": [{"schema": "icsd.token_dump", "version": 1}],
            "dump_allocators": [{"allocator": "icsd", "trust": "laplace"}], "synthetic": synthetic,
            "icsd_version": "0.1.0", "generated_at": "2026-01-01T00:00:00+00:00",
            "audit": {"base": {"allocator": "sdar"}, "compare": {"allocator": "icsd"}}}
    return AuditReport(stats=stats, landscape=landscape_result(), dynamics=dynamics_result(), gradcos=gradcos_summary(),
                       provenance=prov, options=ReportOptions(n_resamples=1000))
