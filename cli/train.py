"""``icsd train`` and ``icsd eval``: the training loop and held-out evaluation."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Mapping, Optional

import typer

from .common import fail, handle_errors, stderr_console
from .options import allocator_options
from .apps import app
from .progress import RichReporter as _RichReporter, routed_logs, silence_bars


#: What ``pip install 'icsd-audit[train]'`` adds (pyproject.toml), by import name.
TRAIN_EXTRA = ("transformers", "gguf", "accelerate", "bm25s", "safetensors")


def _require_train_extra(command: str) -> None:
    """Fail in one line, before any import, when the ``[train]`` extra is not installed."""
    import importlib.util

    missing = []
    for name in TRAIN_EXTRA:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise fail(f"`icsd {command}` needs the [train] extra ({', '.join(missing)} not installed): "
                   "pip install 'icsd-audit[train]' (from a checkout: pip install -e '.[train]')")
    from icsd_audit.threads import check_environment

    check_environment()  # ICSD_* variables: a bad one fails here, naming it, before any work


#: config fields whose command-line option is not ``--field-name``
_FLAGS = {"total_steps": "--steps", "adv_estimator": "--adv", "distill_coef": "--lambda", "out_dir": "--out",
          "checkpoint_optimizer": "--weights-only", "eval_tasks": "--tasks", "eval_temperature": "--temperature",
          "alloc_eps": "--eps"}


def _build_config(preset: str, overrides: Mapping[str, Any], sets: List[str], *, env_here: bool = True) -> Any:
    """The validated config; each problem names the option that set the field (``--seed: seed=-1 must ...``).

    ``env_here=False``: the environment runs on another machine (``--engine verl --dry-run``).
    """
    from icsd_audit.train.config import ConfigError, TrainConfig, from_preset, parse_override, preset_for

    fields: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    given = {k: _FLAGS.get(k, "--" + k.replace("_", "-")) for k in fields}
    for item in sets:
        key, value = parse_override(item)
        if key in fields and fields[key] != value:  # two options for one field: neither silently wins
            raise ConfigError([f"--set {item.strip()} contradicts {given[key]} (both set {key}: {value!r} and "
                               f"{fields[key]!r}); pass one"])
        fields[key] = value
        given[key] = f"--set {item.strip()}"
    try:
        return from_preset(preset_for(preset, fields.get("env")), **fields).validate(env_here=env_here)
    except ConfigError as exc:
        named = [next((f"{given[k]}: {p}" for k in given if p.startswith(f"{k}=")), p) for p in exc.problems]
        raise ConfigError(named) from None


def resume_command(flag: str = "--resume") -> str | None:
    """This command line with ``flag`` (``--resume`` or ``--overwrite``) instead of ``--resume``, ``--overwrite``
    and ``--resume-from``, when it is known."""
    import shlex

    args = sys.argv[1:]
    if "train" not in args:
        return None
    kept: list[str] = []
    skip = False
    for a in args[args.index("train"):]:
        if skip:
            skip = False
        elif a == "--resume-from":
            skip = True
        elif a not in ("--overwrite", "--resume") and not a.startswith("--resume-from="):
            kept.append(a)
    return "icsd " + shlex.join(kept + [flag])


def _print_fields() -> None:
    from icsd_audit.train.config import field_docs

    con = stderr_console()
    for name, (typ, doc, default) in field_docs().items():
        con.print(f"[bold]{name}[/] ({typ}, default {default!r}): {doc}", highlight=False)


def _note_prompt_changes(cfg: Any) -> None:
    """One line when the run's prompts differ from those a warm start (icsd sft) was fitted to."""
    from icsd_audit.train.models.lora import is_adapter_dir, read_adapter_meta
    from icsd_audit.train.sft import prompt_changes

    init = cfg.init_path
    if init is None or not is_adapter_dir(init):
        return
    changed = prompt_changes(read_adapter_meta(init).get("prompts"), cfg)
    if changed:
        stderr_console().print(f"note: the warm start {cfg.init} was fitted to prompts with {changed[0]}; this run "
                               f"uses {changed[1]}: what it learned may not carry over", highlight=False, soft_wrap=True)


def _check_env_data(cfg: Any) -> None:
    """Load the environment's user data before the model, so a bad file fails in seconds (exit 2)."""
    if cfg.env == "searchqa":
        from icsd_audit.envs.searchqa import load_data

        load_data(cfg.searchqa_corpus, cfg.searchqa_data, cfg.retriever_url or cfg.env_url)  # cached for the run


@app.command("train")
@handle_errors
@allocator_options("(default: the preset's; else {})")
def train_cmd(
    preset: str = typer.Option(
        "cpu-demo", help="Starting configuration: paper (Table A1) or cpu-demo; with --env searchqa or alfworld "
                         "their variants."),
    env: Optional[str] = typer.Option(
        None, help="Environment (built-in: webshop, searchqa, alfworld, clue; alfworld: pip install 'icsd-audit\\[alfworld]')."),
    env_url: Optional[str] = typer.Option(None, help="URL of a real WebShop server instead of the built-in one."),
    model: Optional[str] = typer.Option(None, help="Local HF model folder, 'embedded' (SmolLM2-135M) or 'tiny-random'."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run folder (metrics.jsonl, dumps/, checkpoints/)."),
    steps: Optional[int] = typer.Option(None, help="Training steps."),
    adv: Optional[str] = typer.Option(None, help="Advantage estimator: grpo or gigpo."),
    allocator: Optional[str] = typer.Option(
        None, help="none (plain GRPO/GiGPO), opsd, sdar, icsd, fisher, sign, influence-only, gaussian, permuted. "
                   "Paper names: '+ OPSD' = opsd, stand-alone 'OPSD' = opsd with --set pg_coef=0, "
                   "'Skill-GRPO' = none with --set student_skills=train ('Skill-GRPO*': both), "
                   "'Fisher magnitude' = fisher, 'Sign-only' = sign (docs/reproduce.md)."),
    hybrid: Optional[str] = typer.Option(
        None, help="The paper's hybrid distillation baselines, as SDAR's code defines them (with --allocator none): "
                   "rlsd or skill-sd; none: off (docs/training.md)."),
    distill_coef: Optional[float] = typer.Option(None, "--lambda", help="Distillation weight lambda."),
    seed: Optional[int] = typer.Option(None, help="Master seed."),
    device: Optional[str] = typer.Option(None, help="auto, cpu, cuda, cuda:1, ..."),
    eval_every: Optional[int] = typer.Option(None, help="Evaluate on held-out instructions every N steps (0: never)."),
    dump_every: Optional[int] = typer.Option(None, help="Dump every actor mini-batch every N steps (0: never)."),
    sketch_k: Optional[int] = typer.Option(
        None, help="Per-token gradient sketches in the dumps (for `icsd audit gradcos`): k projections per side; 0: off."),
    sketch_layers: Optional[str] = typer.Option(
        None, help="Layers to sketch: auto (LM head + last block's o_proj and MLP) or comma-separated module names."),
    lora: Optional[int] = typer.Option(
        None, "--lora", help="Train rank-R LoRA adapters (peft) instead of every weight; 0: full fine-tuning."),
    lora_alpha: Optional[float] = typer.Option(None, help="LoRA scaling alpha (default 2 * R)."),
    lora_targets: Optional[str] = typer.Option(
        None, help="Modules that get adapters: all-linear (default: every linear of the decoder blocks, not the LM "
                   "head) or comma-separated names, e.g. q_proj,v_proj."),
    init: Optional[Path] = typer.Option(
        None, help="Start from this folder: a LoRA adapter (icsd train checkpoints, icsd sft) or a full model folder."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --out from its newest complete checkpoint (from step 0 when it has "
                                "none; a new run when --out is empty)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="--out holds another run: move it aside (to OUT.old-<date>, never deleted) and start afresh."),
    resume_from: Optional[Path] = typer.Option(None, help="Continue from this checkpoint folder."),
    set_: List[str] = typer.Option([], "--set", help="Any config field: --set lr=1e-5 (repeatable)."),
    list_fields: bool = typer.Option(False, "--list-fields", help="List every config field with its doc and exit."),
    keep_checkpoints: Optional[int] = typer.Option(
        None, help="Keep the newest N checkpoints (default 1; one is 1.6 GB for the 135M model)."),
    weights_only: bool = typer.Option(
        False, "--weights-only", help="Checkpoints without AdamW state (0.54 GB instead of 1.6 GB; a resume restarts AdamW)."),
    plain: bool = typer.Option(False, "--plain", help="Plain log lines instead of a progress bar (the default when stderr is not a terminal)."),
    report_to: Optional[str] = typer.Option(
        None, "--report-to", help="Also log every step's metrics and the config to trackers: tensorboard, mlflow, "
        "trackio, wandb (comma-separated; local stores; each needs its extra, e.g. pip install 'icsd-audit\\[tensorboard]')."),
    policy: Optional[str] = typer.Option(
        None, help="model (train it) or expert (the environment's expert plays the rollouts: advantages, metrics and "
                   "turns.jsonl, no gradient; a check of the environment's rules and the source of warm-start data)."),
    engine: str = typer.Option(
        "builtin", help="builtin (our multi-turn loop), trl (ICSDGRPOTrainer on whole episodes, GRPO advantages; "
        "icsd-audit[trl]) or verl (writes the env's data files, the model and verl_command.sh, and launches it; "
        "needs GPUs, icsd-audit[verl]). See docs/engines.md."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="--engine verl: write config.json, data/, model/, agent_loops.yaml and verl_command.sh "
                                 "into the run folder and run nothing (any machine)."),
    gpus: Optional[int] = typer.Option(
        None, help="--engine verl: GPUs per node the command asks for (default: all torch sees; 1 for --dry-run "
                   "on a machine without)."),
    *, settings: dict[str, Any],
) -> None:
    """Train a policy with GRPO/GiGPO, a privileged self-teacher and an allocated distillation term.

    Writes metrics.jsonl (one line per step), dumps/ (per-token rows of every actor mini-batch, readable by `icsd audit ...`) and checkpoints/ under the run folder.

    Example: icsd train --env webshop --preset cpu-demo --allocator icsd --out runs/demo

    A run folder holds one run: a new run into a folder holding another is refused (--resume continues it, --overwrite moves it aside). SIGTERM or Ctrl-C stops at once without a half-written file (exit 143 / 130) and says how to continue.

    Search-QA over your own Search-R1 files: icsd train --env searchqa --preset paper --set searchqa_corpus=corpus.jsonl --set searchqa_data=train.parquet,test.parquet

    Example: icsd train --engine verl --preset paper --model /models/Qwen2.5-1.5B-Instruct --out runs/verl

    Expert rollouts (no gradient): icsd train --env searchqa --model tiny-random --policy expert --steps 1 --out runs/expert

    LoRA: icsd train --preset cpu-demo --lora 8 --set lr=1e-4 --out runs/lora (checkpoints hold the adapter only); a warm start: --init ADAPTER_DIR.

    verl files only: icsd train --engine verl --env alfworld --dry-run --out runs/verl-alf

    ALFWorld: icsd train --env alfworld --preset cpu-demo --out runs/alf (generated games; --set alfworld_data=PATH or $ALFWORLD_DATA for the official ones).
    """
    if list_fields:
        _print_fields()
        return
    import contextlib

    from icsd_audit.outputs import GracefulStop, Stopped

    try:  # builtin, trl: a signal before the run starts writes nothing and exits as one during it (143 / 130)
        with GracefulStop() if engine in ("builtin", "trl") else contextlib.nullcontext():
            _train(preset, dict(env=env, env_url=env_url, model=model, out=out, steps=steps, adv=adv,
                                allocator=allocator, hybrid=hybrid, settings=settings, distill_coef=distill_coef, seed=seed,
                                device=device,
                                eval_every=eval_every, dump_every=dump_every, sketch_k=sketch_k,
                                sketch_layers=sketch_layers, keep_checkpoints=keep_checkpoints,
                                weights_only=weights_only, report_to=report_to, policy=policy, lora=lora,
                                lora_alpha=lora_alpha, lora_targets=lora_targets, init=init), resume=resume,
                   resume_from=resume_from, overwrite=overwrite,
                   set_=set_, plain=plain, engine=engine, dry_run=dry_run, gpus=gpus)
    except Stopped as exc:
        from icsd_audit.train.run.resume import TrainingStopped

        line = exc.line(resume_command(), resume_command("--overwrite")) if isinstance(exc, TrainingStopped) else \
            exc.line(resume_command()) if hasattr(exc, "line") else (
            f"stopped by {exc.signal_name} before the run started: nothing was written")
        print(line, file=sys.stderr)
        raise typer.Exit(exc.exit_code) from None


def _train(preset: str, o: dict[str, Any], *, resume: bool, resume_from: Optional[Path], overwrite: bool,
           set_: List[str], plain: bool, engine: str, dry_run: bool = False, gpus: Optional[int] = None) -> None:
    from icsd_audit.train.launch import check_launch, launch

    _require_train_extra("train")
    # a live bar only on a terminal; logs get whole lines, one per phase, and no progress bars
    log_lines = plain or not sys.stderr.isatty()
    silence_bars()  # tqdm and Hugging Face bars: our bar or log lines say what runs
    from icsd_audit.train.run.metrics import PrintReporter

    model, init = o["model"], o["init"]
    if init is not None and model is None:  # an adapter names its base: --init alone is enough
        from icsd_audit.train.config import resolve_init
        from icsd_audit.train.models.lora import is_adapter_dir, read_adapter_meta

        folder = str(resolve_init(str(init)))
        model = read_adapter_meta(folder).get("base_model") if is_adapter_dir(folder) else None
    alloc = {("alloc_eps" if k == "eps" else k): v for k, v in o["settings"].items()}
    cfg = _build_config(preset, dict(env=o["env"], env_url=o["env_url"], model=model,
                                     out_dir=None if o["out"] is None else str(o["out"]), total_steps=o["steps"],
                                     adv_estimator=o["adv"], allocator=o["allocator"], hybrid=o["hybrid"], **alloc,
                                     distill_coef=o["distill_coef"], seed=o["seed"], device=o["device"],
                                     eval_every=o["eval_every"], dump_every=o["dump_every"], sketch_k=o["sketch_k"],
                                     sketch_layers=o["sketch_layers"], keep_checkpoints=o["keep_checkpoints"],
                                     report_to=o["report_to"], policy=o["policy"], lora_rank=o["lora"],
                                     lora_alpha=o["lora_alpha"], lora_targets=o["lora_targets"],
                                     init=None if init is None else str(init),
                                     checkpoint_optimizer=False if o["weights_only"] else None), set_,
                        env_here=not dry_run)
    check_launch(cfg, engine=engine, dry_run=dry_run, gpus=gpus)
    if engine == "verl" and init is None and not any(x.strip().startswith("init=") for x in set_ or []) \
            and (cfg.init or "").startswith("warmstart:"):
        cfg = cfg.replace(init=None)  # a preset's warm start is for the built-in model on CPU, not verl's
    cfg.validate_training(env_here=not dry_run)  # what only training needs (a server's goal count), before any data loads
    _note_prompt_changes(cfg)
    from icsd_audit.outputs import check_not_input
    from icsd_audit.runs.trackers import check_available, parse_report_to

    check_available(parse_report_to(cfg.report_to))  # a missing tracker package: one line, before any loading
    if cfg.out_dir:
        check_not_input(cfg.out_dir, cfg.input_paths(), option="--out")
    if engine == "builtin":  # before loading any data: a folder holding another run fails in a second
        from icsd_audit.train.run.folder import check_run_folder

        check_run_folder(cfg.out_dir, resume=resume or resume_from is not None, overwrite=overwrite)
    _check_env_data(cfg)
    resume_at = resume_from if resume_from is not None else (True if resume else None)
    if cfg.policy != "model":
        played = launch(cfg, engine=engine, reporter=PrintReporter(), overwrite=overwrite).result
        stderr_console().print(f"done: {len(played.records)} step(s) played by the {cfg.policy}; metrics "
                               f"[bold]{played.metrics_path}[/]; turns [bold]{played.turns_path}[/]",
                               highlight=False, soft_wrap=True)
        return
    if engine == "verl":
        path = launch(cfg, engine=engine, dry_run=dry_run, gpus=gpus, overwrite=overwrite).result
        stderr_console().print(("wrote " if dry_run else "ran ") + f"[bold]{path}[/] (data, model and agent loop "
                               f"in {path.parent})", highlight=False, soft_wrap=True)
        return
    if engine == "trl":
        if log_lines:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        adv_explicit = o["adv"] is not None or any(item.strip().startswith("adv_estimator=") for item in set_)
        launch(cfg, engine=engine, reporter=PrintReporter() if log_lines else _RichReporter(),
               adv_explicit=adv_explicit, overwrite=overwrite, resume=resume_at)
        return
    reporter = PrintReporter() if log_lines else _RichReporter()
    with routed_logs(reporter), reporter.keepalive():
        res = launch(cfg, engine=engine, resume=resume_at, reporter=reporter, overwrite=overwrite).result
    if res.next_step == res.start_step:  # a resume with nothing to run: train() said so and changed nothing
        return
    con = stderr_console()
    con.print(f"done: steps {res.start_step}..{res.next_step - 1}; metrics [bold]{res.metrics_path}[/]"
              + (f"; dumps [bold]{res.dumps_dir}[/]" if res.dumps_dir else "")
              + (f"; checkpoint [bold]{res.checkpoint}[/]" if res.checkpoint else ""), highlight=False, soft_wrap=True)
    for line in what_next(cfg, res.dumps_dir, res.records[-1] if res.records else None):
        con.print(line, highlight=False, soft_wrap=True)


def what_next(cfg: Any, dumps: Optional[Path], last: Optional[Mapping[str, Any]] = None) -> list[str]:
    """The run's last lines: what success means on this configuration, why it is 0 when the last
    step (``last``, its metrics record) won nothing, and what to look at next."""
    from icsd_audit.envs import success_rule

    won = success_rule(cfg.env)
    def n(k: int, word: str) -> str:
        return f"{k} {word}{'' if k == 1 else 's'}"

    lines = [f"success here: the share of a step's {n(cfg.n_tasks * cfg.group_size, 'episode')} ({n(cfg.n_tasks, 'task')} "
             f"x {n(cfg.group_size, 'rollout')}, at most {n(cfg.max_turns, 'turn')} each) that {won}."]
    invalid = (last or {}).get("rollout/invalid_rate")
    if last is not None and last.get("rollout/success") == 0 and invalid is not None:
        # a newcomer reads "success 0.00" as a broken run: say why, and that the run is for the mechanism
        lines.append(f"why success is 0: in the last step {100 * invalid:.0f} % of the replies were not a valid action, "
                     f"and an episode has at most {n(cfg.max_turns, 'turn')} to finish its task; a run this small "
                     "shows where the distillation mass goes, not learning.")
    if dumps is not None:
        report = Path(cfg.out_dir) / "report"
        lines.append(f"what to look at: icsd audit report {dumps} --out {report} (report.html: where the distillation "
                     "mass went, trusted-conflict mass and gradient cosines with bootstrap CIs)")
    return lines


def _probe_writable(out: Path) -> None:
    """Create ``out``'s folder and a file in it (removed at once): permission checks alone pass for root."""
    import tempfile

    from icsd_audit.outputs import temp_prefix

    from icsd_audit.outputs import OutputError

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Creating (and at once deleting) a file in the folder is the probe: it fails as the real write would.
        tempfile.NamedTemporaryFile(prefix=temp_prefix(out, "probe"), dir=out.parent).close()
    except OSError as exc:
        raise OutputError(out, f"--out cannot be written: {exc.strerror or exc} ({exc.filename or out.parent})") from None


@app.command("eval")
@handle_errors
def eval_cmd(
    model: Optional[str] = typer.Option(
        None, help="Local HF model folder, a checkpoint folder, 'embedded' (default) or 'tiny-random'; with --adapter: "
                   "its base (default: the base the adapter names)."),
    adapter: Optional[Path] = typer.Option(None, help="A LoRA adapter folder (an icsd checkpoint of a --lora run) to "
                                                      "evaluate over --model."),
    preset: Optional[str] = typer.Option(
        None, help="Prompt and rollout settings to evaluate with: paper or cpu-demo (default: cpu-demo for a model; "
                   "paper with --policy expert, whose episodes need the paper's turn budget)."),
    env: Optional[str] = typer.Option(
        None, help="Environment (built-in: webshop, searchqa, alfworld, clue; alfworld: pip install 'icsd-audit\\[alfworld]')."),
    env_url: Optional[str] = typer.Option(None, help="URL of a real WebShop server instead of the built-in one."),
    tasks: Optional[int] = typer.Option(None, help="Number of held-out instructions (the first N of the split)."),
    max_turns: Optional[int] = typer.Option(None, help="Turn budget per episode."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature (0: greedy)."),
    device: Optional[str] = typer.Option(None, help="auto, cpu, cuda, ..."),
    seed: Optional[int] = typer.Option(None, help="Seed of the sampling."),
    policy: Optional[str] = typer.Option(
        None, help="model (the --model's replies) or expert (each environment's expert: the goal path, ALFWorld's "
                   "handcoded expert, Search-QA's oracle searches; checks the environment's rules, loads no weights)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Also write the result as JSON here."),
    set_: List[str] = typer.Option([], "--set", help="Any config field: --set history_window=2 (repeatable)."),
) -> None:
    """Report WebShop score and success rate, Search-QA exact match per subset (NQ ... Bam, Avg) or ALFWorld success per task type (Pick ... Pick2, Avg), on held-out tasks.

    Example: icsd eval --model runs/demo/checkpoints/step-000002 --tasks 16

    LoRA: icsd eval --model embedded --adapter runs/lora/checkpoints/step-000001 --tasks 16

    Search-QA: icsd eval --env searchqa --model runs/sq/checkpoints/step-000200 --tasks 875

    ALFWorld: icsd eval --env alfworld --model runs/alf/checkpoints/step-000002 --tasks 128

    The environment's expert: icsd eval --env webshop --policy expert --tasks 20

    Skill-Prompt* (skills in the student's prompt): icsd eval --model DIR --set student_skills=eval
    """
    import json

    _require_train_extra("eval")
    silence_bars()  # a first run converts the model: no GGUF bar in a log
    from icsd_audit.train.eval import evaluate_config

    if preset is None:
        preset = "paper" if policy == "expert" else "cpu-demo"
    from icsd_audit.train.models.lora import base_of, is_adapter_dir

    from icsd_audit.train.config import resolve_init

    if adapter is None and model is not None and is_adapter_dir(model):  # a --lora run's checkpoint given as --model
        adapter, model = Path(model), None
    base_seed = None
    if adapter is not None:
        folder = str(resolve_init(str(adapter)))  # a shipped warm start: --adapter warmstart:NAME
        if not is_adapter_dir(folder):
            raise ValueError(f"--adapter {adapter}: no adapter_config.json there (not a LoRA adapter folder)")
        model, base_seed = base_of(folder, model, seed or 0)
    cfg = _build_config(preset, dict(model=model, env=env, env_url=env_url, eval_tasks=tasks, max_turns=max_turns,
                                     eval_temperature=temperature, device=device, policy=policy,
                                     seed=seed if base_seed is None else base_seed,
                                     init=None if adapter is None else str(adapter)), set_)
    if adapter is None and not any(s.strip().startswith("init=") for s in set_):
        cfg = cfg.replace(init=None)  # the policy is what --model says; a preset's warm start needs --adapter
    if out is not None:  # before the evaluation: a bad --out fails in seconds, not after it
        from icsd_audit.outputs import check_not_input, check_output_file

        check_not_input(out, cfg.input_paths(), option="--out")
        check_output_file(out, [], option="--out")
        _probe_writable(out)
    _check_env_data(cfg)
    from icsd_audit.train.loop import check_services

    check_services(cfg)
    res = evaluate_config(cfg)
    d = res.to_dict()
    d["model"] = cfg.model
    d["policy"] = cfg.policy
    if adapter is not None:
        d["adapter"] = str(adapter)
    text = json.dumps(d, indent=2)
    if d.get("subsets"):  # the paper's table columns (percent), for a quick look
        cols = list(d["subsets"])
        stderr_console().print("  ".join(f"{c:>5}" for c in cols) + "\n"
                               + "  ".join(f"{100 * d['subsets'][c]:5.1f}" for c in cols), highlight=False)
    if out is not None:
        from icsd_audit.outputs import write_text_atomic

        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, text + "\n")
    print(text)


@app.command("export")
@handle_errors
def export_cmd(
    adapter: Path = typer.Option(..., help="A LoRA adapter folder (a checkpoint of an `icsd train --lora` run)."),
    out: Path = typer.Option(..., "--out", "-o", help="New folder for the merged model (must not exist)."),
    model: Optional[str] = typer.Option(
        None, help="The adapter's base: a local HF folder, 'embedded' or 'tiny-random' (default: the base the adapter "
                   "names)."),
) -> None:
    """Merge a LoRA adapter into its base model and write a plain Hugging Face folder (weights, tokenizer).

    The result loads anywhere without peft: icsd eval --model OUT, from_pretrained(OUT), icsd train --init OUT.
    --out may not be or lie inside an input, and may not exist.

    Example: icsd export --model embedded --adapter runs/lora/checkpoints/step-000001 --out models/demo-merged
    """
    _require_train_extra("export")
    silence_bars()  # no "Writing model shards" bar
    from icsd_audit.train.models.lora import export_merged
    from icsd_audit.train.models.loading import set_threads

    set_threads(None)
    path = export_merged(model=model, adapter=adapter, out=out)
    stderr_console().print(f"merged model written to [bold]{path}[/]", highlight=False, soft_wrap=True)
