"""The server's process-wide memory settings (`eagle_jax.serve.memory.map_large_blocks`) and its background
preparation's resident tree programs and warm-up runs (`eagle_jax.serve.prepare`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from eagle_jax.serve.memory import map_large_blocks

    def rss():
        return int(dict(l.split(":", 1) for l in open("/proc/self/status"))["VmRSS"].split()[0]) // 1024

    applied = map_large_blocks() if sys.argv[1] == "map" else None
    x = np.ones(3_000_000); del x  # a freed 24 MB block: glibc now keeps blocks up to that size on its heap
    base = rss(); blocks, pins = [], []
    for _ in range(40):  # 8 MB buffers come and go, as KV caches and step buffers do
        blocks.append(np.ones(1_000_000))
        pins.append(np.ones(1000))
    del blocks
    print(applied, rss() - base)
''')


def retained(mode: str, **env) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr[-2000:]
    applied, mb = out.stdout.split()
    return applied, int(mb)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_freed_large_buffers_go_back_to_the_os_and_an_explicit_setting_is_kept():
    _, before = retained("plain")
    if before < 16:
        pytest.skip(f"this C library gave back the freed buffers by itself ({before} MB kept)")
    applied, after = retained("map")
    assert applied == "True" and after <= before // 4, (before, after)
    applied, _ = retained("map", MALLOC_MMAP_THRESHOLD_="65536")  # the user's own setting wins
    assert applied == "False"


@pytest.mark.slow
def test_tree_programs_of_idle_buckets_are_dropped_and_load_again_when_stepped(tmp_path, monkeypatch):
    """With resident_tree_buckets=1 only one batch bucket's tree programs stay loaded: a batch that grows
    and shrinks drops the other's and loads them again from the program store in the background. A tree
    step always finds its program (the bucket being stepped is never dropped), speculation rejoins every
    bucket it returns to, and the tokens are plain greedy decoding's."""
    import eagle_jax
    from eagle_jax import steps
    from eagle_jax.harness import FixedPolicy
    from eagle_jax.serve.requests import Request, SchedulerConfig
    from eagle_jax.serve.scheduler import Scheduler
    from eagle_jax.tree import TreeConfig
    from builders import PROMPTS, oracle_pair

    monkeypatch.setattr(steps, "QUICK_COMPILE_WORK", 0)  # programs kept through the store, as real targets' are
    target, head = oracle_pair()
    tree = TreeConfig(3, 2, 6)
    sched = Scheduler(target, head, FixedPolicy(tree),
                      SchedulerConfig(max_batch=2, max_model_len=128, batch_buckets=(1, 2), prefill_batches=(1,),
                                      shrink_patience=1, resident_tree_buckets=1))
    engine = sched.engine
    engine.use_store(tmp_path / "programs")
    prep = sched.prepare_in_background(prompt_len=24)
    tree_programs = lambda: sorted(k[1] for k in engine.programs if k[0] == "step" and k[4] == tree.name)
    steps_run = []  # (bucket, tree or None, whether the tree's program was loaded when the step ran)
    run_step = engine.run_step

    def logged(state, params, active, t, sampling=True, **k):  # slowed: as many steps as a load takes
        time.sleep(0.05)
        key = ("step", state.root.shape[0], state.cache.max_len, state.draft_cache.max_len, t and t.name, sampling)
        steps_run.append((state.root.shape[0], t and t.name, t is None or key in engine.programs))
        return run_step(state, params, active, t, sampling=sampling, **k)

    monkeypatch.setattr(engine, "run_step", logged)
    warmed, warm = [], engine.warm
    monkeypatch.setattr(engine, "warm", lambda key, limit: warmed.append((key, warm(key, limit))) or warmed[-1][1])
    sched.start()
    deadline = time.time() + 300
    while not prep.complete and time.time() < deadline:
        time.sleep(0.05)
    snap = prep.snapshot()
    assert prep.complete and not snap["failed"]
    assert len(tree_programs()) == 1 and snap["tree_programs_dropped"] == 1  # bucket 1's stays: the first
    assert snap["resident_tree_buckets"] == tree_programs() == [1]
    # Every step and prefill program ran once after it was prepared (its first run's setup paid ahead).
    assert all(ran for _, ran in warmed) and {k for k, _ in warmed} >= set(engine.programs)
    assert {k[0] for k, _ in warmed} == {"step", "prefill"} and not steps_run  # (none of them a served step)
    some = next(iter(engine.programs))
    assert not warm(some, limit=0) and not warm(("step", 64) + some[2:], limit=1 << 40)  # too large; not kept

    class Sink:
        def __init__(self):
            self.tokens, self.done = [], threading.Event()

        def __call__(self, ev):
            if ev.kind == "tokens":
                self.tokens.extend(ev.tokens)
            else:
                self.done.set()

    prompts, max_tokens = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [90, 30, 40]
    want = [eagle_jax.generate(target, [p], max_new_tokens=m).token_ids[0] for p, m in zip(prompts, max_tokens)]
    sinks = [Sink() for _ in prompts]
    try:
        for p, m, sink in zip(prompts, max_tokens, sinks):  # grows to bucket 2, shrinks as they finish
            sched.submit(Request(p, m, sink=sink))
        assert all(s.done.wait(120) for s in sinks)
    finally:
        sched.shutdown()
    assert [s.tokens for s in sinks] == want
    assert all(found for _, _, found in steps_run)  # no tree step ever missed its program
    buckets = {b for b, t, _ in steps_run}
    assert buckets == {1, 2} and prep.evictions > 2  # it moved across buckets, dropping programs as it went
    assert len({b for b, t, _ in steps_run if t}) >= 2  # and speculated again where it returned to
    assert len(tree_programs()) <= 2  # the bucket stepped last, and at most one being loaded beside it
