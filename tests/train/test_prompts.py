"""Turn prompt assembly: history window, teacher = student with the skill block prepended."""

from __future__ import annotations

import pytest

from icsd_audit.train.models.loading import chat_prompt, tiny_random_causal_lm
from icsd_audit.train.rollout.prompts import (
    REPLY_FORMAT,
    SKILL_HEADER,
    HistoryEntry,
    TurnContext,
    render_history,
    skill_block,
    student_messages,
    student_prompt_text,
    teacher_messages,
    teacher_prompt_text,
)

HISTORY = [HistoryEntry(f"obs {i}", f"search[item {i}]") for i in range(1, 6)]  # 5 past steps
CTX = TurnContext(
    task="find a red cotton t-shirt under 30 dollars",
    observation="[Back to Search] Page 1 (Total results: 3) ...",
    actions=["click[back to search]", "click[b0001]", "click[next >]"],
    history=HISTORY,
    env="webshop",
)
Z = "### GENERAL SKILLS ###\n1. Search with the core."


@pytest.fixture(scope="module")
def tok():
    return tiny_random_causal_lm()[1]


def test_history_window_keeps_last_h_with_absolute_numbers():
    text = render_history(HISTORY, 2)
    assert text.splitlines() == [
        "[Observation 4: 'obs 4', Action 4: 'search[item 4]']",
        "[Observation 5: 'obs 5', Action 5: 'search[item 5]']",
    ]
    assert render_history(HISTORY, 0) == ""
    assert len(render_history(HISTORY, 99).splitlines()) == 5
    assert render_history([("o", "a")], 3) == "[Observation 1: 'o', Action 1: 'a']"
    with pytest.raises(ValueError):
        render_history(HISTORY, -1)


def test_student_prompt_content():
    (msg,) = student_messages(CTX, history_window=2)
    c = msg["content"]
    assert msg["role"] == "user"
    assert "Your task is to: find a red cotton t-shirt under 30 dollars" in c
    assert "already taken 5 step(s)" in c and "most recent 2 observation(s)" in c
    assert "'obs 3'" not in c and "'obs 4'" in c and "'obs 5'" in c
    assert "You are now at step 6 and your current observation is: [Back to Search]" in c
    assert "'click[b0001]'," in c
    assert c.endswith(REPLY_FORMAT)
    assert "<think>" in c and "<action>" in c


def test_first_turn_and_free_form_actions():
    ctx = TurnContext(task="who wrote hamlet?", observation="(no results yet)", actions=None, env="searchqa")
    (msg,) = student_messages(ctx)
    c = msg["content"]
    assert "Prior to this step" not in c
    assert "Your current observation is: (no results yet)" in c
    assert "admissible actions" not in c
    assert c.startswith("You are an expert agent answering questions")


def test_window_changes_only_the_history_part():
    a = student_messages(CTX, history_window=1)[0]["content"]
    b = student_messages(CTX, history_window=3)[0]["content"]
    assert "'obs 5'" in a and "'obs 4'" not in a
    assert "'obs 3'" in b and "'obs 2'" not in b
    assert a.split("Your admissible actions")[1] == b.split("Your admissible actions")[1]


def test_teacher_prompt_is_student_prompt_with_z_prepended(tok):
    student = student_prompt_text(tok, CTX, history_window=2)
    teacher = teacher_prompt_text(tok, CTX, Z, history_window=2)
    assert teacher == f"{SKILL_HEADER}\n{Z}\n\n" + student
    assert teacher == skill_block(Z) + student
    # token level: the teacher's ids are the block's ids followed by the student's ids,
    # because the student text opens with a special token (a clean tokenisation boundary)
    t_ids = tok(teacher, add_special_tokens=False)["input_ids"]
    s_ids = tok(student, add_special_tokens=False)["input_ids"]
    b_ids = tok(skill_block(Z), add_special_tokens=False)["input_ids"]
    assert t_ids == b_ids + s_ids


def test_teacher_user_placement(tok):
    msgs = teacher_messages(CTX, Z, history_window=2, system="sys")
    student = student_messages(CTX, history_window=2, system="sys")
    assert msgs[0] == student[0] == {"role": "system", "content": "sys"}
    assert msgs[1]["content"] == skill_block(Z) + student[1]["content"]
    text = teacher_prompt_text(tok, CTX, Z, history_window=2, system="sys", placement="user")
    assert text == chat_prompt(tok, msgs)
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="placement"):
        teacher_prompt_text(tok, CTX, Z, placement="suffix")


def test_prompt_ends_with_generation_header(tok):
    text = student_prompt_text(tok, CTX)
    assert text.startswith("<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


# ------------------------------------------------------------------ Search-QA protocols, chat-template switches


def _tiny_tok():
    from icsd_audit.train.rollout.policy import policy_tokenizer

    return policy_tokenizer("tiny-random")


def test_search_r1_context_is_the_first_prompt_grown_by_cut_replies_and_observations():
    from icsd_audit.envs.searchqa.data import SEARCH_R1_PREFIX
    from icsd_audit.envs.searchqa.protocol import INVALID_MESSAGE
    from icsd_audit.train.rollout.collect import PromptBuilder

    tok = _tiny_tok()
    b = PromptBuilder(tok, env="searchqa", history_window=2, max_prompt_tokens=4096, protocol="search-r1")
    info = "<information>Doc 1(Title: x) y</information>"
    hist = (HistoryEntry("No search results yet.", "<search> x </search>", reply="<think>a</think><search> x </search>"),
            HistoryEntry(info, "", reply="I do not know"))
    ctx = TurnContext(task="who?", observation=INVALID_MESSAGE, history=hist, env="searchqa", protocol="search-r1")
    first = chat_prompt(tok, [{"role": "user", "content": SEARCH_R1_PREFIX.format(question="who?")}])
    # Search-R1 appends '\n\n<information>...</information>\n\n' after a search and the invalid
    # message between single newlines (generation.py, execute_predictions)
    pieces = [first, "<think>a</think><search> x </search>", f"\n\n{info}\n\n", "I do not know",
              f"\n{INVALID_MESSAGE}\n"]
    assert b.student_text(ctx) == "".join(pieces)
    ids, cut = b.student(ctx)
    assert not cut and ids == [i for p in pieces for i in tok(p, add_special_tokens=False).input_ids]
    assert b.teacher(ctx, ids, Z)[0] == tok(skill_block(Z), add_special_tokens=False).input_ids + ids
    short = PromptBuilder(tok, env="searchqa", history_window=2, max_prompt_tokens=50, protocol="search-r1")
    assert short.student(ctx) == (ids[-50:], True)  # cut from the left, as Search-R1 keeps the last max_prompt_length


def test_rollout_grows_the_context_with_the_reply_cut_after_its_search():
    from icsd_audit.envs import make_env
    from icsd_audit.train.rollout.policy import ScriptedPolicy
    from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, collect_rollouts

    tok = _tiny_tok()
    env = make_env("searchqa", split="eval", max_steps=2)
    q = env.tasks[0].hops[0][0]
    replies = [f"<think>a</think><search> {q} </search> <information>made up</information>", "<answer> x </answer>"]
    policy = ScriptedPolicy(tok, lambda t: replies[len(t.ctx.history)])
    b = PromptBuilder(tok, env="searchqa", history_window=2, max_prompt_tokens=4096, protocol="search-r1")
    batch = collect_rollouts(model=None, tokenizer=tok, builder=b, envs=[env], tasks=[0], group_size=1,
                             settings=RolloutSettings(max_turns=2, max_response_tokens=8, temperature=1.0, batch_rows=1,
                                                      require_think=True, reward="score", record_logp=False),
                             device=None, policy=policy)
    second = b.student_text(batch.rows[1].ctx)
    assert second.startswith(b.student_text(batch.rows[0].ctx) + f"<think>a</think><search> {q} </search>\n\n<information>Doc 1(")
    assert "made up" not in second and second.endswith("</information>\n\n")


def test_verl_agent_search_prompt_is_its_template_with_memory_lines():
    from icsd_audit.train.rollout.prompts import VERL_AGENT_SEARCH, VERL_AGENT_SEARCH_FIRST

    ctx0 = TurnContext(task="who?", observation="No search results yet.", env="searchqa", protocol="verl-agent")
    assert student_messages(ctx0, history_window=4)[0]["content"] == VERL_AGENT_SEARCH_FIRST.format(task_description="who?")
    hist = (HistoryEntry("No search results yet.", "<search> a b </search>"), HistoryEntry("<information>A</information>", ""),
            HistoryEntry("", "<answer> c </answer>"))
    ctx = TurnContext(task="who?", observation="<information>C</information>", history=hist, env="searchqa",
                      protocol="verl-agent")
    # SearchMemory.fetch: f"Step {k}:{action} {obs}\n" per step, joined by "\n"; action as search_projection writes it
    mem = "Step 2: \n\nStep 3:<answer>c</answer> <information>C</information>\n"
    assert student_messages(ctx, history_window=2)[0]["content"] == VERL_AGENT_SEARCH.format(
        task_description="who?", memory_context=mem, step_count=3)


def test_enable_thinking_reaches_the_chat_template():
    from icsd_audit.train.config import TrainConfig
    from icsd_audit.train.rollout.collect import PromptBuilder

    tok = _tiny_tok()
    # Qwen3's switch, reduced: the non-thinking mode opens the reply with an empty think block
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                         "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    cfg = TrainConfig(env="webshop", enable_thinking=False)
    assert cfg.chat_kwargs == {"enable_thinking": False} and TrainConfig().chat_kwargs == {}
    off = PromptBuilder.from_config(tok, cfg).student_text(CTX)
    on = PromptBuilder.from_config(tok, TrainConfig(env="webshop")).student_text(CTX)
    assert off == on + "<think>\n\n</think>\n\n"
