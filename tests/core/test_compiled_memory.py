"""The suite's guard against running out of memory mappings (`builders.release_compiled_code`): compiled
executables hold mappings until JAX's caches drop them, and dropping them gives the mappings back."""

import jax
import jax.numpy as jnp
import pytest

from builders import memory_maps, release_compiled_code


@pytest.mark.slow
@pytest.mark.skipif(memory_maps() is None, reason="needs /proc (Linux)")
def test_dropping_the_caches_gives_back_the_mappings_of_compiled_code():
    release_compiled_code(fraction=0.0)  # start from nothing held
    before = memory_maps()[0]
    x = jnp.ones((8, 16))
    alive = []  # like the package's module-level jitted steps: their caches live as long as they do
    for i in range(2000):  # distinct executables until they visibly hold mappings
        alive.append(jax.jit(lambda x, i=i: jnp.sin(x * i) @ x.T + i))
        alive[-1](x).block_until_ready()
        if i % 50 == 49 and memory_maps()[0] > before + 300:
            break
    grown = memory_maps()[0]
    assert grown > before + 300, f"{i + 1} executables added only {grown - before} mappings"
    assert release_compiled_code(fraction=1.0) is False  # under the threshold: nothing dropped
    assert memory_maps()[0] >= grown - 20
    assert release_compiled_code(fraction=0.0) is True
    assert memory_maps()[0] < before + 100
