"""The TRL engine's episode rollout on the built-in WebShop with a scripted policy (no TRL needed).

A scripted sampler plays known replies, a recording wrapper keeps every observation the
environment returned, and the test rebuilds each episode independently: the chat
template's rendering of the whole conversation, the reply runs of the mask, the
observations between them, the scores and the teacher's prompt.
"""

from __future__ import annotations

import re

import pytest
import torch

from icsd_audit.envs import make_env
from icsd_audit.integrations.trl.rollout import EpisodeRollout, episode_reward
from icsd_audit.train.models.loading import tiny_random_causal_lm
from icsd_audit.train.rollout.prompts import TurnContext, skill_block, student_messages
from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings
from icsd_audit.train.teacher.skills import load_skillbank
from icsd_audit.train.teacher.self_teacher import skill_retriever

TASK = 5  # WebShop train task 5: wool socks; search, first product, buy now scores 1/3 (checked below)
LOGP = -0.25  # the scripted sampler's log-prob of every reply token


class Recording:
    """A WebShop instance that keeps every observation it returned (reset first, then each step's)."""

    def __init__(self) -> None:
        self.env = make_env("webshop", split="train", max_steps=3, seed=0)
        self.name, self.max_steps = self.env.name, self.env.max_steps
        self.seen: list = []
        self.rewards: list[float] = []

    @property
    def num_tasks(self) -> int:
        return self.env.num_tasks

    def reset(self, task):
        self.seen, self.rewards = [self.env.reset(task)], []
        return self.seen[0]

    def step(self, action):
        res = self.env.step(action)
        self.seen.append(res.observation)
        self.rewards.append(res.reward)
        return res


def _scripted(tok, log: list[list[list[int]]]):
    """Replies chosen from the last user message of each context; episode 1 opens with a malformed reply cut short."""
    eos = tok.eos_token_id
    calls = [0]

    def sampler(model, contexts, *, max_new_tokens, temperature, pad_id, stop_ids, device, precision, want_logp):
        replies = []
        for j, ctx in enumerate(contexts):
            last = tok.decode(ctx).rsplit("<|im_start|>user", 1)[-1]
            if calls[0] == 0 and j == 1:
                ids = list(tok("I would rather not say", add_special_tokens=False).input_ids)  # no tags, no EOS
            else:
                item = re.search(r"'(click\[b0[a-z0-9]+\])'", last)
                act = ("click[buy now]" if "'click[buy now]'" in last else item.group(1) if item
                       else "search[wool socks arch support]")
                ids = list(tok(f"<think>go</think><action>{act}</action>", add_special_tokens=False).input_ids) + [eos]
            replies.append(ids)
        calls[0] += 1
        log.append(replies)
        return replies, [torch.full((len(r),), LOGP) for r in replies]

    return sampler


def _rollout(tok, max_prompt_tokens: int, log: list) -> EpisodeRollout:
    builder = PromptBuilder(tok, env="webshop", history_window=1, max_prompt_tokens=max_prompt_tokens)
    settings = RolloutSettings(max_turns=3, max_response_tokens=64, temperature=1.0, batch_rows=8, require_think=True,
                               reward="score", record_logp=True)
    skill = skill_retriever(load_skillbank("webshop"), skill_mode="match", skill_match="sdar")
    return EpisodeRollout(tokenizer=tok, builder=builder, make_env=Recording, settings=settings, invalid_penalty=0.1,
                          tasks={}, teacher_skill=skill, sampler=_scripted(tok, log))


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    t = torch.tensor(mask)
    cut = [0, *((t[1:] != t[:-1]).nonzero().flatten() + 1).tolist(), len(mask)]
    return [(mask[a], a, b) for a, b in zip(cut, cut[1:])]


def _user(obs) -> str:
    ctx = TurnContext(task=obs.instruction, observation=obs.text, actions=obs.available_actions or None, env="webshop")
    return student_messages(ctx)[-1]["content"]


def test_episodes_are_the_conversation_the_chat_template_renders():
    _, tok = tiny_random_causal_lm(seed=0)
    log: list = []
    ro = _rollout(tok, 100_000, log)
    batch = ro.play(None, [TASK, TASK], device=torch.device("cpu"), group_size=2)
    eos = tok.eos_token_id
    assert [len(call) for call in log] == [2, 2, 2]  # both episodes run all three turns
    for i, (env, traj) in enumerate(zip(ro.envs, batch.trajectories)):
        replies = [call[i] for call in log]
        # the mask's runs of 1s are exactly the replies, in order; the 0-runs sit between them
        runs = _runs(batch.env_mask[i])
        ones = [batch.completion_ids[i][a:b] for v, a, b in runs if v == 1]
        zeros = [tok.decode(batch.completion_ids[i][a:b]) for v, a, b in runs if v == 0]
        assert ones == replies and len(zeros) == len(replies) - 1
        # each 0-run is the observation the environment returned after the previous reply, as a user turn
        for z, obs in zip(zeros, env.seen[1:]):
            assert obs.text in z and z.endswith("<|im_end|>\n<|im_start|>assistant\n")
        # prompt + completion is the chat template's rendering of the whole conversation
        msgs = [{"role": "user", "content": _user(env.seen[0])}]
        for k, r in enumerate(replies):
            msgs.append({"role": "assistant", "content": tok.decode(r, skip_special_tokens=True)})
            if k + 1 < len(replies):
                msgs.append({"role": "user", "content": _user(env.seen[k + 1])})
        whole = tok.apply_chat_template(msgs, tokenize=False)
        assert tok.decode(batch.prompt_ids[i] + batch.completion_ids[i]) == whole.removesuffix("\n")
        assert tok.convert_tokens_to_ids("<|im_start|>") in batch.completion_ids[i]  # specials are special ids
        want_lp = torch.where(torch.tensor(batch.env_mask[i]) == 1, LOGP, 0.0)
        assert torch.equal(torch.tensor(batch.logprobs[i]), want_lp)
        # the teacher's prompt: SDAR's skill block in front of the exact student prompt ids
        student_text = tok.decode(batch.prompt_ids[i])
        block = skill_block(load_skillbank("webshop").retrieve_sdar(student_text).text)
        assert batch.teacher_prompt_ids[i] == list(tok(block, add_special_tokens=False).input_ids) + batch.prompt_ids[i]
        assert traj.n_turns == len(replies) == 3
        assert (replies[0][-1] == eos) == (i == 0)  # episode 1 opened with the reply cut short
    # episode 0 searched, clicked and bought (WebShop scored the purchase 1/3); episode 1 lost its first
    # turn to a malformed reply (no EOS: the 0-run then holds the template's whole closing) and ran out of turns
    assert ro.envs[0].rewards == [0.0, 0.0, pytest.approx(1 / 3)]
    assert ro.envs[1].rewards == [0.0, 0.0, 0.0] and not batch.trajectories[1].won
    assert [t.n_invalid for t in batch.trajectories] == [0, 1]
    assert tok.decode(batch.completion_ids[1]).startswith("I would rather not say<|im_end|>\n<|im_start|>user\n")
    assert batch.scores(0.1) == pytest.approx([1 / 3, -0.1 / 3])
    trl = batch.to_trl(0.1)
    assert trl["env_mask"] is batch.env_mask and trl["episode_turns"] == [3, 3]
    logged: dict[str, float] = {}
    assert episode_reward([], **{k: v for k, v in trl.items() if k.startswith("episode_")},
                          log_metric=logged.__setitem__) == pytest.approx([1 / 3, -0.1 / 3])
    # episode 0's purchase scored 1/3 (reward="score": its return too), episode 1 bought nothing
    assert logged == pytest.approx({"episodes/turns": 3.0, "episodes/won": 0.0, "episodes/invalid_turn_share": 1 / 6,
                                    "episodes/context_stops": 0.0, "episodes/prompt_cut": 0.0,
                                    "episodes/return": 1 / 6, "episodes/score": 1 / 6})


def test_an_observation_that_would_pass_max_prompt_tokens_stops_the_episode():
    _, tok = tiny_random_causal_lm(seed=0)
    probe: list = []
    first = _rollout(tok, 100_000, probe).play(None, [TASK], device=torch.device("cpu"))
    p, r0 = len(first.prompt_ids[0]), len(probe[0][0])
    obs_len = _runs(first.env_mask[0])[1][2] - _runs(first.env_mask[0])[1][1]
    # room for the prompt and the first reply, one token short of the first observation: one turn, then a stop
    log: list = []
    ro = _rollout(tok, p + r0 + obs_len - 1, log)
    batch = ro.play(None, [TASK], device=torch.device("cpu"))
    assert batch.completion_ids[0] == probe[0][0] and batch.env_mask[0] == [1] * r0
    assert batch.context_stops == [True] and batch.trajectories[0].n_turns == 1 and batch.trajectories[0].done
    assert batch.prompt_ids == first.prompt_ids and batch.prompt_truncated == [False]
    # exactly at the bound the observation fits: a second turn, whose product page no longer does
    log2: list = []
    ok = _rollout(tok, p + r0 + obs_len, log2).play(None, [TASK], device=torch.device("cpu"))
    assert ok.completion_ids[0][: r0 + obs_len] == first.completion_ids[0][: r0 + obs_len]
    assert ok.trajectories[0].n_turns == 2 and ok.context_stops == [True] and ok.env_mask[0][-1] == 1
