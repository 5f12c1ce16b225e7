"""``--backend ray`` of ``strata``, ``coeffs``, ``verify``, ``gradcos`` and ``--by settings``: the parts that Ray
tasks compute, computed here by the same functions in a shuffled order and merged in batch order, give the local
results; so do the bootstrap's work units handed to a unit runner (a pickled engine, units in a shuffled order), as
``--backend ray`` hands them to Ray tasks (Ray itself is replaced by loops; tests/cli/test_ray_backend.py runs real
clusters).

Each comparison is shown to fail when the driver loses a part, and those whose output lists batches when it takes
the parts in completion order (:func:`test_a_lost_or_reordered_part_would_be_seen`; the strata's layout is
canonical, so their order cannot matter)."""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from icsd_audit.alloc.options import AllocatorOptions
from icsd_audit.audit import ray_backend, strata_ray
from icsd_audit.audit.coeffs import compute_coefficients
from icsd_audit.audit.gradcos import run_gradcos
from icsd_audit.audit.run import AuditRequest, run_audit_groups
from icsd_audit.audit.strata import run_strata
from icsd_audit.audit.verify import verify_dumps
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import DumpWriter
from icsd_audit.stats.engine.resample import unit_runner

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo" / "dumps"
MODE = "batch order"  # or "completion order", "one lost"


def _shuffled_parts(part: Any, paths: Any, args: tuple, batch_ids: Any, **_: Any) -> Iterator[Any]:
    names = [str(p) for p in paths]
    order = list(batch_ids)
    np.random.default_rng(3).shuffle(order)  # "completion" order
    done = {b: part(names, *args, b) for b in order}
    for b in (order if MODE == "completion order" else batch_ids[:-1] if MODE == "one lost" else batch_ids):
        yield done[b]


UNITS: list[int] = []


def _shuffled_units(engine: Any, units: Any) -> list[np.ndarray]:
    eng = pickle.loads(pickle.dumps(engine))  # what a worker receives
    order = list(units)
    np.random.default_rng(4).shuffle(order)
    done = {u: eng.block(u) for u in order}
    UNITS.extend(order)
    return [done[u] for u in units]


@contextlib.contextmanager
def _bootstrap_loop(*_: Any, **__: Any) -> Iterator[None]:
    with unit_runner(_shuffled_units):
        yield


@pytest.fixture
def ray_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(ray_backend, "ray_parts", _shuffled_parts)
    monkeypatch.setattr(strata_ray, "ray_parts", _shuffled_parts)
    monkeypatch.setattr(ray_backend, "ray_bootstrap", _bootstrap_loop)
    monkeypatch.setattr(strata_ray, "ray_bootstrap", _bootstrap_loop)
    UNITS.clear()
    yield


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six batches over two files, 40k tokens each (above torch's 32768-element split of a reduction)."""
    out = tmp_path_factory.mktemp("parts")
    for f in range(2):
        w = DumpWriter(out, producer="t", synthetic=True)
        for b in range(3):
            t = synth_tokens(40_000, n_batches=1, seed=10 * f + b, step=b)
            t["batch_id"][:] = 3 * f + b
            w.write(**t)
    return out


def _req(**kw: Any) -> AuditRequest:
    return AuditRequest(base=AllocatorOptions(allocator="sdar"), compare=AllocatorOptions(allocator="icsd"),
                        n_resamples=300, seed=5, **kw)


def _strata(paths: list, **kw: Any) -> str:
    res = (strata_ray.run_strata_ray if kw.pop("ray") else run_strata)(paths, _req(), **kw)
    return json.dumps(res.to_dict(), sort_keys=True)


@pytest.mark.parametrize("by, bins, top", [("abs_delta", 4, None), ("pos", None, 0.2), ("logp", 5, None)])
def test_strata_parts_give_the_local_result(ray_loop: None, synth: Path, by: str, bins: Any, top: Any) -> None:
    paths = [DEMO] if by == "logp" else [synth]
    assert _strata(paths, by=by, bins=bins, top=top, ray=True) == _strata(paths, by=by, bins=bins, top=top, ray=False)
    assert set(UNITS) == set(range(5))  # 300 resamples: 5 units of 64, each by the runner


def test_coeffs_parts_write_the_local_file(ray_loop: None, synth: Path, tmp_path: Path) -> None:
    a = compute_coefficients([synth], tmp_path / "local.parquet", AllocatorOptions(allocator="icsd"))
    b = compute_coefficients([synth], tmp_path / "ray.parquet", AllocatorOptions(allocator="icsd"), backend="ray")
    assert a == b and a.n_batches == 6
    assert (tmp_path / "ray.parquet").read_bytes() == (tmp_path / "local.parquet").read_bytes()


def test_verify_parts_give_the_local_result(ray_loop: None) -> None:
    a, b = verify_dumps([DEMO]), verify_dumps([DEMO], backend="ray")
    assert a.ok and len(a.batches) == 3
    assert b.to_dict() == a.to_dict()


def test_gradcos_parts_give_the_local_result(ray_loop: None) -> None:
    kw: dict[str, Any] = dict(permutations=3, n_resamples=300, blocks=4)
    a, b = run_gradcos([DEMO], **kw), run_gradcos([DEMO], backend="ray", **kw)
    assert len(a.batch_ids) == 3
    assert b.to_dict() == a.to_dict()


def test_groups_on_one_cluster_give_the_local_results(ray_loop: None, synth: Path) -> None:
    groups = [("demo", [DEMO], _req()), ("synth", [synth], _req(eps=1e-3))]
    a = run_audit_groups(groups, statistics=("tcm", "clip"))
    b = run_audit_groups(groups, statistics=("tcm", "clip"), backend="ray")
    assert json.dumps(b.tcm.to_dict()) == json.dumps(a.tcm.to_dict())
    assert json.dumps(b.clip.to_dict()) == json.dumps(a.clip.to_dict())
    assert len(UNITS) >= 2 * 5 and set(UNITS) == set(range(5))  # both groups' bootstraps by the runner


def test_the_map_and_the_bootstrap_on_workers_give_the_local_bits(ray_loop: None, synth: Path) -> None:
    from icsd_audit.audit.run import run_audit, run_landscape

    stats = ("tcm", "quadrants", "shift", "clip")
    for req in (_req(), _req(by="step"), _req(unit="batch")):
        a, b = run_audit([synth], req, statistics=stats), run_audit([synth], req, statistics=stats, backend="ray")
        for s in stats:
            assert json.dumps(getattr(b, s).to_dict()) == json.dumps(getattr(a, s).to_dict()), (s, req)
    a, b = run_landscape([synth], _req(), grid=5), run_landscape([synth], _req(), grid=5, backend="ray")
    assert json.dumps(b.to_dict()) == json.dumps(a.to_dict())
    assert UNITS  # the runner computed the units


def test_a_lost_or_reordered_part_would_be_seen(ray_loop: None, synth: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparisons above can fail: a part lost, or parts taken as they complete, give other results."""
    this = __import__(__name__, fromlist=["_"])
    local = (_strata([synth], by="abs_delta", bins=4, ray=False), verify_dumps([DEMO]).to_dict(),
             run_gradcos([DEMO], permutations=3, n_resamples=300, blocks=4).to_dict(),
             compute_coefficients([synth], tmp_path / "a.parquet", AllocatorOptions(allocator="icsd")))
    for mode in ("one lost", "completion order"):
        monkeypatch.setattr(this, "MODE", mode)
        if mode == "one lost":
            assert _strata([synth], by="abs_delta", bins=4, ray=True) != local[0]
        assert verify_dumps([DEMO], backend="ray").to_dict() != local[1]
        assert run_gradcos([DEMO], permutations=3, n_resamples=300, blocks=4, backend="ray").to_dict() != local[2]
        # (completion order: the rows land in place, the diagnostics' order differs)
        assert compute_coefficients([synth], tmp_path / f"{mode}.parquet", AllocatorOptions(allocator="icsd"),
                                    backend="ray") != local[3]


def test_a_runner_that_takes_more_units_per_call_gives_the_same_sums() -> None:
    from icsd_audit.stats.engine.resample import Family, Layout, family_sums

    lay = Layout([300, 500, 40])
    fam = Family(np.random.default_rng(0).gamma(1.0, 1.0, (5, lay.n)), [0, 1, 1], 2, lay)
    ref = np.concatenate([T for _, _, (T,) in family_sums(lay, [fam], 1000, seed=np.random.SeedSequence(1))])

    class Runner:
        units_at_once = 7

        def __init__(self) -> None:
            self.calls: list[int] = []

        def __call__(self, engine: Any, units: Any) -> list[np.ndarray]:
            self.calls.append(len(units))
            return _shuffled_units(engine, units)

    run = Runner()
    with unit_runner(run):
        got = np.concatenate([T for _, _, (T,) in family_sums(lay, [fam], 1000, seed=np.random.SeedSequence(1),
                                                              chunk_size=3 * 64)])
    assert run.calls == [7, 7, 2]  # 16 units of 64 resamples: 7 at a time, not the 3 of chunk_size
    assert got.tobytes() == ref.tobytes()
