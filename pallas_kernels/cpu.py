"""Tree attention in pure jnp, arranged for XLA:CPU: the CPU's default implementation.

Letters as in tree_attention.py: B rows, N queries, M tree keys, S cache slots, W slots read (the
window), K kv heads, G query heads per kv head, D head dim, E = K * D (one slot's keys, contiguous in
the cache), Q = N * K * G.

With few queries per row (decode, tree verification, draft expansion) attention is a matrix-vector
product per row that reads the row's keys and values once: its cost is memory traffic, not arithmetic.
The reference's grouped einsum batches over (row, kv head), so XLA:CPU first copies the whole window
with the kv head moved beside the row, zeroes the unread value slots with another full copy, and reads
every row up to the window (the longest row's length); a window sliced off a longer cache ([:, :W]) is
one more copy before any of that. Here a loop over rows reads each row's slots where they lie, a chunk
of CHUNK slots at a time ([C, E] contiguous in the row) and only as far as that row's own tree reaches
(a run-time trip count, folded with an online softmax), so a short row next to a long one costs what a
short row costs, and one program serves every length. The queries are spread over every kv head's
lanes with zeros elsewhere (block-diagonal, [Q, E]), so one [C, E] x [E, Q] product scores every head
(K x the arithmetic, which is cheap), and each query keeps its own kv head's block of the [Q, E]
result. Unread slots' values are zeroed per chunk (0 x NaN would be NaN). Measured with
`benchmarks/cpu_attention.py` (a SmolLM2 decode step at batch 64).

Many queries per row (prefill, training) are arithmetic-bound; K x the arithmetic would not pay, and
`tree_attention` sends calls with more than MAX_QUERY_ROWS query rows (N * Hq) per row to the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.layout import slot_visibility

MAX_QUERY_ROWS = 128  # N * Hq per row at or under which the row loop runs (above: the reference)
CHUNK = 512  # slots of a row read per inner step


def block_diagonal_queries(q, num_kv_heads: int):
    """q [B, N, Hq, D] -> [B, Q, E]: query (n, kv head k, g) holds its D values in lanes [k*D, (k+1)*D)
    and zeros elsewhere, scaled by D ** -0.5; rows ordered n, k, g."""
    b, n, hq, d = q.shape
    g = hq // num_kv_heads
    eye = jnp.eye(num_kv_heads, dtype=jnp.float32)
    qg = q.reshape(b, n, num_kv_heads, g, d).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(d)))
    return jnp.einsum("BNKGD,KJ->BNKGJD", qg, eye).reshape(b, n * hq, num_kv_heads * d)


def own_head_blocks(out, n: int, num_kv_heads: int, d: int):
    """[B, Q, E] -> [B, N, Hq, D]: each query row's block of lanes of its own kv head."""
    b, rows, _ = out.shape
    g = rows // (n * num_kv_heads)
    out = out.reshape(b, n, num_kv_heads, g, num_kv_heads, d)
    return jnp.einsum("BNKGJD,KJ->BNKGD", out, jnp.eye(num_kv_heads, dtype=out.dtype)).reshape(b, n, -1, d)


def tree_attention_rows(q, k_cache, v_cache, lengths, tree_mask, *, key_starts=None, window: int | None = None,
                        chunk: int = CHUNK):
    """The row loop (module docstring) for any shape; `tree_attention` picks when to use it.
    window (static): no slot at or past it is read (None: the cache's S). Not reverse-differentiable
    (run-time trip counts); training's attention is its own (`eagle_jax.train.losses`)."""
    b, n, hq, d = q.shape
    s, kv = k_cache.shape[1], k_cache.shape[2]
    w = s if window is None else min(window, s)
    c, e, rows = min(chunk, w), kv * d, n * hq
    m = tree_mask.shape[-1]
    qb = block_diagonal_queries(q, kv).astype(k_cache.dtype)  # [B, Q, E]
    kf, vf = k_cache.reshape(b, s, e), v_cache.reshape(b, s, e)

    def row(i, out):
        length = lengths[i]
        first = 0 if key_starts is None else jnp.min(key_starts[i]) // c  # chunks before every query's window
        trips = jnp.minimum((length + m + c - 1) // c, -(-w // c))  # chunks up to the row's last tree key

        def step(j, carry):
            acc, top, den = carry
            start = jnp.minimum(j * c, w - c)  # the last chunk ends at the window (it may re-read slots)
            k_c = jax.lax.dynamic_slice(kf, (i, start, 0), (1, c, e))[0]  # [C, E], contiguous in the row
            v_c = jax.lax.dynamic_slice(vf, (i, start, 0), (1, c, e))[0]
            slots = start + jnp.arange(c, dtype=jnp.int32)
            visible, live = slot_visibility(length[None], tree_mask[i][None], slots,
                                            None if key_starts is None else key_starts[i][None])
            fresh = slots >= j * c  # slots an earlier chunk did not cover
            visible, live = visible[0] & fresh[None, :], live[0] & fresh  # [N, C], [C]
            scores = jnp.dot(k_c, qb[i].T, preferred_element_type=jnp.float32).reshape(c, n, hq)
            scores = jnp.where(visible.T[:, :, None], scores, -jnp.inf).reshape(c, rows)
            new_top = jnp.maximum(top, scores.max(axis=0))
            safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
            scale = jnp.exp(top - safe)  # 0 while nothing was visible yet
            p = jnp.exp(scores - safe[None, :])
            v_c = jnp.where(live[:, None], v_c, 0)  # slots past the tree may hold NaN (a chunk: cheap)
            acc = acc * scale[:, None] + jnp.dot(p.T.astype(v_c.dtype), v_c, preferred_element_type=jnp.float32)
            return acc, new_top, den * scale + p.sum(axis=0)

        init = (jnp.zeros((rows, e), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        acc, _, den = jax.lax.fori_loop(jnp.minimum(first, trips), trips, step, init)
        return out.at[i].set(acc / den[:, None])  # a query that sees nothing: 0 / 0, as the reference's NaN

    out = jax.lax.fori_loop(0, b, row, jnp.zeros((b, rows, e), jnp.float32))
    return own_head_blocks(out, n, kv, d).astype(q.dtype)
