"""The built-in, offline WebShop: WebShop's text interface and state machine over the
shipped synthetic catalogue.

Pages and what can be done on them (actions are ``search[...]`` or ``click[...]``,
case-insensitive; the clickables are WebShop's lower-cased button texts, product ids
and option values):

============  ===============================================================
search        ``search[query]``
results       ``click[back to search]``, ``click[< prev]`` (page > 1),
              ``click[next >]`` (more results), ``click[<product id>]``
item          ``click[back to search]``, ``click[< prev]`` (to the results),
              ``click[description]``, ``click[features]``, ``click[reviews]``,
              ``click[buy now]``, ``click[<option value>]``
item sub page ``click[back to search]``, ``click[< prev]`` (to the item)
============  ===============================================================

Observations follow WebShop's ``simple`` text mode (visible texts joined by ``[SEP]``),
without the leading ``Instruction: [SEP] <instruction>`` part, which
:attr:`Observation.instruction` carries (``include_instruction=True`` keeps it, as the
raw WebShop page text has it). ``click[buy now]`` ends the episode with WebShop's
reward (:mod:`.reward`); so does reaching ``max_steps``, with reward 0.
"""

from __future__ import annotations

import numbers
import random
from typing import Any, Mapping

from ..base import Observation, StepResult, match_admissible, step_info
from .catalogue import Catalogue, load_catalogue
from .reward import webshop_reward
from .search import SEARCH_RETURN_N

__all__ = ["WebShopEnv", "PRODUCTS_PER_PAGE", "SEARCH_TEMPLATE", "render_available_actions"]

PRODUCTS_PER_PAGE = 10
SEARCH_TEMPLATE = "search[<your query>]"
SEP = " [SEP] "

BACK, PREV, NEXT, BUY = "back to search", "< prev", "next >", "buy now"
SUB_PAGES = ("description", "features", "reviews")
_LABEL = {BACK: "Back to Search", PREV: "< Prev", NEXT: "Next >", BUY: "Buy Now",
          "description": "Description", "features": "Features", "reviews": "Reviews"}

PAGE_SEARCH, PAGE_RESULTS, PAGE_ITEM, PAGE_SUB, PAGE_DONE = "search", "results", "item", "item_sub_page", "done"

_REQUIRED_GOAL_KEYS = ("asin", "query", "product_category", "nouns", "attributes", "goal_options",
                       "price_upper", "instruction_text")


def render_available_actions(has_search_bar: bool, clickables: list[str]) -> tuple[str, ...]:
    """verl-agent's formatting of WebShop's ``get_available_actions``."""
    actions = [SEARCH_TEMPLATE] if has_search_bar else []
    actions.extend(f"click[{c}]" for c in clickables)
    return tuple(actions)


def _split_action(action: str) -> tuple[str, str | None]:
    if action.endswith("]") and "[" in action:
        name, _, arg = action.partition("[")
        return name.strip(), arg[:-1].strip()
    return action, None


class WebShopEnv:
    """Offline WebShop over the shipped catalogue (see the module docstring).

    Args:
        split: ``"train"`` or ``"eval"`` (held-out instructions on held-out products).
        max_steps: episode budget; the paper (and verl-agent) use 15.
        seed: seeds the draw of a task when ``reset()`` gets no task.
        catalogue: a loaded :class:`Catalogue`; the shipped one by default.
        include_instruction: keep WebShop's ``Instruction: [SEP] ...`` prefix in the text.
    """

    name = "webshop"

    def __init__(
        self,
        split: str = "train",
        *,
        max_steps: int = 15,
        seed: int = 0,
        catalogue: Catalogue | None = None,
        include_instruction: bool = False,
    ):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.catalogue = catalogue if catalogue is not None else load_catalogue()
        self.split = split
        self.tasks: list[dict[str, Any]] = self.catalogue.goals(split)
        self.max_steps = int(max_steps)
        self.include_instruction = include_instruction
        self._rng = random.Random(seed)
        self._engine = self.catalogue.search_engine
        self._goal: dict[str, Any] | None = None
        self._done = True
        self._reset_state()

    # ------------------------------------------------------------------ protocol
    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def goal(self) -> Mapping[str, Any] | None:
        """The current episode's goal (instruction, target, attributes, options, price cap)."""
        return self._goal

    @property
    def data_info(self) -> dict[str, Any]:
        """Where the tasks come from (stored in the dumps' metadata under ``env_data``)."""
        return {"name": self.name, "split": self.split, "tasks": len(self.tasks), "synthetic": True,
                "source": f"icsd synthetic WebShop catalogue v{self.catalogue.version}"}

    def reset(self, task: int | Mapping[str, Any] | None = None) -> Observation:
        """Start an episode on task index ``task`` of the split, a goal mapping, or a random task."""
        if task is None:
            goal = self.tasks[self._rng.randrange(len(self.tasks))]
        elif isinstance(task, numbers.Integral) and not isinstance(task, bool):
            task = int(task)
            if not 0 <= task < len(self.tasks):
                raise IndexError(f"task index {task} out of range for split {self.split!r} ({len(self.tasks)} tasks)")
            goal = self.tasks[task]
        elif isinstance(task, Mapping):
            missing = [k for k in _REQUIRED_GOAL_KEYS if k not in task]
            if missing:
                raise ValueError(f"goal mapping lacks {missing}")
            if task["asin"] not in self.catalogue.by_asin:
                raise ValueError(f"goal targets unknown product {task['asin']!r}")
            goal = dict(task)
        else:
            raise TypeError(f"task must be an int index, a goal mapping or None, not {type(task).__name__}")
        self._goal = goal
        self._done = False
        self._reset_state()
        return self._observation()

    def step(self, action: str) -> StepResult:
        """Apply one action (``search[...]`` / ``click[...]``); inadmissible ones are no-ops."""
        if self._done:
            raise RuntimeError("the episode is over; call reset() first")
        self._steps += 1
        matched = match_admissible(action, self.available_actions())
        reward, extra = 0.0, {}
        if matched is not None:
            reward, extra = self._apply(matched)
        truncated = False
        if not self._done and self._steps >= self.max_steps:
            self._done, truncated = True, True
        won = self._page == PAGE_DONE and reward == 1.0
        info = step_info(won=won, score=reward, valid_action=matched is not None,
                         page=self._page, steps=self._steps, truncated=truncated, **extra)
        return StepResult(self._observation(), reward, self._done, info)

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        self._page = PAGE_SEARCH
        self._query = ""
        self._results: tuple[int, ...] = ()
        self._page_no = 1
        self._asin: str | None = None
        self._options: dict[str, str] = {}
        self._sub_page: str | None = None
        self._steps = 0
        self._reward = 0.0

    def _product(self) -> dict[str, Any]:
        assert self._asin is not None
        return self.catalogue.by_asin[self._asin]

    def _page_products(self) -> list[dict[str, Any]]:
        start = (self._page_no - 1) * PRODUCTS_PER_PAGE
        return [self.catalogue.products[i] for i in self._results[start : start + PRODUCTS_PER_PAGE]]

    def _to_results(self) -> None:
        self._page, self._asin, self._options, self._sub_page = PAGE_RESULTS, None, {}, None

    def _apply(self, action: str) -> tuple[float, dict[str, Any]]:
        verb, arg = _split_action(action)
        if verb == "search":
            self._query = arg
            self._results = self._engine.search(self._query, SEARCH_RETURN_N)
            self._page_no = 1
            self._to_results()
            return 0.0, {}
        # a click the current page admits
        if arg == BACK:
            self._reset_state_keep_steps()
        elif self._page == PAGE_RESULTS:
            if arg == NEXT:
                self._page_no += 1
            elif arg == PREV:
                self._page_no -= 1
            else:
                self._page, self._asin, self._options = PAGE_ITEM, arg.upper(), {}
        elif self._page == PAGE_ITEM:
            if arg == PREV:
                self._to_results()
            elif arg in SUB_PAGES:
                self._page, self._sub_page = PAGE_SUB, arg
            elif arg == BUY:
                return self._buy()
            else:
                for name, values in self._product()["options"].items():
                    if arg in values:
                        self._options[name] = arg
                        break
        elif self._page == PAGE_SUB and arg == PREV:
            self._page, self._sub_page = PAGE_ITEM, None
        return 0.0, {}

    def _reset_state_keep_steps(self) -> None:
        steps = self._steps
        self._reset_state()
        self._steps = steps

    def _buy(self) -> tuple[float, dict[str, Any]]:
        product = self._product()
        info = webshop_reward(product, self._goal, product["price"], self._options)
        self._page, self._done, self._reward = PAGE_DONE, True, info.reward
        purchased = {"asin": product["asin"], "options": dict(self._options), "price": product["price"]}
        return info.reward, {"reward_info": info.as_dict(), "purchased": purchased}

    # ------------------------------------------------------------------ views
    def available(self) -> dict[str, Any]:
        """WebShop's ``get_available_actions``: ``has_search_bar`` and the clickables."""
        page = self._page
        if page == PAGE_SEARCH:
            return {"has_search_bar": True, "clickables": []}
        if page == PAGE_RESULTS:
            clickables = [BACK]
            if self._page_no > 1:
                clickables.append(PREV)
            if self._page_no * PRODUCTS_PER_PAGE < len(self._results):
                clickables.append(NEXT)
            clickables.extend(p["asin"].lower() for p in self._page_products())
            return {"has_search_bar": False, "clickables": clickables}
        if page == PAGE_ITEM:
            clickables = [BACK, PREV, *SUB_PAGES, BUY]
            for values in self._product()["options"].values():
                clickables.extend(values)
            return {"has_search_bar": False, "clickables": clickables}
        if page == PAGE_SUB:
            return {"has_search_bar": False, "clickables": [BACK, PREV]}
        return {"has_search_bar": False, "clickables": []}

    def available_actions(self) -> tuple[str, ...]:
        """The admissible actions, formatted as verl-agent shows them to the model."""
        avail = self.available()
        return render_available_actions(avail["has_search_bar"], avail["clickables"])

    def page_text(self) -> str:
        """The current page in WebShop's simple text mode, without the instruction part."""
        page = self._page
        if page == PAGE_SEARCH:
            return "Search"
        if page == PAGE_RESULTS:
            parts = [_LABEL[BACK], f"Page {self._page_no} (Total results: {len(self._results)})"]
            clickables = self.available()["clickables"]
            parts.extend(_LABEL[c] for c in (PREV, NEXT) if c in clickables)
            for p in self._page_products():
                parts.extend([p["asin"], p["title"], f"${p['price']:.2f}"])
            return SEP.join(parts)
        if page == PAGE_ITEM:
            p = self._product()
            parts = [_LABEL[BACK], _LABEL[PREV]]
            for name, values in p["options"].items():
                parts.append(name)
                parts.extend(values)
            parts.extend([p["title"], f"Price: ${p['price']:.2f}", "Rating: N.A."])
            parts.extend(_LABEL[c] for c in (*SUB_PAGES, BUY))
            return SEP.join(parts)
        if page == PAGE_SUB:
            p = self._product()
            parts = [_LABEL[BACK], _LABEL[PREV]]
            if self._sub_page == "description":
                parts.append(p["description"])
            elif self._sub_page == "features":
                parts.extend(p["features"])
            return SEP.join(parts)
        return SEP.join(["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", repr(self._reward)])

    def _observation(self) -> Observation:
        instruction = self._goal["instruction_text"] if self._goal else ""
        text = self.page_text()
        if self.include_instruction and self._page != PAGE_DONE:
            prefix = ["WebShop"] if self._page == PAGE_SEARCH else []
            text = SEP.join([*prefix, "Instruction:", instruction, text])
        meta = {"page": self._page, "step": self._steps, "asin": self._asin, "options": dict(self._options)}
        return Observation(text=text, available_actions=self.available_actions(), instruction=instruction, meta=meta)
