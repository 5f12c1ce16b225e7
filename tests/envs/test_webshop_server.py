"""WebShopServerEnv against a tiny fake WebShop server on 127.0.0.1.

The fake server answers the routes of WebShop's Flask app (``web_agent_site/app.py``)
with pages shaped like its templates (same ids, classes, forms, radio ``data-url``s,
``Instruction:<br>`` header, hidden done-page block) over the built-in catalogue, so
the adapter's observations can be compared with the built-in environment's.
It runs in a daemon thread, stops at teardown and, as a safety net, by itself after
60 seconds.
"""

from __future__ import annotations

import ast
import html
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

pytest.importorskip("bm25s")

from icsd_audit.envs import make_env  # noqa: E402
from icsd_audit.envs.webshop import WebShopEnv, WebShopServerEnv, load_catalogue, webshop_reward  # noqa: E402
from icsd_audit.envs.webshop.server import parse_page  # noqa: E402

E = html.escape
HEAD = ('<head><link rel="stylesheet" href="/static/style.css"><script src="https://x/jquery.min.js"></script>'
        '<title>WebShop</title></head>')


def q(value) -> str:
    return urllib.parse.quote(str(value), safe="")


def instruction_block(text: str) -> str:
    return f'<div id="instruction-text" class="text-center"><h4>Instruction:<br>{E(text)}</h4></div>'


def button_form(action: str, label: str, cls: str = "btn btn-primary") -> str:
    return f'<form method="post" action="{action}"><button type="submit" class="{cls}">{E(label)}</button></form>'


class FakeWebShop:
    """State of the fake app: goals (eval first, then train) and the catalogue."""

    def __init__(self):
        self.cat = load_catalogue()
        self.goals = self.cat.goals("eval") + self.cat.goals("train")
        self.sessions: dict[str, dict] = {}

    def goal(self, sid: str) -> dict:
        if sid not in self.sessions:
            self.sessions[sid] = self.goals[int(sid.split("_")[-1])]
        return self.sessions[sid]

    # pages ------------------------------------------------------------------------------
    def search_page(self, sid):
        return (f"<!DOCTYPE html><html>{HEAD}<body><div class='container'><div id='logo'><h2>WebShop</h2></div>"
                f"<div id=\"instruction-text\"><h4>Instruction: <br>{E(self.goal(sid)['instruction_text'])}</h4></div>"
                f'<form role="form" id="form-buscar" method="post" action="/{sid}"><div class="input-group">'
                f'<input id="search_input" class="form-control" type="text" name="search_query" required/>'
                f'<span class="input-group-btn"><button class="btn btn-success" type="submit">'
                f'<i class="glyphicon glyphicon-search"></i>Search</button></span></div></form></div></body></html>')

    def results_page(self, sid, kw_raw, page):
        keywords = ast.literal_eval(kw_raw)
        top = self.cat.search_engine.search(" ".join(keywords), 50)
        items = [self.cat.products[i] for i in top[(page - 1) * 10 : page * 10]]
        nav = ""
        if page > 1:
            nav += button_form(f"/search_results/{sid}/{q(keywords)}/{page - 1}", "< Prev")
        nav += button_form(f"/search_results/{sid}/{q(keywords)}/{page + 1}", "Next >")  # always, as the app
        rows = "".join(
            f'<div class="list-group-item"><img src="x.jpg" class="result-img">'
            f'<h4 class="product-asin"><a class="product-link" '
            f'href="/item_page/{sid}/{p["asin"]}/{q(keywords)}/{page}/{q({})}">{p["asin"]}</a></h5>'
            f'<h4 class="product-title">{E(p["title"])}</h5><h5 class="product-price">${p["price"]:.2f}</h6>'
            f'<!-- <h5 class="product-category">{E(p["category"])}</h5> --></div>'
            for p in items
        )
        return (f"<!DOCTYPE html><html>{HEAD}<body>{instruction_block(self.goal(sid)['instruction_text'])}"
                f"{button_form(f'/{sid}', 'Back to Search', 'btn btn-success')}"
                f"<div class='display-4'><h3>Page {page} (Total results: {len(top)})</h3></div>{nav}"
                f"<div class='row'>{rows}</div></body></html>")

    def item_page(self, sid, asin, kw_raw, page, options):
        p = self.cat.by_asin[asin]
        radios = ""
        for name, values in p["options"].items():
            radios += f"<div class='row'><h4>{E(name)}</h4><div class='radio-toolbar'>"
            for i, v in enumerate(values):
                url = f"/item_page/{sid}/{asin}/{q(kw_raw)}/{page}/{q(dict(options, **{name: v}))}"
                radios += (f'<input type="radio" id="radio_{E(name)}{i}" name="{E(name)}" value="{E(v)}" '
                           f'data-url="{url}"><label for="radio_{E(name)}{i}">{E(v)}</label>')
            radios += "</div></div>"
        subs = "".join(
            f'<div class="col-sm-3" name="{s.lower()}">'
            + button_form(f"/item_sub_page/{sid}/{asin}/{q(kw_raw)}/{page}/{s}/{q(options)}", s) + "</div>"
            for s in ("Description", "Features", "Reviews")
        )
        return (f"<!DOCTYPE html><html>{HEAD}<body>{instruction_block(self.goal(sid)['instruction_text'])}"
                f"{button_form(f'/{sid}', 'Back to Search', 'btn btn-success')}"
                f"{button_form(f'/search_results/{sid}/{q(kw_raw)}/{page}', '< Prev')}"
                f'<img id="product-image" src="x.jpg">{radios}<h2>{E(p["title"])}</h2>'
                f'<h4>Price: ${p["price"]:.2f}</h4><h4>Rating: N.A.</h4>{subs}'
                f"{button_form(f'/done/{sid}/{asin}/{q(options)}', 'Buy Now', 'btn btn-lg purchase')}"
                "</body><script>$(document).ready(function() { let x = 1; });</script></html>")

    def sub_page(self, sid, asin, kw_raw, page, sub, options):
        p = self.cat.by_asin[asin]
        if sub == "Description":
            body = f'<p class="product-info">{E(p["description"])}</p>'
        elif sub == "Features":
            body = "<ul>" + "".join(f'<li><p class="product-info"> {E(f)}</p></li>' for f in p["features"]) + "</ul>"
        else:
            body = ""
        return (f"<!DOCTYPE html><html>{HEAD}<body>{instruction_block(self.goal(sid)['instruction_text'])}"
                f"{button_form(f'/{sid}', 'Back to Search', 'btn btn-success')}"
                f"{button_form(f'/item_page/{sid}/{asin}/{q(kw_raw)}/{page}/{q(options)}', '< Prev')}"
                f"<div class='card card-body'>{body}</div></body></html>")

    def done_page(self, sid, asin, options):
        goal = self.goal(sid)
        p = self.cat.by_asin[asin]
        reward = webshop_reward(p, goal, p["price"], options).reward
        return (f"<!DOCTYPE html><html>{HEAD}<body><div id='thankyou'><h1>Thank you for shopping with us!</h1></div>"
                f"<div id='stats'><h3>Your code: </h3><p><pre>abc123</pre> (Paste it in your MTurk interface.)</p>"
                f"<div style='display:none'><h4 id='asin'>asin<pre>{asin}</pre></p>"
                f"<h4 id='goal-asin'>asin<pre>{goal['asin']}</pre></p></div>"
                f'<h3 id="reward">Your score (min 0.0, max 1.0)<pre>{reward}</pre></h3></div></body></html>')


def make_handler(app: FakeWebShop):
    class Handler(BaseHTTPRequestHandler):
        timeout = 10

        def log_message(self, *args):  # keep pytest output clean
            pass

        def _send(self, status: int, body: str = "", location: str | None = None):
            data = body.encode()
            self.send_response(status)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, form: dict[str, str]):
            parts = [urllib.parse.unquote(s) for s in urllib.parse.urlsplit(self.path).path.split("/")[1:]]
            kind = parts[0]
            if len(parts) == 1:
                if "search_query" in form:
                    kws = form["search_query"].lower().split(" ")
                    return self._send(302, location=f"/search_results/{kind}/{q(kws)}/1")
                return self._send(200, app.search_page(kind))
            if kind == "search_results":
                return self._send(200, app.results_page(parts[1], parts[2], int(parts[3])))
            if kind == "item_page":
                return self._send(200, app.item_page(parts[1], parts[2], parts[3], parts[4], ast.literal_eval(parts[5])))
            if kind == "item_sub_page":
                return self._send(200, app.sub_page(parts[1], parts[2], parts[3], parts[4], parts[5],
                                                    ast.literal_eval(parts[6])))
            if kind == "done":
                return self._send(200, app.done_page(parts[1], parts[2], ast.literal_eval(parts[3])))
            return self._send(404, "not found")

        def do_GET(self):
            self._route({})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
            self._route(form)

    return Handler


@pytest.fixture(scope="module")
def server_url():
    app = FakeWebShop()
    server = HTTPServer(("127.0.0.1", 0), make_handler(app))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    watchdog = threading.Timer(60.0, server.shutdown)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        watchdog.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _oracle_actions(env, goal):
    yield f"search[{goal['name']}]"
    yield f"click[{goal['asin'].lower()}]"
    for value in goal["goal_options"].values():
        yield f"click[{value}]"
    yield "click[features]"
    yield "click[< prev]"
    yield "click[buy now]"


def test_adapter_matches_builtin_env_along_oracle_path(server_url):
    remote = make_env("webshop", url=server_url, split="eval", max_steps=15)
    assert isinstance(remote, WebShopServerEnv)
    local = WebShopEnv("eval", max_steps=15)
    for task in (0, 7, 123):
        lo, ro = local.reset(task), remote.reset(task)
        assert ro.instruction == lo.instruction
        assert ro.text == lo.text == "Search"
        assert ro.available_actions == lo.available_actions
        for action in _oracle_actions(local, local.goal):
            lr, rr = local.step(action), remote.step(action)
            assert rr.info["valid_action"] and lr.info["valid_action"], action
            if rr.observation.meta["page"] != "done":
                assert rr.observation.text == lr.observation.text, action
                assert rr.observation.available_actions == lr.observation.available_actions, action
            assert rr.observation.meta["page"] == lr.observation.meta["page"]
        assert rr.done and lr.done
        assert rr.reward == lr.reward == 1.0 and rr.info["won"] and rr.info["score"] == 1.0


def test_adapter_partial_reward_invalid_actions_and_max_steps(server_url):
    remote = WebShopServerEnv(server_url, split="eval", max_steps=6)
    local = WebShopEnv("eval", max_steps=6)
    local.reset(2)
    remote.reset(2)
    assert not remote.step("click[buy now]").info["valid_action"]  # nothing to buy on the search page
    local.step("click[buy now]")
    g = local.goal
    for action in (f"search[{g['name']}]", f"click[{g['asin'].lower()}]", "click[buy now]"):
        lr, rr = local.step(action), remote.step(action)
    assert rr.done and lr.done and rr.reward == pytest.approx(lr.reward)
    if g["goal_options"]:  # bought without choosing the goal options
        assert rr.reward < 1.0 and not rr.info["won"]
    with pytest.raises(RuntimeError):
        remote.step("click[buy now]")
    # running out of steps
    remote = WebShopServerEnv(server_url, split="eval", max_steps=2)
    remote.reset(0)
    remote.step("search[perfume]")
    r = remote.step("click[next >]")
    assert r.done and r.reward == 0.0 and r.info["truncated"] and not r.info["won"]


def test_adapter_train_split_offsets_and_validation(server_url):
    cat = load_catalogue()
    n = len(cat.goals("eval")) + len(cat.goals("train"))
    remote = WebShopServerEnv(server_url, split="train", num_goals=n)
    assert remote.num_tasks == len(cat.goals("train"))
    obs = remote.reset(4)
    assert remote.session_id == "fixed_504"
    assert obs.instruction == cat.goals("train")[4]["instruction_text"]
    with pytest.raises(ValueError):
        WebShopServerEnv(server_url, split="train")
    with pytest.raises(IndexError):
        remote.reset(n)


def test_parse_page_reads_done_page_and_clickables():
    page = parse_page(
        '<html><body><h3 id="reward">Your score (min 0.0, max 1.0)<pre>0.6666666666666666</pre></h3>'
        '<form method="post" action="/abc"><button class="btn">Back to Search</button></form>'
        '<a class="product-link" href="/item_page/abc/B0X/kw/1/%7B%7D">B0X</a>'
        '<input type="radio" name="size" value="Large" data-url="/item_page/abc/B0X/kw/1/x">'
        '<script>var hidden = "not text";</script></body></html>',
        "http://h:1/done/abc/B0X/%7B%7D",
    )
    assert page.kind == "done" and page.reward == pytest.approx(2 / 3)
    assert page.clickables == {
        "back to search": ("POST", "http://h:1/abc"),
        "b0x": ("GET", "http://h:1/item_page/abc/B0X/kw/1/%7B%7D"),
        "large": ("GET", "http://h:1/item_page/abc/B0X/kw/1/x"),
    }
    assert "not text" not in " ".join(page.texts)


def test_unreachable_server_raises_connection_error():
    env = WebShopServerEnv("http://127.0.0.1:9", split="eval", timeout=2)
    with pytest.raises(ConnectionError):
        env.reset(0)
