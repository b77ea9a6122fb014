"""Llama-family decoder in Flax NNX: per-layer parameters, one code path for prefill, decode and verify.

Covers Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3, SmolLM2, Gemma 3 and the MoE families Mixtral and
Qwen3-MoE (see `ModelConfig`; a MoE layer's w_gate / w_up / w_down are stacked over experts). The forward pass
takes new tokens for each row, writes their keys / values into the KV cache past the row's committed
length, and attends through `pallas_kernels.tree_attention` with a causal or tree mask, so prefill,
plain decode and tree verification are one code path.

Run it functionally: `graphdef, state = nnx.split(model)` once, then inside jit
`nnx.merge(graphdef, state)(...)` (see `eagle_jax.steps`). The layer math itself is in `eagle_jax.layers`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.config import ModelConfig
from eagle_jax.kv_cache import KVCache
from eagle_jax.layers import (cached_attention, causal_mask, layer_tail, param_factories, project_qkv, rms_norm,
                              sliding_window)
from eagle_jax.quant import QuantizedWeight, matmul, take_columns


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    logits: jax.Array | None  # [B, V] at `logits_at`, or [B, T, V]
    hidden: jax.Array  # [B, T, H] final normed hidden state (what feeds the lm_head)
    captured: jax.Array | None  # [C, B, T, H] residual stream after each layer in capture_layers
    cache: KVCache


class Block(nnx.Module):
    """One decoder layer's parameters."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None, dtype=jnp.float32):
        H, F = cfg.hidden_size, cfg.intermediate_size
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        w, ones, zeros = param_factories(rngs, dtype)
        norm = zeros if cfg.norm_offset == 1.0 else ones  # a norm's initial scale is 1 either way
        self.attn_norm = norm(H)
        self.wq, self.wk, self.wv = w(H, qd), w(H, kd), w(H, kd)
        self.wo = w(qd, H)
        if cfg.qkv_bias:
            self.bq, self.bk, self.bv = zeros(qd), zeros(kd), zeros(kd)
        if cfg.o_bias:
            self.bo = zeros(H)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(cfg.head_dim), norm(cfg.head_dim)
        if cfg.sandwich_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(H), norm(H)
        self.mlp_norm = norm(H)
        if cfg.num_experts:  # MoE: a router and the experts' stacked SwiGLU matrices
            E, F = cfg.num_experts, cfg.expert_size
            self.router = w(H, E)
            self.w_gate, self.w_up, self.w_down = w(E, H, F), w(E, H, F), w(E, F, H)
        else:
            self.w_gate, self.w_up = w(H, F), w(H, F)
            self.w_down = w(F, H)

    def __call__(self, x, k_cache, v_cache, *, cfg: ModelConfig, positions, lengths, tree_mask, window=None,
                 table=None, mesh=None, rope=None, key_starts=None):
        """x [B,T,H]; this layer's caches [B,S,K,D] (block pools with a paged cache's table); rope: this
        layer's (default cfg.rope); key_starts: a sliding-window layer's first visible slots (its window
        already folded into tree_mask; see `layers.sliding_window`). Returns (x, k_cache, v_cache)."""
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        q, k, v = project_qkv(
            rms_norm(x, self.attn_norm[...], eps, off), self.wq[...], self.wk[...], self.wv[...],
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, positions=positions,
            rope=rope or cfg.rope, eps=eps, norm_offset=off, query_scale=cfg.query_scale,
            biases=(self.bq[...], self.bk[...], self.bv[...]) if cfg.qkv_bias else None,
            qk_norms=(self.q_norm[...], self.k_norm[...]) if cfg.qk_norm else None)
        attn, k_cache, v_cache = cached_attention(q, k, v, k_cache, v_cache, starts=lengths, lengths=lengths,
                                                  tree_mask=tree_mask, window=window, table=table, mesh=mesh,
                                                  key_starts=key_starts)
        sandwich = cfg.sandwich_norms
        x = layer_tail(x, attn, self.wo[...], self.mlp_norm[...], self.w_gate[...], self.w_up[...],
                       self.w_down[...], eps, bo=self.bo[...] if cfg.o_bias else None, norm_offset=off,
                       activation=cfg.activation, post_attn_norm=self.post_attn_norm[...] if sandwich else None,
                       post_mlp_norm=self.post_mlp_norm[...] if sandwich else None,
                       experts=(self.router[...], cfg.experts_per_token, cfg.norm_topk) if cfg.num_experts else None)
        return x, k_cache, v_cache


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None, dtype=jnp.float32):
        """rngs=None builds an abstract model (shapes only; see `layers.param_factories`)."""
        self.cfg = cfg
        self.dtype = dtype
        # The ("data", "model") mesh the parameters are sharded over (`eagle_jax.sharding`); None: one device.
        # Static (part of the graphdef), so steps compile for it.
        self.mesh = None
        # (scheme, group) when `eagle_jax.quant.quantize_model` quantized the matrices; None: full precision.
        self.quantization = None
        w, ones, zeros = param_factories(rngs, dtype)
        self.embed = w(cfg.vocab_size, cfg.hidden_size)
        self.layers = nnx.List([Block(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_layers)])
        self.final_norm = (zeros if cfg.norm_offset == 1.0 else ones)(cfg.hidden_size)
        if not cfg.tie_embeddings:
            self.lm_head = w(cfg.hidden_size, cfg.vocab_size)

    # --- pieces the speculative engine and draft heads reuse -------------------------------------
    def embed_tokens(self, tokens):
        table = self.embed[...]
        if isinstance(table, QuantizedWeight):  # stored transposed, [H, V] (`quant.quantize_model`)
            x = take_columns(table, tokens, self.dtype)
        else:
            x = jnp.take(table, tokens, axis=0)
        if self.cfg.embed_scale != 1.0:  # (in the embedding's dtype, as the reference implementations round it)
            x = x * jnp.asarray(self.cfg.embed_scale, x.dtype)
        return x

    def lm_head_weight(self):
        """[H, V] output projection (the transposed embedding when tied; a `QuantizedWeight` when quantized)."""
        if not self.cfg.tie_embeddings:
            return self.lm_head[...]
        table = self.embed[...]
        return table if isinstance(table, QuantizedWeight) else table.T

    def logits(self, hidden):
        w = self.lm_head_weight()
        if isinstance(w, QuantizedWeight):
            return matmul(hidden.astype(jnp.float32), w)
        return jnp.einsum("...H,HV->...V", hidden, w, preferred_element_type=jnp.float32)

    # --- forward ---------------------------------------------------------------------------------
    def __call__(
        self,
        tokens,  # [B, T] int32
        cache: KVCache,
        *,
        positions=None,  # [B, T]; default lengths + arange(T)
        tree_mask=None,  # [B, T, T] bool; default causal
        capture_layers: Sequence[int] = (),
        logits_at=None,  # [B] index into T to compute logits for; None = all T; False = no logits
        window: int | None = None,  # static: attend over cache slots [0, window) only (see layers.cached_attention)
    ) -> ForwardOutput:
        """Writes the new tokens' K/V at each row's [length, length + T) and returns logits / hidden.

        The layer loop is unrolled in Python on purpose: on XLA:CPU a `lax.scan` over stacked weights
        copies every layer's weight slice before each matmul (measured: 1.6x slower decode at batch 1).
        """
        cfg = self.cfg
        b, t = tokens.shape
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if tree_mask is None:
            tree_mask = jnp.broadcast_to(causal_mask(t), (b, t, t))
        bad = [i for i in capture_layers if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"capture_layers {bad} out of range for a {cfg.num_layers}-layer model")
        x = self.embed_tokens(tokens)  # [B, T, H]
        windowed = None  # (key_starts, tree mask) of the sliding-window layers
        if cfg.sliding_window and "sliding_attention" in cfg.layer_types:
            windowed = sliding_window(positions, tree_mask, cfg.sliding_window)
        captured = {}
        ks, vs = [], []
        for i, block in enumerate(self.layers):
            local = windowed is not None and cfg.layer_types[i] == "sliding_attention"
            x, k_i, v_i = block(x, cache.k[i], cache.v[i], cfg=cfg, positions=positions, lengths=cache.lengths,
                                tree_mask=windowed[1] if local else tree_mask, window=window, table=cache.table,
                                mesh=self.mesh, rope=cfg.layer_rope(i), key_starts=windowed[0] if local else None)
            ks.append(k_i)
            vs.append(v_i)
            if i in capture_layers:
                captured[i] = x
        hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.norm_offset)
        if logits_at is False:
            logits = None
        elif logits_at is None:
            logits = self.logits(hidden)
        else:
            logits = self.logits(jnp.take_along_axis(hidden, logits_at[:, None, None], axis=1)[:, 0])
        stacked = jnp.stack([captured[i] for i in capture_layers]) if capture_layers else None
        return ForwardOutput(logits, hidden, stacked, cache.replace(k=tuple(ks), v=tuple(vs)))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        cfg = self.cfg
        return KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype or self.dtype)


@functools.lru_cache(maxsize=8)
def abstract_model(cfg: ModelConfig, dtype=jnp.float32):
    """(graphdef, flat abstract state) of a model of this config: shapes and dtypes, nothing allocated
    or traced. Call it with positional arguments only, so equal calls share one cache entry."""
    graphdef, state = nnx.split(Transformer(cfg, rngs=None, dtype=dtype))
    return graphdef, tuple(nnx.to_flat_state(state))


def param_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flat parameter path -> shape, without allocating anything."""
    return {tuple(str(k) for k in path): tuple(v.shape) for path, v in abstract_model(cfg, jnp.float32)[1]}


def from_arrays(cfg: ModelConfig, arrays: dict[tuple[str, ...], np.ndarray], dtype=jnp.float32,
                sharding=None) -> Transformer:
    """Builds a model whose parameters are exactly `arrays` (flat path -> array).

    Shapes must already be checked by the caller (the loader does, with file and tensor names).
    """
    graphdef, flat = abstract_model(cfg, dtype)
    leaves = []
    for path, var in flat:
        key = tuple(str(k) for k in path)
        if isinstance(arrays[key], QuantizedWeight):  # kept as the checkpoint stores it (`quant.from_blocks`)
            leaves.append((path, var.replace(arrays[key])))
            continue
        arr = np.asarray(arrays[key])
        value = jax.device_put(jnp.asarray(arr, dtype=dtype), sharding) if sharding else jnp.asarray(arr, dtype)
        leaves.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def random_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(seed), dtype=dtype)
