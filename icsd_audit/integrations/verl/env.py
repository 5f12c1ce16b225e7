"""What ``icsd train --engine verl`` writes before it launches: the env's data files, the model, the agent loop.

verl's v1 trainer reads its tasks from parquet files (``data.train_files`` /
``data.val_files``) and plays each row with the agent loop the row names
(``agent_name``).  For the built-in environments this module writes, under the run folder:

* ``data/train.parquet`` and ``data/test.parquet``: one row per task of the run's train
  split and per evaluation task (the first ``eval_tasks`` of its evaluation split), in
  verl-agent's layout (``data_source``, ``prompt``, ``ability``, ``extra_info`` with
  ``split`` and ``index``) plus ``agent_name: icsd_env`` and the task in
  ``extra_info`` (``env``, ``task``).  ``prompt`` holds the task's instruction, for
  reading and for verl's length filter; the agent loop renders the real first prompt
  from the environment, as verl-agent's environment managers do;
* ``agent_loops.yaml``: verl's ``agent_loop_config_path`` file registering ``icsd_env``
  (:class:`~icsd_audit.integrations.verl.agent_loop.EnvAgentLoop`) with the run's
  ``config.json``, which fixes the environment, prompts, turn budget, reply parser,
  reward shaping and invalid-turn rule exactly as the built-in loop uses them;
* ``model/``: the policy as a Hugging Face folder when ``--model`` is ``embedded`` (the
  converted SmolLM2 cache, hard-linked when the file system allows) or ``tiny-random``
  (saved); a local folder or a hub name is used as given.

Imports no verl: ``--dry-run`` writes all of it on any machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["AGENT_LOOP_NAME", "task_instructions", "write_verl_data", "write_agent_loop_config", "export_model"]

#: the agent loop name the data rows carry and ``agent_loops.yaml`` registers
AGENT_LOOP_NAME = "icsd_env"


def _env_factory(cfg: Any) -> Any:
    from icsd_audit.train.setup import env_factory as make_env_factory

    return make_env_factory(cfg)


def task_instructions(cfg: Any, split: str, n: int | None = None) -> list[str]:
    """The instruction of each of the first ``n`` tasks (all without ``n``) of ``split`` of ``cfg.env``.

    ALFWorld's come from the game list (no engine needed); the others from the
    environment's task records.
    """
    if cfg.env == "alfworld":
        from icsd_audit.envs.alfworld.games import game_files

        data = cfg.alfworld_data or None
        games = game_files(split, data=data)
        count = len(games) if n is None else min(n, len(games))
        if getattr(games, "synthetic", False):  # the generated games: their manifest holds each task's text
            return [str(games.entries[i]["task_text"]) for i in range(count)]
        return [games.task_type(i) for i in range(count)]
    env = _env_factory(cfg)(split)
    count = env.num_tasks if n is None else min(n, env.num_tasks)
    tasks = getattr(env, "tasks", None)
    if tasks is not None and count and isinstance(tasks[0], dict) and "instruction" in tasks[0]:
        return [str(tasks[i]["instruction"]) for i in range(count)]  # WebShop's goals
    if tasks is not None and count and hasattr(tasks[0], "question"):
        return [str(tasks[i].question) for i in range(count)]  # Search-QA's items
    return [str(env.reset(i).instruction) for i in range(count)]


def _rows(cfg: Any, split: str, role: str, n: int | None) -> list[dict[str, Any]]:
    return [{"data_source": f"icsd/{cfg.env}", "agent_name": AGENT_LOOP_NAME,
             "prompt": [{"role": "user", "content": text}], "ability": "agent",
             "reward_model": {"style": "environment", "ground_truth": ""},
             "extra_info": {"split": role, "index": i, "env": cfg.env, "env_split": split, "task": i}}
            for i, text in enumerate(task_instructions(cfg, split, n))]


def _write_atomic_table(rows: list[dict[str, Any]], path: Path) -> Path:
    import pyarrow as pa

    from icsd_audit.parquet_io import write_table

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write_table(pa.Table.from_pylist(rows), tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_verl_data(cfg: Any, data_dir: str | Path) -> tuple[Path, Path]:
    """``(train.parquet, test.parquet)`` of ``cfg.env`` under ``data_dir`` (see the module docstring)."""
    d = Path(data_dir)
    train = _write_atomic_table(_rows(cfg, cfg.train_split, "train", None), d / "train.parquet")
    test = _write_atomic_table(_rows(cfg, cfg.eval_split, "test", cfg.eval_tasks), d / "test.parquet")
    return train, test


def write_agent_loop_config(config_json: str | Path, path: str | Path) -> Path:
    """verl's ``agent_loop_config_path`` file: ``icsd_env`` with the run's ``config.json``."""
    import json

    path = Path(path)
    text = (f"# written by `icsd train --engine verl` (docs/engines.md)\n- name: {AGENT_LOOP_NAME}\n"
            f"  _target_: icsd_audit.integrations.verl.agent_loop.EnvAgentLoop\n"
            f"  run_config: {json.dumps(str(Path(config_json).resolve()))}\n")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; verl's workers (maybe another user) read it
    os.replace(tmp, path)
    return path


def _link_tree(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` with hard links where the file system allows (a 0.5 GB model costs nothing)."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)


def export_model(model: str, out_dir: str | Path, *, seed: int = 0) -> str:
    """The ``actor_rollout_ref.model.path`` for ``--model``: an HF folder for ``embedded`` / ``tiny-random``.

    ``embedded`` and ``tiny-random`` are written to ``<out_dir>/model`` (replacing an
    earlier export atomically); anything else is returned as given, an existing local
    folder as its absolute path.
    """
    if model not in ("embedded", "tiny-random"):
        p = Path(model).expanduser()
        return str(p.resolve()) if p.exists() else model
    target = Path(out_dir) / "model"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    try:
        if model == "embedded":
            from icsd_audit.train.models.loading import ensure_embedded_model

            folder, _ = ensure_embedded_model()
            tmp.rmdir()
            _link_tree(folder, tmp)
        else:
            from icsd_audit.train.models.loading import tiny_random_causal_lm

            m, tok = tiny_random_causal_lm(seed=seed)
            m.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=".model.old-", dir=target.parent))
            os.replace(target, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(target.resolve())
