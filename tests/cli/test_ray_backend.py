"""``icsd audit ... --backend ray`` prints the bytes of ``--backend local`` on a local Ray cluster of 1, 2 and 4 workers:
``tcm``, ``quadrants``, ``shift``, ``clip``, ``landscape``, ``strata``, ``verify``, ``gradcos``, ``--by settings``, the
file ``coeffs`` writes, ``report``'s numbers and the files of ``figures``.

The clusters are slow tests: each takes ~20 s to start on the 2-core dev box, so one cluster per worker count runs
every command. The merges themselves are tested without Ray in tests/stats/test_batch_merge.py and
tests/stats/test_ray_parts.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import cli

ray = pytest.importorskip("ray")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMO = str(EXAMPLES / "cpu-demo" / "dumps")
STATS = ("tcm", "quadrants", "shift", "clip", "landscape")


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "dumps"
    res = cli("synth", str(out), "--tokens", "2000000", "--batches", "20", "--seed", "1")
    assert res.returncode == 0, res.stderr
    return out


def _commands(synth: Path) -> dict[str, list[str]]:
    """Every command compared, by name: each prints one JSON object on stdout."""
    out = {f"{stat} demo": ["audit", stat, DEMO, "--json", "--resamples", "500"] for stat in STATS}
    out["tcm synth"] = ["audit", "tcm", str(synth), "--json", "--resamples", "500"]
    out["clip --by settings"] = ["audit", "clip", DEMO, str(synth), "--by", "settings", "--json", "--resamples", "300"]
    out["strata logp demo"] = ["audit", "strata", DEMO, "--by", "logp", "--bins", "5", "--json", "--resamples", "500"]
    out["strata abs_delta synth"] = ["audit", "strata", str(synth), "--by", "abs_delta", "--top", "0.2", "--json",
                                     "--resamples", "500"]
    out["verify demo"] = ["audit", "verify", DEMO, "--json"]
    out["gradcos demo"] = ["audit", "gradcos", DEMO, "--json", "--resamples", "500", "--permutations", "4"]
    return out


@pytest.fixture(scope="module")
def local(synth: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | bytes]:
    """The local backend's stdout of every command, and the bytes of the file ``coeffs`` writes."""
    out: dict[str, str | bytes] = {}
    for name, args in _commands(synth).items():
        res = cli(*args, threads=2)
        assert res.returncode == 0, (name, res.stderr)
        out[name] = res.stdout
    path = tmp_path_factory.mktemp("coeffs") / "local.parquet"
    res = cli("audit", "coeffs", str(synth), "--out", str(path), threads=2)
    assert res.returncode == 0, res.stderr
    out["coeffs synth"] = path.read_bytes()
    return out


@pytest.fixture(params=[1, 2, 4])
def cluster(request: pytest.FixtureRequest) -> Iterator[int]:
    ray.init(num_cpus=request.param, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
             log_to_driver=False)
    try:
        yield request.param
    finally:
        ray.shutdown()


def _summary(out: Path) -> dict:
    d = json.loads((out / "summary.json").read_text())
    d["provenance"].pop("generated_at")
    return d


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small") / "dumps"
    res = cli("synth", str(out), "--tokens", "60000", "--batches", "6", "--seed", "2")
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="module")
def local_report(tmp_path_factory: pytest.TempPathFactory, small: Path) -> dict:
    out = tmp_path_factory.mktemp("report") / "local"
    res = cli("audit", "report", str(small), "--out", str(out), "--resamples", "300", threads=2)
    assert res.returncode == 0, res.stderr
    return _summary(out)


def _figures(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def local_figures(tmp_path_factory: pytest.TempPathFactory, small: Path) -> dict[str, bytes]:
    """``icsd audit figures`` (PNG and SVG: the same bytes run after run for the same numbers)."""
    out = tmp_path_factory.mktemp("figures") / "local"
    res = cli("audit", "figures", str(small), "--out", str(out), "--resamples", "300", "--format", "png,svg",
              threads=2)
    assert res.returncode == 0, res.stderr
    return _figures(out)


@pytest.mark.slow
def test_ray_backend_gives_the_local_bytes(cluster: int, synth: Path, local: dict[str, str | bytes], small: Path,
                                           local_report: dict, local_figures: dict[str, bytes],
                                           tmp_path: Path) -> None:
    """One cluster per worker count, every command on it."""
    assert int(ray.cluster_resources()["CPU"]) == cluster
    for name, args in _commands(synth).items():
        res = cli(*args, "--backend", "ray", threads=2)
        assert res.returncode == 0, (name, res.stderr)
        assert res.stdout == local[name], (name, cluster)
        json.loads(res.stdout)
    res = cli("audit", "coeffs", str(synth), "--out", str(tmp_path / "ray.parquet"), "--backend", "ray", threads=2)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "ray.parquet").read_bytes() == local["coeffs synth"]
    res = cli("audit", "report", str(small), "--out", str(tmp_path / "ray"), "--resamples", "300", "--backend", "ray",
              threads=2)
    assert res.returncode == 0, res.stderr
    assert _summary(tmp_path / "ray") == local_report
    res = cli("audit", "figures", str(small), "--out", str(tmp_path / "figs"), "--resamples", "300", "--format",
              "png,svg", "--backend", "ray", threads=2)
    assert res.returncode == 0, res.stderr
    assert _figures(tmp_path / "figs") == local_figures and len(local_figures) == 6


@pytest.mark.slow
def test_ray_backend_starts_and_stops_its_own_cluster(local: dict[str, str | bytes]) -> None:
    assert not ray.is_initialized()
    res = cli("audit", "tcm", DEMO, "--json", "--resamples", "500", "--backend", "ray", threads=2)
    assert res.returncode == 0, res.stderr
    assert res.stdout == local["tcm demo"]
    assert not ray.is_initialized()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_no_cluster_answers_is_one_line_exit_2() -> None:
    port = _free_port()  # nothing listens on it
    res = cli("audit", "tcm", DEMO, "--json", "--backend", "ray", "--ray-address", f"127.0.0.1:{port}")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        f"error: --ray-address 127.0.0.1:{port}: no Ray cluster answers there ([Errno 111] Connection refused)"]
    assert not ray.is_initialized()


@pytest.mark.parametrize("args, message", [
    (["--backend", "spark"], "error: --backend must be one of local, ray, got 'spark'"),
    (["--ray-address", "auto"], "error: --ray-address needs --backend ray"),
])
@pytest.mark.parametrize("command", [["audit", "tcm"], ["audit", "strata", "--by", "pos"], ["audit", "verify"],
                                     ["audit", "gradcos"], ["audit", "coeffs", "--out", "never.parquet"],
                                     ["audit", "figures", "--out", "never.parquet"]])
def test_bad_backend_options_are_one_line_exit_2(command: list[str], args: list[str], message: str) -> None:
    res = cli(*command, DEMO, *args)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [message]
    assert not Path("never.parquet").exists()
