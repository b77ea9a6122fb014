"""The decoder layer's math, shared by the target (`eagle_jax.model`) and the draft heads (`eagle_jax.draft`).

Pure functions over arrays: RMSNorm, rotary embeddings, the q/k/v projection, attention through the KV
cache (`pallas_kernels.tree_attention`, which takes a causal or a tree mask), and the layer's tail
(output projection, residual, SwiGLU MLP). A change to the layer math goes here, once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from eagle_jax.config import rope_inv_freq
from eagle_jax.kv_cache import write_rows
from eagle_jax.moe import moe_mlp
from eagle_jax.quant import matmul
from pallas_kernels import paged_tree_attention, tree_attention


def rms_norm(x, weight, eps, offset: float = 0.0):
    """RMSNorm scaled by (offset + weight): offset 0 for Llama, 1 for Gemma (its weights sit around 0)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = weight.astype(jnp.float32) if offset == 0 else offset + weight.astype(jnp.float32)
    return (xf * scale).astype(x.dtype)


def apply_rope(x, positions, inv_freq):
    """Rotary embedding in the rotate-half layout (the Hugging Face convention). x [B,T,H,D]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def rope_frequencies(rope, head_dim: int) -> np.ndarray:
    """Inverse rotary frequencies [head_dim / 2] of a (hashable) RopeConfig: a trace-time constant."""
    return np.asarray(rope_inv_freq(rope, head_dim), np.float32)


def causal_mask(t: int):
    return jnp.tril(jnp.ones((t, t), dtype=bool))


def param_factories(rngs: nnx.Rngs | None, dtype):
    """(random normal(0.02), ones, zeros) parameter constructors taking a shape. rngs=None makes abstract
    parameters (shapes and dtypes only, nothing traced or allocated): what loaders build and then fill,
    in milliseconds where `nnx.eval_shape` traces every initialiser (about a second for 30 layers)."""
    if rngs is None:
        abstract = lambda *shape: nnx.Param(jax.ShapeDtypeStruct(shape, dtype))
        return abstract, abstract, abstract
    init = nnx.initializers.normal(0.02)
    return (lambda *shape: nnx.Param(init(rngs.params(), shape, dtype)),
            lambda *shape: nnx.Param(jnp.ones(shape, dtype)),
            lambda *shape: nnx.Param(jnp.zeros(shape, dtype)))


def project_qkv(h, wq, wk, wv, *, num_heads: int, num_kv_heads: int, head_dim: int, positions, rope,
                biases=None, qk_norms=None, eps: float = 1e-6, norm_offset: float = 0.0, query_scale=None):
    """q [B,T,Hq,D], k and v [B,T,K,D] from the layer input h [B,T,*], with rotary embeddings at
    `positions` [B,T]; optional q/k/v biases and per-head q/k norms (Qwen3, Gemma 3; scaled by
    norm_offset + w). query_scale: the attention scores' scale when it is not head_dim ** -0.5 (Gemma 3):
    q is multiplied so that the kernels' own head_dim ** -0.5 gives it."""
    b, t, _ = h.shape
    q, k, v = matmul(h, wq), matmul(h, wk), matmul(h, wv)  # (quantized matrices dequantize inside)
    if biases is not None:
        q, k, v = q + biases[0], k + biases[1], v + biases[2]
    q = q.reshape(b, t, num_heads, head_dim)
    k = k.reshape(b, t, num_kv_heads, head_dim)
    v = v.reshape(b, t, num_kv_heads, head_dim)
    if qk_norms is not None:
        q, k = rms_norm(q, qk_norms[0], eps, norm_offset), rms_norm(k, qk_norms[1], eps, norm_offset)
    inv_freq = jnp.asarray(rope_frequencies(rope, head_dim))
    q = apply_rope(q, positions, inv_freq)
    if query_scale is not None:
        q = (q.astype(jnp.float32) * (query_scale * head_dim ** 0.5)).astype(q.dtype)
    return q, apply_rope(k, positions, inv_freq), v


def cached_attention(q, k, v, k_cache, v_cache, *, starts, lengths, tree_mask, window: int | None = None,
                     table=None, mesh=None, split_heads: bool = True, key_starts=None):
    """Writes the new keys / values at each row's slots [starts, starts + T) and attends over the
    committed prefix [0, lengths) plus the scratch keys [lengths, lengths + M) that tree_mask [B,T,M]
    selects. Returns (attention output [B,T,Hq,D], k_cache, v_cache).

    table: the block table of a paged cache (k_cache / v_cache are then block pools; see
    `eagle_jax.kv_cache`): `pallas_kernels.paged_tree_attention` reads through it (on CPU it walks the
    rows' blocks only as far as the longest row reaches).
    window (static): attention reads only slots [0, window), so its cost follows the longest row
    instead of the cache's length; the caller guarantees lengths + M <= window for every row whose
    output it keeps.
    key_starts [B,T] (a sliding window): the first prefix slot each query sees (see `sliding_window`).

    mesh: a ("data", "model") `jax.sharding.Mesh` (`eagle_jax.sharding`): the write and the attention run
    per shard (`jax.shard_map`), rows over "data" and, with split_heads, q heads over "model" (kv heads
    too where they divide the degree; otherwise every shard holds them all and reads the one its q
    heads group with), so a Pallas kernel sees one shard's heads. split_heads=False: heads replicated
    (the draft head's layer)."""
    if mesh is not None:
        return sharded_attention(q, k, v, k_cache, v_cache, starts=starts, lengths=lengths, tree_mask=tree_mask,
                                 window=window, table=table, mesh=mesh, split_heads=split_heads,
                                 key_starts=key_starts)
    k_cache = write_rows(k_cache, k, starts, table)
    v_cache = write_rows(v_cache, v, starts, table)
    return attend(q, k_cache, v_cache, table, lengths, tree_mask, window, key_starts), k_cache, v_cache


def attend(q, k_cache, v_cache, table, lengths, tree_mask, window, key_starts):
    """The attention kernel for a contiguous cache (table None) or a paged one, over slots [0, window)."""
    if table is not None:
        return paged_tree_attention(q, k_cache, v_cache, table, lengths, tree_mask, window=window,
                                    key_starts=key_starts)
    return tree_attention(q, k_cache, v_cache, lengths, tree_mask, window=window, key_starts=key_starts)


def sliding_window(positions, tree_mask, size: int):
    """(key_starts [B,T], tree_mask) of a sliding window of `size` keys (the query's own included) for
    queries at `positions` [B,T] whose tree keys are the queries themselves (tree_mask [B,T,T]): prefix
    slot s holds position s, so each query's first visible slot is position - size + 1, and tree keys
    further back than that leave the mask."""
    near = positions[:, :, None] - positions[:, None, :] < size
    return jnp.maximum(positions - size + 1, 0).astype(jnp.int32), tree_mask & near


def sharded_attention(q, k, v, k_cache, v_cache, *, starts, lengths, tree_mask, window, table, mesh,
                      split_heads: bool, key_starts=None):
    """`cached_attention` under `jax.shard_map` over mesh (see there)."""
    tp, hq, nk = mesh.shape["model"], q.shape[2], k.shape[2]
    heads = "model" if split_heads and tp > 1 else None
    kv = heads if nk % tp == 0 else None
    if table is not None and mesh.shape["data"] > 1:
        raise ValueError("a paged KV cache is shared by every row: it needs data_parallel 1 (use a contiguous cache)")
    cache_spec = P(None, None, kv, None) if table is not None else P("data", None, kv, None)
    rows = P("data")
    extras = (() if table is None else (table,)) + (() if key_starts is None else (key_starts,))
    in_specs = (P("data", None, heads, None), P("data", None, kv, None), P("data", None, kv, None), cache_spec,
                cache_spec, rows, rows, P("data", None, None)) + (P("data", None),) * len(extras)

    def local(q, k, v, k_cache, v_cache, starts, lengths, tree_mask, *extras):
        tbl = extras[0] if table is not None else None
        first = extras[-1] if key_starts is not None else None
        if heads is None or kv is not None:
            return cached_attention(q, k, v, k_cache, v_cache, starts=starts, lengths=lengths, tree_mask=tree_mask,
                                    window=window, table=tbl, key_starts=first)
        # kv heads replicated (the degree is a multiple of them): this shard's q heads share one kv head.
        k_cache = write_rows(k_cache, k, starts, tbl)
        v_cache = write_rows(v_cache, v, starts, tbl)
        head = jax.lax.axis_index("model") * q.shape[2] // (hq // nk)
        k_one = jax.lax.dynamic_slice_in_dim(k_cache, head, 1, axis=2)
        v_one = jax.lax.dynamic_slice_in_dim(v_cache, head, 1, axis=2)
        return attend(q, k_one, v_one, tbl, lengths, tree_mask, window, first), k_cache, v_cache

    run = jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                        out_specs=(P("data", None, heads, None), cache_spec, cache_spec), check_vma=False)
    return run(q, k, v, k_cache, v_cache, starts, lengths, tree_mask, *extras)


def layer_tail(residual, attn, wo, mlp_norm, w_gate, w_up, w_down, eps, bo=None, *, norm_offset: float = 0.0,
               activation: str = "silu", post_attn_norm=None, post_mlp_norm=None, experts=None):
    """The rest of a decoder layer after attention: output projection onto the residual, then the
    pre-normed gated MLP (SwiGLU, or GeGLU with activation "gelu_tanh") with its own residual. Gemma 3
    also norms the attention output and the MLP output before each residual add (post_attn_norm,
    post_mlp_norm). experts: (router [H,E], top_k, norm_topk) for a MoE MLP, whose w_gate / w_up /
    w_down are stacked over experts (`eagle_jax.moe`). attn [B,T,Hq,D]."""
    b, t = attn.shape[:2]
    o = matmul(attn.reshape(b, t, -1), wo)
    if bo is not None:
        o = o + bo
    if post_attn_norm is not None:
        o = rms_norm(o, post_attn_norm, eps, norm_offset)
    x = residual + o
    h = rms_norm(x, mlp_norm, eps, norm_offset)
    if experts is not None:
        router, top_k, norm_topk = experts
        m = moe_mlp(h, router, w_gate, w_up, w_down, top_k=top_k, norm_topk=norm_topk)
    else:
        gate = matmul(h, w_gate)
        gate = jax.nn.gelu(gate, approximate=True) if activation == "gelu_tanh" else jax.nn.silu(gate)
        m = matmul(gate * matmul(h, w_up), w_down)
    if post_mlp_norm is not None:
        m = rms_norm(m, post_mlp_norm, eps, norm_offset)
    return x + m
