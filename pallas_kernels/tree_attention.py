"""Tree-masked attention over a KV cache: the entry point and its pure-jnp reference.

Shapes (one letter per axis):
  B batch rows, N new (tree) tokens per row, S cache slots, K kv heads, G query heads per kv head,
  D head dim.

Every row has a prefix of `lengths[b]` committed tokens in cache slots [0, length); the tree's keys
and values are already written at slots [length, length + M). Query n sees the whole prefix and the
tree keys m with `tree_mask[b, n, m]` ([B, N, M]; M = N when the queries are the tree itself, as in
verification). Slots at or past `length + M` are never read: they may hold anything, NaN included.

A causal mask makes this ordinary prefill / decode attention (N = 1 is a decode step), so the engine
runs all of its attention through this one function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_attention_reference(q, k_cache, v_cache, lengths, tree_mask, *, interpret: bool = False):
    """Pure-jnp tree attention. q [B,N,Hq,D]; caches [B,S,K,D]; lengths [B]; tree_mask [B,N,M] bool."""
    del interpret  # same signature as the kernels
    b, n, hq, d = q.shape
    s, k = k_cache.shape[1], k_cache.shape[2]
    g = hq // k
    qg = q.reshape(b, n, k, g, d)
    m = tree_mask.shape[-1]  # tree keys; equals N except for draft expansion (queries = one frontier)
    rel = jnp.arange(s)[None, :] - lengths[:, None]  # [B, S] slot index relative to the tree start
    in_prefix = rel < 0
    in_tree = (rel >= 0) & (rel < m)
    tree_vis = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, m - 1)[:, None, :], (b, n, s)), axis=2
    )  # [B, N, S]
    visible = in_prefix[:, None, :] | (in_tree[:, None, :] & tree_vis)  # [B, N, S]
    # Slots past the tree may hold garbage (NaN). Scores of hidden slots are replaced below; their
    # values must be zeroed too, or 0-weight * NaN would leak into the output.
    live = (in_prefix | in_tree)[:, :, None, None]  # [B, S, 1, 1]
    v_live = jnp.where(live, v_cache, 0)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum(
        "BNKGD,BSKD->BKGNS", qg, k_cache, preferred_element_type=jnp.float32
    ) * scale
    scores = jnp.where(visible[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKGNS,BSKD->BNKGD", probs.astype(v_cache.dtype), v_live,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, n, hq, d).astype(q.dtype)


def tree_attention(q, k_cache, v_cache, lengths, tree_mask, *, interpret: bool = False):
    """Dispatches to the best implementation for the current backend.

    Only the reference exists so far; the TPU (Mosaic) and GPU (Triton) kernels plug in here with
    the same signature.
    """
    return tree_attention_reference(q, k_cache, v_cache, lengths, tree_mask, interpret=interpret)
