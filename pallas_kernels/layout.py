"""Array plumbing the TPU and GPU kernels share: shape checks, query folding, the tree's keys.

Letters as in tree_attention.py: B rows, N queries, M tree keys, S cache slots, K kv heads, G query
heads per kv head, D head dim, R = N * G query rows per kv head (row r = n * G + g).

The kernels see the tree's keys on their own axis, [B, K, M', D] gathered from slots
[length, length + M) and zero-padded to M' (a whole number of blocks), and the tree mask expanded to
one row per (n, g), [B, R', M'] int32. Tree blocks then start at key 0, so a mask block lines up with
its key block and no kernel needs a gather along lanes; cache blocks hold only the prefix
[0, length), whose visibility is just `slot < length`.

Paged caches (pallas_kernels/paged.py) keep K / V in a pool of blocks read through a block table; the
tree's keys are gathered through the table the same way (`paged_tree_keys`), so only the prefix
blocks differ between the contiguous and the paged kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cdiv(x: int, m: int) -> int:
    return -(-x // m)


def next_power_of_two(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def check_inputs(q, k_cache, v_cache, lengths, tree_mask):
    """Raises ValueError unless the shapes fit together; returns (B, N, M, S, K, G, D)."""
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"q must be [B, N, Hq, D] and caches [B, S, Hkv, D]; got q {q.shape}, k_cache {k_cache.shape}")
    b, n, hq, d = q.shape
    _, s, k, dk = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {v_cache.shape} must match k_cache {k_cache.shape}")
    if k_cache.shape[0] != b or dk != d:
        raise ValueError(f"k_cache {k_cache.shape} does not fit q {q.shape} (batch and head dim must match)")
    if hq % k:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {k}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B] = [{b}], got {lengths.shape}")
    if tree_mask.ndim != 3 or tree_mask.shape[:2] != (b, n) or tree_mask.shape[2] < 1:
        raise ValueError(f"tree_mask must be [B, N, M] = [{b}, {n}, M >= 1], got {tree_mask.shape}")
    return b, n, tree_mask.shape[2], s, k, hq // k, d


def fold_queries(q, num_kv_heads: int, rows_padded: int):
    """[B, N, K*G, D] -> [B, K, R', D], row r = n * G + g, zero rows past R = N * G."""
    b, n, hq, d = q.shape
    g = hq // num_kv_heads
    rows = q.reshape(b, n, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, n * g, d)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, rows_padded - n * g), (0, 0)))


def unfold_rows(out, n: int, g: int):
    """[B, K, R', D] -> [B, N, K*G, D]: the inverse of fold_queries."""
    b, k, _, d = out.shape
    return out[:, :, : n * g].reshape(b, k, n, g, d).transpose(0, 2, 1, 3, 4).reshape(b, n, k * g, d)


def tree_keys(cache, lengths, m: int, m_padded: int):
    """The tree's rows of one cache, [B, S, K, D] -> [B, K, M', D].

    Key j is slot length + j. Keys at j >= M or past the cache's end are zeros (selected, not
    multiplied, so NaN in those slots cannot leak).
    """
    s = cache.shape[1]
    slot = lengths[:, None] + jnp.arange(m_padded, dtype=jnp.int32)[None, :]  # [B, M']
    valid = (jnp.arange(m_padded)[None, :] < m) & (slot < s)  # [B, M']
    rows = jnp.take_along_axis(cache, jnp.clip(slot, 0, s - 1)[:, :, None, None], axis=1)  # [B, M', K, D]
    rows = jnp.where(valid[:, :, None, None], rows, jnp.zeros((), cache.dtype))
    return rows.transpose(0, 2, 1, 3)


def row_mask(tree_mask, lengths, num_slots: int, g: int, rows_padded: int, m_padded: int):
    """[B, N, M] bool -> [B, R', M'] int32, one row per (n, g); padding rows / keys and tree keys that
    would fall past the cache's end are 0."""
    b, n, m = tree_mask.shape
    in_cache = (lengths[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]) < num_slots  # [B, M]
    visible = tree_mask & in_cache[:, None, :]
    rows = jnp.repeat(visible, g, axis=1).astype(jnp.int32)  # [B, N*G, M]
    return jnp.pad(rows, ((0, 0), (0, rows_padded - n * g), (0, m_padded - m)))


def row_starts(key_starts, g: int, rows_padded: int):
    """[B, N] first visible prefix slots (a sliding window) -> [B, R'] int32, one per (n, g) row; padding
    rows start past any cache (they see no prefix, and do not hold back a tile's earliest start)."""
    b, n = key_starts.shape
    rows = jnp.repeat(key_starts.astype(jnp.int32), g, axis=1)
    return jnp.pad(rows, ((0, 0), (0, rows_padded - n * g)), constant_values=2 ** 30)


def check_key_starts(key_starts, b: int, n: int):
    if key_starts is not None and tuple(key_starts.shape) != (b, n):
        raise ValueError(f"key_starts must be [B, N] = [{b}, {n}], got {tuple(key_starts.shape)}")


def as_lengths(lengths):
    return jnp.asarray(lengths, jnp.int32)


def finish(acc, l, dtype):
    """acc / l in f32 with rows that saw no key (padding rows) set to 0 instead of 0 / 0."""
    safe = jnp.where(l > 0, l, 1.0)
    return (acc / safe).astype(dtype)



# Paged caches: K / V live in a pool [P, block, K, D] shared by all rows, and row b's logical slot s is
# pool[table[b, s // block], s % block]; a -1 table entry holds no block (its slots read as zeros).

def window_blocks(num_entries: int, block: int, window: int | None) -> tuple[int, int]:
    """(table entries a call reads, logical slots it sees) for slots [0, window) of a table of
    num_entries entries: like slicing the gathered cache, a window past the table's end sees the
    whole table."""
    if window is None:
        return num_entries, num_entries * block
    entries = min(cdiv(window, block), num_entries)
    return entries, min(window, entries * block)


def check_paged_inputs(q, k_pool, v_pool, block_table, lengths, tree_mask, window):
    """Raises ValueError unless the shapes fit together; returns (B, N, M, S, K, G, D, block, NB'):
    S logical slots and NB' table entries in the window."""
    if q.ndim != 4 or k_pool.ndim != 4:
        raise ValueError(f"q must be [B, N, Hq, D] and pools [P, block, Hkv, D]; got q {q.shape}, k_pool {k_pool.shape}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool {v_pool.shape} must match k_pool {k_pool.shape}")
    b, d = q.shape[0], q.shape[3]
    if block_table.ndim != 2 or block_table.shape[0] != b or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be [B, NB] = [{b}, NB >= 1], got {block_table.shape}")
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(f"block_table must hold integers, got {block_table.dtype}")
    if k_pool.shape[3] != d:
        raise ValueError(f"k_pool {k_pool.shape} does not fit q {q.shape} (head dims must match)")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    block = k_pool.shape[1]
    entries, slots = window_blocks(block_table.shape[1], block, window)
    logical = jax.ShapeDtypeStruct((b, slots) + k_pool.shape[2:], k_pool.dtype)  # the gathered cache
    b, n, m, s, k, g, d = check_inputs(q, logical, logical, lengths, tree_mask)
    return b, n, m, s, k, g, d, block, entries


def paged_tree_keys(pool, table, lengths, m: int, m_padded: int, num_slots: int):
    """The tree's rows of one pool, [P, block, K, D] -> [B, K, M', D] (cf. tree_keys).

    Key j is logical slot length + j, read through the table. Keys at j >= M, past num_slots or in a
    block the row does not hold are zeros (selected, so NaN in the pool cannot leak).
    """
    p, block = pool.shape[:2]
    slot = lengths[:, None] + jnp.arange(m_padded, dtype=jnp.int32)[None, :]  # [B, M']
    entry = jnp.clip(slot // block, 0, table.shape[1] - 1)
    phys = jnp.take_along_axis(table.astype(jnp.int32), entry, axis=1)  # [B, M']
    valid = (jnp.arange(m_padded)[None, :] < m) & (slot < num_slots) & (phys >= 0)
    flat = jnp.where(valid, phys * block + slot % block, 0)
    rows = jnp.take(pool.reshape((p * block,) + pool.shape[2:]), flat, axis=0)  # [B, M', K, D]
    rows = jnp.where(valid[:, :, None, None], rows, jnp.zeros((), pool.dtype))
    return rows.transpose(0, 2, 1, 3)


def paged_operands(q, k_pool, v_pool, block_table, lengths, tree_mask, *, entries: int, num_slots: int,
                   rows_padded: int, m_padded: int):
    """What both paged kernels take besides the pools: (lengths, the table's first `entries` entries,
    queries folded by KV head [B, K, R', D], the tree's keys and values [B, K, M', D] read through the
    table, and the row mask [B, R', M'])."""
    k, m = k_pool.shape[2], tree_mask.shape[-1]
    g = q.shape[2] // k
    lengths = as_lengths(lengths)
    table = block_table[:, :entries].astype(jnp.int32)
    return (lengths, table, fold_queries(q, k, rows_padded),
            paged_tree_keys(k_pool, table, lengths, m, m_padded, num_slots),
            paged_tree_keys(v_pool, table, lengths, m, m_padded, num_slots),
            row_mask(tree_mask, lengths, num_slots, g, rows_padded, m_padded))


def slot_visibility(lengths, tree_mask, slots, key_starts=None):
    """(visible [B, N, C], live [B, C]) for cache slots `slots` [C] (int32): which slots each query sees
    (the prefix [key_starts or 0, length), and tree keys [length, length + M) per tree_mask), and which
    slots are inside prefix or tree at all (the only ones whose values may be read)."""
    b, n, m = tree_mask.shape
    rel = slots[None, :] - lengths[:, None]  # [B, C]: slot relative to the tree's first key
    in_prefix, in_tree = rel < 0, (rel >= 0) & (rel < m)
    tree_vis = jnp.take_along_axis(tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, m - 1)[:, None, :],
                                                               (b, n, slots.shape[0])), axis=2)
    prefix_vis = in_prefix[:, None, :]
    if key_starts is not None:
        prefix_vis = prefix_vis & (slots[None, None, :] >= key_starts[:, :, None])
    return prefix_vis | (in_tree[:, None, :] & tree_vis), in_prefix | in_tree
