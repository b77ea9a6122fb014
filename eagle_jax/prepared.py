"""Programs compiled ahead of time: the engine's prefill and step programs by shapes, compiled without
running (a server prepares its buckets while it serves), kept through a `ProgramStore` on disk, warmed
once on empty inputs, dropped and loaded again. `Engine` inherits this; `run_prefill` / `run_step`
call the kept programs directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax import sharding, steps
from eagle_jax.compiling import quick
from eagle_jax.paging import blocks_for
from eagle_jax.programs import ProgramStore, default_store_dir, fingerprint
from eagle_jax.sampling import SamplingParams
from eagle_jax.tree import TreeConfig, tree_name


class PreparedPrograms:
    """The ahead-of-time half of `eagle_jax.engine.Engine` (which provides graphdef / state, head_state,
    n_params, programs, store, mesh and empty_state)."""

    def abstract(self, tree):
        """Shapes (and, on a mesh, shardings) of a pytree of arrays: what a program is compiled for."""
        return sharding.abstract(tree, self.mesh, self.target.cfg.num_kv_heads)

    def compile_prefill(self, batch: int, tokens: int, cache_len: int, draft_len: int, sampling: bool = True,
                        pages: tuple[int, int] | None = None) -> None:
        """Compiles the prefill of `batch` prompts padded to `tokens` without running it (`steps.compile_prefill`)."""
        b = batch
        s = self.abstract(jax.eval_shape(lambda: self.empty_state(b, cache_len, draft_len, pages)))
        rows = self.abstract((jax.ShapeDtypeStruct((b, tokens), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
                              SamplingParams.make(b)))

        def build(fresh: bool):
            return steps.compile_prefill(
                self.graphdef, self.state, self.head_graphdef, self.head_state, rows[0], rows[1],
                s.cache, s.draft_cache if self.head is not None else None,
                rows[2], None, sampling, self.n_params, fresh)

        self._keep(self.prefill_key(b, tokens, cache_len, draft_len, sampling, pages), build)

    def compile_step(self, batch: int, cache_len: int, draft_len: int, tree: TreeConfig | None,
                     sampling: bool = True, pages: tuple[int, int] | None = None) -> None:
        """Compiles one step of `tree` (None: plain) at these shapes without running it (`steps.compile_step`)."""
        def build(fresh: bool):
            s = self.abstract(jax.eval_shape(lambda: self.empty_state(batch, cache_len, draft_len, pages)))
            params, active = self.abstract((SamplingParams.make(batch), jax.ShapeDtypeStruct((batch,), jnp.bool_)))
            return steps.compile_step(self.graphdef, self.state, self.head_graphdef, self.head_state, s, params,
                                      active, tree, None, sampling, self.n_params, fresh)

        self._keep(self.step_key(batch, cache_len, draft_len, tree, sampling, pages), build)

    def _lengths(self, cache_len: int, draft_len: int, pages) -> tuple[int, int]:
        """(cache, draft) lengths as a state of these shapes reports them (a paged state's table width)."""
        draft_len = draft_len if self.head is not None else 0
        if pages is None:
            return cache_len, draft_len
        width = blocks_for(max(cache_len, draft_len), pages[1]) * pages[1]
        return width, width if self.head is not None else 0

    def step_key(self, batch: int, cache_len: int, draft_len: int, tree: TreeConfig | None, sampling: bool = True,
                 pages: tuple[int, int] | None = None) -> tuple:
        """The key of a step program in `programs` (what `compile_step` keeps)."""
        key = ("step", batch, *self._lengths(cache_len, draft_len, pages), tree_name(tree), sampling)
        return key if pages is None else key + ("paged", *pages)

    def prefill_key(self, batch: int, tokens: int, cache_len: int, draft_len: int, sampling: bool = True,
                    pages: tuple[int, int] | None = None) -> tuple:
        """The key of a prefill program in `programs` (what `compile_prefill` keeps)."""
        key = ("prefill", batch, tokens, *self._lengths(cache_len, draft_len, pages), sampling)
        return key if pages is None else key + ("paged", *pages)

    def warm(self, key: tuple, limit: int) -> bool:
        """Runs kept program `key` (as `programs`' keys: ("step", batch, cache_len, draft_len, tree name,
        sampling) or ("prefill", batch, tokens, cache_len, draft_len, sampling), then ("paged", blocks,
        block size) for paged caches) once on empty inputs, when those take at most `limit` bytes. XLA:CPU
        builds part of a program on its first run (the pipelines of its library dot fusions: 0.2-0.4 s for
        a SmolLM2 step, against 0.05-0.13 s a run after); warmed ahead, a served step never pays it. Rows
        are inactive and the outputs dropped. Returns whether it ran."""
        prog = self.programs.get(key)
        if prog is None:
            return False
        pages = tuple(key[-2:]) if "paged" in key else None
        base = key[:-3] if pages else key
        b, sampling = base[1], base[-1]
        cache_len, draft_len = (base[2], base[3]) if base[0] == "step" else (base[3], base[4])
        abstract = jax.eval_shape(lambda: self.empty_state(b, cache_len, draft_len, pages))
        size = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(abstract))
        if size > limit:
            return False
        s = self.empty_state(b, cache_len, draft_len, pages)
        params = SamplingParams.make(b, temperature=1.0 if sampling else 0.0)
        if base[0] == "step":
            out = prog(self.state, self.head_state, s, params, jnp.zeros((b,), bool))
        else:
            tokens = jnp.zeros((b, base[2]), jnp.int32)
            out = prog(self.state, self.head_state, tokens, jnp.ones((b,), jnp.int32), s.cache,
                       s.draft_cache if self.head is not None else None, params, jnp.full((b,), -1, jnp.int32))
        jax.block_until_ready(out)
        return True

    def stored(self, key: tuple) -> bool:
        """Whether the program store holds program `key` (`step_key`, `prefill_key`): compiling it would load it."""
        return (self.store is not None and self.mesh is None and not quick(self.n_params * key[1], steps.QUICK_COMPILE_WORK)
                and self.store.path(" ".join(map(str, key))).exists())

    def drop(self, key: tuple) -> bool:
        """Forgets program `key`, kept through the store (compiling it loads it again, from the store): its
        memory is freed once a step running it returns. Returns whether one was kept."""
        return self.programs.pop(key, None) is not None

    # --- programs kept ahead of time --------------------------------------------------------------
    def use_store(self, directory=None) -> ProgramStore:
        """From now on `compile_step` / `compile_prefill` load their programs from a `ProgramStore` in
        `directory` (default `programs.default_store_dir()`), or compile and write them there, and
        `run_step` / `run_prefill` call them directly: a restart loads each program without tracing it."""
        if self.store is None:
            fp = fingerprint(self.state, self.head_state, configs=(self.target.cfg, getattr(self.head, "cfg", None)))
            self.store = ProgramStore(directory or default_store_dir(), fp)
        return self.store

    def _keep(self, key: tuple, build) -> None:
        # Programs compiled without LLVM optimisation (small models and batches, `steps.QUICK_COMPILE_WORK`)
        # do not reload reliably on XLA:CPU (kernels missing at run time), and compile in a second anyway.
        # On a mesh the programs stay in jax's caches too (sharded executables are not written to the store).
        if self.store is None or self.mesh is not None or quick(self.n_params * key[1], steps.QUICK_COMPILE_WORK):
            build(False)  # compiled into jax's own caches: the next call of these shapes runs it
        elif key not in self.programs:  # kept here alone (fresh), so dropping it frees it
            self.programs[key] = self.store.load_or_build(" ".join(map(str, key)), lambda: build(True))
