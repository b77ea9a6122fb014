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

A sliding window (`key_starts`) adds one input, each query row's first visible slot: prefix tiles mask
slots before it, and the prefix loop starts at the block holding the row tile's earliest start, so
blocks wholly before every row's window are never visited.

Paged caches (`paged_tree_attention_gpu`): the program sees the whole pool of its KV head, [P * block,
D], and its row's block table; a prefix tile loads the table entries of its slots and gathers its rows
(masked past the length and for -1 entries, so no load goes through a -1 entry). Tiles need not line
up with pool blocks: any pool block size works with any block_kv.
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


def _attention_kernel(lengths_ref, *refs, pool_block: int | None, windowed: bool, block_kv: int,
                      blocks_per_split: int, block_tree: int, tree_steps: int, scale: float):
    # lengths_ref [B]; when paged (pool_block set) table_ref [NB'] (this row's block table); q_ref [bq, D];
    # k_ref / v_ref this head's cache: [S, D] (this row) or [P * block, D] (the whole pool);
    # kt_ref / vt_ref [M', D] (tree keys); mask_ref [bq, M'] int32;
    # outputs (this split): acc_ref [bq, D], m_ref / l_ref [bq], all f32. windowed: starts_ref [bq] int32
    # (each row's first visible slot) comes right after the lengths.
    if windowed:
        starts_ref, refs = refs[0], refs[1:]
    if pool_block is not None:
        table_ref, refs = refs[0], refs[1:]
    q_ref, k_ref, v_ref, kt_ref, vt_ref, mask_ref, acc_ref, m_ref, l_ref = refs
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
        slot = start + jnp.arange(block_kv, dtype=jnp.int32)  # [bkv]
        visible = slot < length
        if pool_block is None:
            live, index = visible, (pl.ds(start, block_kv), slice(None))
        else:  # gather the tile's rows through the table; slots of -1 entries read as zeros
            entry = jnp.minimum(jax.lax.div(slot, pool_block), table_ref.shape[0] - 1)  # slot >= 0: floor
            block = plgpu.load(table_ref.at[entry], mask=visible, other=-1)  # [bkv]
            live = visible & (block >= 0)
            row = jnp.maximum(block, 0) * pool_block + jax.lax.rem(slot, pool_block)  # [bkv] pool rows
            # Both indices as arrays (a pointer gather; the interpreter takes no array / slice mix).
            index = (row[:, None], jnp.arange(head_dim, dtype=jnp.int32)[None, :])
        load_mask = jnp.broadcast_to(live[:, None], (block_kv, head_dim))
        k = plgpu.load(k_ref.at[index], mask=load_mask, other=0.0)  # [bkv, D]
        v = plgpu.load(v_ref.at[index], mask=load_mask, other=0.0)
        visible = jnp.broadcast_to(visible[None, :], (block_q, block_kv))
        if windowed:
            visible = visible & (slot[None, :] >= starts_ref[...][:, None])
        return accumulate(carry, k, v, visible)

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
    end = jnp.minimum(first + blocks_per_split, needed)
    if windowed:  # blocks before every row's window hold nothing this tile sees
        first = jnp.maximum(first, jax.lax.div(jnp.min(starts_ref[...]), block_kv))
    carry = jax.lax.fori_loop(first, end, prefix_block, carry)
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


def _tiles(n: int, g: int, m: int, prefix_slots: int, programs: int, bs: BlockSizes):
    """(block_q, rows padded, KV splits, blocks per split, tree tile, tree steps, M padded)."""
    rows = n * g
    block_q = min(bs.block_q, max(16, layout.next_power_of_two(rows)))
    rows_padded = layout.round_up(rows, block_q)
    prefix_blocks = layout.cdiv(prefix_slots, bs.block_kv)
    splits = min(bs.kv_splits or _auto_splits(programs * (rows_padded // block_q), prefix_blocks), prefix_blocks)
    blocks_per_split = layout.cdiv(prefix_blocks, splits)
    splits = layout.cdiv(prefix_blocks, blocks_per_split)  # no split left without blocks
    block_tree = min(bs.block_kv, max(16, layout.next_power_of_two(m)))
    tree_steps = layout.cdiv(m, block_tree)
    return block_q, rows_padded, splits, blocks_per_split, block_tree, tree_steps, tree_steps * block_tree


def _check(d: int, interpret, block_sizes):
    if plgpu is None:
        raise NotImplementedError("this JAX has no Pallas Triton backend (jax.experimental.pallas.triton)")
    if not interpret and d != layout.next_power_of_two(d):
        raise ValueError(f"the Triton kernel needs a power-of-two head dim, got {d}")
    return block_sizes or BlockSizes.gpu_default()


def _attention_call(lengths, starts, table, q_rows, k_cache, v_cache, k_tree, v_tree, mask, *, pool_block, bs,
                    splits, blocks_per_split, block_q, block_tree, tree_steps, interpret, name):
    """The pallas_call both entry points share. q_rows [B, K, R', D]; starts [B, R'] or None (no window);
    caches [B, S, K, D] (table None) or pools viewed as [P * block, K, D] with table [B, NB']; returns the
    splits' (acc, max, sum)."""
    b, k, rows_padded, d = q_rows.shape
    m_padded = k_tree.shape[2]
    if table is None:
        s = k_cache.shape[1]
        cache_spec = [pl.BlockSpec((None, s, None, d), lambda bi, h, qi, sp: (bi, 0, h, 0))]
        tables = []
    else:
        cache_spec = [pl.BlockSpec((k_cache.shape[0], None, d), lambda bi, h, qi, sp: (0, h, 0))]
        tables = [pl.BlockSpec((None, table.shape[1]), lambda bi, h, qi, sp: (bi, 0))]
    windows = [] if starts is None else [pl.BlockSpec((None, block_q), lambda bi, h, qi, sp: (bi, qi))]
    kernel = functools.partial(_attention_kernel, pool_block=pool_block, windowed=starts is not None,
                               block_kv=bs.block_kv,
                               blocks_per_split=blocks_per_split, block_tree=block_tree, tree_steps=tree_steps,
                               scale=float(d) ** -0.5)
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, k, splits, rows_padded, d), f32),
                   jax.ShapeDtypeStruct((b, k, splits, rows_padded), f32),
                   jax.ShapeDtypeStruct((b, k, splits, rows_padded), f32)),
        grid=(b, k, rows_padded // block_q, splits),
        in_specs=[
            pl.BlockSpec((b,), lambda bi, h, qi, sp: (0,)),
            *windows,
            *tables,
            pl.BlockSpec((None, None, block_q, d), lambda bi, h, qi, sp: (bi, h, qi, 0)),
            *cache_spec, *cache_spec,
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
        name=name,
    )(lengths, *([] if starts is None else [starts]), *([] if table is None else [table]), q_rows, k_cache, v_cache,
      k_tree, v_tree, mask)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def tree_attention_gpu(q, k_cache, v_cache, lengths, tree_mask, *, key_starts=None,
                       block_sizes: BlockSizes | None = None, interpret=False):
    """Tree attention, GPU (Triton) kernel. Same contract as `tree_attention_reference`.

    interpret: False (compile with Triton) or True (Pallas' generic interpreter, any backend).
    """
    b, n, m, s, k, g, d = layout.check_inputs(q, k_cache, v_cache, lengths, tree_mask)
    layout.check_key_starts(key_starts, b, n)
    bs = _check(d, interpret, block_sizes)
    block_q, rows_padded, splits, per_split, block_tree, tree_steps, m_padded = _tiles(n, g, m, s, b * k, bs)

    lengths = layout.as_lengths(lengths)
    q_rows = layout.fold_queries(q, k, rows_padded)  # [B, K, R', D]
    k_tree = layout.tree_keys(k_cache, lengths, m, m_padded)  # [B, K, M', D]
    v_tree = layout.tree_keys(v_cache, lengths, m, m_padded)
    mask = layout.row_mask(tree_mask, lengths, s, g, rows_padded, m_padded)  # [B, R', M']
    starts = None if key_starts is None else layout.row_starts(key_starts, g, rows_padded)
    acc, m_run, l_run = _attention_call(
        lengths, starts, None, q_rows, k_cache, v_cache, k_tree, v_tree, mask, pool_block=None, bs=bs, splits=splits,
        blocks_per_split=per_split, block_q=block_q, block_tree=block_tree, tree_steps=tree_steps,
        interpret=interpret, name="tree_attention_gpu")
    return layout.unfold_rows(merge_splits(acc, m_run, l_run, q.dtype), n, g)


@functools.partial(jax.jit, static_argnames=("window", "block_sizes", "interpret"))
def paged_tree_attention_gpu(q, k_pool, v_pool, block_table, lengths, tree_mask, *, window: int | None = None,
                             key_starts=None, block_sizes: BlockSizes | None = None, interpret=False):
    """Tree attention over a paged cache, GPU (Triton) kernel; same contract as
    `paged_tree_attention_reference`.

    Each [block_kv, D] prefix tile gathers its rows from the pool through the row's block table (one
    table load per slot, masked past the length and for -1 entries), so block_kv and the pool's block
    size are independent: any pool block size works.
    """
    b, n, m, s, k, g, d, block, entries = layout.check_paged_inputs(q, k_pool, v_pool, block_table, lengths,
                                                                     tree_mask, window)
    layout.check_key_starts(key_starts, b, n)
    bs = _check(d, interpret, block_sizes)
    block_q, rows_padded, splits, per_split, block_tree, tree_steps, m_padded = _tiles(n, g, m, s, b * k, bs)

    lengths, table, q_rows, k_tree, v_tree, mask = layout.paged_operands(
        q, k_pool, v_pool, block_table, lengths, tree_mask, entries=entries, num_slots=s, rows_padded=rows_padded,
        m_padded=m_padded)
    flat = (k_pool.shape[0] * block, k, d)  # free: a pool block's slots are contiguous
    starts = None if key_starts is None else layout.row_starts(key_starts, g, rows_padded)
    acc, m_run, l_run = _attention_call(
        jnp.minimum(lengths, s), starts, table, q_rows, k_pool.reshape(flat), v_pool.reshape(flat), k_tree, v_tree, mask,
        pool_block=block, bs=bs, splits=splits, blocks_per_split=per_split, block_q=block_q, block_tree=block_tree,
        tree_steps=tree_steps, interpret=interpret, name="paged_tree_attention_gpu")
    return layout.unfold_rows(merge_splits(acc, m_run, l_run, q.dtype), n, g)
