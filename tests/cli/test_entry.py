"""The console script's exit without teardown keeps exit codes, output and atexit handlers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_help_exit_code_and_atexit_handlers(tmp_path: Path) -> None:
    marker = tmp_path / "atexit.txt"
    code = ("import atexit, sys; from icsd_audit.cli.main import entry; "
            f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ran')); "
            "sys.argv = ['icsd', '--help']; entry()")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert "audit" in res.stdout and res.stdout.endswith("\n")
    assert marker.read_text() == "ran"


def test_usage_error_keeps_status_2_and_its_line() -> None:
    res = _run("import sys; from icsd_audit.cli.main import entry; sys.argv = ['icsd', 'audit', 'tcm', '--nope']; entry()")
    assert res.returncode == 2
    assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1


def test_large_stdout_reaches_the_pipe_whole(tmp_path: Path) -> None:
    # 200k lines written by the command and flushed before os._exit: none may be lost
    code = ("import sys, typer; from icsd_audit.cli.apps import app\n"
            "@app.command('bulk')\n"
            "def bulk() -> None:\n"
            "    sys.stdout.write(''.join(f'{i}\\n' for i in range(200_000)))\n"
            "from icsd_audit.cli.main import entry; sys.argv = ['icsd', 'bulk']; entry()")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 200_000 and lines[-1] == "199999"


def test_a_live_thread_gets_the_normal_exit_that_waits_for_it(tmp_path: Path) -> None:
    marker = tmp_path / "thread.txt"
    code = ("import sys, threading, time; from icsd_audit.cli.main import entry\n"
            f"def late():\n    time.sleep(0.5); open({str(marker)!r}, 'w').write('done')\n"
            "threading.Thread(target=late).start(); sys.argv = ['icsd', '--help']; entry()")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert marker.read_text() == "done"


def test_sys_exit_with_a_message_prints_it_and_exits_1() -> None:
    code = ("import sys; from icsd_audit.cli import main as m\n"
            "m.main = lambda: sys.exit('stopped: reason')\n"
            "m.entry()")
    res = _run(code)
    assert res.returncode == 1
    assert res.stderr.strip() == "stopped: reason"
