"""Hostile requests against a real server (a fuzz run's findings): each is answered 4xx with an OpenAI-style
error body naming the problem, is counted, and leaves its keep-alive connection usable for the next request.
A request that fails in a way no handler expected is answered 500 with `Connection: close`."""

from __future__ import annotations

import dataclasses
import http.client
import json

import pytest

pytest.importorskip("uvicorn")

from eagle_jax.serve import ServeConfig, create_app  # noqa: E402
from builders import tiny_target  # noqa: E402
from servers import ServerThread, char_tokenizer  # noqa: E402

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
INVALID = 'eagle_requests_total{outcome="invalid"}'
OK = {"completions": {"prompt": "hi", "max_tokens": 3, "temperature": 0},
      "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}}


@pytest.fixture(scope="module")
def server():
    tgt = dataclasses.replace(tiny_target(), tokenizer=char_tokenizer())
    cfg = ServeConfig(max_batch=2, max_model_len=64, batch_buckets=(2,), prefill_batches=(1, 2), speculation="off",
                      api_key=KEY, warmup=False)
    with ServerThread(create_app(tgt, None, cfg)) as srv:
        yield srv


def _valid_with(endpoint: str, field: str, literal: str) -> bytes:
    """The endpoint's good body with `field` set to a raw JSON literal."""
    body = json.dumps(OK[endpoint])
    return (body[:-1] + f', "{field}": ' + literal + "}").encode()


def _cases(endpoint: str):
    """(raw body, the param the error names, words in its message)."""
    deep = 10_000
    text_param = "prompt" if endpoint == "completions" else "messages[0].content"
    good = OK[endpoint]
    surrogate = {**good, "prompt": "a\ud800b"} if endpoint == "completions" else \
        {**good, "messages": [{"role": "user", "content": "a\ud800b"}]}
    return [
        (b"[" * deep + b"]" * deep, None, "nested"),
        (b'{"a":' * deep + b"1" + b"}" * deep, None, "nested"),
        (_valid_with(endpoint, "extra", "[" * deep + "]" * deep), None, "nested"),
        (_valid_with(endpoint, "extra", '{"x":' * 100 + "1" + "}" * 100), None, "nested"),  # under Python's limit
        (_valid_with(endpoint, "max_tokens", "9" * 5000), "max_tokens", "5000 digits"),
        (_valid_with(endpoint, "seed", "-" + "7" * 5000), "seed", "5000 digits"),
        (_valid_with(endpoint, "temperature", "1" * 400), "temperature", "400 digits"),
        (json.dumps(surrogate).encode(), text_param, "surrogate"),
        (json.dumps({**good, "stop": ["ok", "\udfff"]}).encode(), "stop[1]", "surrogate"),
        (b'{"prompt": "hi", "max_tokens": 1e999999}', None, None),  # inf is no integer: a 400 either way
    ]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_hostile_bodies_get_4xx_naming_the_problem_and_the_connection_stays_usable(server, endpoint):
    before = server.metrics().get(INVALID, 0.0)
    cases = _cases(endpoint)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        for raw, param, words in cases:
            conn.request("POST", f"/v1/{endpoint}", body=raw, headers=AUTH)
            resp = conn.getresponse()
            data = json.loads(resp.read())
            assert resp.status == 400, (raw[:80], data)
            assert set(data["error"]) == {"message", "type", "param", "code"}
            if words is not None:
                assert data["error"]["param"] == param, (raw[:80], data)
                assert words in data["error"]["message"], (raw[:80], data)
            # The same keep-alive connection answers a good request next.
            conn.request("POST", f"/v1/{endpoint}", body=json.dumps(OK[endpoint]).encode(), headers=AUTH)
            resp = conn.getresponse()
            good = json.loads(resp.read())
            assert resp.status == 200 and good["usage"]["completion_tokens"] == 3, good
    finally:
        conn.close()
    after = server.metrics()[INVALID]
    assert after - before == len(cases)


def test_an_unexpected_failure_is_a_counted_500_that_closes_its_connection(server, monkeypatch):
    api = server.app.state.api

    async def broken(http, req):
        raise RuntimeError("a bug")

    monkeypatch.setattr(api, "completions", broken)
    key = 'eagle_requests_total{outcome="error"}'
    before = server.metrics().get(key, 0.0)
    code, headers, data = server.request("POST", "/v1/completions", OK["completions"], headers=AUTH)
    assert code == 500 and data["error"]["type"] == "server_error" and "a bug" not in data["error"]["message"]
    assert headers.get("connection") == "close"
    assert server.metrics()[key] - before == 1
    monkeypatch.undo()
    code, _, data = server.request("POST", "/v1/completions", OK["completions"], headers=AUTH)
    assert code == 200 and data["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("header,status", [(f"bearer {KEY}", 200), (f"BEARER  {KEY} ", 200), (f"Bearer{KEY}", 401),
                                           (f"Basic {KEY}", 401), (f"Bearer {KEY}x", 401)])
def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not(server, header, status):
    code, _, _ = server.request("GET", "/v1/models", headers={"Authorization": header})
    assert code == status
