"""KV cache as a registered dataclass pytree, with pure update functions; contiguous or paged.

Contiguous layout: k, v are tuples of L per-layer arrays [B, S, K, D] (separate buffers, so a decode
step updates each in place under donation), lengths [B] int32, table None.
Paged layout: k, v are tuples of L per-layer block pools [P, block, K, D] shared by all rows, and
table [B, NB] int32 maps row b's logical slot s to pool block table[b, s // block], offset s % block
(-1: no block). A row holds only the blocks its tokens need (`eagle_jax.paging` hands them out);
writes to slots without a block are dropped and reads of them give zeros, so a row can never touch
another row's blocks.
Either way `lengths[b]` counts the committed tokens of row b; slots past it are scratch space: a
forward pass writes its new tokens' keys at [length, length + T) without committing them, and the
caller decides how many to commit (`advance`) or which to keep (`gather_rows`, used by tree
verification).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import gather_blocks


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "lengths", "table"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple  # L x [B, S, K, D]; paged: L x [P, block, K, D]
    v: tuple  # as k
    lengths: jax.Array  # [B] int32
    table: jax.Array | None = None  # paged: [B, NB] int32 block table (-1: no block); None: contiguous

    @property
    def paged(self) -> bool:
        return self.table is not None

    @property
    def max_len(self) -> int:
        """Slots a row can address: S, or NB blocks of `block` slots when paged."""
        return self.table.shape[1] * self.k[0].shape[1] if self.paged else self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @classmethod
    def create(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32) -> "KVCache":
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   jnp.zeros((batch,), jnp.int32))

    @classmethod
    def create_paged(cls, num_layers, num_blocks, block_size, table, num_kv_heads, head_dim,
                     dtype=jnp.float32) -> "KVCache":
        """Empty pools of num_blocks blocks and rows addressing them through table [B, NB] (lengths 0)."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        table = jnp.asarray(table, jnp.int32)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   jnp.zeros((table.shape[0],), jnp.int32), table)

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)


def pool_slots(table, slots, block_size: int, num_blocks: int):
    """Flat pool indices (block * block_size + offset) of logical slots [B, T] through table [B, NB].
    Slots without a block (past the table, or a -1 entry) map to num_blocks * block_size, one past the
    pool: writes there are dropped and reads give zeros."""
    nb = table.shape[1]
    blk = slots // block_size
    phys = jnp.take_along_axis(table, jnp.clip(blk, 0, nb - 1), axis=1)
    phys = jnp.where((blk < nb) & (phys >= 0), phys, num_blocks)
    return phys * block_size + slots % block_size


def write_rows(layer_cache, new, starts, table=None):
    """Writes new [B, T, K, D] at per-row slot offsets starts [B]: into layer_cache [B, S, K, D], or
    through table into the block pool layer_cache [P, block, K, D].

    Contiguous: the caller guarantees starts + T <= S (dynamic_update_slice would clamp, not fail).
    Paged: slots without a block are dropped.
    """
    if table is None:
        return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x, s, axis=0))(
            layer_cache, new.astype(layer_cache.dtype), starts
        )
    p, bs = layer_cache.shape[:2]
    b, t = new.shape[:2]
    flat = pool_slots(table, starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :], bs, p)
    pool = layer_cache.reshape((p * bs,) + layer_cache.shape[2:])
    pool = pool.at[flat.reshape(-1)].set(new.reshape((b * t,) + new.shape[2:]).astype(pool.dtype), mode="drop")
    return pool.reshape(layer_cache.shape)


def read_rows(layer_cache, table=None, window: int | None = None):
    """Each row's slots [0, window) (all of them when window is None) as [B, window, K, D]: a slice of
    a contiguous cache, or the row's first window / block blocks gathered from a pool (blocks it does
    not hold read as zeros), so the cost follows the window, not the pool."""
    if table is None:
        return layer_cache if window is None else layer_cache[:, :window]
    return gather_blocks(layer_cache, table, window)


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

    if cache.paged:
        p, bs = cache.k[0].shape[:2]
        src_flat = pool_slots(cache.table, src_slots, bs, p).reshape(-1)
        dst_flat = pool_slots(cache.table, dst_slots, bs, p).reshape(-1)

        def move(arr):  # [P, block, K, D]: the same move through the block table
            pool = arr.reshape((p * bs,) + arr.shape[2:])
            rows = jnp.take(pool, src_flat, axis=0, mode="fill", fill_value=0)
            return pool.at[dst_flat].set(rows, mode="drop").reshape(arr.shape)
    else:
        def move(arr):  # [B, S, K, D]
            rows = jnp.take_along_axis(arr, src_slots[:, :, None, None], axis=1)  # [B, M, K, D]
            return jax.vmap(lambda a, r, d: a.at[d].set(r))(arr, rows, dst_slots)

    return cache.replace(k=tuple(move(a) for a in cache.k), v=tuple(move(a) for a in cache.v),
                         lengths=cache.lengths + counts.astype(jnp.int32))
