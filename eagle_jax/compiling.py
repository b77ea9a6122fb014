"""Compile-time vs run-time: which programs skip XLA:CPU's LLVM optimisation.

LLVM's optimisation of XLA:CPU kernels pays for itself only over many calls that do real work. The
programs of a small model over a small batch (the tiny models of tests, smoke runs and notebooks'
quick configurations) compile about twice as fast without it, and the run time they give up takes
hundreds to thousands of calls to cost as much. Each jitted family keeps both programs (`jit_pair`)
and picks one per call from the work it does (`quick`); the limits and their measurements sit with
each family (`eagle_jax.steps` for decoding, `eagle_jax.train.trainer` for training). Real targets
(SmolLM2-135M and up) always get the full optimisation, and other backends are left as they are.
"""

from __future__ import annotations

import jax

QUICK_OPTIONS = {"xla_backend_optimization_level": 0}


def param_count(*states) -> int:
    """Elements in these pytrees (nnx states; None counts nothing)."""
    return sum(x.size for x in jax.tree_util.tree_leaves(states))


def quick(work: int, limit: int, *values) -> bool:
    """Whether a call doing `work` (parameters x rows or tokens) compiles its quick program: under
    `limit`, on CPU, and none of `values` traced (a call inlined into a caller's jit, pmap or vmap is
    compiled as that caller's program says)."""
    return (work < limit and jax.default_backend() == "cpu"
            and not any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(values)))


def jit_pair(fn, **jit_kwargs) -> dict[bool, object]:
    """{quick: jitted fn}: the fully optimised program (False) and the quick-compile one (True)."""
    return {False: jax.jit(fn, **jit_kwargs), True: jax.jit(fn, compiler_options=QUICK_OPTIONS, **jit_kwargs)}
