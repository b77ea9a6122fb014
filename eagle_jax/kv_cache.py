"""Preallocated KV cache as a registered dataclass pytree, with pure update functions.

Layout: k, v are tuples of L per-layer arrays [B, S, K, D] (separate buffers, so a decode step
updates each in place under donation), lengths [B] int32.
`lengths[b]` counts the committed tokens of row b; slots past it are scratch space: a forward pass
writes its new tokens' keys at [length, length + T) without committing them, and the caller decides
how many to commit (`advance`) or which to keep (`gather_rows`, used by tree verification).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple  # L x [B, S, K, D]
    v: tuple  # L x [B, S, K, D]
    lengths: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @classmethod
    def create(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32) -> "KVCache":
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   jnp.zeros((batch,), jnp.int32))

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)


def write_rows(layer_cache, new, starts):
    """Writes new [B, T, K, D] into layer_cache [B, S, K, D] at per-row slot offsets starts [B].

    The caller guarantees starts + T <= S (dynamic_update_slice would clamp, not fail).
    """
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x, s, axis=0))(
        layer_cache, new.astype(layer_cache.dtype), starts
    )


def advance(cache: KVCache, counts) -> KVCache:
    """Commits `counts[b]` of the tokens just written past each row's length."""
    return cache.replace(lengths=cache.lengths + counts.astype(jnp.int32))


def gather_rows(cache: KVCache, src, counts) -> KVCache:
    """Keeps chosen scratch tokens: for each row, moves slots lengths + src[b, j] to lengths + j.

    src [B, M] holds offsets (relative to the row's length) of the tokens to keep, in order; only
    the first counts[b] are committed. Used after tree verification to make the accepted path
    contiguous.
    """
    b, m = src.shape
    base = cache.lengths[:, None]  # [B, 1]
    src_slots = base + src  # [B, M]
    dst_slots = base + jnp.arange(m)[None, :]  # [B, M]

    def move(arr):  # [B, S, K, D]
        rows = jnp.take_along_axis(arr, src_slots[:, :, None, None], axis=1)  # [B, M, K, D]
        return jax.vmap(lambda a, r, d: a.at[d].set(r))(arr, rows, dst_slots)

    return KVCache(tuple(move(a) for a in cache.k), tuple(move(a) for a in cache.v),
                   cache.lengths + counts.astype(jnp.int32))
