"""verl's two ICSD allocation scopes on CPU: allocation time per micro-batch and its share of an actor micro-step.

Usage (needs the engines environment: pip install -e '.[train,verl]'):
  python benchmarks/bench_verl_scope.py --model embedded --rows 128 --micro 4 --prompt 256 --response 256 \
      --turns 4 --micro-steps 4 --repeats 3

A global actor mini-batch of ``rows`` verl v1 rows (whole multi-turn trajectories,
``turns`` assistant turns each, separated by observation tokens; ``prompt`` / ``response``
tokens; random token ids) is cut into micro-batches of ``micro`` rows, as verl's worker
cuts it for ``ppo_micro_batch_size_per_gpu=micro``.  Timed, medians over ``repeats``:

* **mini-batch scope** (``icsd_sync``'s driver): ``allocate_mini_batches`` over the whole
  mini-batch, once per mini-batch; reported per mini-batch and per micro-batch (divided by
  the micro-batches of the mini-batch);
* **micro-batch scope** (the worker loss): ``MicroBatchScope.allocate`` inside
  ``icsd_ppo_loss``, once per micro-batch (no dumps);
* **actor micro-step**: what a verl worker does per gradient micro-batch on CPU: the
  model's forward over the micro-batch's sequences, verl's layout of the log-probs,
  ``icsd_ppo_loss`` (verl's ``ppo_loss`` + the distillation term) in the given scope, and
  the backward; for ``micro-steps`` micro-batches of the mini-batch.

The share printed is allocation time / actor micro-step time (both per micro-batch).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import numpy as np
import torch


def actor_config(micro: int, rows: int):
    from hydra import compose, initialize_config_dir
    import verl
    from verl.utils.config import omega_conf_to_dataclass

    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=d, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.rollout.n=1",
            f"data.train_batch_size={rows}", "actor_rollout_ref.actor.use_kl_loss=false"])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def make_rows(a: argparse.Namespace, vocab: int) -> list[dict]:
    """Rows of one mini-batch: prompt ids, response ids with ``turns`` runs of 1s in the mask, per-token inputs."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(a.rows):
        P = int(torch.randint(a.prompt // 2, a.prompt + 1, (1,), generator=g))
        R = int(torch.randint(a.response // 2, a.response + 1, (1,), generator=g))
        mask = torch.zeros(R, dtype=torch.long)
        span = R // a.turns
        for k in range(a.turns):  # each turn: 2/3 of its span assistant tokens, then an observation
            mask[k * span: k * span + max(1, 2 * span // 3)] = 1
        old = torch.randn(R, generator=g) * 0.5 - 2.0
        rows.append(dict(uid=f"task{i // 8}", session=i % 8, prompt=torch.randint(3, vocab, (P,), generator=g),
                         response=torch.randint(3, vocab, (R,), generator=g), mask=mask, old=old,
                         adv=torch.full((R,), float(torch.randn(1, generator=g))),
                         teacher=old + 0.5 * torch.randn(R, generator=g)))
    return rows


def micro_td(rows: list[dict], n_tokens: int):
    from tensordict import TensorDict  # noqa: F401
    from verl.utils import tensordict_utils as tu

    from icsd_audit.integrations.core import TEACHER_KEY

    def nt(xs):
        return torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)

    td = tu.get_tensordict({"prompts": nt(r["prompt"] for r in rows), "responses": nt(r["response"] for r in rows),
                            "response_mask": nt(r["mask"] for r in rows), "old_log_probs": nt(r["old"] for r in rows),
                            "advantages": nt(r["adv"] for r in rows), TEACHER_KEY: nt(r["teacher"] for r in rows),
                            "uid": [r["uid"] for r in rows], "session_id": [r["session"] for r in rows]})
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=n_tokens, global_batch_size=None)
    return td


def forward(model, rows: list[dict]):
    """The model's log-probs in verl's no-padding layout (position i: log p(token i+1)), flat over the rows."""
    seqs = [torch.cat([r["prompt"], r["response"]]) for r in rows]
    L = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    att = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()], att[i, : s.numel()] = s, 1
    logits = model(input_ids=ids, attention_mask=att).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    lp = torch.cat([lp, torch.zeros(len(seqs), 1)], 1)
    values = torch.cat([lp[i, : s.numel()] for i, s in enumerate(seqs)])
    offs = torch.tensor([0] + [s.numel() for s in seqs]).cumsum(0)
    nested = torch.nested.nested_tensor_from_jagged(values, offs)
    return {"log_probs": nested, "entropy": torch.nested.nested_tensor_from_jagged(torch.zeros_like(values), offs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded", help="'embedded' (SmolLM2-135M) or 'tiny-random'")
    ap.add_argument("--rows", type=int, default=128, help="verl rows (trajectories) per global actor mini-batch")
    ap.add_argument("--micro", type=int, default=4, help="rows per gradient micro-batch")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--micro-steps", type=int, default=4, help="actor micro-steps timed per scope and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from icsd_audit.integrations.core import C_KEY
    from icsd_audit.integrations.verl.loss import MicroBatchScope, icsd_ppo_loss
    from icsd_audit.integrations.verl.trainer import ICSDVerlConfig, allocate_mini_batches, trajectory_turns
    from icsd_audit.train.models.loading import load_policy

    model, _ = load_policy(a.model, device=torch.device("cpu"))
    model.train()
    rows = make_rows(a, model.config.vocab_size)
    n_micro = -(-a.rows // a.micro)
    cfg = actor_config(a.micro, a.rows)
    n_tokens = int(sum(int(r["mask"].sum()) for r in rows))

    # the driver's mini-batch allocation over padded [B, T]
    T = max(r["response"].numel() for r in rows)
    pad = {k: torch.zeros(a.rows, T) for k in ("adv", "old", "teacher")}
    mask = torch.zeros(a.rows, T, dtype=torch.bool)
    for i, r in enumerate(rows):
        R = r["response"].numel()
        mask[i, :R] = r["mask"].bool()
        for k in pad:
            pad[k][i, :R] = r[k]
    keys = [f"{r['uid']}_{r['session']}_0" for r in rows]
    traj, turn = trajectory_turns(keys, mask)
    icfg = ICSDVerlConfig()
    mini = np.zeros(a.rows, dtype=np.int64)  # one global mini-batch
    micro_scope = MicroBatchScope()
    res: dict[str, list[float]] = {"driver": [], "micro_alloc": [], "step_mini": [], "step_micro": []}
    for rep in range(a.repeats + 1):
        t0 = time.perf_counter()
        c_mini, _ = allocate_mini_batches(advantage=pad["adv"], old_log_probs=pad["old"],
                                          teacher_log_probs=pad["teacher"], response_mask=mask, traj_id=traj,
                                          turn_id=turn, mini_batch=mini, step=0, cfg=icfg)
        driver = time.perf_counter() - t0
        for scope in ("mini", "micro") if rep % 2 == 0 else ("micro", "mini"):
            for j in range(min(a.micro_steps, n_micro)):
                part = rows[j * a.micro:(j + 1) * a.micro]
                td = micro_td(part, n_tokens)
                if scope == "mini":  # the driver's c, as icsd_sync stores it
                    td[C_KEY] = torch.nested.as_nested_tensor(
                        [c_mini[i, : rows[i]["response"].numel()] for i in range(j * a.micro, j * a.micro + len(part))],
                        layout=torch.jagged)
                t0 = time.perf_counter()
                out = forward(model, part)
                loss, metrics = icsd_ppo_loss(copy.deepcopy(cfg), out, td, distill_coef=0.01,
                                              micro=micro_scope if scope == "micro" else None)
                loss.backward()
                model.zero_grad(set_to_none=True)
                step = time.perf_counter() - t0
                if rep:
                    res[f"step_{scope}"].append(step)
                    if scope == "micro":
                        res["micro_alloc"].append(float(metrics["icsd/alloc_seconds"].values[0]))
        if rep:
            res["driver"].append(driver)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"model {a.model}: mini-batch of {a.rows} rows ({n_tokens} assistant tokens, {a.turns} turns per row, "
          f"prompts <= {a.prompt}, responses <= {a.response}), micro-batches of {a.micro} rows ({n_micro} per "
          f"mini-batch), {a.threads} thread(s), {a.repeats} repeats, load average {os.getloadavg()[0]:.2f}")
    per_micro_driver = med["driver"] / n_micro
    print(f"mini-batch scope: driver allocation {1e3 * med['driver']:.1f} ms per mini-batch = "
          f"{1e3 * per_micro_driver:.2f} ms per micro-batch; actor micro-step {med['step_mini']:.3f} s; "
          f"share {100 * per_micro_driver / med['step_mini']:.2f} %")
    print(f"micro-batch scope: allocation {1e3 * med['micro_alloc']:.2f} ms per micro-batch (in the worker loss); "
          f"actor micro-step {med['step_micro']:.3f} s; share {100 * med['micro_alloc'] / med['step_micro']:.2f} %")
    print("all:", {k: [round(x, 5) for x in v] for k, v in res.items()})


if __name__ == "__main__":
    main()
