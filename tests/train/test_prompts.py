"""Turn prompt assembly: history window, teacher = student with the skill block prepended."""

from __future__ import annotations

import pytest

from icsd_audit.train.models import chat_prompt, tiny_random_causal_lm
from icsd_audit.train.prompts import (
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
