"""``run.json``: written at start, per step and at the end, atomically; a resume appends a session."""

from __future__ import annotations

import json
import os

from icsd_audit.runs.manifest import RunManifest, git_revision, read_manifest


def test_lifecycle_and_resume(tmp_path):
    cfg = {"seed": 3, "total_steps": 4, "allocator": "icsd", "out_dir": str(tmp_path)}
    m = RunManifest(tmp_path, config=cfg, engine="builtin").start()
    first = read_manifest(tmp_path)
    assert first["status"] == "running" and first["completed_steps"] == 0 and first["seed"] == 3
    assert first["config"] == cfg and first["total_steps"] == 4 and first["engine"] == "builtin"
    m.step(1)
    m.step(2)
    assert read_manifest(tmp_path)["completed_steps"] == 2  # a killed run would stop here, status running
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary left behind
    r = RunManifest(tmp_path, config=cfg, engine="builtin", start_step=2).start()  # --resume at step 2
    r.step(3)
    r.step(4)
    r.finish()
    done = read_manifest(tmp_path)
    assert done["status"] == "finished" and done["completed_steps"] == 4 and done["started"] == first["started"]
    assert [(s["start_step"], s.get("end_step")) for s in done["sessions"]] == [(0, None), (2, 4)]
    assert done["ended"] >= done["started"]
    fresh = RunManifest(tmp_path, config=cfg, engine="trl").start()  # a new run from step 0 starts over
    assert len(read_manifest(tmp_path)["sessions"]) == 1 and fresh.data["engine"] == "trl"


def test_git_revision_of_a_checkout_and_of_no_repository(tmp_path):
    rev = git_revision()
    if rev is not None:  # the tests run from a checkout (CI, dev); from a wheel there is none
        assert len(rev["commit"]) == 40 and isinstance(rev["dirty"], bool)
    assert git_revision(tmp_path) is None or os.environ.get("GIT_DIR")
    assert json.loads(json.dumps(rev)) == rev
