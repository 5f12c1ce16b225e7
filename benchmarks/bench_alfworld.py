"""Speed of ALFWorld on the real engine (one core): game loads, resets, steps.

    ICSD_THREADS=1 taskset -c 0 python benchmarks/bench_alfworld.py [--games 12] [--steps 30] [--seed 0] [--json]

For each of the first ``--games`` generated train games (two of each task type by
default): the first ``reset`` (writes the game to the cache if needed and loads it: PDDL
translation and grammar parsing), a second ``reset`` of the same game, then
``--steps`` steps of a random policy over the admissible actions, and the expert's
walkthrough from a fresh reset. Reports medians and steps per second; ``--no-memo``
measures TextWorld's own (unmemoized) parsing. Needs the ``alfworld`` extra.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memo", action="store_true", help="TextWorld's own parsing (no memo)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)

    from icsd_audit.envs.alfworld import engine
    from icsd_audit.envs.alfworld.env import AlfWorldEnv
    from icsd_audit.envs.alfworld.games import load_manifest

    if args.no_memo:
        engine.memoize_parsing = lambda: None  # type: ignore[assignment]
    env = AlfWorldEnv("train", max_steps=10_000, seed=args.seed)
    walks = load_manifest()["splits"]["train"]
    rng = random.Random(args.seed)
    first, again, step_t, walk_t = [], [], [], []
    n_random = n_walk = 0
    for g in range(args.games):
        env.games.ref(g)  # write the game into the cache outside the timing
        env._loaded = None  # force a load, as the first episode on a game has
        t0 = time.perf_counter()
        obs = env.reset(g)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        obs = env.reset(g)
        again.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            res = env.step(rng.choice(obs.available_actions))
            obs = res.observation
            n_random += 1
            if res.done:
                obs = env.reset(g)
        step_t.append(time.perf_counter() - t0)
        env.reset(g)
        t0 = time.perf_counter()
        for action in walks[g]["walkthrough"]:
            res = env.step(action)
            n_walk += 1
        walk_t.append(time.perf_counter() - t0)
        assert res.won, f"walkthrough of train/{g} did not win"
    out = {
        "games": args.games,
        "memo": not args.no_memo,
        "first_reset_s_median": statistics.median(first),
        "same_game_reset_s_median": statistics.median(again),
        "random_steps_per_s": n_random / sum(step_t),
        "expert_steps_per_s": n_walk / sum(walk_t),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>26}: {v:.3f}" if isinstance(v, float) else f"{k:>26}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
