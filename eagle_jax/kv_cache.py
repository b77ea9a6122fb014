"""Preallocated KV cache as a registered dataclass pytree, with pure update functions.

Layout: k, v [L, B, S, K, D] (layers stacked so the model can scan over them), lengths [B] int32.
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
    k: jax.Array  # [L, B, S, K, D]
    v: jax.Array  # [L, B, S, K, D]
    lengths: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @classmethod
    def create(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

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
    contiguous. Moves every layer in one gather.
    """
    b, m = src.shape
    base = cache.lengths[:, None]  # [B, 1]
    src_slots = base + src  # [B, M]
    dst_slots = base + jnp.arange(m)[None, :]  # [B, M]

    def move(arr):  # [L, B, S, K, D]
        rows = jnp.take_along_axis(arr, src_slots[None, :, :, None, None], axis=2)  # [L, B, M, K, D]
        return jax.vmap(
            lambda a, r, d: a.at[:, d].set(r), in_axes=(1, 1, 0), out_axes=1
        )(arr, rows, dst_slots)

    return KVCache(move(cache.k), move(cache.v), cache.lengths + counts.astype(jnp.int32))
