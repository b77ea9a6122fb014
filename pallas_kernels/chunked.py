"""Tree attention over a paged KV cache in pure jnp, chunk by chunk: the CPU path for paged caches.

Letters as in tree_attention.py: B rows, N queries, M tree keys, K kv heads, G query heads per kv head,
D head dim; P pool blocks of `block` slots, NB table entries per row.

The keys and values sit in block pools [P, block, K, D] shared by all rows; row b's logical slot s is
in block table[b, s // block] (-1: the row holds none there; such slots are never visible). The loop
walks the rows' logical slots `chunk` at a time, gathering that chunk's blocks for every row and
folding it into an online softmax, and stops after the last chunk any row reaches
(max(lengths) + M): the cost follows the longest sequence in the batch, and one program serves every
length (the trip count is a run-time value, not a shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.layout import slot_visibility


def paged_tree_attention_chunked(q, k_pool, v_pool, table, lengths, tree_mask, *, key_starts=None,
                                 chunk: int = 128):
    """q [B,N,Hq,D]; pools [P,block,K,D]; table [B,NB] int32; lengths [B]; tree_mask [B,N,M] bool;
    key_starts [B,N] int32 or None (a sliding window: the first prefix slot each query sees).
    Same contract as `tree_attention_reference` on the rows' gathered caches; chunk: logical slots a
    loop iteration reads (rounded to whole blocks)."""
    b, n, hq, d = q.shape
    p, bs, kv, _ = k_pool.shape
    g, m = hq // kv, tree_mask.shape[-1]
    per = max(chunk // bs, 1)  # blocks per chunk
    width = table.shape[1]
    table = jnp.pad(table, ((0, 0), (0, (-width) % per)), constant_values=-1)
    table = jnp.where(table >= 0, table, p)  # one past the pool: gathers read zeros
    total = table.shape[1] // per
    c = per * bs
    reach = jnp.max(lengths) + m  # slots the longest row's queries may see
    trips = jnp.minimum((reach + c - 1) // c, total)
    # With a window, chunks wholly before every query's first slot are skipped.
    first = 0 if key_starts is None else jnp.minimum(jnp.min(key_starts) // c, trips)
    qg = q.reshape(b, n, kv, g, d).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(d)))

    def body(i, carry):
        acc, top, den = carry
        blocks = jax.lax.dynamic_slice_in_dim(table, i * per, per, axis=1)  # [B, per]
        kc = jnp.take(k_pool, blocks, axis=0, mode="fill", fill_value=0).reshape(b, c, kv, d)
        vc = jnp.take(v_pool, blocks, axis=0, mode="fill", fill_value=0).reshape(b, c, kv, d)
        visible, live = slot_visibility(lengths, tree_mask, i * c + jnp.arange(c, dtype=jnp.int32), key_starts)
        vc = jnp.where(live[:, :, None, None], vc, 0)  # slots past the tree may hold NaN
        s = jnp.einsum("BNKGD,BCKD->BKGNC", qg, kc, preferred_element_type=jnp.float32)
        s = jnp.where(visible[:, None, None], s, -jnp.inf)
        new_top = jnp.maximum(top, s.max(axis=-1))
        safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        scale = jnp.exp(top - safe)  # 0 while nothing was visible yet
        w = jnp.exp(s - safe[..., None])
        acc = acc * scale[..., None] + jnp.einsum("BKGNC,BCKD->BKGND", w, vc.astype(jnp.float32))
        return acc, new_top, den * scale + w.sum(axis=-1)

    init = (jnp.zeros((b, kv, g, n, d), jnp.float32), jnp.full((b, kv, g, n), -jnp.inf, jnp.float32),
            jnp.zeros((b, kv, g, n), jnp.float32))
    acc, _, den = jax.lax.fori_loop(first, trips, body, init)
    out = acc / jnp.where(den > 0, den, 1.0)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, n, hq, d).astype(q.dtype)
