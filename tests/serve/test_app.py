"""The OpenAI-compatible server on tiny models: the real `openai` client against a real uvicorn server.

Two servers per module: a speculative one (the oracle pair: a tiny target and a near-perfect EAGLE-1
head, harness on, up to 32 rows) and a plain one (no head, 4 rows, a short queue, an API key). Both
use a character-level tokenizer, so text compares exactly with `eagle_jax.generate`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import random
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import eagle_jax  # noqa: E402
from eagle_jax import steps as step_fns  # noqa: E402
from eagle_jax.harness import Choice  # noqa: E402
from eagle_jax.profiles import Profile  # noqa: E402
from eagle_jax.tree import tree_name  # noqa: E402
from eagle_jax.serve import ServeConfig, create_app  # noqa: E402
from eagle_jax.serve.metrics import Metrics, parse as parse_metrics  # noqa: E402
from eagle_jax.tree import TreeConfig  # noqa: E402
from builders import oracle_pair, tiny_target  # noqa: E402
from servers import CHARS, ServerThread, char_tokenizer  # noqa: E402

MODEL = "tiny"
KEY = "sekrit-key"


@pytest.fixture(scope="module")
def spec_pair():
    tgt, head = oracle_pair()
    return dataclasses.replace(tgt, tokenizer=char_tokenizer()), head


@pytest.fixture(scope="module")
def spec_server(spec_pair):
    tgt, head = spec_pair
    cfg = ServeConfig(max_batch=32, max_model_len=128, batch_buckets=(4, 32), prefill_batches=(1, 4, 16),
                      candidates=("off", "3,2,6", "4,4,16"), warmup=False)
    # A synthetic cost profile under which the harness switches between speculation and plain steps as rows
    # come and go (the tiny model's real costs would make it speculate at batch 4 and never at 32); profiles
    # are measured and cached in test_harness.py.
    profile = Profile("synthetic", {4: {"off": 1.0, "3,2,6": 1.3, "4,4,16": 1.6},
                                    32: {"off": 1.0, "3,2,6": 2.2, "4,4,16": 3.0}}, {})
    with ServerThread(create_app(tgt, head, cfg, profile=profile)) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain_target():
    return dataclasses.replace(tiny_target(), tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def plain_server(plain_target):
    cfg = ServeConfig(max_batch=4, max_model_len=128, batch_buckets=(1, 4), prefill_batches=(1, 4), max_queue=2,
                      speculation="off", api_key=KEY, warmup=False)
    with ServerThread(create_app(plain_target, None, cfg)) as srv:
        yield srv


def _client(srv, key="unused"):
    return openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=120)


def _async_client(srv, key="unused"):
    return openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=120)


def _reference(target, prompts, max_tokens, chat=False, **sampling):
    """Texts and finish reasons of `eagle_jax.generate` (plain decoding), one prompt at a time."""
    out = []
    for p, m in zip(prompts, max_tokens):
        r = eagle_jax.generate(target, [p], max_new_tokens=m, chat=chat, **sampling)
        out.append((r.texts[0], r.finish_reasons[0], len(r.token_ids[0])))
    return out


def _greedy_reference(target, prompts, max_tokens):
    """Plain greedy texts per prompt, from one batched `generate` call cut to each request's max_tokens
    (greedy rows do not depend on their batch, and a shorter budget only cuts the same tokens)."""
    r = eagle_jax.generate(target, prompts, max_new_tokens=max(max_tokens), chat=False)
    out = []
    for ids, m in zip(r.token_ids, max_tokens):
        ids = ids[:m]
        reason = "stop" if ids and ids[-1] == 2 else "length"
        out.append((target.tokenizer.decode(ids, skip_special_tokens=True), reason, len(ids)))
    return out


def _random_prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    letters = [c for c in CHARS if c.isalnum() or c in " .,!?"]
    return ["".join(rng.choice(letters) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


# --- the OpenAI client end to end ------------------------------------------------------------------------

def test_openai_client_completions_chat_and_streams_equal_plain_greedy(spec_server, spec_pair):
    tgt, _ = spec_pair
    client = _client(spec_server)
    prompt, messages = "The quick brown fox", [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Name a river."}]
    want_text, want_reason, want_n = _reference(tgt, [prompt], [40])[0]
    want_chat, chat_reason, chat_n = _reference(tgt, [messages], [50], chat=True)[0]

    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == want_text and r.choices[0].finish_reason == want_reason
    n_prompt = len(tgt.tokenizer(prompt)["input_ids"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, want_n,
                                                                                      n_prompt + want_n)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want_reason
    assert chunks[-1].usage.completion_tokens == want_n and not chunks[-1].choices

    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=0)
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == want_chat and c.choices[0].finish_reason == chat_reason
    assert c.usage.completion_tokens == chat_n

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want_chat
    assert chunks[-1].choices[0].finish_reason == chat_reason

    # A stop string cuts the text before it (streamed and not), and finishes with "stop".
    stop = want_text[10:13]
    cut = want_text[: want_text.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert spec_server.request("GET", "/health")[:3:2] == (200, {"status": "ok", "model": MODEL})
    code, _, state = spec_server.request("GET", "/harness")
    assert code == 200 and state["mode"] == "auto" and state["profile"]["source"] == "given"
    assert sum(state["choices"].values()) > 0 and state["last_choice"]["tree"] in state["candidates"]
    m = spec_server.metrics()
    assert sum(v for k, v in m.items() if k.startswith("eagle_harness_choice")) == 1.0
    assert m['eagle_tau{sampling="greedy"}'] > 1.5  # the oracle head's drafts are mostly accepted


@pytest.mark.slow  # heavy on a cold cache: CI runs it, the quick loop does not
def test_32_concurrent_streams_each_equal_their_single_request_result(spec_server, spec_pair, monkeypatch):
    tgt, _ = spec_pair
    # Cycle plain and speculative steps whatever the load, so rows join, leave, fall out of sync with
    # their draft (plain steps) and are verified under trees in every combination (the harness's own
    # choices are tested in test_harness.py and above).
    policy = spec_server.scheduler.policy
    script = [None, TreeConfig(3, 2, 6), TreeConfig(4, 4, 16), TreeConfig(3, 2, 6)]
    calls = iter(range(10**9))

    def scripted(bucket, active, synced, sampled=0):
        tree = script[next(calls) % len(script)]
        return Choice(tree_name(tree), tree, 0.0, 0.0)

    monkeypatch.setattr(policy, "choose", scripted)
    n = 32
    prompts = _random_prompts(n, seed=1)
    max_tokens = [random.Random(i).randint(4, 80) for i in range(n)]
    # Every fourth request samples (its own temperature / top_p / top_k / seed); the rest are greedy.
    sampling = [dict(temperature=0.0) if i % 4 else
                dict(temperature=0.6 + 0.1 * (i % 7), top_p=0.9, seed=100 + i, extra_body={"top_k": 5})
                for i in range(n)]
    want = _greedy_reference(tgt, prompts, max_tokens)

    async def one(client, i):
        await asyncio.sleep(0.01 * i)  # staggered arrivals: rows join a running batch
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i],
                                                 stream=True, stream_options={"include_usage": True}, **sampling[i])
        text, reasons, usage = [], [], None
        async for ch in stream:
            if ch.choices:
                text.append(ch.choices[0].text)
                reasons.append(ch.choices[0].finish_reason)
            if ch.usage is not None:
                usage = ch.usage
        return "".join(text), reasons, usage

    async def main():
        async with _async_client(spec_server) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    before = spec_server.metrics()
    results = asyncio.run(main())
    after = spec_server.metrics()
    for i, (text, reasons, usage) in enumerate(results):
        assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
        assert usage is not None and 1 <= usage.completion_tokens <= max_tokens[i]
        if sampling[i]["temperature"] == 0:
            assert (text, reasons[-1], usage.completion_tokens) == want[i], f"request {i}"
        elif reasons[-1] == "length":
            assert usage.completion_tokens == max_tokens[i]
    assert after["eagle_requests_running"] == 0 and after["eagle_slots_free"] == 32
    assert after['eagle_requests_total{outcome="completed"}'] - before.get(
        'eagle_requests_total{outcome="completed"}', 0) == n
    assert after["eagle_generation_tokens_total"] - before.get("eagle_generation_tokens_total", 0) == sum(
        r[2].completion_tokens for r in results)
    steps = lambda m, name: m.get(f'eagle_steps_total{{config="{name}"}}', 0)
    assert all(steps(after, c) > steps(before, c) for c in ("off", "3,2,6", "4,4,16"))
    assert step_fns.TRACE_COUNTS["insert_rows"] > 0


def test_bad_requests_get_openai_errors_naming_the_field_and_do_not_disturb_others(spec_server, spec_pair):
    tgt, _ = spec_pair
    good = [("Good morning", 30), ("Once upon a time", 45), ("abc", 20)]
    want = _reference(tgt, [p for p, _ in good], [m for _, m in good])
    results = [None] * len(good)

    def run_good(i):
        client = _client(spec_server)
        chunks = client.completions.create(model=MODEL, prompt=good[i][0], max_tokens=good[i][1], temperature=0,
                                           stream=True)
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=run_good, args=(i,)) for i in range(len(good))]
    for t in threads:
        t.start()

    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 5}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        # (path, body or raw bytes, status, param, words in the message)
        ("/v1/completions", b"{not json", 400, None, "Invalid JSON"),
        ("/v1/completions", [1, 2], 400, None, "JSON object"),
        ("/v1/completions", {**ok, "max_tokens": "5"}, 400, "max_tokens", "integer"),
        ("/v1/completions", {**ok, "temperature": "hot"}, 400, "temperature", "number"),
        ("/v1/completions", {**ok, "stream": "yes"}, 400, "stream", "boolean"),
        ("/v1/completions", {**ok, "model": "gpt-9"}, 404, "model", "gpt-9"),
        ("/v1/completions", {**ok, "max_tokens": -5}, 400, "max_tokens", "at least 1"),
        ("/v1/completions", {**ok, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ("/v1/completions", {**ok, "max_tokens": 10**12}, 400, "max_tokens", "maximum context length"),
        ("/v1/completions", {**ok, "prompt": "a" * 200}, 400, "prompt", "maximum context length"),
        ("/v1/completions", {**ok, "prompt": [5, 4000]}, 400, "prompt", "token ids"),
        ("/v1/completions", {**ok, "prompt": ""}, 400, "prompt", "empty"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt", "Missing"),
        ("/v1/completions", {**ok, "temperature": -0.5}, 400, "temperature", "temperature"),
        ("/v1/completions", {**ok, "top_p": 0}, 400, "top_p", "top_p"),
        ("/v1/completions", {**ok, "top_k": -3}, 400, "top_k", "top_k"),
        ("/v1/completions", {**ok, "temperature": 2.5}, 400, "temperature", "[0, 2]"),
        ("/v1/completions", {**ok, "n": 2}, 400, "n", "n=1"),
        ("/v1/completions", {**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "messages", "non-empty"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "Missing"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}, 400,
         "messages[0].role", "role"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": 7}]}, 400,
         "messages[0].content", "string"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "a" * 200}]}, 400, "messages",
         "maximum context length"),
        ("/v1/chat/completions", {**chat, "max_tokens": 10**6}, 400, "max_tokens", "maximum context length"),
    ]
    for path, body, status, param, words in cases:
        raw = body if isinstance(body, bytes) else None
        code, headers, data = spec_server.request("POST", path, None if raw else body, raw=raw)
        assert code == status, (path, body, data)
        err = data["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param, (body, err)
        assert words.lower() in err["message"].lower(), (body, err)
    code, _, data = spec_server.request("GET", "/v1/nowhere")
    assert code == 404 and "error" in data

    for t in threads:
        t.join(120)
    assert results == [w[0] for w in want]
    assert spec_server.request("GET", "/health")[0] == 200
    r = _client(spec_server).completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0)
    assert r.choices[0].text == _reference(tgt, ["hi"], [5])[0][0]
    # Extreme but valid values are served, not passed on to break a shared batch.
    r = _client(spec_server).completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=2,
                                                seed=-(10**30), extra_body={"top_k": 10**12})
    assert r.usage.completion_tokens == 5


# --- the plain server: sampling, auth, queue limits, disconnects ------------------------------------

def test_sampled_requests_in_a_batch_equal_their_single_request_result(plain_server, plain_target):
    prompts = _random_prompts(6, seed=7)
    specs = [dict(temperature=0.7, seed=1), dict(temperature=1.0, top_p=0.8, seed=2), dict(temperature=0.0),
             dict(temperature=1.3, seed=3, top_k=7), dict(temperature=0.9, top_p=0.5, top_k=3, seed=4),
             dict(temperature=1.0, seed=5)]
    max_tokens = [30, 12, 25, 40, 18, 33]
    want = [_reference(plain_target, [p], [m], **s)[0] for p, m, s in zip(prompts, max_tokens, specs)]

    async def one(client, i):
        s = dict(specs[i])
        extra = {"top_k": s.pop("top_k")} if "top_k" in s else None
        r = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i],
                                            extra_body=extra, **s)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    async def main():
        async with _async_client(plain_server, KEY) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    assert asyncio.run(main()) == want  # 6 requests on 4 slots: two of them wait in the queue


def test_api_key_is_required_on_v1_routes(plain_server):
    code, headers, data = plain_server.request("POST", "/v1/completions", {"prompt": "hi"})
    assert code == 401 and data["error"]["code"] == "invalid_api_key"
    code, _, _ = plain_server.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(plain_server, "wrong").models.list()
    assert _client(plain_server, KEY).models.list().data[0].id == MODEL
    assert plain_server.request("GET", "/health")[0] == 200  # health and metrics stay open for probes


def _slow_steps(monkeypatch, server, seconds=0.03):
    sched = server.scheduler
    step = sched._step

    def slow():
        time.sleep(seconds)
        step()

    monkeypatch.setattr(sched, "_step", slow)


def _wait_for(predicate, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_queue_full_gets_503_with_retry_after_not_a_hang(plain_server, plain_target, monkeypatch):
    _slow_steps(monkeypatch, plain_server)
    prompts = _random_prompts(6, seed=11)
    want = _greedy_reference(plain_target, prompts, [60] * 6)

    async def main():
        async with _async_client(plain_server, KEY) as client:
            tasks = [asyncio.create_task(client.completions.create(model=MODEL, prompt=p, max_tokens=60,
                                                                   temperature=0)) for p in prompts]
            full = await asyncio.to_thread(_wait_for, lambda: plain_server.metrics()["eagle_requests_waiting"] == 2)
            t0 = time.time()
            code, headers, data = await asyncio.to_thread(
                plain_server.request, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5},
                {"Authorization": f"Bearer {KEY}"})
            rejected = (code, headers.get("retry-after"), data["error"]["code"], time.time() - t0)
            return full, rejected, await asyncio.gather(*tasks)

    full, rejected, done = asyncio.run(main())
    assert full
    assert rejected[:3] == (503, "1", "queue_full") and rejected[3] < 5
    assert [(r.choices[0].text, r.choices[0].finish_reason) for r in done] == [w[:2] for w in want]


def test_client_disconnect_mid_stream_frees_its_slot(plain_server, monkeypatch):
    _slow_steps(monkeypatch, plain_server)
    before = plain_server.metrics()
    conn = http.client.HTTPConnection("127.0.0.1", plain_server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "Tell me", "max_tokens": 100,
                                                             "temperature": 0, "stream": True, "ignore_eos": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    line = resp.fp.readline()
    while not line.startswith(b"data:"):
        line = resp.fp.readline()
    assert _wait_for(lambda: plain_server.metrics()["eagle_requests_running"] == 1)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    key = 'eagle_requests_total{outcome="cancelled"}'
    freed = lambda n: lambda: (lambda m: m.get(key, 0) == before.get(key, 0) + n and m["eagle_requests_running"] == 0
                               and m["eagle_slots_free"] == 4)(plain_server.metrics())
    assert _wait_for(freed(1))
    after = plain_server.metrics()
    assert after["eagle_generation_tokens_total"] - before["eagle_generation_tokens_total"] < 100
    r = _client(plain_server, KEY).completions.create(model=MODEL, prompt="again", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3

    # A non-streaming client that goes away is noticed too (the handler polls for the disconnect).
    conn = http.client.HTTPConnection("127.0.0.1", plain_server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "Tell me", "max_tokens": 100,
                                                             "temperature": 0, "ignore_eos": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert _wait_for(lambda: plain_server.metrics()["eagle_requests_running"] == 1)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert _wait_for(freed(2))
    assert plain_server.metrics()["eagle_generation_tokens_total"] - after["eagle_generation_tokens_total"] < 100


def test_unlabelled_counters_are_exported_at_zero_before_any_request():
    fresh = parse_metrics(Metrics().render())
    for name in ("eagle_prompt_tokens_total", "eagle_generation_tokens_total", "eagle_prefills_total"):
        assert fresh[name] == 0.0
    m = Metrics()
    m.inc("eagle_generation_tokens_total", 7)
    m.inc("eagle_requests_total", outcome="completed")
    got = parse_metrics(m.render())
    assert got["eagle_generation_tokens_total"] == 7.0 and got['eagle_requests_total{outcome="completed"}'] == 1.0
