"""The named training presets: the paper's settings per environment and the CPU presets of this project.

``PRESETS`` maps a name to a factory of a fresh :class:`~icsd_audit.train.config.fields.TrainConfig`;
``<name>-<env>`` is the variant of preset ``name`` for ``env`` (:func:`preset_for`). Field
meanings are TrainConfig's docstrings; these factories only choose values.
"""

from __future__ import annotations

from typing import Any

from icsd_audit.train.config.errors import ConfigError
from icsd_audit.train.config.fields import TrainConfig
from icsd_audit.train.config.warmstarts import WARM_START_PREFIX, same_base

__all__ = ["CPU_WARM_START", "PRESETS", "from_preset", "preset", "preset_for"]


def _paper() -> TrainConfig:
    return TrainConfig(
        out_dir="runs/paper",
        n_tasks=16, group_size=8, max_turns=15,
        max_prompt_tokens=4096, max_response_tokens=512,
        mini_batch_rows=64 * 8, micro_batch_rows=8,
        lr=1e-6, clip_ratio=0.2, dual_clip=3.0, kl_coef=0.01, distill_coef=0.01,
        total_steps=150, eval_tasks=128, eval_every=10, eval_temperature=0.4,
        adv_estimator="gigpo", gamma=0.95, step_weight=1.0,
        temperature=1.0, reward="won10", invalid_penalty=0.1,
        recompute_old_logp=True, checkpoint_every=10, dump_every=1,
    )


def _cpu_base() -> TrainConfig:
    """What every CPU preset shares: the embedded model on 2 cores, short replies, dumps and sketches each step."""
    return TrainConfig(
        out_dir="runs/cpu-demo",
        model="embedded", device="cpu", precision="float32", threads=None,
        n_tasks=2, group_size=4, max_turns=2, history_window=1,
        max_prompt_tokens=1024, max_response_tokens=48,
        temperature=0.7, one_shot=True, reward="score",
        rollout_batch_rows=8, mini_batch_rows=4, micro_batch_rows=4,
        lr=1e-5, total_steps=2, dump_every=1, checkpoint_every=0, keep_checkpoints=1,
        eval_every=0, eval_tasks=4, eval_temperature=0.7,
        sketch_k=32,  # so that `icsd audit gradcos` and the report's alignment section work on its dumps
    )


#: The warm start the WebShop CPU presets start from (``icsd sft``; docs/training.md, "Warm start from the expert").
CPU_WARM_START = "warmstart:webshop-smollm2-135m"


def _cpu_demo() -> TrainConfig:
    """The README's main job: RL from the shipped warm start, whose prompts these are (no one-shot example:
    the warm start learned the format; 5 turns and 96-token replies let the expert's 3-to-6-step path and
    its longest reply fit, so a purchase, hence a score, is within reach)."""
    return _cpu_base().replace(
        init=CPU_WARM_START,
        n_tasks=2, group_size=3, max_turns=5, max_response_tokens=96, one_shot=False,
        mini_batch_rows=64, micro_batch_rows=4,
        lr=1e-4, total_steps=3,
    )


def _cpu_study() -> TrainConfig:
    """examples/cpu-study: the main job made cheap enough for 9 runs (one task of 3 episodes a step, no sketches)."""
    return _cpu_demo().replace(out_dir="runs/cpu-study", n_tasks=1, group_size=3, sketch_k=0, total_steps=3)


def _paper_searchqa() -> TrainConfig:
    """Table A1's Search-QA column: 128 x 8, 4 turns, mini-batch 256 prompts, KL 0.001, 200 updates, 512 held out."""
    return _paper().replace(
        out_dir="runs/paper-searchqa", env="searchqa",
        n_tasks=128, group_size=8, max_turns=4, history_window=3,
        max_prompt_tokens=4096, max_response_tokens=512,
        mini_batch_rows=256 * 8, kl_coef=0.001, total_steps=200, eval_tasks=512,
        reward="score",
        gigpo_mode="mean_std_norm",  # verl-agent's examples/gigpo_trainer/run_search.sh, line 10 (SDAR@aa18336)
        # SDAR's search scripts (jasonchen505/SDAR@aa18336; examples/sdar_trainer/run_search_3b.sh lines 34 and
        # 54, the same in its gigpo/grpo/opsd copies of verl-agent's run_search.sh): warm-up ratio 0.1 and
        # invalid_action_penalty_coef 0.01; they set no val_kwargs, so validation is verl's default, greedy
        # (verl/trainer/config/ppo_trainer.yaml lines 144 and 146: temperature 0, do_sample False)
        lr_warmup_steps_ratio=0.1, invalid_penalty=0.01, eval_temperature=0.0,
    )


def _cpu_demo_searchqa() -> TrainConfig:
    return _cpu_base().replace(
        out_dir="runs/cpu-demo-searchqa", env="searchqa",
        max_turns=3, history_window=2, max_response_tokens=64, kl_coef=0.001,
    )


def _paper_alfworld() -> TrainConfig:
    return _paper().replace(
        out_dir="runs/paper-alfworld", env="alfworld", max_turns=50, max_prompt_tokens=2048,
        mini_batch_rows=256 * 8,
        # verl-agent's examples/gigpo_trainer/run_alfworld.sh sets mode="mean_std_norm" (line 10 in
        # SDAR's copy, jasonchen505/SDAR@aa18336; run_webshop.sh keeps mean_norm)
        gigpo_mode="mean_std_norm",
    )


def _cpu_demo_alfworld() -> TrainConfig:
    return _cpu_base().replace(
        out_dir="runs/cpu-demo-alfworld", env="alfworld", max_turns=3, max_prompt_tokens=1536, reward="won10",
    )


def _cpu_demo_clue() -> TrainConfig:
    """The clue testbed (docs/envs.md, "Clue"): the tiny word model from random init, GRPO with the teacher's
    allocation, 200 updates of 16 tasks x 8 episodes (64-row optimizer steps: about six per update), greedy evaluation on 100
    held-out tasks every 20 updates."""
    return TrainConfig(
        out_dir="runs/clue", env="clue", model="tiny-word", device="cpu", precision="float32", threads=None,
        clue_boxes=8, clue_accuracy=1.0,
        n_tasks=16, group_size=8, max_turns=4, history_window=1,
        max_prompt_tokens=64, max_response_tokens=2, temperature=1.0, one_shot=False,
        reward="score", invalid_penalty=0.1, adv_estimator="grpo",
        rollout_batch_rows=64, mini_batch_rows=64, micro_batch_rows=64,
        lr=1e-3, kl_coef=0.0, total_steps=200, dump_every=1, checkpoint_every=0, keep_checkpoints=1,
        eval_every=20, eval_tasks=100, eval_temperature=0.0, sketch_k=0, recompute_activations=False,
        # 280k parameters: AdamW's moments stay in memory and no freed memory is handed back (same numbers)
        spill_optimizer_state=False, trim_memory=False,
    )


#: Preset name -> factory. ``<name>-<env>`` is the variant of preset ``name`` for ``env``
#: (see :func:`preset_for`).
PRESETS = {"paper": _paper, "cpu-demo": _cpu_demo, "cpu-study": _cpu_study,
           "paper-searchqa": _paper_searchqa, "cpu-demo-searchqa": _cpu_demo_searchqa,
           "paper-alfworld": _paper_alfworld, "cpu-demo-alfworld": _cpu_demo_alfworld, "cpu-demo-clue": _cpu_demo_clue,
           # the paper has no clue column: --preset paper (icsd eval --policy expert's default) gets the testbed's one setting
           "paper-clue": _cpu_demo_clue}


def preset(name: str) -> TrainConfig:
    """A fresh config for preset ``name`` (``paper``, ``cpu-demo``, or an ``<name>-<env>`` variant)."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError([f"unknown preset {name!r}; choose one of {sorted(PRESETS)}"]) from None


def preset_for(name: str, env: str | None) -> str:
    """``name``'s variant for ``env`` when there is one (``paper`` + searchqa -> ``paper-searchqa``), else ``name``."""
    return f"{name}-{env}" if env and f"{name}-{env}" in PRESETS else name


def from_preset(name: str, **overrides: Any) -> TrainConfig:
    """Preset ``name`` with ``overrides``. A preset's shipped warm start belongs to its base model:
    when ``model`` names another model (and ``init`` is not given), the run starts from that model."""
    base = preset(name)
    if ("model" in overrides and "init" not in overrides and base.init is not None
            and base.init.startswith(WARM_START_PREFIX) and not same_base(overrides["model"], base.init)):
        overrides = {**overrides, "init": None}
    return base.replace(**overrides)
