"""The engine loop without HTTP (batch buckets growing and shrinking, cancellation, queue limits) and the
incremental detokeniser."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

import eagle_jax
from eagle_jax.harness import FixedPolicy, Harness
from eagle_jax.profiles import Profile
from eagle_jax.serve.prepare import hopeless
from eagle_jax.serve.requests import QueueFull, Request, SchedulerConfig
from eagle_jax.serve.scheduler import Scheduler
from eagle_jax.stream import TokenStream
from eagle_jax.tree import TreeConfig
from builders import PROMPTS, oracle_pair, tiny_target


class Collector:
    """Sinks for requests: tokens and the final event per request, and an event when all are done."""

    def __init__(self, n):
        self.tokens = [[] for _ in range(n)]
        self.end = [None] * n
        self.left = n
        self.done = threading.Event()
        self.lock = threading.Lock()

    def sink(self, i):
        def on_event(ev):
            with self.lock:
                if ev.kind == "tokens":
                    self.tokens[i].extend(ev.tokens)
                else:
                    self.end[i] = ev.reason or ev.message
                    self.left -= 1
                    if self.left == 0:
                        self.done.set()
        return on_event


def models(speculative: bool):
    """(target, head, policy): the oracle pair with a fixed 3,2,6 tree, or a tiny target decoding plainly."""
    if speculative:
        target, head = oracle_pair()
        return target, head, FixedPolicy(TreeConfig(3, 2, 6))
    return tiny_target(), None, FixedPolicy(None)


def run_in_two_waves(sched, col, reqs, first: int, second_wave_when, why, timeout: float = 120) -> None:
    """Submits reqs[:first], starts the loop, submits the rest once second_wave_when() holds (within 60 s,
    else fails with why()), and waits until every request has ended."""
    for r in reqs[:first]:
        sched.submit(r)
    sched.start()
    try:
        deadline = time.time() + 60
        while not second_wave_when():
            assert time.time() < deadline, why()
            time.sleep(0.005)
        for r in reqs[first:]:
            sched.submit(r)
        assert col.done.wait(timeout)
    finally:
        sched.shutdown()


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "spec"])
def test_batch_shrinks_and_grows_between_steps_without_changing_any_output(speculative, monkeypatch):
    target, head, policy = models(speculative)
    cfg = SchedulerConfig(max_batch=4, max_model_len=96, batch_buckets=(1, 4), prefill_batches=(1, 4),
                          shrink_patience=2)
    sched = Scheduler(target, head, policy, cfg)
    resizes = []
    resize = sched._resize
    monkeypatch.setattr(sched, "_resize", lambda b: (resizes.append(b), resize(b)))
    prompts = PROMPTS + [[9, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    max_tokens = [3, 6, 70, 9, 40, 5]  # the long ones outlive the others: 4 rows -> 1 row -> 4 rows
    col = Collector(len(prompts))
    reqs = [Request(p, m, sink=col.sink(i)) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    # The second wave arrives once the batch has shrunk to one row.
    run_in_two_waves(sched, col, reqs, 4, lambda: 1 in resizes[1:], lambda: f"the batch did not shrink: {resizes}")
    want = [eagle_jax.generate(target, [p], max_new_tokens=m).token_ids[0] for p, m in zip(prompts, max_tokens)]
    assert col.tokens == want
    assert col.end == ["length"] * len(prompts)
    assert resizes[:2] == [4, 1] and 4 in resizes[2:]  # grew for the first wave, shrank, grew again


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "spec"])
def test_a_kv_budget_gives_larger_buckets_shorter_rows_and_a_long_request_waits_for_room(speculative, monkeypatch):
    """kv_cache_tokens: bucket 4 holds rows of at most 128 cache slots, buckets 1 and 2 the full 256. A
    long request keeps the batch at 2 rows (the third waits), short ones then fill bucket 4, and rows
    moving between the cache lengths keep plain decoding's tokens."""
    from eagle_jax.serve.requests import bucket_lengths

    target, head, policy = models(speculative)
    cfg = SchedulerConfig(max_batch=4, max_model_len=200, batch_buckets=(1, 2, 4), prefill_batches=(1, 2),
                          shrink_patience=1, kv_cache_tokens=512)
    sched = Scheduler(target, head, policy, cfg)
    trees = sched.trees
    assert {b: c for b, (_, c) in bucket_lengths(cfg, trees).items()} == {1: 256, 2: 256, 4: 128}
    longest4 = sched.lengths[4][0]
    assert longest4 == 128 - (1 if not speculative else trees[0].tree_tokens + trees[0].depth)
    states = []  # (bucket, target cache slots, longest request running) at every step
    run_step = sched.engine.run_step

    def logged(state, *a, **k):
        rows = [r for r in sched.slots if r is not None]
        if threading.current_thread() is sched.thread:  # (not the reference decoding below)
            states.append((state.root.shape[0], state.cache.k[0].shape[1],
                           max(len(r.prompt_ids) + r.max_tokens for r in rows)))
        return run_step(state, *a, **k)

    monkeypatch.setattr(sched.engine, "run_step", logged)
    long_prompt = [(3 * i + 1) % 50 + 1 for i in range(20)]
    prompts = [long_prompt, PROMPTS[0], PROMPTS[1], [9, 9, 2]] + [PROMPTS[2], PROMPTS[0], [5, 6, 7], PROMPTS[1]]
    max_tokens = [150, 12, 40, 20] + [30, 25, 20, 35]  # the first needs 170 slots: never in bucket 4
    col = Collector(len(prompts))
    reqs = [Request(p, m, sink=col.sink(i)) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    # A second wave of short requests once the long one is done.
    run_in_two_waves(sched, col, reqs, 4, lambda: col.end[0] is not None, lambda: "the long request did not end",
                     timeout=180)
    want = [eagle_jax.generate(target, [p], max_new_tokens=m).token_ids[0] for p, m in zip(prompts, max_tokens)]
    assert col.tokens == want and col.end == ["length"] * len(prompts)
    assert all(c == {1: 256, 2: 256, 4: 128}[b] and need <= sched.lengths[b][0] for b, c, need in states)
    assert any(b == 2 and need == 170 for b, _, need in states)  # the long row ran beside a short one
    assert any(b == 4 for b, _, _ in states)  # the short ones filled bucket 4 once it had left


def test_cancelling_a_queued_request_ends_it_without_tokens_and_others_finish():
    target = tiny_target()
    sched = Scheduler(target, None, FixedPolicy(None), SchedulerConfig(max_batch=2, max_model_len=64,
                                                                       batch_buckets=(2,), prefill_batches=(1, 2)))
    col = Collector(3)
    reqs = [Request(PROMPTS[i], 8, sink=col.sink(i)) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    sched.cancel(reqs[1])  # still waiting: the loop has not started
    sched.start()
    try:
        assert col.done.wait(60)
    finally:
        sched.shutdown()
    assert col.end == ["length", "cancelled", "length"] and col.tokens[1] == []
    assert col.tokens[2] == eagle_jax.generate(target, [PROMPTS[2]], max_new_tokens=8).token_ids[0]


def test_a_full_queue_raises_instead_of_waiting():
    sched = Scheduler(tiny_target(), None, FixedPolicy(None), SchedulerConfig(max_batch=1, max_queue=1))
    sched.submit(Request([1, 2], 4))
    sched.submit(Request([1, 2], 4))
    with pytest.raises(QueueFull):
        sched.submit(Request([1, 2], 4))


class ByteTokenizer:
    """Token id = one byte: characters can span tokens, as with byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_token_stream_holds_back_partial_characters_and_possible_stop_strings():
    ts = TokenStream(ByteTokenizer(), max_tokens=100)
    e_acute = list("é".encode())
    ts.push([ord("a"), e_acute[0]])
    assert ts.delta() == "a"  # the first byte of é decodes to U+FFFD: held back
    ts.push([e_acute[1], ord("b")])
    assert ts.delta() == "éb"
    assert ts.delta(final=True) == "" and len(ts.ids) == 4 and not ts.done

    ts = TokenStream(ByteTokenizer(), max_tokens=100, stop=["END", "!!"])
    out = []
    for piece in (b"ab", b"E", b"X", b"EN", b"D tail"):
        ts.push(list(piece))
        out.append(ts.delta())
    assert out == ["ab", "", "EX", "", ""]
    assert ts.reason == "stop" and ts.text == "abEX" and len(ts.ids) == 7  # up to the token that completed "END"
    assert ts.push(list(b"more")) == 0 and ts.delta() == ""

    ts = TokenStream(ByteTokenizer(), max_tokens=100, stop=["END"])
    ts.push(list(b"hello EN"))
    assert ts.delta() == "hello "
    assert ts.delta(final=True) == "EN"  # generation ended without the stop string: release what was held


def test_token_stream_ends_rows_at_eos_or_max_tokens():
    ts = TokenStream(ByteTokenizer(), max_tokens=5, eos_ids=[0])
    assert ts.push([65, 66, 0, 67]) == 3 and ts.reason == "stop" and ts.ids == [65, 66, 0]
    ts = TokenStream(None, max_tokens=3)
    assert ts.push([1, 2]) == 2 and ts.remaining == 1 and not ts.done
    assert ts.push([3, 4]) == 1 and ts.reason == "length" and ts.remaining == 0 and ts.text == ""
    with pytest.raises(ValueError, match="max_tokens"):
        TokenStream(None, max_tokens=0)


@pytest.mark.slow
def test_background_preparation_compiles_everything_serving_runs():
    from eagle_jax import steps

    target, head = oracle_pair()
    sched = Scheduler(target, head, FixedPolicy(TreeConfig(3, 2, 6)),
                      SchedulerConfig(max_batch=2, max_model_len=64, batch_buckets=(1, 2), prefill_batches=(1, 2),
                                      shrink_patience=1))
    prep = sched.prepare_in_background(prompt_len=24)
    assert not prep.servable and prep.snapshot()["programs_done"] == 0
    sched.start()
    deadline = time.time() + 120
    while not prep.complete and time.time() < deadline:
        time.sleep(0.05)
    snap = prep.snapshot()
    assert prep.complete and snap["programs_done"] == snap["programs_total"] == prep.total and not snap["failed"]
    # Buckets 1 and 2: a plain step and the row ops each; prefills of 1 and of 2 prompts at prompt buckets
    # 16 and 32; the tree at both buckets.
    assert snap["plain_buckets"] == [1, 2] and snap["speculation"] == {"1": ["3,2,6"], "2": ["3,2,6"]}
    assert snap["sampled_speculation"] == {"1": [], "2": []}  # compiled only once some row samples
    assert prep.total == 2 + 2 + 4 + 2
    before = dict(steps.TRACE_COUNTS)
    col = Collector(4)
    prompts = [PROMPTS[0], PROMPTS[1], [5] * 24, PROMPTS[2]]
    for i, (p, m) in enumerate(zip(prompts, [4, 30, 8, 12])):  # joins, leaves, batch grows and shrinks
        sched.submit(Request(p, m, seed=i, sink=col.sink(i)))
    sched.start()
    try:
        assert col.done.wait(60)
    finally:
        sched.shutdown()
    assert col.end == ["length"] * 4
    assert dict(steps.TRACE_COUNTS) == before  # no request waited for a compile


@pytest.mark.slow
def test_sampling_rows_get_plain_steps_until_the_general_tree_programs_compile_in_the_background(monkeypatch):
    """Prepared tree steps are the all-greedy programs; a step with a sampling row runs the general plain
    program until the trees' general programs, asked for then, are compiled in the background (never
    inside a served step); after that such steps speculate with them, and greedy rows stay exact."""
    from eagle_jax import steps

    target, head = oracle_pair()
    tree = TreeConfig(3, 2, 6)
    sched = Scheduler(target, head, FixedPolicy(tree),  # (a sampling row never steps alone at bucket 1)
                      SchedulerConfig(max_batch=2, max_model_len=64, batch_buckets=(1, 2), prefill_batches=(1, 2),
                                      shrink_patience=10**6))
    prep = sched.prepare_in_background(prompt_len=24)
    gate = threading.Event()  # the general tree programs wait for it
    compile_step = prep._compile_step
    monkeypatch.setattr(prep, "_compile_step", lambda b, t, sampling=True: (
        t is None or not sampling or gate.wait(120), compile_step(b, t, sampling)))
    ran = []  # (tree, sampling program, some row samples) of every served step
    run_step = sched.engine.run_step

    def logged(state, params, active, tree, sampling=True, **k):
        ran.append((tree and tree.name, sampling, bool((np.asarray(params.temperature)[np.asarray(active)] > 0).any())))
        return run_step(state, params, active, tree, sampling=sampling, **k)

    monkeypatch.setattr(sched.engine, "run_step", logged)
    sched.start()
    deadline = time.time() + 120
    while not prep.complete and time.time() < deadline:
        time.sleep(0.02)
    total = prep.total
    prompts, max_tokens = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], [24, 16, 24, 16]
    want = [eagle_jax.generate(target, [p], max_new_tokens=m).token_ids[0] for p, m in zip(prompts, max_tokens)]
    col = Collector(4)
    try:
        before = dict(steps.TRACE_COUNTS)
        for i in (0, 1):  # a greedy row beside a sampling one, while their general tree programs wait
            sched.submit(Request(prompts[i], max_tokens[i], temperature=0.7 * i, seed=i, sink=col.sink(i)))
        while col.left > 2 and time.time() < deadline:
            time.sleep(0.02)
        assert col.end[:2] == ["length"] * 2 and dict(steps.TRACE_COUNTS) == before
        mixed = [r for r in ran if r[2]]
        assert mixed and all(r == (None, True, True) for r in mixed)  # plain steps, the general program
        assert all(r[1] is False for r in ran if r[0] is not None)  # greedy tree steps: the all-greedy program
        assert prep.busy and not any(prep.tree_ready(b, tree, True) for b in (1, 2))
        gate.set()
        while prep.busy and time.time() < deadline:
            time.sleep(0.02)
        snap = prep.snapshot()
        assert prep.total == total + 1 and snap["programs_done"] == prep.total and not snap["failed"]
        assert snap["sampled_speculation"] == {"1": [], "2": ["3,2,6"]}  # only where a row sampled
        before, n = dict(steps.TRACE_COUNTS), len(ran)
        for i in (2, 3):
            sched.submit(Request(prompts[i], max_tokens[i], temperature=0.7 * (i - 2), seed=i, sink=col.sink(i)))
        assert col.done.wait(60)
    finally:
        sched.shutdown()
    assert dict(steps.TRACE_COUNTS) == before  # nothing compiled inside a served step
    assert ("3,2,6", True, True) in ran[n:]  # a sampling row speculates with the general program now
    assert col.tokens[0] == want[0] and col.tokens[2] == want[2]  # the greedy rows: plain decoding's tokens
    assert [len(col.tokens[i]) for i in (1, 3)] == [16, 16]


def test_a_tree_that_costs_more_than_its_depth_plus_one_plain_steps_is_hopeless_there_and_above():
    chain, wide = TreeConfig.chain(3), TreeConfig(3, 2, 6)  # both emit at most 4 tokens a row
    prof = Profile("p", {1: {"off": 1.0, "3,1,4": 4.0, "3,2,6": 4.1},
                         4: {"off": 2.0, "3,1,4": 9.0},
                         16: {"off:sampled": 3.0, "3,1,4:sampled": 11.0}}, {})
    assert hopeless(prof, 1, chain) is None  # exactly depth + 1 plain steps: it may still tie, so it stays
    assert "bucket 1" in hopeless(prof, 1, wide) and "4.1 plain steps" in hopeless(prof, 1, wide)
    assert "bucket 1" in hopeless(prof, 2, wide)  # nothing measured at 2: the largest smaller bucket decides
    assert hopeless(prof, 2, chain) is None
    assert "bucket 4" in hopeless(prof, 4, chain) and "bucket 4" in hopeless(prof, 8, chain)
    assert hopeless(prof, 16, chain) is None  # only sampled costs at 16: 3.7 plain steps
    assert hopeless(Profile("p", {}, {}), 1, wide) is None and hopeless(None, 32, wide) is None  # nothing known
    assert hopeless(Profile("p", {4: {"off": 1.0, "3,2,6": 9.0}}, {}), 2, wide) is None  # larger buckets never decide


@pytest.mark.slow
def test_preparation_skips_the_trees_the_profile_shows_cannot_win_and_serves_the_rest():
    from eagle_jax import steps

    target, head = oracle_pair()
    cheap, dear = TreeConfig.chain(2), TreeConfig(3, 2, 6)
    profile = Profile("given", {1: {"off": 1.0, "2,1,3": 1.5, "3,2,6": 6.0}}, {})
    sched = Scheduler(target, head, Harness([cheap, dear], profile),
                      SchedulerConfig(max_batch=2, max_model_len=64, batch_buckets=(1, 2), prefill_batches=(1,)))
    prep = sched.prepare_in_background(prompt_len=24)
    sched.start()
    deadline = time.time() + 120
    while not prep.complete and time.time() < deadline:
        time.sleep(0.05)
    snap = prep.snapshot()
    assert prep.complete and not snap["failed"] and snap["programs_done"] == snap["programs_total"]
    assert sorted(snap["programs_skipped"]) == ["step 1 3,2,6", "step 2 3,2,6"]
    assert "6.0 plain steps" in snap["programs_skipped"]["step 2 3,2,6"]
    assert snap["speculation"] == {"1": ["2,1,3"], "2": ["2,1,3"]}
    prompts, max_tokens = [PROMPTS[0], PROMPTS[1]], [20, 14]
    want = [eagle_jax.generate(target, [p], max_new_tokens=m).token_ids[0] for p, m in zip(prompts, max_tokens)]
    before = dict(steps.TRACE_COUNTS)
    col = Collector(2)
    try:
        for i in (0, 1):
            sched.submit(Request(prompts[i], max_tokens[i], sink=col.sink(i)))
        assert col.done.wait(60)
    finally:
        sched.shutdown()
    assert col.tokens == want
    assert dict(steps.TRACE_COUNTS) == before  # the skipped tree never ran (it would have compiled)
    assert sched.policy.counts.get("2,1,3", 0) > 0 and "3,2,6" not in sched.policy.counts


def test_requests_made_during_preparation_equal_plain_greedy_and_speculation_joins_once_compiled(monkeypatch):
    import eagle_jax.serve.scheduler as scheduler_module
    from eagle_jax import steps

    target, head = oracle_pair()
    tree = TreeConfig(3, 2, 6)
    sched = Scheduler(target, head, FixedPolicy(tree),
                      SchedulerConfig(max_batch=2, max_model_len=64, batch_buckets=(1, 2), prefill_batches=(1, 2)))
    prep = sched.prepare_in_background(prompt_len=24)
    gate = threading.Event()  # the tree's programs wait for it: requests come while only plain steps exist
    compile_step = prep._compile_step
    monkeypatch.setattr(prep, "_compile_step", lambda b, t, sampling=True: (t is None or gate.wait(120),
                                                                            compile_step(b, t, sampling)))
    chosen = []
    choose = scheduler_module.choose_step
    monkeypatch.setattr(scheduler_module, "choose_step", lambda *a: chosen.append(choose(*a).name) or choose(*a))
    prompts, max_tokens = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [7, 3] * 9], [30, 12, 25, 20]
    want = [eagle_jax.generate(target, [p], max_new_tokens=m).token_ids[0] for p, m in zip(prompts, max_tokens)]
    col = Collector(4)
    sched.start()
    try:
        for i in (0, 1):
            sched.submit(Request(prompts[i], max_tokens[i], sink=col.sink(i)))
        deadline = time.time() + 120
        while col.left > 2 and time.time() < deadline:
            time.sleep(0.02)
        assert col.end[:2] == ["length"] * 2 and not prep.complete
        assert set(chosen) == {"off"} and not any(prep.tree_ready(b, tree) for b in (1, 2))
        gate.set()
        while not prep.complete and time.time() < deadline:
            time.sleep(0.02)
        assert prep.complete and not prep.snapshot()["failed"]
        before, n_plain = dict(steps.TRACE_COUNTS), len(chosen)
        for i in (2, 3):
            sched.submit(Request(prompts[i], max_tokens[i], sink=col.sink(i)))
        assert col.done.wait(60)
    finally:
        sched.shutdown()
    assert col.tokens == want  # greedy: token for token what plain decoding gives, before and after
    assert set(chosen[n_plain:]) == {"3,2,6"}  # the tree's steps joined once compiled
    assert dict(steps.TRACE_COUNTS) == before


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "spec"])
def test_long_prompts_are_prefilled_in_chunks_between_the_running_rows_steps(speculative, monkeypatch):
    """A prompt longer than prefill_chunk is prefilled alone, a chunk per loop iteration, with the running
    rows stepping in between; its output is what the whole prompt's one-shot prefill gives (greedy: plain
    decoding; sampled: the same server unchunked), and it speculates afterwards like any row. A request
    cancelled mid-prefill ends cleanly."""
    target, head, policy = models(speculative)
    cfg = SchedulerConfig(max_batch=4, max_model_len=128, batch_buckets=(1, 4), prefill_batches=(1, 2),
                          prefill_chunk=16)
    sched = Scheduler(target, head, policy, cfg)
    calls = []
    run_prefill, run_step = sched.engine.run_prefill, sched.engine.run_step

    def logged_prefill(tokens, *a, prev=None, follow=None, **k):
        calls.append(("chunk" if follow is not None else "prefill", tokens.shape[1], prev is not None))
        return run_prefill(tokens, *a, prev=prev, follow=follow, **k)

    monkeypatch.setattr(sched.engine, "run_prefill", logged_prefill)
    monkeypatch.setattr(sched.engine, "run_step", lambda *a, **k: (calls.append(("step",)), run_step(*a, **k))[1])
    long_a = [(7 * i + 3) % 97 + 1 for i in range(41)]  # chunks of 16 + 16 + 9 tokens
    long_b = [(5 * i + 11) % 89 + 2 for i in range(70)]
    prompts, max_tokens, temps = [PROMPTS[1], long_a, long_b, PROMPTS[0]], [40, 20, 16, 6], [0.0, 0.0, 0.8, 0.0]

    def request(i, sink):
        return Request(prompts[i], max_tokens[i], temperature=temps[i], seed=3, sink=sink)

    col = Collector(5)
    reqs = [request(i, col.sink(i)) for i in range(4)]
    doomed = Request(long_b, 10, sink=col.sink(4))
    sched.submit(reqs[0])
    sched.start()
    try:
        deadline = time.time() + 120
        while not col.tokens[0] and time.time() < deadline:
            time.sleep(0.005)
        for r in reqs[1:]:
            sched.submit(r)
        while col.left > 1 and time.time() < deadline:
            time.sleep(0.01)
        assert col.left == 1
        sched.submit(doomed)
        while sched._chunked is None and doomed.finish_reason is None and time.time() < deadline + 60:
            time.sleep(0.001)
        sched.cancel(doomed)
        assert col.done.wait(60)
    finally:
        sched.shutdown()
    seen = list(calls)  # (the references below run on the same engine)
    for i in (0, 1, 3):
        assert col.tokens[i] == eagle_jax.generate(target, [prompts[i]], max_new_tokens=max_tokens[i]).token_ids[0], i
    # The sampled long prompt, prefilled at once by the same server: the same tokens.
    whole = Scheduler(target, head, policy, dataclasses.replace(cfg, prefill_chunk=128))
    ref = Collector(1)
    whole.submit(request(2, ref.sink(0)))
    whole.start()
    try:
        assert ref.done.wait(60)
    finally:
        whole.shutdown()
    assert col.tokens[2] == ref.tokens[0] and len(ref.tokens[0]) == max_tokens[2]
    assert col.end[:4] == ["length"] * 4 and col.end[4] == "cancelled" and col.tokens[4] == []
    assert sched._chunked is None and sched.counts()["running"] == 0
    chunks = [c[2] for c in seen if c[0] == "chunk"]  # whether each chunk continued an earlier one
    # PROMPTS[1] (19 tokens): 16 + 3; long_a: 16 + 16 + 9; long_b: 4 x 16 + 6 (every chunk in bucket 16);
    # then the cancelled one's first chunks. Requests of at most 16 tokens are prefilled at once.
    assert chunks[:10] == [False, True] + [False, True, True] + [False, True, True, True, True], seen
    assert {c[1] for c in seen if c[0] != "step"} == {16}
    # The running row stepped between the long prompts' chunks.
    first = seen.index(("chunk", 16, False), 1)
    assert [c[0] for c in seen[first: first + 5]] == ["chunk", "step", "chunk", "step", "chunk"], seen
