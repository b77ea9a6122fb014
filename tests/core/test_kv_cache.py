"""KV cache pure functions and the reference tree attention against a naive per-query loop."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kv_cache import KVCache, advance, gather_rows, write_rows
from pallas_kernels import tree_attention, tree_attention_reference


def _naive_attention(q, k, v, lengths, tree_mask):
    b, n, hq, d = q.shape
    kv = k.shape[2]
    g = hq // kv
    out = np.zeros((b, n, hq, d), np.float64)
    for r in range(b):
        L = lengths[r]
        for i in range(n):
            slots = list(range(L)) + [L + j for j in range(n) if tree_mask[r, i, j]]
            for h in range(hq):
                kk = k[r, slots, h // g].astype(np.float64)
                vv = v[r, slots, h // g].astype(np.float64)
                s = kk @ q[r, i, h].astype(np.float64) / np.sqrt(d)
                p = np.exp(s - s.max())
                out[r, i, h] = (p / p.sum()) @ vv
    return out


@pytest.mark.parametrize("n", [1, 5])
def test_reference_tree_attention_matches_naive_loop_and_ignores_nan_padding(n):
    rng = np.random.default_rng(n)
    b, s, kv, g, d = 3, 24, 2, 3, 8
    lengths = np.array([0, 7, 24 - n], np.int32)
    q = rng.normal(size=(b, n, kv * g, d)).astype(np.float32)
    k = rng.normal(size=(b, s, kv, d)).astype(np.float32)
    v = rng.normal(size=(b, s, kv, d)).astype(np.float32)
    for r in range(b):  # poison everything past the tree
        k[r, lengths[r] + n:] = np.nan
        v[r, lengths[r] + n:] = np.nan
    # A tree mask: each node sees itself and a random earlier ancestor chain.
    mask = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            mask[r, i, i] = True
            if i:
                p = rng.integers(0, i)
                mask[r, i] |= mask[r, p]
    got = np.asarray(tree_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                    jnp.asarray(mask)))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _naive_attention(q, k, v, lengths, mask), rtol=2e-5, atol=2e-5)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), jnp.asarray(mask))
    same = np.asarray(tree_attention_reference(*args))
    np.testing.assert_array_equal(np.asarray(tree_attention(*args, implementation="reference")), same)
    np.testing.assert_allclose(got, same, rtol=1e-6, atol=1e-6)  # the backend's default (CPU: its row loop)


def test_write_rows_writes_at_per_row_offsets():
    cache = jnp.zeros((2, 10, 1, 2))
    new = jnp.arange(2 * 3 * 1 * 2, dtype=jnp.float32).reshape(2, 3, 1, 2) + 1
    out = np.asarray(write_rows(cache, new, jnp.asarray([0, 6])))
    np.testing.assert_array_equal(out[0, :3], np.asarray(new[0]))
    np.testing.assert_array_equal(out[1, 6:9], np.asarray(new[1]))
    assert out[0, 3:].sum() == 0 and out[1, :6].sum() == 0 and out[1, 9:].sum() == 0


def test_gather_rows_makes_the_kept_scratch_tokens_contiguous():
    L, B, S, K, D = 2, 2, 16, 1, 1
    k = np.arange(L * B * S, dtype=np.float32).reshape(L, B, S, K, D)
    cache = KVCache(jnp.asarray(k), jnp.asarray(-k), jnp.asarray([3, 5], jnp.int32))
    src = jnp.asarray([[0, 2, 4], [1, 3, 0]], jnp.int32)  # offsets past each row's length
    out = gather_rows(cache, src, jnp.asarray([3, 2]))
    np.testing.assert_array_equal(np.asarray(out.lengths), [6, 7])
    ok = np.asarray(out.k)
    for layer in range(L):
        np.testing.assert_array_equal(ok[layer, 0, 3:6, 0, 0], k[layer, 0, [3, 5, 7], 0, 0])
        np.testing.assert_array_equal(ok[layer, 1, 5:7, 0, 0], k[layer, 1, [6, 8], 0, 0])
        np.testing.assert_array_equal(ok[layer, 0, :3, 0, 0], k[layer, 0, :3, 0, 0])  # prefix untouched
    np.testing.assert_array_equal(np.asarray(out.v), -ok)
    np.testing.assert_array_equal(np.asarray(advance(cache, jnp.asarray([1, 2])).lengths), [4, 7])


def test_an_attention_window_reads_only_its_slots():
    """layers.cached_attention(window=W) attends over slots [0, W): the same output while every row fits,
    a different one for a row that does not (so the window really bounds what attention reads)."""
    from eagle_jax.layers import cached_attention
    from eagle_jax.rows import attention_window

    rng = np.random.default_rng(3)
    b, n, hq, kv, d, s = 2, 3, 4, 2, 8, 512
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in [(b, n, hq, d), (b, n, kv, d), (b, n, kv, d)])
    kc, vc = (jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32) for _ in range(2))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))

    def run(lengths, window):
        lengths = jnp.asarray(lengths, jnp.int32)
        return cached_attention(q, k, v, kc, vc, starts=lengths, lengths=lengths, tree_mask=mask, window=window)

    full, k_full, _ = run([100, 125], None)
    win, k_win, _ = run([100, 125], 128)
    np.testing.assert_allclose(np.asarray(win), np.asarray(full), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(k_win), np.asarray(k_full))  # writes go to the whole cache
    over, _, _ = run([100, 200], 128)  # row 1's prefix and tree lie past the window
    np.testing.assert_allclose(np.asarray(over[0]), np.asarray(full[0]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(over[1]), np.asarray(run([100, 200], None)[0][1]), atol=1e-3)
    assert [attention_window(x, 1024) for x in (1, 128, 129, 300, 512, 513)] == [128, 128, 256, 512, 512, None]
    assert attention_window(100, 128) is None  # the whole cache: no window
