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

Sliding window (`key_starts`): each query row's first visible slot arrives as one more input, [bq, 1]
per tile, and prefix slots before it are masked. The tiles' earliest starts are scalar-prefetched too:
the contiguous kernel's index map clamps to the block holding its tile's earliest start, so blocks wholly
before the window cost neither a DMA nor compute (the paged kernel skips their compute only).

Paged caches (`paged_tree_attention_tpu`): the prefix steps read pool blocks instead of cache slabs. The
block table arrives by scalar prefetch too, re-encoded per step (`_paged_steps`) so that an index map
names the block to DMA directly; a grid step takes `sub_blocks` whole pool blocks, each its own input
and BlockSpec (one DMA each), so BlockSizes.block_kv must be a multiple of the pool's block size. Steps
past the row's length and -1 table entries repeat the block already in VMEM (no DMA, never a -1
address); a -1 entry inside the prefix reads as zeros, as in the gathered reference.
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
_MAX_SUB_BLOCKS = 8  # default cap on pool blocks per grid step of the paged kernel


def _attention_kernel(lengths_ref, *refs, paged: bool, windowed: bool, sub_blocks: int, num_kv_heads: int,
                      head_dim: int, block_kv: int, prefix_steps: int, tree_steps: int, scale: float):
    # Scalar prefetch: lengths_ref [B]; when windowed, lows_ref [B * row tiles] (each tile's earliest
    # first slot); when paged, steps_ref [B * prefix_steps * sub_blocks] (see `_paged_steps`). Then q_ref
    # [K, bq, D]; sub_blocks k refs, then as many v refs, each [bkv, K*D] (a cache slab, or one pool
    # block); kt_ref / vt_ref [K, bt, D] (tree keys); mask_ref [bq, bt] int32; when windowed, starts_ref
    # [bq, 1] int32; o_ref [K, bq, D]; scratch m_ref / l_ref [K, bq, 128], acc_ref [K, bq, D].
    if windowed:
        lows_ref, refs = refs[0], refs[1:]
    if paged:
        steps_ref, refs = refs[0], refs[1:]
    q_ref, k_refs, v_refs = refs[0], refs[1:1 + sub_blocks], refs[1 + sub_blocks:1 + 2 * sub_blocks]
    kt_ref, vt_ref, mask_ref = refs[1 + 2 * sub_blocks:4 + 2 * sub_blocks]
    if windowed:
        starts_ref, refs = refs[4 + 2 * sub_blocks], refs[:4 + 2 * sub_blocks] + refs[5 + 2 * sub_blocks:]
    o_ref, m_ref, l_ref, acc_ref = refs[4 + 2 * sub_blocks:]
    b = pl.program_id(0)
    step = pl.program_id(2)
    length = lengths_ref[b]
    low = lows_ref[b * pl.num_programs(1) + pl.program_id(1)] if windowed else 0
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

    def prefix_block(j):
        index = step * sub_blocks + j  # logical KV block
        start = index * block_kv

        needed = (step < prefix_steps) & (start < length)
        if windowed:
            needed = needed & (start + k_refs[j].shape[0] > low)

        @pl.when(needed)
        def _prefix():
            # Slots [start, kept) hold data: all of the prefix in the block, or none when the row holds
            # no pool block there (it reads as zeros: visible, score 0, value 0).
            kept = length
            if paged:
                kept = jnp.where(steps_ref[b * prefix_steps * sub_blocks + index] >= 0, length, start)
            bk = k_refs[j].shape[0]
            slot = jax.lax.broadcasted_iota(jnp.int32, (block_q, bk), 1) + start
            visible = slot < length  # [bq, bkv]
            if windowed:
                visible = visible & (slot >= starts_ref[...])
            live = jax.lax.broadcasted_iota(jnp.int32, (bk, head_dim), 0) + start < kept  # [bkv, D]
            for h in range(num_kv_heads):
                k = k_refs[j][:, h * head_dim:(h + 1) * head_dim]  # [bkv, D]
                v = v_refs[j][:, h * head_dim:(h + 1) * head_dim]
                if paged:
                    k = jnp.where(live, k, jnp.zeros((), k.dtype))
                accumulate(h, k, jnp.where(live, v, jnp.zeros((), v.dtype)), visible)

    for j in range(sub_blocks):
        prefix_block(j)

    @pl.when(step >= prefix_steps)
    def _tree():
        visible = mask_ref[...] != 0  # [bq, bt]; padding rows and keys are 0
        for h in range(num_kv_heads):
            accumulate(h, kt_ref[h], vt_ref[h], visible)

    @pl.when(step == prefix_steps + tree_steps - 1)
    def _finish():
        for h in range(num_kv_heads):
            o_ref[h] = layout.finish(acc_ref[h], l_ref[h][:, :1], o_ref.dtype)


def _row_tiles(rows: int, m: int, block_sizes: BlockSizes, interpret):
    """(block_q, rows padded, tree tile, tree steps, M padded) for R = rows query rows and M tree keys."""
    block_q = min(block_sizes.block_q, layout.round_up(rows, 8))
    block_tree = min(block_sizes.block_kv, layout.round_up(m, 128))
    tree_steps = layout.cdiv(m, block_tree)
    if not interpret and tree_steps > 1 and block_tree % 128:
        raise ValueError(f"TPU tree blocks must be multiples of 128 lanes when the tree ({m} keys) spans several "
                         f"blocks; got block_kv={block_sizes.block_kv}")
    return block_q, layout.round_up(rows, block_q), block_tree, tree_steps, tree_steps * block_tree


def _attention_call(scalars, q_rows, ks, vs, kv_specs, k_tree, v_tree, mask, starts, *, paged, block_kv,
                    prefix_steps, block_q, block_tree, tree_steps, interpret, name):
    """The pallas_call both entry points share: q_rows [B, K, R', D]; ks / vs the cache inputs of the
    kernel's sub-blocks with their BlockSpecs kv_specs; starts [B, R', 1] or None (no window; else the
    scalars hold the tiles' earliest starts after the lengths); returns [B, K, R', D]."""
    b, k, rows_padded, d = q_rows.shape

    def rows_map(bi, qi, i, *_):
        return bi, 0, qi, 0

    def tree_map(bi, qi, i, *_):
        return bi, 0, jnp.clip(i - prefix_steps, 0, tree_steps - 1), 0

    def mask_map(bi, qi, i, *_):
        return bi, qi, jnp.clip(i - prefix_steps, 0, tree_steps - 1)

    windowed = starts is not None
    kernel = functools.partial(_attention_kernel, paged=paged, windowed=windowed, sub_blocks=len(ks),
                               num_kv_heads=k, head_dim=d,
                               block_kv=block_kv, prefix_steps=prefix_steps, tree_steps=tree_steps,
                               scale=float(d) ** -0.5)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(b, rows_padded // block_q, prefix_steps + tree_steps),
        in_specs=[
            pl.BlockSpec((None, k, block_q, d), rows_map),
            *kv_specs, *kv_specs,
            pl.BlockSpec((None, k, block_tree, d), tree_map),
            pl.BlockSpec((None, k, block_tree, d), tree_map),
            pl.BlockSpec((None, block_q, block_tree), mask_map),
            *([pl.BlockSpec((None, block_q, 1), lambda bi, qi, i, *_: (bi, qi, 0))] if windowed else []),
        ],
        out_specs=pl.BlockSpec((None, k, block_q, d), rows_map),
        scratch_shapes=[
            pltpu.VMEM((k, block_q, _LANES), jnp.float32),  # running max
            pltpu.VMEM((k, block_q, _LANES), jnp.float32),  # running sum
            pltpu.VMEM((k, block_q, d), jnp.float32),  # accumulator
        ],
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, k, rows_padded, d), q_rows.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=name,
    )(*scalars, q_rows, *ks, *vs, k_tree, v_tree, mask, *([starts] if windowed else []))


def _window_operands(key_starts, g: int, rows_padded: int, block_q: int):
    """(starts [B, R', 1], each row tile's earliest start [B * R' / bq]) of a sliding window, or (None, None)."""
    if key_starts is None:
        return None, None
    rows = layout.row_starts(key_starts, g, rows_padded)  # [B, R']
    lows = jnp.min(rows.reshape(rows.shape[0], rows_padded // block_q, block_q), axis=2).reshape(-1)
    return rows[:, :, None], lows


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def tree_attention_tpu(q, k_cache, v_cache, lengths, tree_mask, *, key_starts=None,
                       block_sizes: BlockSizes | None = None, interpret=False):
    """Tree attention, TPU kernel. Same contract as `tree_attention_reference`.

    interpret: False (compile with Mosaic), True (Pallas' generic interpreter) or a
    `pltpu.InterpretParams()` (the TPU interpreter, which also models DMAs and VMEM).
    """
    b, n, m, s, k, g, d = layout.check_inputs(q, k_cache, v_cache, lengths, tree_mask)
    layout.check_key_starts(key_starts, b, n)
    bs = block_sizes or BlockSizes.tpu_default()
    block_q, rows_padded, block_tree, tree_steps, m_padded = _row_tiles(n * g, m, bs, interpret)
    block_kv = bs.block_kv if s >= bs.block_kv else s  # a short cache is one whole-dim block

    lengths = layout.as_lengths(lengths)
    q_rows = layout.fold_queries(q, k, rows_padded)  # [B, K, R', D]
    k_tree = layout.tree_keys(k_cache, lengths, m, m_padded)  # [B, K, M', D]
    v_tree = layout.tree_keys(v_cache, lengths, m, m_padded)
    mask = layout.row_mask(tree_mask, lengths, s, g, rows_padded, m_padded)  # [B, R', M']

    starts, lows = _window_operands(key_starts, g, rows_padded, block_q)

    def cache_map(bi, qi, i, lens, *window):
        # The row's last prefix block; lax.div truncates like floor here (non-negative operands)
        # and, unlike `//`, needs no sign fix-up in the scalar core.
        last = jnp.maximum(jax.lax.div(lens[bi] + block_kv - 1, block_kv) - 1, 0)
        if window:  # blocks before the tile's window repeat its first block: no DMA
            first = jax.lax.div(window[0][bi * (rows_padded // block_q) + qi], block_kv)
            i = jnp.maximum(i, first)
        return bi, jnp.minimum(i, last), 0

    slab_spec = pl.BlockSpec((None, block_kv, k * d), cache_map)
    out = _attention_call(
        (lengths,) + (() if lows is None else (lows,)), q_rows, [k_cache.reshape(b, s, k * d)],
        [v_cache.reshape(b, s, k * d)], [slab_spec], k_tree, v_tree, mask, starts, paged=False, block_kv=block_kv,
        prefix_steps=layout.cdiv(s, block_kv),
        block_q=block_q, block_tree=block_tree, tree_steps=tree_steps, interpret=interpret, name="tree_attention_tpu")
    return layout.unfold_rows(out, n, g)  # (reshapes above are free: heads are contiguous per slot)


def _paged_steps(table, lengths, block: int, sub_blocks: int):
    """[B, W] table -> [B * W] int32: what sub-block j of prefix step i reads for row b, at b * W + i * r + j.

    A block the row holds and needs (its first slot before the length) is stored as its pool index
    e >= 0. Any other entry is stored as -1 - e, where e is the block already in sub-block j's VMEM
    buffer (its last needed block before step i, else its first one, else whatever the table or pool
    block 0 offers), so the pipeline starts no DMA for it and a -1 table entry is never used as an
    address. Index maps decode max(x, -1 - x).
    """
    b, w = table.shape
    position = jnp.arange(w, dtype=jnp.int32).reshape(1, w // sub_blocks, sub_blocks)
    table = table.reshape(b, w // sub_blocks, sub_blocks)
    use = (table >= 0) & (position * block < lengths[:, None, None])
    last = jax.lax.cummax(jnp.where(use, position, -1), axis=1)  # per sub-block: its latest needed block
    first = jnp.argmax(use, axis=1).astype(jnp.int32)[:, None, :] * sub_blocks + position[:, :1]
    source = jnp.where(last >= 0, last, first).reshape(b, w)
    held = jnp.maximum(jnp.take_along_axis(table.reshape(b, w), source, axis=1), 0)
    return jnp.where(use.reshape(b, w), held, -1 - held).reshape(-1)


def paged_tiles(block: int, entries: int, block_sizes: BlockSizes | None) -> int:
    """Pool blocks per KV grid step of the paged TPU kernel.

    Each step reads whole pool blocks, one DMA each: block_sizes.block_kv must be a multiple of the pool
    block size (block_kv / block blocks per step). Without block_sizes, steps cover up to 256 slots in
    at most _MAX_SUB_BLOCKS blocks (each is an unrolled copy of the step's body).
    """
    if block_sizes is None:
        per_step = max(1, min(_MAX_SUB_BLOCKS, BlockSizes.tpu_default().block_kv // block))
    elif block_sizes.block_kv % block:
        raise ValueError(f"paged TPU kernel: BlockSizes.block_kv={block_sizes.block_kv} must be a multiple of the "
                         f"pool's block size {block} (each grid step reads whole pool blocks)")
    else:
        per_step = block_sizes.block_kv // block
    return min(per_step, entries)


@functools.partial(jax.jit, static_argnames=("window", "block_sizes", "interpret"))
def paged_tree_attention_tpu(q, k_pool, v_pool, block_table, lengths, tree_mask, *, window: int | None = None,
                             key_starts=None, block_sizes: BlockSizes | None = None, interpret=False):
    """Tree attention over a paged cache, TPU kernel; same contract as `paged_tree_attention_reference`.

    The block table is scalar-prefetched and the prefix blocks are DMA'd straight from the pool by the
    BlockSpec index maps (no contiguous copy); see `paged_tiles` for the block-size rule.
    """
    b, n, m, s, k, g, d, block, entries = layout.check_paged_inputs(q, k_pool, v_pool, block_table, lengths,
                                                                     tree_mask, window)
    layout.check_key_starts(key_starts, b, n)
    sub_blocks = paged_tiles(block, entries, block_sizes)
    bs = block_sizes or BlockSizes.tpu_default()
    block_q, rows_padded, block_tree, tree_steps, m_padded = _row_tiles(n * g, m, bs, interpret)
    prefix_steps = layout.cdiv(entries, sub_blocks)
    width = prefix_steps * sub_blocks

    lengths, table, q_rows, k_tree, v_tree, mask = layout.paged_operands(
        q, k_pool, v_pool, block_table, lengths, tree_mask, entries=entries, num_slots=s, rows_padded=rows_padded,
        m_padded=m_padded)
    prefix = jnp.minimum(lengths, s)  # no slot past the window is read, whatever the lengths say
    table = jnp.pad(table, ((0, 0), (0, width - entries)), constant_values=-1)
    steps = _paged_steps(table, prefix, block, sub_blocks)

    starts, lows = _window_operands(key_starts, g, rows_padded, block_q)

    def pool_map(j):
        def index(bi, qi, i, lens, *refs):
            steps_ref = refs[-1]
            e = steps_ref[bi * width + jnp.minimum(i, prefix_steps - 1) * sub_blocks + j]
            return jnp.maximum(e, -1 - e), 0, 0
        return pl.BlockSpec((None, block, k * d), index)

    p = k_pool.shape[0]
    out = _attention_call(
        (prefix,) + (() if lows is None else (lows,)) + (steps,), q_rows,
        [k_pool.reshape(p, block, k * d)] * sub_blocks,
        [v_pool.reshape(p, block, k * d)] * sub_blocks, [pool_map(j) for j in range(sub_blocks)], k_tree, v_tree,
        mask, starts, paged=True, block_kv=block, prefix_steps=prefix_steps, block_q=block_q, block_tree=block_tree,
        tree_steps=tree_steps, interpret=interpret, name="paged_tree_attention_tpu")
    return layout.unfold_rows(out, n, g)
