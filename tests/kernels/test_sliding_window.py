"""Sliding-window attention in the kernels: `key_starts` [B, N], each query's first visible prefix slot.

The reference is checked against attention computed here in numpy from its definition; every kernel
(TPU and GPU in Pallas interpret mode, contiguous and paged, and the chunked CPU path for paged caches)
is checked against the reference, with windows that start inside a block, on a block edge, past whole
blocks and at 0, and with NaN in every slot past each row's tree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import BlockSizes, paged_tree_attention, paged_tree_attention_reference, tree_attention_reference
from pallas_kernels.gpu import paged_tree_attention_gpu, tree_attention_gpu
from pallas_kernels.tpu import paged_tree_attention_tpu, tree_attention_tpu

KV_HEADS, G, D = 2, 2, 64
BLOCKS = BlockSizes(block_q=16, block_kv=16, kv_splits=2)


def tree_masks(rng, b, n):
    masks = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            if i:
                masks[r, i] = masks[r, rng.integers(0, i)]
            masks[r, i, i] = True
    return masks


def inputs(seed=0, lengths=(0, 53, 300), n=5, window=40):
    """q, caches (NaN past each tree), lengths, a tree mask, and key_starts of a `window`-slot window over
    the queries' positions (length + depth), as the model makes them."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    b, s = len(lengths), int(lengths.max()) + n + 3
    mask = tree_masks(rng, b, n)
    depth = mask.sum(-1) - 1  # [B, N]
    starts = np.maximum(lengths[:, None] + depth - window + 1, 0).astype(np.int32)
    q = rng.normal(size=(b, n, KV_HEADS * G, D)).astype(np.float32)
    k = rng.normal(size=(b, s, KV_HEADS, D)).astype(np.float32)
    v = rng.normal(size=(b, s, KV_HEADS, D)).astype(np.float32)
    for r in range(b):
        k[r, lengths[r] + n:] = v[r, lengths[r] + n:] = np.nan
    return tuple(jnp.asarray(a) for a in (q, k, v, lengths, mask, starts))


def numpy_attention(q, k, v, lengths, mask, starts):
    """Attention from its definition: query n of row b sees prefix slots [starts, length) and its tree keys."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, n, hq, d = q.shape
    out = np.zeros_like(q)
    for r in range(b):
        length = int(lengths[r])
        for i in range(n):
            slots = list(range(int(starts[r, i]), length))
            slots += [length + j for j in range(n) if mask[r, i, j]]
            for h in range(hq):
                kv = h // (hq // k.shape[2])
                scores = k[r, slots, kv] @ q[r, i, h] / np.sqrt(d)
                p = np.exp(scores - scores.max())
                out[r, i, h] = (p / p.sum()) @ v[r, slots, kv]
    return out


def paged(k, v, lengths, block, seed=0):
    """The caches as shuffled pool blocks and a block table."""
    b, s = k.shape[:2]
    nb = -(-s // block)
    pad = ((0, 0), (0, nb * block - s), (0, 0), (0, 0))
    order = np.random.default_rng(seed).permutation(b * nb)
    pool_k = np.zeros((b * nb, block) + k.shape[2:], np.float32)
    pool_v = np.zeros_like(pool_k)
    pool_k[order] = np.asarray(jnp.pad(k, pad)).reshape((b * nb, block) + k.shape[2:])
    pool_v[order] = np.asarray(jnp.pad(v, pad)).reshape((b * nb, block) + k.shape[2:])
    return jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(order.reshape(b, nb).astype(np.int32))


def test_reference_is_attention_over_the_window():
    q, k, v, lengths, mask, starts = inputs()
    assert int(starts.max()) > 200 and int(starts.min()) == 0  # long and short rows both
    ref = tree_attention_reference(q, k, v, lengths, mask, key_starts=starts)
    np.testing.assert_allclose(np.asarray(ref), numpy_attention(q, k, v, lengths, mask, starts), atol=2e-5)
    full = tree_attention_reference(q, k, v, lengths, mask)
    assert np.abs(np.asarray(full) - np.asarray(ref)).max() > 0.1  # the window changed the long rows


@pytest.mark.parametrize("window", [1, 16, 40])
@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_interpreted_kernels_honour_the_window(name, window):
    q, k, v, lengths, mask, starts = inputs(seed=window, window=window)
    fn = {"tpu": tree_attention_tpu, "gpu": tree_attention_gpu}[name]
    out = fn(q, k, v, lengths, mask, key_starts=starts, block_sizes=BLOCKS, interpret=True)
    ref = tree_attention_reference(q, k, v, lengths, mask, key_starts=starts)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


@pytest.mark.parametrize("impl", ["chunked", "tpu", "gpu"])
def test_paged_paths_honour_the_window(impl):
    q, k, v, lengths, mask, starts = inputs(seed=3)
    pool_k, pool_v, table = paged(k, v, lengths, block=16)
    ref = tree_attention_reference(q, k, v, lengths, mask, key_starts=starts)
    np.testing.assert_allclose(np.asarray(paged_tree_attention_reference(q, pool_k, pool_v, table, lengths, mask,
                                                                         key_starts=starts)), np.asarray(ref),
                               atol=2e-5)
    if impl == "chunked":  # 128-slot chunks: the window starts two chunks in for the longest row
        out = paged_tree_attention(q, pool_k, pool_v, table, lengths, mask, key_starts=starts)
    else:
        fn = {"tpu": paged_tree_attention_tpu, "gpu": paged_tree_attention_gpu}[impl]
        out = fn(q, pool_k, pool_v, table, lengths, mask, key_starts=starts, block_sizes=BLOCKS, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


def test_key_starts_of_the_wrong_shape_are_refused():
    q, k, v, lengths, mask, starts = inputs()
    with pytest.raises(ValueError, match=r"key_starts must be \[B, N\]"):
        tree_attention_tpu(q, k, v, lengths, mask, key_starts=starts[:, :2], interpret=True)


def _lower(fn, platform, *shapes):
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []
    return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*shapes).mlir_module()


def test_windowed_kernels_lower_for_their_hardware():
    # Gemma-3-like serving shapes (bf16, 4k cache, 16 tree tokens) with a window, contiguous and paged.
    sd, n, d = jax.ShapeDtypeStruct, 16, 128
    q, rows = sd((8, n, 32, d), jnp.bfloat16), (sd((8,), jnp.int32), sd((8, n, n), jnp.bool_), sd((8, n), jnp.int32))
    cache, pool, table = sd((8, 4096, 8, d), jnp.bfloat16), sd((2048, 16, 8, d), jnp.bfloat16), sd((8, 256), jnp.int32)
    for platform, contiguous, paged_fn, tag in (("tpu", tree_attention_tpu, paged_tree_attention_tpu, "tpu_custom_call"),
                                                ("cuda", tree_attention_gpu, paged_tree_attention_gpu, "triton")):
        run = functools.partial(lambda fn, q, k, v, lengths, mask, s: fn(q, k, v, lengths, mask, key_starts=s), contiguous)
        assert tag in _lower(run, platform, q, cache, cache, *rows)
        run = functools.partial(lambda fn, q, k, v, t, lengths, mask, s: fn(q, k, v, t, lengths, mask, key_starts=s,
                                                                             window=2048), paged_fn)
        assert tag in _lower(run, platform, q, pool, pool, table, *rows)
