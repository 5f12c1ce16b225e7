"""``icsd_audit.threads``: the ICSD_THREADS setting and the idle-core default (torch-free)."""

from __future__ import annotations

import pytest

from icsd_audit.threads import MAX_THREADS, busy_cores, choose_threads, env_threads, idle_cores


@pytest.mark.parametrize("cores, busy, want", [
    (2, 0.0, 2), (2, 0.49, 2), (2, 0.5, 1), (2, 1.7, 1), (2, 9.5, 1),  # the 2-core box: idle, one busy, loaded
    (16, 10.4, 6), (16, 3.2, 8), (16, 0.1, 8),                        # a bigger box, capped at 8
    (1, 0.0, 1),
])
def test_idle_cores_is_the_cores_less_those_busy_now_between_1_and_the_cap(monkeypatch, cores, busy, want):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    choice = idle_cores(busy=lambda: busy)
    assert choice.n == want and f"{busy:.1f} of" in choice.why and "busy over" in choice.why


def test_busy_cores_is_the_busy_share_of_two_proc_stat_reads_times_the_cores():
    reads = iter([(1000, 4000), (1000 + 150, 4000 + 200)])  # 150 of 200 jiffies busy between the reads
    slept: list[float] = []
    got = busy_cores(read=lambda: next(reads), sleep=slept.append, seconds=0.3, cores=4)
    assert got == pytest.approx(0.75 * 4) and slept == [0.3]  # the injected clock: no real sleep
    assert busy_cores(read=lambda: None, sleep=slept.append) is None


def test_busy_cores_reads_the_real_proc_stat_where_there_is_one():
    got = busy_cores(sleep=lambda s: None, seconds=0.0)  # two back-to-back reads may see no tick: None or a share
    assert got is None or 0.0 <= got


def test_without_proc_stat_the_load_average_then_1(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("os.getloadavg", lambda: (1.2, 0.0, 0.0))
    choice = idle_cores(busy=lambda: None)
    assert choice.n == 1 and choice.why == "no /proc/stat: 1-minute load average 1.20"

    def no_load() -> tuple[float, float, float]:
        raise OSError("load average unobtainable")

    monkeypatch.setattr("os.getloadavg", no_load)
    assert idle_cores(busy=lambda: None).n == 1


def test_icsd_threads_overrides_the_default_and_is_capped(monkeypatch):
    monkeypatch.setenv("ICSD_THREADS", "3")
    assert env_threads(default=1) == 3 and choose_threads(None).n == 3 and choose_threads(None).why == "ICSD_THREADS"
    assert choose_threads(2).n == 2 and choose_threads(2).why == "threads=2"
    monkeypatch.setenv("ICSD_THREADS", str(MAX_THREADS))
    assert env_threads(default=1) == MAX_THREADS == 256
    for bad in ("10000", str(MAX_THREADS + 1), "0", "-2"):
        monkeypatch.setenv("ICSD_THREADS", bad)
        with pytest.raises(ValueError, match=rf"^ICSD_THREADS={bad}: must lie in 1\.\.256"):
            env_threads(default=1)
    monkeypatch.setenv("ICSD_THREADS", "two")
    with pytest.raises(ValueError, match="ICSD_THREADS='two' is not an integer"):
        env_threads(default=1)
    monkeypatch.setenv("ICSD_THREADS", " ")
    assert env_threads(default=5) == 5
