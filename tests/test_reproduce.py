"""Every command in docs/reproduce.md runs, in a tiny form.

The page's ``bash`` blocks are run by bash, in order, with the page's placeholders bound
to small local stand-ins and with ``icsd`` and ``python`` defined as functions that only
record their arguments; bash does the loops, variables and quoting exactly as for a
reader. Each recorded command then runs here, in order, in one scratch folder:

* ``icsd train``: ``--model tiny-random --steps 1`` and a few rollouts of two turns
  (``n_tasks=1``, ``group_size=2``, short prompts and replies, small mini-batches, one
  evaluation task, sketches of k <= 8);
* ``icsd eval``: ``--model tiny-random`` and two tasks (a model gets two turns; the
  expert keeps the preset's turn budget);
* ``icsd audit ...``: at most 200 bootstrap resamples and 2 permutations;
* any other ``icsd`` command (table builders among them) as written;
* ``python`` scripts from the repository root, with ``--model tiny-random`` for
  ``--model embedded`` and one repeat.

Placeholders: ``$M``/``$Q3`` -> any text (every model becomes tiny-random), ``$WS`` -> a
fake WebShop server over the built-in catalogue (tests/envs/test_webshop_server.py),
``$NGOALS`` -> its goal count, ``$RET`` -> a stub Search-R1 retriever over the built-in KB
(tests/envs/test_searchqa_server.py), ``$QA`` -> the built-in KB in Search-R1's files,
``$SK`` -> a small SDAR skills folder, ``ALFWORLD_DATA`` unset (the generated games).
A command naming ALFWorld is marked slow and skips without the ``alfworld`` extra. One outcome other than
success is accepted, and only for an audit: a random model earns no reward, so every
advantage of the tiny runs is 0, and a statistic that needs a non-zero RL direction
(``icsd audit gradcos``) ends with its one-line "undefined in every batch" error, having
read the dumps, their sketch columns and every option. Nothing else may fail.
A code span of the page that starts with ``icsd `` must be one of the block commands,
so no command escapes this test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
from http.server import HTTPServer
from pathlib import Path

import pytest

from icsd_audit.envs.alfworld.engine import engine_available

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reproduce.md"
PLACEHOLDERS = ("M", "Q3", "SK", "WS", "NGOALS", "QA", "RET", "ALFWORLD_DATA")
_BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)

TRAIN_SETS = {"n_tasks": "1", "group_size": "2", "max_turns": "2", "max_response_tokens": "8",
              "max_prompt_tokens": "384", "rollout_batch_rows": "2", "mini_batch_rows": "2", "micro_batch_rows": "2",
              "eval_tasks": "1"}
EVAL_SETS = {"max_response_tokens": "8", "max_prompt_tokens": "384"}


def bash_blocks(text: str) -> list[str]:
    return _BLOCK.findall(text)


def record_commands(blocks: list[str], binding: dict[str, str], workdir: Path) -> list[list[str]]:
    """Run the blocks with bash, ``icsd``/``python`` recording their argv; return the argv lists in order."""
    rec = workdir / "commands.bin"
    assign = re.compile(rf"^\s*(?:export\s+)?({'|'.join(PLACEHOLDERS)})=")
    body = "\n".join(line for b in blocks for line in b.splitlines() if not assign.match(line))
    pre = "\n".join(f"{k}={shlex.quote(v)}" for k, v in binding.items())
    script = (f"set -eo pipefail\n{pre}\nunset ALFWORLD_DATA\n"
              f'icsd() {{ printf "%s\\0" icsd "$@" >> {shlex.quote(str(rec))}; printf "\\1\\0" >> {shlex.quote(str(rec))}; }}\n'
              f'python() {{ printf "%s\\0" python "$@" >> {shlex.quote(str(rec))}; printf "\\1\\0" >> {shlex.quote(str(rec))}; }}\n'
              f"{body}\n")
    rec.write_bytes(b"")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=workdir, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmds, cur = [], []
    for part in rec.read_bytes().split(b"\0")[:-1]:
        if part == b"\1":
            cmds.append(cur)
            cur = []
        else:
            cur.append(part.decode())
    return cmds


def _opt(argv: list[str], flag: str, value: str, *, add: bool = True) -> list[str]:
    """``argv`` with ``flag``'s value replaced (every occurrence), or ``flag value`` appended."""
    out, found, i = [], False, 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            out += [flag, value]
            found, i = True, i + 2
        elif argv[i].startswith(flag + "="):
            out.append(f"{flag}={value}")
            found, i = True, i + 1
        else:
            out.append(argv[i])
            i += 1
    return out if found or not add else out + [flag, value]


def _sets(argv: list[str], sets: dict[str, str]) -> list[str]:
    for k, v in sets.items():
        argv = argv + ["--set", f"{k}={v}"]
    return argv


def _capped(argv: list[str], flag: str, cap: int) -> list[str]:
    for i, a in enumerate(argv[:-1]):
        if a == flag and argv[i + 1].isdigit():
            return _opt(argv, flag, str(min(int(argv[i + 1]), cap)), add=False)
    return argv


def tiny(argv: list[str]) -> list[str]:
    """The tiny form of one recorded command (see the module docstring)."""
    prog, args = argv[0], argv[1:]
    if prog == "python":
        script = ROOT / args[0]
        args = [str(script) if script.exists() else args[0], *args[1:]]
        if "--model" in args:
            args = _opt(args, "--model", "tiny-random", add=False)
        for flag in ("--repeats", "--mini-batches"):
            args = _capped(args, flag, 1)
        return ["python", *args]
    sub = args[0] if args else ""
    if sub == "train":
        args = _opt(_opt(args, "--model", "tiny-random"), "--steps", "1")
        args = _capped(args, "--sketch-k", 8)
        return ["icsd", *_sets(args, TRAIN_SETS)]
    if sub == "eval":
        args = _opt(_opt(args, "--model", "tiny-random"), "--tasks", "2")
        if "expert" not in args:
            args = _opt(args, "--max-turns", "2")
        return ["icsd", *_sets(args, EVAL_SETS)]
    if sub == "audit":
        return ["icsd", *_capped(_capped(args, "--resamples", 200), "--permutations", 2)]
    return argv


def _sdar_skills(root: Path) -> Path:
    """A small SDAR skills folder per environment (skill_mapping.json + markdown), as import_sdar reads it."""
    layouts = {
        "webshop": ({"apparel": ["shirt", "dress"], "other": []}, {"apparel": "apparel", "other": "other"}),
        "alfworld": ({"pick_heat_then_place_in_recep": ["heat"], "pick_and_place": ["put"]},
                     {"pick_and_place": "pick_and_place", "pick_heat_then_place_in_recep": "heat"}),
        "search": ({}, {"direct_retrieval": "direct_retrieval", "multi_hop_reasoning": "multi_hop_reasoning"}),
    }
    for env, (keywords, to_skill) in layouts.items():
        d = root / env
        d.mkdir(parents=True)
        files = {"general_skills": "general_skills.md", **{s: f"{s}.md" for s in set(to_skill.values())}}
        for name, fname in files.items():
            (d / fname).write_text(f"## {name}\n- a skill of {name}\n")
        (d / "skill_mapping.json").write_text(json.dumps({"skill_files": files, "task_to_skill": to_skill,
                                                          "task_keywords": keywords}))
    return root


def _serve(handler) -> tuple[HTTPServer, str]:
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class Workspace:
    """The scratch folder, stand-ins and recorded commands, built once per session."""

    def __init__(self, root: Path):
        from icsd_audit.envs.searchqa import builtin_kb, write_searchr1
        from tests.envs import test_searchqa_server as sq
        from tests.envs import test_webshop_server as ws

        self.root = root
        for shared in ("examples",):  # the page reads the repository's example runs by relative path
            (root / shared).symlink_to(ROOT / shared, target_is_directory=True)
        fake = ws.FakeWebShop()
        self.servers = []
        shop, shop_url = _serve(ws.make_handler(fake))
        ret, ret_url = _serve(sq.make_handler(sq.Stub()))
        self.servers += [shop, ret]
        qa = root / "qa"
        write_searchr1(builtin_kb(), qa)
        binding = {"M": "/models/any", "Q3": "/models/any-qwen3", "SK": str(_sdar_skills(root / "skills")),
                   "WS": shop_url, "NGOALS": str(len(fake.goals)), "QA": str(qa), "RET": f"{ret_url}/retrieve"}
        self.commands = record_commands(bash_blocks(PAGE.read_text()), binding, root)

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()


def _label(i: int, argv: list[str]) -> str:
    words = [a for a in argv[1:] if not a.startswith("-")][:2]
    env = next((argv[j + 1] for j, a in enumerate(argv[:-1]) if a == "--env"), "")
    alloc = next((argv[j + 1] for j, a in enumerate(argv[:-1]) if a == "--allocator"), "")
    tag = "alfworld" if _needs_alfworld(argv) and env != "alfworld" else ""
    return "-".join(x for x in [f"{i:02d}", argv[0], *words[:1], env, alloc, tag] if x).replace("/", "_")[:60]


#: tables built from ALFWorld runs only (Table 3: Qwen3 on ALFWorld, Table 4: the ALFWorld ablation)
ALFWORLD_TABLES = ("paper-3", "paper-4")


def _needs_alfworld(argv: list[str]) -> bool:
    return any("alfworld" in a for a in argv) or any(t in argv for t in ALFWORLD_TABLES)


_COMMANDS: list[list[str]] = []


def _collect() -> list[list[str]]:
    """The page's commands as bash expands them, for test ids (placeholders bound to dummies)."""
    if not _COMMANDS:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            binding = {k: f"/x/{k}" for k in PLACEHOLDERS}
            _COMMANDS.extend(record_commands(bash_blocks(PAGE.read_text()), binding, Path(d)))
    return _COMMANDS


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproduce")
    w = Workspace(root)
    yield w
    w.close()


def test_every_icsd_code_span_is_a_block_command():
    text = PAGE.read_text()
    outside = _BLOCK.sub("", text)
    spans = [s for s in re.findall(r"`([^`\n]+)`", outside) if s.startswith("icsd ")]
    block_text = " ".join(bash_blocks(text))
    flat = " ".join(block_text.replace("\\\n", " ").split())
    missing = [s for s in spans if " ".join(s.split()) not in flat]
    assert not missing, f"docs/reproduce.md names commands outside its bash blocks (the test cannot run them): {missing}"


def test_the_page_has_commands_for_every_table_and_figure():
    cmds = _collect()
    assert len(cmds) > 20
    text = PAGE.read_text()
    for anchor in ("Table 1", "Table 2", "Table 3", "Table 4", "Table A1", "Figure 2", "Figure 3", "Figure 4",
                   "Figure A1", "Figure A3", "Compute overhead"):
        assert f"### {anchor}" in text or f"## {anchor}" in text, anchor


def _params() -> list[object]:
    """One parameter per command; those naming ALFWorld are marked slow: with the alfworld extra installed they
    add minutes to the default suite, so CI runs them in its ALFWorld step (``-m 'slow or not slow'``)."""
    return [pytest.param(i, id=_label(i, c), marks=[pytest.mark.slow] if _needs_alfworld(c) else [])
            for i, c in enumerate(_collect())]


@pytest.mark.parametrize("index", _params())
def test_reproduce_command_runs(index, workspace, monkeypatch, capsys):
    argv = tiny(workspace.commands[index])
    if _needs_alfworld(argv) and not engine_available():
        pytest.skip("ALFWorld engine not installed: pip install 'icsd-audit[alfworld]'")
    monkeypatch.chdir(workspace.root)
    monkeypatch.setenv("ICSD_CACHE", str(workspace.root / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ICSD_THREADS", "1")
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    if argv[0] == "python":
        proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, cwd=workspace.root,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stderr[-3000:]}"
        return
    from icsd_audit.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(argv[1:])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if argv[1] == "audit" and done.value.code == 2 and "undefined in every batch" in err:
        assert "zero RL direction (every advantage is 0)" in err and err.count("error:") == 1, err
        return
    assert done.value.code in (0, None), f"{shlex.join(argv)}\n{err[-3000:]}"
