"""The paged server: requests hold KV blocks by need from one pool, wait when too few are free, give them
back when they end, and get exactly the tokens the contiguous server gives."""

from __future__ import annotations

import threading
import time

import pytest

from eagle_jax.harness import FixedPolicy
from eagle_jax.serve.requests import Request, SchedulerConfig
from eagle_jax.serve.scheduler import Scheduler
from eagle_jax.tree import TreeConfig
from builders import MORE_PROMPTS, oracle_pair


@pytest.fixture(scope="module")
def pair():
    return oracle_pair()


@pytest.fixture(scope="module")
def reference(pair):
    """The contiguous server's tokens and end reasons for every request (plain decoding)."""
    return serve(pair, speculative=False, block_size=0)[:2]


def serve(pair, *, speculative: bool, block_size: int, kv_cache_tokens: int = 0, max_batch: int = 4,
          cancel: int | None = None):
    """Runs every prompt of MORE_PROMPTS (max_tokens 20 + 3 i, EOS ignored) through a scheduler; returns
    (tokens by request, end reasons, the most requests seen running at once, the blocks' high-water
    mark, the scheduler's counts at the end)."""
    target, head = pair
    cfg = SchedulerConfig(max_batch=max_batch, max_model_len=96, batch_buckets=(1, 2, 4), prefill_batches=(1, 4),
                          shrink_patience=2, block_size=block_size, kv_cache_tokens=kv_cache_tokens, prefill_chunk=16)
    sched = Scheduler(target, head if speculative else None,
                      FixedPolicy(TreeConfig(3, 2, 6) if speculative else None), cfg)
    n = len(MORE_PROMPTS)
    tokens, ends, lock, done = [[] for _ in range(n)], [None] * n, threading.Lock(), threading.Event()

    def sink(i):
        def on_event(ev):
            with lock:
                if ev.kind == "tokens":
                    tokens[i].extend(ev.tokens)
                else:
                    ends[i] = ev.reason or ev.message
                    if all(e is not None for e in ends):
                        done.set()
        return on_event

    reqs = [Request(p, 20 + 3 * i, sink=sink(i), ignore_eos=True) for i, p in enumerate(MORE_PROMPTS)]
    for r in reqs:
        sched.submit(r)
    if cancel is not None:
        sched.cancel(reqs[cancel])
    sched.start()
    running = used = 0
    try:
        deadline = time.time() + 120
        while not done.wait(0.002):
            c = sched.counts()
            running, used = max(running, c["running"]), max(used, c.get("kv_blocks_used", 0))
            assert time.time() < deadline, (ends, c)
        return tokens, ends, running, used, sched.counts()
    finally:
        sched.shutdown()


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "spec"])
def test_a_paged_server_gives_the_contiguous_server_s_tokens_and_gets_every_block_back(pair, reference, speculative):
    ref, ref_ends = reference
    got, ends, running, used, end = serve(pair, speculative=speculative, block_size=8)
    assert got == ref and ends == ref_ends == ["length"] * len(MORE_PROMPTS)
    assert running == 4 and used > 0  # prompts of up to 19 tokens: two of them were prefilled in chunks
    assert end["kv_blocks_used"] == 0 and end["kv_blocks_free"] > 0 and end["kv_block_size"] == 8


def test_requests_wait_for_blocks_when_the_pool_runs_short(pair, reference):
    """A pool of 18 blocks of 8 (the least: one request of max_model_len 96 with the tree's slack and the
    draft's scratch) holds two of these requests (7 to 10 blocks each), not four: the others wait, and
    still get the same tokens."""
    ref = reference[0]
    got, ends, running, used, end = serve(pair, speculative=True, block_size=8, kv_cache_tokens=18 * 8)
    assert got == ref and ends == ["length"] * len(MORE_PROMPTS)
    assert used <= 18 and running == 2 and end["kv_blocks_used"] == 0 and end["kv_blocks_free"] == 18


def test_a_cancelled_request_never_holds_blocks_and_the_others_finish(pair, reference):
    ref = reference[0]
    got, ends, _, _, end = serve(pair, speculative=True, block_size=8, cancel=2)
    assert ends[2] == "cancelled" and got[2] == []
    assert [t for i, t in enumerate(got) if i != 2] == [t for i, t in enumerate(ref) if i != 2]
    assert end["kv_blocks_used"] == 0
