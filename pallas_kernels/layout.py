"""Array plumbing the TPU and GPU kernels share: shape checks, query folding, the tree's keys.

Letters as in tree_attention.py: B rows, N queries, M tree keys, S cache slots, K kv heads, G query
heads per kv head, D head dim, R = N * G query rows per kv head (row r = n * G + g).

The kernels see the tree's keys on their own axis, [B, K, M', D] gathered from slots
[length, length + M) and zero-padded to M' (a whole number of blocks), and the tree mask expanded to
one row per (n, g), [B, R', M'] int32. Tree blocks then start at key 0, so a mask block lines up with
its key block and no kernel needs a gather along lanes; cache blocks hold only the prefix
[0, length), whose visibility is just `slot < length`.
"""

from __future__ import annotations

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


def as_lengths(lengths):
    return jnp.asarray(lengths, jnp.int32)


def finish(acc, l, dtype):
    """acc / l in f32 with rows that saw no key (padding rows) set to 0 instead of 0 / 0."""
    safe = jnp.where(l > 0, l, 1.0)
    return (acc / safe).astype(dtype)

