"""The program store: executables written once, loaded later without tracing, called directly with the
same results as the jitted steps; programs from a compilation cache, unoptimised ones and broken files
are never stored or loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle_jax.engine import Engine
from eagle_jax.programs import fingerprint
from builders import oracle_pair, random_head

TESTS = Path(__file__).resolve().parents[1]

# Run in a process of its own with an empty persistent compilation cache: the store keeps only programs
# compiled afresh, and this suite's shared cache may already hold these.
SCRIPT = textwrap.dedent('''
    import logging, sys
    import numpy as np
    from eagle_jax import steps
    from eagle_jax.engine import Engine
    from eagle_jax.programs import ProgramStore
    from eagle_jax.rows import pad_prompts
    from eagle_jax.sampling import SamplingParams
    from eagle_jax.tree import TreeConfig
    from builders import PROMPTS, oracle_pair

    store, phase = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.WARNING)
    steps.QUICK_COMPILE_WORK = 0  # fully optimised programs, as real targets get
    TREE, CACHE, DRAFT, BATCH, TOKENS = TreeConfig(3, 2, 6), 64, 80, 2, 24
    target, head = oracle_pair()

    def prepare(engine):
        engine.compile_prefill(BATCH, TOKENS, CACHE, DRAFT)
        for tree in (TREE, None):
            engine.compile_step(BATCH, CACHE, DRAFT, tree)

    def decode(engine):  # a greedy and a sampled row; a prefill, then tree and plain steps in turn
        tokens, lens = pad_prompts(PROMPTS[:BATCH], BATCH, TOKENS)
        params = SamplingParams.make(BATCH, [0.0, 1.0], [0, 0], [1.0, 0.9], [0, 7])
        s = engine.run_prefill(tokens, lens, CACHE, DRAFT, params)
        out = [np.asarray(s.root)]
        for i in range(4):
            s, emitted, count = engine.run_step(s, params, np.ones(BATCH, bool), TREE if i % 2 == 0 else None)
            out += [np.asarray(emitted).tolist(), np.asarray(count).tolist()]
        return out

    engine = Engine(target, head)
    engine.use_store(store)
    prepare(engine)
    traced = dict(steps.TRACE_COUNTS)
    got = decode(engine)
    assert dict(steps.TRACE_COUNTS) == traced, "a call traced instead of running its stored program"
    want = decode(Engine(target, head))  # the jitted steps, no store
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
    print("built", ProgramStore.built, "loaded", ProgramStore.loaded, "traced to prepare",
          traced.get("step", 0) + traced.get("prefill", 0))
''')


def run(store, phase, env):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(store), phase], env=env, capture_output=True,
                         text=True, timeout=600, cwd=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1], out.stderr


@pytest.mark.slow
def test_stored_programs_load_without_tracing_and_decode_what_the_jitted_steps_decode(tmp_path):
    store = tmp_path / "programs"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"), PYTHONPATH=str(TESTS))
    line, _ = run(store, "first", env)
    assert line == "built 3 loaded 0 traced to prepare 3"  # compiled afresh and stored
    files = sorted(store.glob("*.exe"))
    assert len(files) == 3
    # A restart loads them without tracing. One file is broken: it is compiled again with a warning naming
    # it; its program then comes from the persistent cache, which XLA:CPU cannot store again (a stored copy
    # would miss kernels when loaded), so the file is removed, not replaced.
    files[0].write_bytes(b"not an executable")
    line, err = run(store, "restart", env)
    assert files[0].name in err and "does not load" in err
    assert line == "built 0 loaded 2 traced to prepare 1" and not files[0].exists()  # (whichever program it was)
    assert all(f.exists() for f in files[1:])


def test_unoptimised_programs_stay_out_of_the_store(tmp_path):
    target, head = oracle_pair()  # a tiny model: its programs compile without LLVM optimisation
    engine = Engine(target, head)
    engine.use_store(tmp_path)
    engine.compile_step(2, 64, 80, None)
    assert not engine.programs and not list(tmp_path.iterdir())


def test_the_fingerprint_follows_the_architecture_not_the_weights():
    target, head = oracle_pair()
    other = random_head(target.cfg, "eagle1", seed=3)  # same architecture, other weights

    def fp(h):
        e = Engine(target, h)
        return fingerprint(e.state, e.head_state, configs=(target.cfg, getattr(h, "cfg", None)))

    assert fp(head) == fp(other)
    assert fp(random_head(target.cfg, "eagle3", seed=0)) != fp(head)
    assert fp(None) != fp(head)
