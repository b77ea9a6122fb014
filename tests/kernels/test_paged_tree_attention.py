"""Paged tree attention (K / V in a block pool read through a block table) against the contiguous reference.

Every case scatters the rows' blocks over the pool in random order, gives rows different numbers of
blocks (a row holding none at all, like the engine's padding rows, and -1 entries past and, once,
inside a prefix), fills the pool's free blocks and every slot past a row's tree with NaN, and checks
the paged reference against `tree_attention_reference` on a contiguous cache assembled here in numpy,
then the TPU and GPU kernels (Pallas interpret mode) against that. Shapes are small: interpret mode
is slow.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

from eagle_jax.compiling import quick_options
from pallas_kernels import (BlockSizes, gather_blocks, paged_tree_attention, paged_tree_attention_reference,
                            tree_attention_reference, use_implementation)
from pallas_kernels.gpu import paged_tree_attention_gpu
from pallas_kernels.tpu import paged_tree_attention_tpu

KV_HEADS = 2
SPARE_BLOCKS = 5  # free pool blocks (NaN) besides the held ones; pool block 0 is always free
KERNELS = {"tpu": paged_tree_attention_tpu, "gpu": paged_tree_attention_gpu}


def random_tree_masks(rng, batch: int, n: int) -> np.ndarray:
    """[B, N, N] ancestor masks of random trees (node i's parent is a random earlier node)."""
    masks = np.zeros((batch, n, n), bool)
    for r in range(batch):
        for i in range(n):
            if i:
                masks[r, i] = masks[r, rng.integers(0, i)]
            masks[r, i, i] = True
    return masks


def causal(batch: int, n: int) -> np.ndarray:
    return np.broadcast_to(np.tril(np.ones((n, n), bool)), (batch, n, n)).copy()


def make_paged(seed, lengths, n, g, d, dtype, *, block, entries, m=None, mask="tree", hole_in_prefix=False):
    """(q, k_pool, v_pool, table, lengths, mask) and the contiguous (k, v) caches they stand for.

    Row r holds enough blocks for its length plus the tree (row 0 none when its length is 0, others
    a random number more), in random pool order; the rest of its table is -1.
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    b, m = len(lengths), n if m is None else m
    needed = [-(-(length + m) // block) for length in lengths]
    held = [0 if (r == 0 and lengths[0] == 0) else min(entries, need + int(rng.integers(0, 3)))
            for r, need in enumerate(needed)]
    pool_blocks = sum(held) + SPARE_BLOCKS
    ids = iter(1 + rng.permutation(pool_blocks - 1))
    table = np.full((b, entries), -1, np.int32)
    for r in range(b):
        table[r, :held[r]] = [next(ids) for _ in range(held[r])]
    if hole_in_prefix:  # a block inside the longest row's prefix that the row does not hold: reads zeros
        r = int(np.argmax(lengths))
        assert lengths[r] > 2 * block
        table[r, 1] = -1
    k_pool = rng.normal(size=(pool_blocks, block, KV_HEADS, d)).astype(np.float32)
    v_pool = rng.normal(size=k_pool.shape).astype(np.float32)
    free = np.setdiff1d(np.arange(pool_blocks), table[table >= 0])
    k_pool[free], v_pool[free] = np.nan, np.nan
    k = np.zeros((b, entries * block, KV_HEADS, d), np.float32)
    v = np.zeros_like(k)
    for r in range(b):
        for j in np.flatnonzero(table[r] >= 0):
            for pool, cache in ((k_pool, k), (v_pool, v)):
                cache[r, j * block:(j + 1) * block] = pool[table[r, j]]
                past = max(lengths[r] + m - j * block, 0)  # slots past the row's tree: NaN
                pool[table[r, j], past:] = np.nan
                cache[r, max(j * block, lengths[r] + m):(j + 1) * block] = np.nan
    if isinstance(mask, str):
        mask = random_tree_masks(rng, b, n) if mask == "tree" else causal(b, n)
    q = rng.normal(size=(b, n, KV_HEADS * g, d)).astype(np.float32)
    paged = (jnp.asarray(q, dtype), jnp.asarray(k_pool, dtype), jnp.asarray(v_pool, dtype), jnp.asarray(table),
             jnp.asarray(lengths), jnp.asarray(mask))
    return paged, (jnp.asarray(k, dtype), jnp.asarray(v, dtype))


def contiguous_reference(paged, caches, window):
    q, _, _, _, lengths, mask = paged
    k, v = (c if window is None else c[:, :window] for c in caches)
    return tree_attention_reference(q, k, v, lengths, mask)


def assert_close(out, ref, dtype, tol=None):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    tol = tol or {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


# (lengths, N, M, G, D, dtype, pool block, table entries, window, mask, hole in the prefix)
CASES = {
    "decode-gqa": ([0, 21, 37], 1, None, 4, 64, jnp.float32, 8, 8, None, "causal", False),
    "tree-window": ([21, 0, 30], 5, None, 2, 64, jnp.float32, 8, 10, 40, "tree", False),
    "tree-mha-bf16": ([37, 5], 16, None, 1, 128, jnp.bfloat16, 16, 5, None, "tree", False),
    "prefill-hole": ([0, 16, 40], 12, None, 3, 64, jnp.float32, 16, 5, 64, "causal", True),
    "frontier": ([9, 33, 20], 4, 12, 3, 64, jnp.float32, 12, 5, 50, None, False),
}
KERNEL_CASES = ["decode-gqa", "tree-window", "prefill-hole", "frontier"]


def case_inputs(name):
    lengths, n, m, g, d, dtype, block, entries, window, mask, hole = CASES[name]
    if mask is None:  # draft frontier: 4 queries, 12 tree keys, each query sees a random ancestor set
        rng = np.random.default_rng(5)
        mask = rng.random((len(lengths), n, m)) < 0.4
        mask[:, np.arange(n), m - n + np.arange(n)] = True
    paged, caches = make_paged(sorted(CASES).index(name), lengths, n, g, d, dtype, block=block, entries=entries,
                               m=m, mask=mask, hole_in_prefix=hole)
    return paged, caches, window, dtype


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_equals_tree_attention_on_the_gathered_cache(name):
    paged, caches, window, dtype = case_inputs(name)
    ref = contiguous_reference(paged, caches, window)
    assert_close(paged_tree_attention_reference(*paged, window=window), ref, dtype, tol=1e-6)
    assert_close(paged_tree_attention(*paged, window=window), ref, dtype)  # CPU: the chunked loop (f32 inside)
    if window is not None:  # slots past the window do not exist: the whole table is another call
        full = contiguous_reference(paged, caches, None)
        assert_close(paged_tree_attention_reference(*paged), full, dtype, tol=1e-6)


def test_gather_blocks_reads_zeros_for_unheld_blocks_and_cuts_to_the_window():
    pool = jnp.arange(3 * 2, dtype=jnp.float32).reshape(3, 2, 1, 1) + 1
    table = jnp.asarray([[2, -1, 0], [-1, 1, -1]], jnp.int32)
    rows = np.asarray(gather_blocks(pool, table))[..., 0, 0]
    np.testing.assert_array_equal(rows, [[5, 6, 0, 0, 1, 2], [0, 0, 3, 4, 0, 0]])
    np.testing.assert_array_equal(np.asarray(gather_blocks(pool, table, 3))[..., 0, 0], rows[:, :3])
    assert gather_blocks(pool, table, 100).shape[1] == 6  # a window past the table sees the table


@functools.cache
def interpreted(name, block_sizes):
    return jax.jit(functools.partial(KERNELS[name], block_sizes=block_sizes, interpret=True),
                   static_argnames=("window",), compiler_options=quick_options())


@pytest.mark.parametrize("name", ["tpu", "gpu"])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_interpreted_kernels_match_the_reference(name, case):
    # block_kv 16 over pool blocks of 8 (two per TPU grid step), 16 (one) and 12 (GPU only: its tiles
    # gather rows, so they need not line up with the pool's blocks; the TPU runs 12 with its default).
    paged, caches, window, dtype = case_inputs(case)
    block = paged[1].shape[1]
    sizes = None if (name == "tpu" and 16 % block) else BlockSizes(block_q=16, block_kv=16, kv_splits=2)
    out = interpreted(name, sizes)(*paged, window=window)
    assert_close(out, contiguous_reference(paged, caches, window), dtype)


@pytest.mark.skipif(not hasattr(pltpu, "InterpretParams"), reason="this JAX has no TPU interpreter")
def test_tpu_kernel_under_the_tpu_interpreter_matches_reference():
    # The TPU interpreter models the DMAs the index maps start and poisons memory never written.
    paged, caches, window, dtype = case_inputs("prefill-hole")
    out = paged_tree_attention_tpu(*paged, window=window, block_sizes=BlockSizes(16, 32),
                                   interpret=pltpu.InterpretParams())
    assert_close(out, contiguous_reference(paged, caches, window), dtype)


@pytest.mark.parametrize("sub_blocks", [1, 2, 4])
def test_tpu_index_maps_never_address_a_missing_block_nor_reload_past_the_prefix(sub_blocks):
    # What the paged TPU kernel's index maps decode, per row and sub-block buffer: a pool block (never a
    # -1 entry), the table's block at every step that needs it, and no change (so no DMA) elsewhere.
    steps_of = sys.modules["pallas_kernels.tpu"]._paged_steps
    rng = np.random.default_rng(sub_blocks)
    table = np.where(rng.random((6, 8)) < 0.25, -1, rng.permutation(60)[:48].reshape(6, 8)).astype(np.int32)
    table[0] = -1
    lengths = np.asarray([0, 0, 5, 17, 40, 64], np.int32)
    encoded = np.asarray(steps_of(jnp.asarray(table), jnp.asarray(lengths), 8, sub_blocks)).reshape(6, 8)
    decoded = np.maximum(encoded, -1 - encoded)
    needed = (table >= 0) & (np.arange(8)[None, :] * 8 < lengths[:, None])
    assert np.all(decoded >= 0) and np.all((encoded >= 0) == needed)
    np.testing.assert_array_equal(decoded[needed], table[needed])
    for lane in range(sub_blocks):
        seq, need = decoded[:, lane::sub_blocks], needed[:, lane::sub_blocks]
        assert np.all((seq[:, 1:] == seq[:, :-1]) | need[:, 1:])


def test_dispatch_follows_tree_attention():
    paged, caches, window, dtype = case_inputs("tree-window")
    ref = contiguous_reference(paged, caches, window)

    def jaxpr(**kwargs):
        return str(jax.make_jaxpr(lambda *a: paged_tree_attention(*a, window=window, **kwargs))(*paged))

    if jax.default_backend() == "cpu":
        assert "pallas_call" not in jaxpr()
    for name in ("tpu", "gpu"):
        with use_implementation(name, interpret=True, block_sizes=BlockSizes(16, 16)):
            assert f"paged_tree_attention_{name}" in jaxpr()
            assert_close(paged_tree_attention(*paged, window=window), ref, dtype)
        assert f"paged_tree_attention_{name}" in jaxpr(implementation=name, interpret=True)
    with use_implementation("tpu", interpret=True):  # an explicit implementation wins over the forced one
        assert "pallas_call" not in jaxpr(implementation="reference")
    with pytest.raises(ValueError, match="implementation"):
        paged_tree_attention(*paged, implementation="cuda")


def test_backend_default_falls_back_to_the_reference_for_head_shapes_a_kernel_does_not_take(monkeypatch):
    module = sys.modules["pallas_kernels.tree_attention"]
    paged, _, window, _ = case_inputs("tree-window")
    q, k_pool, v_pool, table, lengths, mask = paged
    for backend, d, kernel in [("gpu", 64, True), ("gpu", 48, False), ("tpu", 128, True), ("tpu", 64, False)]:
        monkeypatch.setattr(module, "default_implementation", lambda: backend)
        shapes = [jax.ShapeDtypeStruct(x.shape[:-1] + (d,), x.dtype) for x in (q, k_pool, v_pool)]
        text = str(jax.make_jaxpr(lambda *a: paged_tree_attention(*a, window=window))(*shapes, table, lengths, mask))
        assert ("pallas_call" in text) == kernel, (backend, d)


def test_tile_and_pool_block_mismatch_raises_a_clear_error():
    paged, _, window, _ = case_inputs("frontier")  # pool blocks of 12 slots
    with pytest.raises(ValueError, match=r"block_kv=16 must be a multiple of the pool's block size 12"):
        paged_tree_attention_tpu(*paged, window=window, block_sizes=BlockSizes(16, 16), interpret=True)
    with pytest.raises(ValueError, match=r"block_kv=16 must be a multiple of the pool's block size 12"):
        with use_implementation("tpu", interpret=True, block_sizes=BlockSizes(16, 16)):
            paged_tree_attention(*paged, window=window)
    q, k_pool, v_pool, table, lengths, mask = paged
    with pytest.raises(ValueError, match="block_table"):
        paged_tree_attention_gpu(q, k_pool, v_pool, table[:2], lengths, mask, interpret=True)
    with pytest.raises(ValueError, match="v_pool"):
        paged_tree_attention_reference(q, k_pool, v_pool[:, :6], table, lengths, mask)
    with pytest.raises(ValueError, match="window"):
        paged_tree_attention_reference(q, k_pool, v_pool, table, lengths, mask, window=0)


def _lower(fn, platform, *shapes, **kwargs):
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []
    return export.export(jax.jit(functools.partial(fn, **kwargs)), platforms=[platform],
                         disabled_checks=checks)(*shapes).mlir_module()


@pytest.mark.parametrize("n, g, block, window", [(1, 4, 16, None), (64, 4, 128, 2048), (16, 3, 8, 1000)])
def test_kernels_lower_for_their_hardware_at_serving_shapes(n, g, block, window):
    # Lowering runs each backend's Pallas rules (Mosaic for TPU, Triton IR for CUDA) without the hardware.
    # Llama-3-8B-like: 8 rows, 8 kv heads, head dim 128, bf16, a 4k-slot table over a shared pool.
    sd, d = jax.ShapeDtypeStruct, 128
    pool = sd((8 * 4096 // block + 7, block, 8, d), jnp.bfloat16)
    shapes = (sd((8, n, 8 * g, d), jnp.bfloat16), pool, pool, sd((8, 4096 // block), jnp.int32),
              sd((8,), jnp.int32), sd((8, n, n), jnp.bool_))
    assert "tpu_custom_call" in _lower(paged_tree_attention_tpu, "tpu", *shapes, window=window)
    assert "triton" in _lower(paged_tree_attention_gpu, "cuda", *shapes, window=window)
