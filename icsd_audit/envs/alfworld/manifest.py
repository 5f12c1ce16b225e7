"""Build the manifest of the generated ALFWorld splits by having the engine's expert play every game.

    python -m icsd_audit.envs.alfworld.manifest [--out PATH] [--sizes train=300,eval=180] [--progress FILE]

For game ``i`` of each split it draws attempts 0, 1, 2, ... and keeps the first one the
handcoded expert (seeded with ``i``) wins within ``EXPERT_STEP_LIMIT`` steps, recording
the attempt, the problem's hash and the winning walkthrough. Needs the ``alfworld``
extra; takes 2-8 s per game on one core (more for pick-two games, which the expert
often fails, so they take several draws).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .engine import expert_play, make_game_env
from .games import EXPERT_STEP_LIMIT, MANIFEST_PATH, SPLIT_SEEDS, SPLIT_SIZES, problem_hash, write_game
from .generate import GENERATOR_VERSION, draw_game

__all__ = ["check_game", "build_manifest"]

MAX_ATTEMPTS = 50


def check_game(env: Any, split: str, index: int, attempt: int, workdir: Path) -> tuple[bool, list[str], Any]:
    """Write attempt ``attempt`` of game ``index`` under ``workdir`` and let the expert play it."""
    game = draw_game(SPLIT_SEEDS[split], index, attempt)
    path = write_game(workdir / split / f"{index:04d}-{attempt}", game, walkthrough=None)
    won, actions = expert_play(env, path, max_steps=EXPERT_STEP_LIMIT, seed=index)
    return won, actions, game


def build_manifest(sizes: dict[str, int], *, progress: Path | None = None, log: Any = sys.stderr) -> dict[str, Any]:
    """Check every game; with ``progress`` (a JSONL file) finished games are kept across restarts."""
    env = make_game_env(expert=True)
    out: dict[str, Any] = {"format": "icsd-alfworld-games", "generator_version": GENERATOR_VERSION,
                           "expert": "alfworld handcoded (HandCodedTWAgent), seeded with the game index",
                           "expert_step_limit": EXPERT_STEP_LIMIT, "split_seeds": dict(SPLIT_SEEDS), "splits": {}}
    done: dict[tuple[str, int], dict[str, Any]] = {}
    if progress is not None and progress.exists():
        for line in progress.read_text().splitlines():
            rec = json.loads(line)
            done[(rec.pop("split"), rec.pop("index"))] = rec
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="icsd-alfworld-manifest-") as tmp:
        for split, n in sizes.items():
            entries = []
            for i in range(n):
                if (split, i) in done:
                    entries.append(done[(split, i)])
                    continue
                for attempt in range(MAX_ATTEMPTS):
                    won, actions, game = check_game(env, split, i, attempt, Path(tmp))
                    if won:
                        break
                else:
                    raise RuntimeError(f"no winnable attempt for {split}/{i} in {MAX_ATTEMPTS} draws")
                entry = {"attempt": attempt, "hash": problem_hash(game.problem), "task_type": game.task_type,
                         "task_text": game.task_text, "walkthrough": actions}
                entries.append(entry)
                if progress is not None:
                    with progress.open("a") as f:
                        f.write(json.dumps({"split": split, "index": i, **entry}) + "\n")
                print(f"{split} {i + 1}/{n} attempt {attempt} {game.task_type} steps {len(actions)} "
                      f"({time.perf_counter() - t0:.0f} s)", file=log, flush=True)
            out["splits"][split] = entries
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=MANIFEST_PATH)
    ap.add_argument("--sizes", default=",".join(f"{k}={v}" for k, v in SPLIT_SIZES.items()))
    ap.add_argument("--progress", type=Path, default=None, help="JSONL file that keeps finished games across restarts")
    args = ap.parse_args(argv)
    sizes = {k: int(v) for k, v in (item.split("=") for item in args.sizes.split(","))}
    data = build_manifest(sizes, progress=args.progress)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(gzip.compress(json.dumps(data, separators=(",", ":")).encode(), mtime=0))
    tmp.replace(args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
