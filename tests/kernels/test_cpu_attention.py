"""The CPU implementation of tree attention (pallas_kernels/cpu.py) against the reference.

The row loop must give the reference's numbers for decode, trees, draft frontiers (more tree
keys than queries), sliding windows and every grouping of query heads, whatever lies in the slots no
query may see (NaN, infinities, large finite garbage: their values are zeroed, their probability is 0),
with one chunk a row or several (a last one that re-reads slots, chunks skipped before a sliding
window), and with a window it reads only the slots before it. Many queries per row go to the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import tree_attention, tree_attention_reference, use_implementation
from pallas_kernels.cpu import MAX_QUERY_ROWS, tree_attention_rows

tree_attention_cpu = functools.partial(tree_attention, implementation="cpu")
KV = 3  # SmolLM2's kv heads: the block-diagonal queries span three blocks of lanes

# (batch, queries N, query heads per kv head G, head dim D, dtype)
CASES = [(4, 1, 3, 64, jnp.float32), (2, 1, 1, 32, jnp.float32), (3, 8, 3, 64, jnp.float32),
         (2, 4, 5, 16, jnp.float32), (3, 1, 3, 64, jnp.bfloat16)]


def inputs(seed, b, n, g, d, dtype, *, m=None, fill=np.nan, key_starts=False):
    """Random q / caches; slots past each row's tree hold `fill`; lengths 0, partial and near full."""
    rng = np.random.default_rng(seed)
    m = n if m is None else m
    s = 40 + m
    lengths = np.asarray([0, 17, 40, 33][:b], np.int32)
    mask = rng.random((b, n, m)) < 0.5
    mask[:, np.arange(n), m - n + np.arange(n)] = True  # each query sees its own key
    q = rng.normal(size=(b, n, KV * g, d)).astype(np.float32)
    k = rng.normal(size=(b, s, KV, d)).astype(np.float32)
    v = rng.normal(size=(b, s, KV, d)).astype(np.float32)
    for r in range(b):
        k[r, lengths[r] + m:] = fill
        v[r, lengths[r] + m:] = fill
    args = [jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lengths),
            jnp.asarray(mask)]
    starts = jnp.asarray(np.maximum(lengths[:, None] - 7 + np.arange(n)[None, :], 0), jnp.int32) if key_starts else None
    return args, starts


def check(out, args, starts, dtype):
    ref = np.asarray(tree_attention_reference(*args, key_starts=starts), np.float32)
    out = np.asarray(out, np.float32)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert np.all(np.isfinite(out))
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-N{c[1]}-G{c[2]}-D{c[3]}-{jnp.dtype(c[4]).name}")
@pytest.mark.parametrize("fill", [np.nan, np.inf, 3e4], ids=["nan", "inf", "finite-garbage"])
def test_row_loop_equals_the_reference_whatever_the_unread_slots_hold(case, fill):
    b, n, g, d, dtype = case
    args, _ = inputs(CASES.index(case), b, n, g, d, dtype, fill=fill)
    check(jax.jit(tree_attention_cpu)(*args), args, None, dtype)  # one chunk covers these caches
    # Chunks of 16 and 7 slots: several per row, a last one that ends at the cache and re-reads slots.
    for chunk in (16, 7):
        check(jax.jit(tree_attention_rows, static_argnames="chunk")(*args, chunk=chunk), args, None, dtype)


def test_draft_frontier_and_sliding_window():
    # 4 frontier queries against 12 tree keys, and a window of 7 prefix slots per query.
    args, starts = inputs(5, 4, 4, 3, 64, jnp.float32, m=12, key_starts=True)
    check(jax.jit(tree_attention_rows)(*args, key_starts=starts), args, starts, jnp.float32)
    check(tree_attention_rows(*args, key_starts=starts, chunk=8), args, starts, jnp.float32)  # chunks skipped
    args, starts = inputs(6, 3, 1, 3, 64, jnp.float32, key_starts=True)
    check(tree_attention_cpu(*args, key_starts=starts), args, starts, jnp.float32)


def test_a_window_reads_only_the_slots_before_it():
    args, _ = inputs(9, 4, 8, 3, 64, jnp.float32)
    q, k, v, lengths, mask = args
    window = 48  # every row's length + 8 tree keys fits; slots from 48 on hold NaN for every row
    k, v = k.at[:, window:].set(jnp.nan), v.at[:, window:].set(jnp.nan)
    check(tree_attention_rows(q, k, v, lengths, mask, window=window, chunk=20), [q, k[:, :window], v[:, :window],
                                                                               lengths, mask], None, jnp.float32)
    out = jax.jit(lambda *a: tree_attention_cpu(*a, window=window))(q, k, v, lengths, mask)
    check(out, [q, k[:, :window], v[:, :window], lengths, mask], None, jnp.float32)
    np.testing.assert_array_equal(np.asarray(tree_attention(q, k, v, lengths, mask, window=window, implementation="cpu")),
                                  np.asarray(out))
    np.testing.assert_allclose(np.asarray(tree_attention(q, k, v, lengths, mask, window=window,
                                                         implementation="reference")), np.asarray(out),
                               rtol=2e-5, atol=2e-5)


def test_many_queries_per_row_go_to_the_reference():
    n = MAX_QUERY_ROWS // (KV * 3) + 1  # one query past the limit
    args, _ = inputs(7, 2, n, 3, 16, jnp.float32)
    np.testing.assert_array_equal(np.asarray(tree_attention_cpu(*args)), np.asarray(tree_attention_reference(*args)))
    jaxpr = str(jax.make_jaxpr(lambda *a: tree_attention_cpu(*a))(*args))
    assert "while" not in jaxpr  # no row loop
    args, _ = inputs(7, 2, n - 1, 3, 16, jnp.float32)
    assert "while" in str(jax.make_jaxpr(lambda *a: tree_attention_cpu(*a))(*args))


def test_cpu_backend_dispatches_to_the_cpu_implementation():
    args, _ = inputs(8, 3, 1, 3, 64, jnp.float32)
    expected = "cpu" if jax.default_backend() == "cpu" else pallas_kernels.default_implementation()
    assert pallas_kernels.default_implementation() == expected
    with use_implementation("cpu"):
        forced = np.asarray(tree_attention(*args))
    np.testing.assert_array_equal(forced, np.asarray(tree_attention_cpu(*args)))
    np.testing.assert_array_equal(np.asarray(tree_attention(*args, implementation="reference")),
                                  np.asarray(tree_attention_reference(*args)))


@pytest.mark.slow  # the real target, two step programs
def test_step_benchmark_times_both_implementations_on_the_real_target(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "cpu_attention.json"
    proc = subprocess.run([sys.executable, "benchmarks/cpu_attention.py", "--batch-size", "2", "--cache-len", "256",
                           "--lengths", "40", "150", "--mixed", "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["length"] for r in rows] == [40, 150] and all(r["mixed"] for r in rows)
    for r in rows:
        assert r["reference_ms"] > 0 and r["cpu_ms"] > 0 and r["same_tokens"]  # same greedy tokens both ways
    assert "speedup" in proc.stdout
    # A speculative step with the shipped head (the bench's batch-1 step).
    proc = subprocess.run([sys.executable, "benchmarks/cpu_attention.py", "--batch-size", "1", "--cache-len", "256",
                           "--lengths", "60", "--tree", "2,2,3", "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["tree"] == "2,2,3" and row["same_tokens"] and row["cpu_ms"] > 0
    assert "2,2,3 tree decode step" in proc.stdout
