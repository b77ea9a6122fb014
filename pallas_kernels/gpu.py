"""Tree attention on GPU: a Pallas Triton kernel with an online (flash) softmax in f32.

Grid (B, K, row blocks, KV splits). One program owns a [block_q, D] tile of query rows of one KV
head (the G query heads folded into rows, padded to a power of two >= 16: Triton's tensors are powers
of two and its dot operands need >= 16 per side) and one chunk of the cache prefix, and loops over

  * its chunk's [block_kv, D] prefix blocks that lie before the row's length: a `fori_loop` whose
    bounds come from the length, so blocks past it are never visited; loads past the length are
    masked (`other=0`), so NaN in unused slots is never read, and
  * (last split only) the tree's gathered keys (see layout.py) in [block_tree, D] blocks, masked by
    the tree mask.

Splitting the prefix (flash decoding) keeps the GPU busy when B * K * row blocks is small, as in
batch-1 decoding of a long cache: each split writes its unnormalised accumulator with its running
max and sum, and a small jnp epilogue merges the splits. Triton has no scalar prefetch or scratch
refs: lengths are an ordinary input read with one scalar load, and the running max / sum /
accumulator are loop carries (registers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas' Triton backend is deprecated from JAX 0.11 on; keep this module importable without it.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the installed JAX
    plgpu = None

from pallas_kernels import layout
from pallas_kernels.block_sizes import BlockSizes

_MASKED = -1e30  # finite, so exp(m_prev - m_next) never sees inf - inf


def _attention_kernel(lengths_ref, q_ref, k_ref, v_ref, kt_ref, vt_ref, mask_ref, acc_ref, m_ref, l_ref, *,
                      block_kv: int, blocks_per_split: int, block_tree: int, tree_steps: int, scale: float):
    # lengths_ref [B]; q_ref [bq, D]; k_ref / v_ref [S, D] (this row's cache, this head);
    # kt_ref / vt_ref [M', D] (tree keys); mask_ref [bq, M'] int32;
    # outputs (this split): acc_ref [bq, D], m_ref / l_ref [bq], all f32.
    length = lengths_ref[pl.program_id(0)]
    split, num_splits = pl.program_id(3), pl.num_programs(3)
    q = q_ref[...]
    block_q, head_dim = q.shape

    def accumulate(carry, k, v, visible):
        m, l, acc = carry  # [bq], [bq], [bq, D] f32
        if k.dtype != q.dtype:
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [bq, bk]
        s = jnp.where(visible, s * scale, _MASKED)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        alpha = jnp.exp(m - m_next)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_next, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

    def prefix_block(j, carry):
        start = pl.multiple_of(j * block_kv, block_kv)
        live = start + jnp.arange(block_kv, dtype=jnp.int32) < length  # [bkv]
        load_mask = jnp.broadcast_to(live[:, None], (block_kv, head_dim))
        k = plgpu.load(k_ref.at[pl.ds(start, block_kv), :], mask=load_mask, other=0.0)  # [bkv, D]
        v = plgpu.load(v_ref.at[pl.ds(start, block_kv), :], mask=load_mask, other=0.0)
        return accumulate(carry, k, v, jnp.broadcast_to(live[None, :], (block_q, block_kv)))

    def tree_block(t, carry):
        start = pl.multiple_of(t * block_tree, block_tree)
        k = kt_ref[pl.ds(start, block_tree), :]  # [bt, D]; padding keys are zeros
        v = vt_ref[pl.ds(start, block_tree), :]
        visible = mask_ref[:, pl.ds(start, block_tree)] != 0  # [bq, bt]
        return accumulate(carry, k, v, visible)

    carry = (jnp.full((block_q,), _MASKED, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, head_dim), jnp.float32))
    first = split * blocks_per_split
    needed = jax.lax.div(length + block_kv - 1, block_kv)  # prefix blocks the row has
    carry = jax.lax.fori_loop(first, jnp.minimum(first + blocks_per_split, needed), prefix_block, carry)
    tree_trips = jnp.where(split == num_splits - 1, tree_steps, 0)
    m, l, acc = jax.lax.fori_loop(0, tree_trips, tree_block, carry)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _auto_splits(programs: int, prefix_blocks: int) -> int:
    """Enough KV splits for ~2 programs per SM, keeping >= 4 blocks per split; 1 off GPU."""
    if jax.default_backend() != "gpu":
        return 1
    cores = getattr(jax.devices()[0], "core_count", None) or 128
    return max(1, min(layout.cdiv(2 * cores, programs), prefix_blocks // 4))


def merge_splits(acc, m, l, dtype):
    """acc [B, K, P, R', D], m / l [B, K, P, R'] from P prefix splits -> [B, K, R', D] attention."""
    weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # [B, K, P, R']; empty splits weigh 0
    total = jnp.sum(weight * l, axis=2)[..., None]  # [B, K, R', 1]
    return layout.finish(jnp.sum(weight[..., None] * acc, axis=2), total, dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def tree_attention_gpu(q, k_cache, v_cache, lengths, tree_mask, *, block_sizes: BlockSizes | None = None,
                       interpret=False):
    """Tree attention, GPU (Triton) kernel. Same contract as `tree_attention_reference`.

    interpret: False (compile with Triton) or True (Pallas' generic interpreter, any backend).
    """
    b, n, m, s, k, g, d = layout.check_inputs(q, k_cache, v_cache, lengths, tree_mask)
    if plgpu is None:
        raise NotImplementedError("this JAX has no Pallas Triton backend (jax.experimental.pallas.triton)")
    if not interpret and d != layout.next_power_of_two(d):
        raise ValueError(f"the Triton kernel needs a power-of-two head dim, got {d}")
    bs = block_sizes or BlockSizes.gpu_default()
    rows = n * g
    block_q = min(bs.block_q, max(16, layout.next_power_of_two(rows)))
    rows_padded = layout.round_up(rows, block_q)
    row_blocks = rows_padded // block_q
    prefix_blocks = layout.cdiv(s, bs.block_kv)
    splits = min(bs.kv_splits or _auto_splits(b * k * row_blocks, prefix_blocks), prefix_blocks)
    blocks_per_split = layout.cdiv(prefix_blocks, splits)
    splits = layout.cdiv(prefix_blocks, blocks_per_split)  # no split left without blocks
    block_tree = min(bs.block_kv, max(16, layout.next_power_of_two(m)))
    tree_steps = layout.cdiv(m, block_tree)
    m_padded = tree_steps * block_tree

    lengths = layout.as_lengths(lengths)
    q_rows = layout.fold_queries(q, k, rows_padded)  # [B, K, R', D]
    k_tree = layout.tree_keys(k_cache, lengths, m, m_padded)  # [B, K, M', D]
    v_tree = layout.tree_keys(v_cache, lengths, m, m_padded)
    mask = layout.row_mask(tree_mask, lengths, s, g, rows_padded, m_padded)  # [B, R', M']

    kernel = functools.partial(_attention_kernel, block_kv=bs.block_kv, blocks_per_split=blocks_per_split,
                               block_tree=block_tree, tree_steps=tree_steps, scale=float(d) ** -0.5)
    f32 = jnp.float32
    acc, m_run, l_run = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, k, splits, rows_padded, d), f32),
                   jax.ShapeDtypeStruct((b, k, splits, rows_padded), f32),
                   jax.ShapeDtypeStruct((b, k, splits, rows_padded), f32)),
        grid=(b, k, row_blocks, splits),
        in_specs=[
            pl.BlockSpec((b,), lambda bi, h, qi, sp: (0,)),
            pl.BlockSpec((None, None, block_q, d), lambda bi, h, qi, sp: (bi, h, qi, 0)),
            pl.BlockSpec((None, s, None, d), lambda bi, h, qi, sp: (bi, 0, h, 0)),
            pl.BlockSpec((None, s, None, d), lambda bi, h, qi, sp: (bi, 0, h, 0)),
            pl.BlockSpec((None, None, m_padded, d), lambda bi, h, qi, sp: (bi, h, 0, 0)),
            pl.BlockSpec((None, None, m_padded, d), lambda bi, h, qi, sp: (bi, h, 0, 0)),
            pl.BlockSpec((None, block_q, m_padded), lambda bi, h, qi, sp: (bi, qi, 0)),
        ],
        out_specs=(
            pl.BlockSpec((None, None, None, block_q, d), lambda bi, h, qi, sp: (bi, h, sp, qi, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda bi, h, qi, sp: (bi, h, sp, qi)),
            pl.BlockSpec((None, None, None, block_q), lambda bi, h, qi, sp: (bi, h, sp, qi)),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="tree_attention_gpu",
    )(lengths, q_rows, k_cache, v_cache, k_tree, v_tree, mask)
    return layout.unfold_rows(merge_splits(acc, m_run, l_run, q.dtype), n, g)
