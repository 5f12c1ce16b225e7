"""WebShop for multi-turn agents: the built-in offline environment and a real-server adapter.

* :class:`WebShopEnv`: WebShop's text interface, state machine and reward over a
  synthetic 1,200-product catalogue shipped with the package (BM25 search via bm25s).
* :class:`WebShopServerEnv`: the same protocol over a WebShop server a user runs.
* :func:`webshop_reward`: WebShop's purchase reward; :func:`load_catalogue`: the data.
"""

from .catalogue import Catalogue, load_catalogue
from .env import WebShopEnv
from .reward import RewardInfo, webshop_reward
from .server import WebShopServerEnv

__all__ = ["SUCCESS_RULE", "Catalogue", "load_catalogue", "WebShopEnv", "WebShopServerEnv", "RewardInfo", "webshop_reward"]

#: what a won episode is, in words (the run's closing lines and docs quote it)
SUCCESS_RULE = (
    "bought a product that matches every requested attribute and option within the price limit (reward 1; score is the reward's partial credit, 0 to 1)"
)
