"""Small programs compile without LLVM optimisation: the choice, and that it changes no token."""

import jax
import jax.numpy as jnp
import pytest

import eagle_jax
from builders import PROMPTS, oracle_pair
from eagle_jax import compiling, steps

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def test_quick_only_under_the_limit_on_cpu_and_never_inside_a_trace():
    assert compiling.quick(10, 100, jnp.ones(3)) is True
    assert compiling.quick(100, 100) is False
    seen = []

    @jax.jit
    def f(x):
        seen.append(compiling.quick(10, 100, x))
        return x

    f(jnp.ones(3))
    assert seen == [False]
    assert compiling.param_count({"a": jnp.ones((2, 3))}, None, [jnp.ones(4)]) == 10


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_quick_and_optimised_programs_give_the_same_tokens(monkeypatch, temperature):
    tgt, head = oracle_pair(seed=3)
    kw = dict(draft=head, tree="3,2,6", max_new_tokens=12, temperature=temperature, seed=7, ignore_eos=True)
    quick = eagle_jax.generate(tgt, PROMPTS, **kw)
    compiles = []
    listening = [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if listening[0] and event == BACKEND_COMPILE else None)
    monkeypatch.setattr(steps, "QUICK_COMPILE_WORK", 0)  # every step takes the optimised program
    full = eagle_jax.generate(tgt, PROMPTS, **kw)
    listening[0] = False
    assert len(compiles) >= 2  # the second run compiled programs of its own (prefill and step at least)
    assert quick.token_ids == full.token_ids
    assert quick.stats["accept_histogram"] == full.stats["accept_histogram"]


def test_quick_programs_take_the_emitter_option_this_xla_knows_and_do_without_one_it_does_not(monkeypatch):
    compiling.quick_options.cache_clear()
    assert compiling.quick_options() == {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
    monkeypatch.setattr(compiling, "QUICK_EMITTER", {"xla_cpu_no_such_option_here": False})
    compiling.quick_options.cache_clear()
    try:
        assert compiling.quick_options() == {"xla_backend_optimization_level": 0}
        pair = compiling.jit_pair(lambda x: x * 2)
        assert float(pair[True](jnp.float32(3))) == 6.0 and float(pair[False](jnp.float32(3))) == 6.0
        assert pair[True] is pair[True] and pair[True] is not pair[False]
    finally:
        compiling.quick_options.cache_clear()
