"""Batch shapes and row surgery: static buckets for prompts and batches, and moving rows between states.

Shapes are bucketed so a compiled step is reused: batch rounds up to a power of two, prompt length to a
half-octave bucket (16, 24, 32, 48, ...), cache length to a power of two (at least 128). A server keeps
one `DecodeState` of a batch bucket; requests join by being prefilled as their own small batch (same
cache length) and scattered into free rows (`insert_rows`), and the bucket grows or shrinks by gathering
rows into a state of another batch size (`take_rows`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.steps import TRACE_COUNTS, DecodeState


def next_pow2(n: int, minimum: int = 1) -> int:
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def attention_window(need: int, cache_len: int, minimum: int = 128) -> int | None:
    """The attention window (a power of two, at least `minimum`) that holds `need` slots, or None when
    that is the whole cache: a step compiles once per window, and its attention costs what the window
    holds instead of the cache's full length."""
    w = next_pow2(need, minimum)
    return None if w >= cache_len else w


def length_bucket(n: int, minimum: int = 16) -> int:
    """Rounds up to 16, 24, 32, 48, 64, 96, 128, ...: at most 1.5x padding, two buckets per octave."""
    p = next_pow2(n, minimum)
    return p * 3 // 4 if p > minimum and n <= p * 3 // 4 else p


def pad_prompts(prompt_ids: Sequence[Sequence[int]], batch: int, length: int):
    """(tokens [batch, length] right-padded with 0, prompt_lens [batch]; padding rows get length 1)."""
    tokens = np.zeros((batch, length), np.int32)
    lens = np.ones((batch,), np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = p
        lens[i] = len(p)
    return tokens, lens


def batch_shapes(max_position: int, prompt_ids, max_new_tokens: int, slack: int = 0) -> tuple[int, int, int]:
    """(batch bucket, prompt bucket, cache length) for a batch of prompts; a ValueError naming the prompt
    that does not fit the model's context. `slack` is extra cache room past the last token (a
    speculative step writes its whole tree there)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lens = [len(p) for p in prompt_ids]
    for i, n in enumerate(lens):
        if n + max_new_tokens + slack > max_position:
            extra = f" (+{slack} speculative slack)" if slack else ""
            raise ValueError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens}{extra} that exceeds the "
                f"model's context length {max_position}")
    t = length_bucket(max(lens))
    return next_pow2(len(lens)), t, next_pow2(max(t, max(lens) + max_new_tokens + 1 + slack), 128)


@functools.partial(jax.jit, donate_argnames=("s",))
def insert_rows(s: DecodeState, new: DecodeState, rows):
    """Writes the b rows of `new` into `s` at row indices rows [b]; indices >= s's batch are dropped
    (padding rows of the newcomers' prefill batch). `new`'s caches may be longer than `s`'s (a server's
    larger batch buckets hold shorter rows): their slots past `s`'s length must be empty, and are cut."""
    TRACE_COUNTS["insert_rows"] += 1
    if s.cache.paged and s.cache.k:
        raise ValueError("insert_rows moves the rows of contiguous caches; use insert_paged_rows for paged ones")

    def put(a, x):
        if a.ndim >= 2 and x.shape[1] > a.shape[1]:  # a cache array (the only ones whose lengths differ)
            x = x[:, : a.shape[1]]
        return a.at[rows].set(x.astype(a.dtype), mode="drop")

    return jax.tree_util.tree_map(put, s, new)


def pools(s: DecodeState) -> tuple:
    """A paged state's block pools (target k, v, draft k, v): shared by all rows, never moved with them."""
    return s.cache.k, s.cache.v, s.draft_cache.k, s.draft_cache.v


def without_pools(s: DecodeState) -> DecodeState:
    """A paged state's per-row part (tables, lengths, roots, draft inputs): what row surgery moves."""
    return s.replace(cache=s.cache.replace(k=(), v=()), draft_cache=s.draft_cache.replace(k=(), v=()))


def with_pools(s: DecodeState, parts: tuple) -> DecodeState:
    k, v, dk, dv = parts
    return s.replace(cache=s.cache.replace(k=k, v=v), draft_cache=s.draft_cache.replace(k=dk, v=dv))


def insert_paged_rows(s: DecodeState, new: DecodeState, rows) -> DecodeState:
    """`insert_rows` for paged caches: new's rows (block tables included) go into s's rows; the pools
    are s's (new was prefilled into them: the caller hands the prefill's output pools back to s)."""
    return with_pools(insert_rows(without_pools(s), without_pools(new), rows), pools(s))


def clear_paged_rows(s: DecodeState, rows) -> DecodeState:
    """Rows `rows` of a paged state hold nothing again: no blocks (their table rows -1) and length 0, so
    a step neither writes into blocks handed to another request nor reads past the rows that remain.
    (One small program per batch shape, whichever rows: they go in as a mask.)"""
    keep = np.ones(s.root.shape[0], bool)
    keep[np.asarray(rows, np.int64)] = False
    draft = s.draft_cache.paged
    table, lengths, dtable, dlengths, lag_n = _cleared(
        s.cache.table, s.cache.lengths, s.draft_cache.table if draft else s.cache.table, s.draft_cache.lengths,
        s.lag_n, jnp.asarray(keep))
    return s.replace(cache=s.cache.replace(table=table, lengths=lengths), lag_n=lag_n,
                     draft_cache=s.draft_cache.replace(table=dtable, lengths=dlengths) if draft else s.draft_cache)


@jax.jit
def _cleared(table, lengths, dtable, dlengths, lag_n, keep):
    gone = lambda a, fill: jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, fill)  # noqa: E731
    return gone(table, -1), gone(lengths, 0), gone(dtable, -1), gone(dlengths, 0), gone(lag_n, 0)


def _resize_axis1(a, size: int | None):
    if size is None or size == a.shape[1]:
        return a
    if size < a.shape[1]:
        return a[:, :size]
    return jnp.pad(a, [(0, 0), (0, size - a.shape[1])] + [(0, 0)] * (a.ndim - 2))


@functools.partial(jax.jit, static_argnames=("size",))
def _take(a, rows, size: int | None = None):
    """Rows `rows` of one array of a state (index < 0: row 0, cleared by `_clear` where it matters), a
    cache array cut or zero-padded to `size` slots."""
    TRACE_COUNTS["take_rows"] += 1
    return _resize_axis1(jnp.take(a, jnp.maximum(rows, 0), axis=0), size)


@jax.jit
def _clear(lengths, rows):
    return jnp.where(rows >= 0, lengths, 0)


def _on_host(leaves) -> bool:
    """Whether every array sits on one CPU device, whose buffers numpy can read in place."""
    return all(isinstance(a, jax.Array) and len(a.devices()) == 1 and next(iter(a.devices())).platform == "cpu"
               for a in leaves)


def _take_on_host(a, rows: np.ndarray, size: int | None = None):
    """`_take` for an array on a CPU device, in numpy: no compiled program per shape and row count."""
    src = np.asarray(a)  # the device buffer itself, read-only
    idx = np.maximum(rows, 0)
    if size is None or size == src.shape[1]:
        out = np.take(src, idx, axis=0)
    else:
        keep = min(size, src.shape[1])
        out = np.zeros((len(idx), size) + src.shape[2:], src.dtype)
        out[:, :keep] = src[idx, :keep]
    return jax.device_put(out, a.sharding)


def _clear_on_host(lengths, rows: np.ndarray):
    return jax.device_put(np.where(rows >= 0, np.asarray(lengths), 0).astype(lengths.dtype), lengths.sharding)


def _cache_sizes(s, cache_len: int | None, draft_len: int | None) -> dict[int, int]:
    """id(array) -> the slots it gets, for the cache arrays of a state (or of its abstract shapes)."""
    sizes = {}
    for cache, size in ((s.cache, cache_len), (s.draft_cache, draft_len)):
        if size is not None:
            sizes.update({id(a): size for a in (*cache.k, *cache.v)})
    return sizes


def take_rows(s: DecodeState, rows, consume: bool = False, cache_len: int | None = None,
              draft_len: int | None = None, host: bool | None = None) -> DecodeState:
    """A state of len(rows) rows: row i is s's row rows[i], or an empty row (length 0) where rows[i] < 0;
    with cache_len / draft_len, its target / draft caches cut or zero-padded to that many slots (cut
    only where no row holds anything past them).

    One array at a time. With consume=True each of s's arrays is deleted as soon as its rows are copied,
    so moving to a larger batch bucket holds the new state plus one array of the old one, not both
    states whole (SmolLM2's KV cache is 0.84 GB at 16 rows and 1.68 GB at 32); s is unusable after.
    A state on one CPU device is moved by numpy, in place of the compiled gathers (`_take`): a server
    would otherwise hold a small program for every array shape and every pair of batch buckets (about
    240 for SmolLM2's default buckets, 1 MB or more each). host=False forces the compiled gathers."""
    if s.cache.paged:  # the rows' part only: the pools stay as they are, and empty rows hold no block
        out = _take_all(without_pools(s), rows, consume, {}, host)
        empty = np.flatnonzero(np.asarray(rows) < 0)
        return with_pools(clear_paged_rows(out, empty) if empty.size else out, pools(s))
    return _take_all(s, rows, consume, _cache_sizes(s, cache_len, draft_len), host)


def _take_all(s: DecodeState, rows, consume: bool, sizes: dict, host: bool | None) -> DecodeState:
    leaves, treedef = jax.tree_util.tree_flatten(s)
    host = _on_host(leaves) if host is None else host
    rows = np.asarray(rows, np.int32) if host else jnp.asarray(rows, jnp.int32)
    take, clear_rows = (_take_on_host, _clear_on_host) if host else (_take, _clear)
    taken: dict[int, jax.Array] = {}  # id(old array) -> its rows: an array in two places is copied once
    for a in leaves:
        if id(a) not in taken:
            taken[id(a)] = take(a, rows, size=sizes.get(id(a)))
            if consume and isinstance(a, jax.Array):
                taken[id(a)].block_until_ready()  # the copy is done before the source goes
                a.delete()
    out = jax.tree_util.tree_unflatten(treedef, [taken[id(a)] for a in leaves])
    clear = lambda c: c.replace(lengths=clear_rows(c.lengths, rows))
    return out.replace(cache=clear(out.cache), draft_cache=clear(out.draft_cache), lag_n=clear_rows(out.lag_n, rows))


def compile_take_rows(state, n: int, cache_len: int | None = None, draft_len: int | None = None,
                      host: bool | None = None) -> None:
    """Compiles (ahead of time, into the compilation caches) what `take_rows` runs to take n rows of a
    state shaped like `state` (arrays or ShapeDtypeStructs), with these cache lengths. Nothing to compile
    where the state would sit on a CPU device (`take_rows` moves such rows with numpy)."""
    if jax.devices()[0].platform == "cpu" if host is None else host:
        return
    idx = jax.ShapeDtypeStruct((n,), jnp.int32)
    sizes = _cache_sizes(state, cache_len, draft_len)
    seen = set()
    for a in jax.tree_util.tree_leaves(state):
        key = (tuple(a.shape), str(a.dtype), sizes.get(id(a)))
        if key not in seen:
            seen.add(key)
            _take.lower(jax.ShapeDtypeStruct(a.shape, a.dtype), idx, size=key[2]).compile()
    _clear.lower(idx, idx).compile()
