"""Tree attention on TPU: a Pallas Mosaic kernel with an online (flash) softmax in f32.

Grid (B, row blocks, KV steps); the KV axis is sequential ("arbitrary") and runs first over the
cache prefix, then over the tree's keys:

  steps [0, P)       cache blocks [i * block_kv, (i + 1) * block_kv), P = ceil(S / block_kv). A block
                     that starts at or past the row's length is skipped by `pl.when`, and its index
                     map clamps to the row's last prefix block, so the pipeline issues no new DMA.
  steps [P, P + T)   tree blocks of the gathered tree keys (see layout.py), masked by the tree mask.

One grid step loads a [block_kv, K * D] slab of the cache (all KV heads, one contiguous DMA; the full
last dim keeps the block legal for any K and D) and serves every query head: the G query heads of a
KV head are folded into the rows of that head's [block_q, D] query tile, and a static loop runs the K
heads. The row lengths arrive by scalar prefetch (SMEM), so index maps can read them; the running
max, sum and accumulator live in VMEM scratch across the KV steps.

Head dims: the per-head lane slices of the slab are tile-aligned when D is a multiple of 128 (Llama,
Qwen, Mistral) or there is one KV head; other head dims lower, but the backend default dispatch
sends them to the reference until they are validated on TPU hardware.

NaN safety: scores of invisible keys are replaced (`where`, never multiplied) and cache values past
the row's length are zeroed before the p @ v product, so NaN in unused slots cannot reach the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import layout
from pallas_kernels.block_sizes import BlockSizes

_MASKED = -1e30  # finite, so exp(m_prev - m_next) never sees inf - inf
_LANES = 128  # running max / sum are kept lane-replicated, [rows, 128], a native TPU tile shape


def _attention_kernel(lengths_ref, q_ref, k_ref, v_ref, kt_ref, vt_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref,
                      *, num_kv_heads: int, head_dim: int, block_kv: int, prefix_steps: int, tree_steps: int,
                      scale: float):
    # q_ref [K, bq, D]; k_ref / v_ref [bkv, K*D] (cache slab); kt_ref / vt_ref [K, bt, D] (tree keys);
    # mask_ref [bq, bt] int32; o_ref [K, bq, D]; scratch m_ref / l_ref [K, bq, 128], acc_ref [K, bq, D].
    b = pl.program_id(0)
    step = pl.program_id(2)
    length = lengths_ref[b]
    block_q = q_ref.shape[1]

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def accumulate(h, k, v, visible):
        q = q_ref[h]  # [bq, D]
        if k.dtype != q.dtype:
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [bq, bk]
        s = jnp.where(visible, s * scale, _MASKED)
        m_prev = m_ref[h]  # [bq, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 128]
        p = jnp.where(visible, jnp.exp(s - m_next[:, :1]), 0.0)  # [bq, bk]
        alpha = jnp.exp(m_prev - m_next)  # [bq, 128]
        l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[h] = m_next
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [bq, D]
        acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv

    start = step * block_kv

    @pl.when((step < prefix_steps) & (start < length))
    def _prefix():
        bk = k_ref.shape[0]
        visible = jax.lax.broadcasted_iota(jnp.int32, (block_q, bk), 1) + start < length  # [bq, bkv]
        live = jax.lax.broadcasted_iota(jnp.int32, (bk, head_dim), 0) + start < length  # [bkv, D]
        for h in range(num_kv_heads):
            k = k_ref[:, h * head_dim:(h + 1) * head_dim]  # [bkv, D]
            v = v_ref[:, h * head_dim:(h + 1) * head_dim]
            accumulate(h, k, jnp.where(live, v, jnp.zeros((), v.dtype)), visible)

    @pl.when(step >= prefix_steps)
    def _tree():
        visible = mask_ref[...] != 0  # [bq, bt]; padding rows and keys are 0
        for h in range(num_kv_heads):
            accumulate(h, kt_ref[h], vt_ref[h], visible)

    @pl.when(step == prefix_steps + tree_steps - 1)
    def _finish():
        for h in range(num_kv_heads):
            o_ref[h] = layout.finish(acc_ref[h], l_ref[h][:, :1], o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def tree_attention_tpu(q, k_cache, v_cache, lengths, tree_mask, *, block_sizes: BlockSizes | None = None,
                       interpret=False):
    """Tree attention, TPU kernel. Same contract as `tree_attention_reference`.

    interpret: False (compile with Mosaic), True (Pallas' generic interpreter) or a
    `pltpu.InterpretParams()` (the TPU interpreter, which also models DMAs and VMEM).
    """
    b, n, m, s, k, g, d = layout.check_inputs(q, k_cache, v_cache, lengths, tree_mask)
    bs = block_sizes or BlockSizes.tpu_default()
    rows = n * g
    block_q = min(bs.block_q, layout.round_up(rows, 8))
    rows_padded = layout.round_up(rows, block_q)
    block_kv = bs.block_kv if s >= bs.block_kv else s  # a short cache is one whole-dim block
    prefix_steps = layout.cdiv(s, block_kv)
    block_tree = min(bs.block_kv, layout.round_up(m, 128))
    tree_steps = layout.cdiv(m, block_tree)
    m_padded = tree_steps * block_tree
    if not interpret and tree_steps > 1 and block_tree % 128:
        raise ValueError(f"TPU tree blocks must be multiples of 128 lanes when the tree ({m} keys) spans several "
                         f"blocks; got block_kv={bs.block_kv}")

    lengths = layout.as_lengths(lengths)
    q_rows = layout.fold_queries(q, k, rows_padded)  # [B, K, R', D]
    k_tree = layout.tree_keys(k_cache, lengths, m, m_padded)  # [B, K, M', D]
    v_tree = layout.tree_keys(v_cache, lengths, m, m_padded)
    mask = layout.row_mask(tree_mask, lengths, s, g, rows_padded, m_padded)  # [B, R', M']
    k_slab = k_cache.reshape(b, s, k * d)  # free: heads are already contiguous per slot
    v_slab = v_cache.reshape(b, s, k * d)

    def rows_map(bi, qi, i, lens):
        return bi, 0, qi, 0

    def cache_map(bi, qi, i, lens):
        # The row's last prefix block; lax.div truncates like floor here (non-negative operands)
        # and, unlike `//`, needs no sign fix-up in the scalar core.
        last = jnp.maximum(jax.lax.div(lens[bi] + block_kv - 1, block_kv) - 1, 0)
        return bi, jnp.minimum(i, last), 0

    def tree_map(bi, qi, i, lens):
        return bi, 0, jnp.clip(i - prefix_steps, 0, tree_steps - 1), 0

    def mask_map(bi, qi, i, lens):
        return bi, qi, jnp.clip(i - prefix_steps, 0, tree_steps - 1)

    kernel = functools.partial(_attention_kernel, num_kv_heads=k, head_dim=d, block_kv=block_kv,
                               prefix_steps=prefix_steps, tree_steps=tree_steps, scale=float(d) ** -0.5)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, rows_padded // block_q, prefix_steps + tree_steps),
        in_specs=[
            pl.BlockSpec((None, k, block_q, d), rows_map),
            pl.BlockSpec((None, block_kv, k * d), cache_map),
            pl.BlockSpec((None, block_kv, k * d), cache_map),
            pl.BlockSpec((None, k, block_tree, d), tree_map),
            pl.BlockSpec((None, k, block_tree, d), tree_map),
            pl.BlockSpec((None, block_q, block_tree), mask_map),
        ],
        out_specs=pl.BlockSpec((None, k, block_q, d), rows_map),
        scratch_shapes=[
            pltpu.VMEM((k, block_q, _LANES), jnp.float32),  # running max
            pltpu.VMEM((k, block_q, _LANES), jnp.float32),  # running sum
            pltpu.VMEM((k, block_q, d), jnp.float32),  # accumulator
        ],
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, k, rows_padded, d), q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tree_attention_tpu",
    )(lengths, q_rows, k_slab, v_slab, k_tree, v_tree, mask)
    return layout.unfold_rows(out, n, g)
