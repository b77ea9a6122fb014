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
    (padding rows of the newcomers' prefill batch). Both states have the same cache lengths."""
    TRACE_COUNTS["insert_rows"] += 1
    return jax.tree_util.tree_map(lambda a, x: a.at[rows].set(x.astype(a.dtype), mode="drop"), s, new)


@jax.jit
def take_rows(s: DecodeState, rows) -> DecodeState:
    """A state of len(rows) rows: row i is s's row rows[i], or an empty row (length 0) where rows[i] < 0."""
    TRACE_COUNTS["take_rows"] += 1
    keep = rows >= 0
    out = jax.tree_util.tree_map(lambda a: jnp.take(a, jnp.maximum(rows, 0), axis=0), s)
    clear = lambda c: c.replace(lengths=jnp.where(keep, c.lengths, 0))
    return out.replace(cache=clear(out.cache), draft_cache=clear(out.draft_cache),
                       lag_n=jnp.where(keep, out.lag_n, 0))
