"""Tree attention over a paged KV cache: the entry point and its pure-jnp reference.

A paged cache keeps every row's keys and values in one pool of fixed-size blocks, [P, block, K, D],
shared by all rows; row b's logical slot s lives at pool[block_table[b, s // block], s % block]. A -1
table entry means the row holds no block there: its slots read as zeros, and no kernel addresses the
pool through it (unheld pool blocks may hold anything, NaN included). Otherwise the contract is
`tree_attention`'s over the logical cache: prefix slots [0, length) are visible, the tree's keys sit at
[length, length + M) and are visible per tree_mask.

window (static): only the row's slots [0, window) exist for the call, i.e. its first
ceil(window / block) table entries, so the cost follows the window, not the table; the caller
guarantees lengths + M <= window. None: the whole table.

key_starts [B, N] (optional): a sliding window, as for `tree_attention`: query n sees prefix slots
[key_starts[b, n], length) only.

Implementations, chosen like `tree_attention`'s (backend default, `use_implementation`, explicit):
  "reference"  pure jnp (`pallas_kernels.chunked`): walks the rows' blocks a chunk at a time, as far as
               the longest row reaches, so its cost follows the longest sequence in the batch whatever
               the table's width. `paged_tree_attention_reference` (gather the window's blocks into a
               contiguous cache, then `tree_attention_reference`) is what tests hold every path to.
  "tpu"        pallas_kernels/tpu.py: the table is scalar-prefetched and the BlockSpec index maps DMA
               the prefix's pool blocks directly. Each grid step reads whole pool blocks:
               BlockSizes.block_kv must be a multiple of the pool's block size (ValueError otherwise);
               without block_sizes a step takes up to 256 slots (at most 8 blocks).
  "gpu"        pallas_kernels/gpu.py: each [block_kv, D] prefix tile gathers its rows through the
               table, so any pool block size works with any block_kv.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import layout
from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.chunked import paged_tree_attention_chunked
from pallas_kernels.tree_attention import resolve_implementation, tree_attention_reference


def gather_blocks(pool, block_table, window: int | None = None):
    """Each row's logical slots [0, window) as a contiguous cache: pool [P, block, K, D] and table
    [B, NB] -> [B, S, K, D] (S = window, or NB * block for None; at most NB * block). Blocks a row does
    not hold (-1) read as zeros."""
    p, block = pool.shape[:2]
    entries, slots = layout.window_blocks(block_table.shape[1], block, window)
    table = block_table[:, :entries]
    table = jnp.where(table >= 0, table, p)  # out of range -> filled with zeros, never read
    rows = jnp.take(pool, table, axis=0, mode="fill", fill_value=0)  # [B, NB', block, K, D]
    rows = rows.reshape((table.shape[0], entries * block) + pool.shape[2:])
    return rows[:, :slots]


def paged_tree_attention_reference(q, k_pool, v_pool, block_table, lengths, tree_mask, *,
                                   window: int | None = None, key_starts=None, block_sizes: BlockSizes | None = None,
                                   interpret=False):
    """Pure-jnp paged tree attention: `tree_attention_reference` over `gather_blocks` of both pools."""
    del block_sizes, interpret  # same signature as the kernels
    layout.check_paged_inputs(q, k_pool, v_pool, block_table, lengths, tree_mask, window)
    return tree_attention_reference(q, gather_blocks(k_pool, block_table, window),
                                    gather_blocks(v_pool, block_table, window), lengths, tree_mask,
                                    key_starts=key_starts)


def paged_tree_attention(q, k_pool, v_pool, block_table, lengths, tree_mask, *, window: int | None = None,
                         key_starts=None, interpret=False, implementation: str | None = None,
                         block_sizes: BlockSizes | None = None):
    """Tree attention over a paged cache through the best implementation (see the module docstring).

    q [B, N, Hq, D]; k_pool / v_pool [P, block, Hkv, D]; block_table [B, NB] int32 (-1: no block);
    lengths [B] int32; tree_mask [B, N, M] bool; window: static int or None; key_starts [B, N] int32 or
    None (a sliding window). Returns [B, N, Hq, D] in
    q's dtype, equal up to rounding to `tree_attention_reference` over `gather_blocks(...)` of the pools.

    interpret / implementation / block_sizes: as for `tree_attention` (and `use_implementation`).
    """
    implementation, interpret, block_sizes = resolve_implementation(implementation, interpret, block_sizes, q,
                                                                    k_pool)
    if implementation == "tpu":
        from pallas_kernels.tpu import paged_tree_attention_tpu  # kernel modules load only when used

        return paged_tree_attention_tpu(q, k_pool, v_pool, block_table, lengths, tree_mask, window=window,
                                        key_starts=key_starts, block_sizes=block_sizes, interpret=interpret)
    if implementation == "gpu":
        from pallas_kernels.gpu import paged_tree_attention_gpu

        return paged_tree_attention_gpu(q, k_pool, v_pool, block_table, lengths, tree_mask, window=window,
                                        key_starts=key_starts, block_sizes=block_sizes, interpret=interpret)
    layout.check_paged_inputs(q, k_pool, v_pool, block_table, lengths, tree_mask, window)
    entries, _ = layout.window_blocks(block_table.shape[1], k_pool.shape[1], window)
    return paged_tree_attention_chunked(q, k_pool, v_pool, block_table[:, :entries], lengths, tree_mask,
                                        key_starts=key_starts)
