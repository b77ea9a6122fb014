"""Compile-time vs run-time: which programs skip XLA:CPU's LLVM optimisation.

LLVM's optimisation of XLA:CPU kernels pays for itself only over many calls that do real work. The
programs of a small model over a small batch (the tiny models of tests, smoke runs and notebooks'
quick configurations) compile about twice as fast without it, and the run time they give up takes
hundreds to thousands of calls to cost as much. Each jitted family keeps both programs (`jit_pair`)
and picks one per call from the work it does (`quick`); the limits and their measurements sit with
each family (`eagle_jax.steps` for decoding, `eagle_jax.train.trainer` for training). Real targets
(SmolLM2-135M and up) always get the full optimisation, and other backends are left as they are.

The quick programs also use XLA:CPU's older elemental emitter instead of its fusion emitters: for these
small programs it compiles faster (the tiny-model bench of every combination, 24 programs: 39 s -> 31 s
of wall time on 2 cores), while on the real target's fully optimised steps the fusion emitters compile
about twice as fast and run as fast or faster (SmolLM2-135M, 3,4,8 tree at batch 8: 5.0 s vs 10.6 s to
compile, 321 vs 326 ms a step), so those keep them.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

# XLA:CPU debug options of the quick programs (which run on CPU alone, `quick`). The emitter option is
# used where this jaxlib knows it (`quick_options`).
QUICK_OPTIONS = {"xla_backend_optimization_level": 0}
QUICK_EMITTER = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def quick_options() -> dict:
    """The quick programs' compiler options: QUICK_OPTIONS plus QUICK_EMITTER when this jaxlib accepts it
    (probed once, on a one-line program, when the first quick program is built)."""
    options = {**QUICK_OPTIONS, **QUICK_EMITTER}
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
    except Exception:  # an XLA without the option: the rest still holds
        return dict(QUICK_OPTIONS)
    return options


def param_count(*states) -> int:
    """Elements in these pytrees (nnx states; None counts nothing)."""
    return sum(x.size for x in jax.tree_util.tree_leaves(states))


def quick(work: int, limit: int, *values) -> bool:
    """Whether a call doing `work` (parameters x rows or tokens) compiles its quick program: under
    `limit`, on CPU, and none of `values` traced (a call inlined into a caller's jit, pmap or vmap is
    compiled as that caller's program says)."""
    return (work < limit and jax.default_backend() == "cpu"
            and not any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(values)))


class JitPair:
    """pair[quick]: `fn` jitted fully optimised (False) or as a quick-compile program (True; built on first
    use, since its options are probed on the backend)."""

    def __init__(self, fn, **jit_kwargs):
        self.fn, self.jit_kwargs = fn, jit_kwargs
        self.programs = {False: jax.jit(fn, **jit_kwargs)}

    def __getitem__(self, quick: bool):
        quick = bool(quick)
        if quick not in self.programs:
            self.programs[quick] = jax.jit(self.fn, compiler_options=quick_options(), **self.jit_kwargs)
        return self.programs[quick]

    def fresh(self, quick: bool):
        """pair[quick] as a new jit of a new function object, for a program compiled ahead of time and kept by
        its caller. JAX's tracing and compilation caches are keyed by the jitted function, and an entry of
        `pair[quick]` holds its executable for the life of the process; through a fresh jit those entries die
        with the jit, so the executable is freed with the caller's last reference (SmolLM2 tree steps: about
        40 MB each, and 15% less resident while kept)."""
        fn = self.fn
        options = {"compiler_options": quick_options()} if quick else {}
        return jax.jit(functools.wraps(fn)(lambda *a, **k: fn(*a, **k)), **options, **self.jit_kwargs)


def jit_pair(fn, **jit_kwargs) -> JitPair:
    """The fully optimised and the quick-compile jit of `fn` (`JitPair`), indexed by `quick(...)`."""
    return JitPair(fn, **jit_kwargs)
