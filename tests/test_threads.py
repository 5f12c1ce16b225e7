"""``icsd_audit.threads``: the ICSD_THREADS setting and the idle-core default (torch-free)."""

from __future__ import annotations

import pytest

from icsd_audit.threads import env_threads, idle_cores


@pytest.mark.parametrize("cores, load, want", [
    (2, 0.0, 2), (2, 0.99, 2), (2, 1.0, 1), (2, 1.7, 1), (2, 9.5, 1),  # the 2-core box: idle, one busy, loaded
    (16, 10.5, 6), (16, 3.2, 8), (16, 0.1, 8),                          # a bigger box, capped at 8
    (1, 0.0, 1),
])
def test_idle_cores_is_the_cores_less_the_whole_load_between_1_and_the_cap(monkeypatch, cores, load, want):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr("os.getloadavg", lambda: (load, 0.0, 0.0))
    assert idle_cores() == want


def test_idle_cores_without_a_load_reading_is_1(monkeypatch):
    def no_load() -> tuple[float, float, float]:
        raise OSError("load average unobtainable")

    monkeypatch.setattr("os.getloadavg", no_load)
    assert idle_cores() == 1


def test_icsd_threads_overrides_the_default(monkeypatch):
    monkeypatch.setenv("ICSD_THREADS", "3")
    assert env_threads(default=idle_cores()) == 3
    monkeypatch.setenv("ICSD_THREADS", " ")
    assert env_threads(default=5) == 5
