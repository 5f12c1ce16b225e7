"""ServerRetriever against a stub Search-R1 retrieval server on 127.0.0.1 (real HTTP).

The stub answers ``POST /retrieve`` the way Search-R1's ``retrieval_server.py`` does
(``{"result": [...]}``, one list per query; with ``return_scores`` each hit is
``{"document": {"id", "contents"}, "score"}``, without it the bare document), searching the
built-in KB with the local BM25, and records every request body. It runs in a daemon
thread, stops at teardown and, as a safety net, by itself after 60 seconds.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

pytest.importorskip("bm25s")

from icsd_audit.envs import make_env  # noqa: E402
from icsd_audit.envs.searchqa import SearchQAEnv, ServerRetriever, builtin_kb, load_data  # noqa: E402


class Stub:
    def __init__(self):
        self.local = load_data().retriever
        self.requests: list[dict] = []
        self.mode = "ok"  # "ok" | "bare" | "short" | "error"

    def answer(self, body: dict) -> tuple[int, dict]:
        self.requests.append(body)
        if self.mode == "error":
            return 500, {"detail": "boom"}
        hits = self.local.search(body["queries"], body.get("topk") or 3)
        if self.mode == "short":
            hits = hits[:-1]
        if body.get("return_scores") and self.mode != "bare":
            result = [[{"document": d, "score": 10.0 - i} for i, d in enumerate(h)] for h in hits]
        else:
            result = hits
        return 200, {"result": result}


def make_handler(stub: Stub):
    class Handler(BaseHTTPRequestHandler):
        timeout = 10

        def log_message(self, *args):
            pass

        def do_POST(self):
            if self.path != "/retrieve":
                status, payload = 404, {"detail": "Not Found"}
            else:
                length = int(self.headers.get("Content-Length") or 0)
                status, payload = stub.answer(json.loads(self.rfile.read(length)))
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture(scope="module")
def server():
    stub = Stub()
    httpd = HTTPServer(("127.0.0.1", 0), make_handler(stub))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    watchdog = threading.Timer(60.0, httpd.shutdown)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", stub
    finally:
        watchdog.cancel()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_adapter_sends_search_r1_requests_and_matches_local_bm25(server):
    url, stub = server
    stub.mode, stub.requests[:] = "ok", []
    remote = ServerRetriever(url)  # base URL: /retrieve is appended
    local = load_data().retriever
    queries = ["who directed the film", builtin_kb().splits["test"][3].question, "who directed the film"]
    assert remote.search(queries, 3) == local.search(queries, 3)
    assert stub.requests == [{"queries": queries[:2], "topk": 3, "return_scores": True}]  # deduplicated, one POST
    assert remote.search(queries[:1], 3) == local.search(queries[:1], 3) and len(stub.requests) == 1  # memoised
    assert ServerRetriever(url + "/retrieve").url == url + "/retrieve"


def test_env_over_server_equals_builtin_env(server):
    url, stub = server
    stub.mode = "ok"
    remote = make_env("searchqa", url=url, split="eval", max_steps=4)
    assert isinstance(remote, SearchQAEnv) and remote.data.info["retriever"] == {"kind": "search-r1-server", "url": url}
    local = SearchQAEnv("eval", max_steps=4)
    for task in (0, 10, 444):
        remote.reset(task)
        local.reset(task)
        for query, _ in local.item.hops:
            a, b = remote.step(f"search[{query}]"), local.step(f"search[{query}]")
            assert a.observation.text == b.observation.text and a.info["doc_ids"] == b.info["doc_ids"]
        a, b = remote.step(f"answer[{local.item.golden_answers[0]}]"), local.step(f"answer[{local.item.golden_answers[0]}]")
        assert a.reward == b.reward == 1.0


def test_scoreless_answers_errors_and_unreachable_server(server):
    url, stub = server
    stub.mode = "ok"
    stub.mode = "bare"  # a server that ignores return_scores and sends bare documents
    assert ServerRetriever(url).search(["who sang"], 2) == load_data().retriever.search(["who sang"], 2)
    stub.mode = "short"
    with pytest.raises(ValueError, match="one list per query"):
        ServerRetriever(url).search(["a b", "c d"], 3)
    stub.mode = "error"
    with pytest.raises(ConnectionError, match="HTTP 500"):
        ServerRetriever(url).search(["x"], 3)
    with pytest.raises(ConnectionError, match="HTTP 404"):
        ServerRetriever(url + "/nowhere/").search(["x"], 3)
    stub.mode = "ok"
    with pytest.raises(ConnectionError, match="unreachable"):
        ServerRetriever("http://127.0.0.1:9", timeout=2).search(["x"], 3)
