"""``icsd audit tcm|quadrants|shift|clip|landscape --backend ray`` prints the bytes of ``--backend local`` on a local
Ray cluster of 1, 2 and 4 workers.

The clusters are slow tests: each takes ~20 s to start on the 2-core dev box. The merge itself is
tested without Ray in tests/stats/test_batch_merge.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import cli

ray = pytest.importorskip("ray")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STATS = ("tcm", "quadrants", "shift", "clip", "landscape")


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "dumps"
    res = cli("synth", str(out), "--tokens", "2000000", "--batches", "20", "--seed", "1")
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="module")
def local(synth: Path) -> dict[tuple[str, str], str]:
    """The local backend's stdout of every statistic on both inputs."""
    out = {}
    for name, path in (("demo", EXAMPLES / "cpu-demo" / "dumps"), ("synth", synth)):
        for stat in STATS if name == "demo" else ("tcm",):
            res = cli("audit", stat, str(path), "--json", "--resamples", "500", threads=2)
            assert res.returncode == 0, res.stderr
            out[name, stat] = res.stdout
    return out


@pytest.fixture(params=[1, 2, 4])
def cluster(request: pytest.FixtureRequest) -> Iterator[int]:
    ray.init(num_cpus=request.param, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
             log_to_driver=False)
    try:
        yield request.param
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_backend_gives_the_local_bytes(cluster: int, synth: Path, local: dict[tuple[str, str], str]) -> None:
    assert int(ray.cluster_resources()["CPU"]) == cluster
    for (name, stat), expected in local.items():
        path = EXAMPLES / "cpu-demo" / "dumps" if name == "demo" else synth
        res = cli("audit", stat, str(path), "--json", "--resamples", "500", "--backend", "ray", threads=2)
        assert res.returncode == 0, res.stderr
        assert res.stdout == expected, (name, stat, cluster)
        json.loads(res.stdout)


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


@pytest.mark.slow
def test_ray_backend_gives_the_local_report_numbers(cluster: int, small: Path, local_report: dict,
                                                    tmp_path: Path) -> None:
    res = cli("audit", "report", str(small), "--out", str(tmp_path / "ray"), "--resamples", "300", "--backend", "ray",
              threads=2)
    assert res.returncode == 0, res.stderr
    assert _summary(tmp_path / "ray") == local_report


@pytest.mark.slow
def test_ray_backend_starts_and_stops_its_own_cluster(local: dict[tuple[str, str], str]) -> None:
    assert not ray.is_initialized()
    res = cli("audit", "tcm", str(EXAMPLES / "cpu-demo" / "dumps"), "--json", "--resamples", "500", "--backend", "ray",
              threads=2)
    assert res.returncode == 0, res.stderr
    assert res.stdout == local["demo", "tcm"]
    assert not ray.is_initialized()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_no_cluster_answers_is_one_line_exit_2() -> None:
    port = _free_port()  # nothing listens on it
    res = cli("audit", "tcm", str(EXAMPLES / "cpu-demo" / "dumps"), "--json", "--backend", "ray", "--ray-address",
              f"127.0.0.1:{port}")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        f"error: --ray-address 127.0.0.1:{port}: no Ray cluster answers there ([Errno 111] Connection refused)"]
    assert not ray.is_initialized()


@pytest.mark.parametrize("args, message", [
    (["--backend", "spark"], "error: --backend must be one of local, ray, got 'spark'"),
    (["--ray-address", "auto"], "error: --ray-address needs --backend ray"),
])
def test_bad_backend_options_are_one_line_exit_2(args: list[str], message: str) -> None:
    res = cli("audit", "tcm", str(EXAMPLES / "cpu-demo" / "dumps"), *args)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [message]
