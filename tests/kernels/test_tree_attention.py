"""Tree-attention kernels (TPU Mosaic, GPU Triton) against the jnp reference, and the dispatch.

The kernels run in Pallas interpret mode on CPU (`TestKernelsInterpreted`); `TestKernelsCompiled`
runs the same cases compiled and skips unless the kernel's accelerator is present. Inputs are fresh
random draws; tree masks come from the real tree builder; every cache slot past a row's tree is NaN,
so a kernel that reads or multiplies an unused slot fails.

Shapes are small (interpret mode is slow) and the blocks smaller still, so every case crosses
several KV blocks, ends inside a partial block, and (for big trees) spans several tree blocks.
The case table covers every value of each axis (B, N, G, D, dtype) at least once per kernel,
pairwise rather than as a full product.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from eagle_jax.compiling import quick_options
from eagle_jax.tree import TreeConfig, select_tree
from pallas_kernels import BlockSizes, tree_attention, tree_attention_reference, use_implementation
from pallas_kernels.gpu import tree_attention_gpu
from pallas_kernels.tpu import tree_attention_tpu

ROOT = Path(__file__).resolve().parents[2]
KV_HEADS = 2
PREFIX = 37  # cache slots before the tree in a "full" row; not a multiple of any block size below
BLOCKS = BlockSizes(block_q=32, block_kv=16, kv_splits=3)  # kv_splits: GPU only

# (batch, tree tokens N, query heads per kv head G, head dim D, dtype)
CASES = [
    (3, 1, 4, 128, jnp.float32),  # plain decode, GQA
    (1, 1, 3, 64, jnp.bfloat16),
    (3, 5, 1, 64, jnp.float32),  # MHA
    (1, 5, 4, 128, jnp.bfloat16),
    (3, 16, 3, 128, jnp.bfloat16),
    (1, 16, 1, 64, jnp.float32),
    (3, 26, 4, 64, jnp.float32),
    (1, 26, 3, 128, jnp.bfloat16),
    (3, 64, 1, 128, jnp.float32),
    (1, 64, 4, 64, jnp.bfloat16),
]
# The quick loop (`-m "not slow"`) checks three cases that between them cover decode, GQA and MHA, both
# dtypes, one and three rows and a tree over several kv blocks; CI checks all of them.
QUICK_CASES = (0, 3, 6)


def case_params(indices=range(len(CASES))):
    return [pytest.param(CASES[i], id=_case_id(CASES[i]), marks=() if i in QUICK_CASES else pytest.mark.slow)
            for i in indices]


TREES = {5: TreeConfig(2, 2, 5), 16: TreeConfig(4, 4, 16), 26: TreeConfig(4, 4, 26), 64: TreeConfig(4, 8, 64)}


def _case_id(case):
    b, n, g, d, dtype = case
    return f"B{b}-N{n}-G{g}-D{d}-{jnp.dtype(dtype).name}"


def real_tree_masks(rng, batch: int, n: int) -> np.ndarray:
    """[B, N, N] ancestor masks of trees chosen by `select_tree` from a random EAGLE-2 expansion."""
    if n == 1:
        return np.ones((batch, 1, 1), bool)
    tree = TREES[n]
    k = tree.topk
    scores = [-rng.exponential(size=(batch, k))]  # cumulative log-probs: a child never beats its parent
    parents = [np.full((batch, k), -1)]
    frontier, base = np.broadcast_to(np.arange(k), (batch, k)), 0
    frontier_scores = scores[0]
    for _ in range(1, tree.depth):
        child = (np.repeat(frontier_scores, k, axis=1) - rng.exponential(size=(batch, k * k)))
        scores.append(child)
        parents.append(np.repeat(frontier, k, axis=1))
        base += scores[-2].shape[1]
        best = np.argsort(-child, axis=1, kind="stable")[:, :k]
        frontier, frontier_scores = base + best, np.take_along_axis(child, best, axis=1)
    pool_scores = np.concatenate(scores, 1).astype(np.float32)
    pool_parents = np.concatenate(parents, 1).astype(np.int32)
    pool_tokens = rng.integers(0, 100, size=pool_scores.shape).astype(np.int32)
    out = select_tree(jnp.zeros((batch,), jnp.int32), jnp.asarray(pool_tokens), jnp.asarray(pool_scores),
                      jnp.asarray(pool_parents), tree)
    return np.asarray(out.mask)


def make_inputs(seed, batch, n, g, d, dtype, *, m=None, mask=None, lengths=None):
    """Random q / caches with NaN past each row's tree, lengths covering 0, a partial block and full."""
    rng = np.random.default_rng(seed)
    m = n if m is None else m
    s = PREFIX + m
    if lengths is None:
        choices = [0, 21, PREFIX] if batch == 3 else [[21], [0], [PREFIX]][seed % 3]
        lengths = np.asarray(choices[:batch], np.int32)
    if mask is None:
        mask = real_tree_masks(rng, batch, n)
    q = rng.normal(size=(batch, n, KV_HEADS * g, d)).astype(np.float32)
    k = rng.normal(size=(batch, s, KV_HEADS, d)).astype(np.float32)
    v = rng.normal(size=(batch, s, KV_HEADS, d)).astype(np.float32)
    for r in range(batch):
        k[r, lengths[r] + m:] = np.nan
        v[r, lengths[r] + m:] = np.nan
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lengths),
            jnp.asarray(mask))


class KernelCases:
    """The kernel-vs-reference cases; subclasses choose compiled or interpreted kernels."""

    INTERPRET = False
    # Interpreted kernels run exact f32 matmuls; compiled ones may use TF32 (GPU) or bf16 passes (TPU).
    TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

    def kernel(self, name):
        backend = jax.default_backend()
        if not self.INTERPRET and backend != name:
            pytest.skip(f"the compiled {name} kernel needs a {name} backend (this is {backend})")
        fn = {"tpu": tree_attention_tpu, "gpu": tree_attention_gpu}[name]
        if self.INTERPRET:
            # Interpreted on CPU the kernel is a loop of small XLA ops: compile it without LLVM optimisation
            # (the same values, about half the compile time; see eagle_jax.compiling).
            return jax.jit(functools.partial(fn, block_sizes=BLOCKS, interpret=True), compiler_options=quick_options())
        return functools.partial(fn, block_sizes=BLOCKS, interpret=False)

    def check(self, out, args, dtype):
        ref = tree_attention_reference(*args)
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        assert out.shape == ref.shape
        assert np.all(np.isfinite(out))
        tol = self.TOLERANCE[dtype]
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)

    @pytest.mark.parametrize("name", ["tpu", "gpu"])
    @pytest.mark.parametrize("case", case_params())
    def test_kernel_matches_reference_on_real_trees_with_nan_past_the_tree(self, name, case):
        kernel = self.kernel(name)
        b, n, g, d, dtype = case
        args = make_inputs(CASES.index(case), b, n, g, d, dtype)
        self.check(kernel(*args), args, dtype)

    @pytest.mark.parametrize("name", ["tpu", "gpu"])
    def test_draft_frontier_queries_attend_to_more_tree_keys_than_queries(self, name):
        # A draft step: 4 frontier nodes query 12 scratch keys through their ancestor rows.
        kernel = self.kernel(name)
        rng = np.random.default_rng(7)
        b, n, m = 3, 4, 12
        mask = rng.random((b, n, m)) < 0.4
        mask[:, np.arange(n), 8 + np.arange(n)] = True  # each frontier node sees its own key
        args = make_inputs(11, b, n, 3, 64, jnp.float32, m=m, mask=mask)
        self.check(kernel(*args), args, jnp.float32)

    @pytest.mark.parametrize("name", ["tpu", "gpu"])
    def test_causal_prefill_from_an_empty_cache_and_lengths_on_block_edges(self, name):
        kernel = self.kernel(name)
        n = 26
        causal = np.broadcast_to(np.tril(np.ones((n, n), bool)), (3, n, n))
        args = make_inputs(12, 3, n, 4, 64, jnp.float32, mask=causal, lengths=np.asarray([0, 16, 32], np.int32))
        self.check(kernel(*args), args, jnp.float32)


class TestKernelsCompiled(KernelCases):
    INTERPRET = False
    TOLERANCE = {jnp.float32: 1e-2, jnp.bfloat16: 2e-2}


class TestKernelsInterpreted(KernelCases):
    INTERPRET = True


@pytest.mark.skipif(not hasattr(pltpu, "InterpretParams"), reason="this JAX has no TPU interpreter")
@pytest.mark.parametrize("case", case_params([0, 3, 4, 9]))
def test_tpu_kernel_under_the_tpu_interpreter_matches_reference(case):
    # The TPU interpreter also models DMAs, VMEM scratch and scalar prefetch (and poisons
    # uninitialised memory with NaN), unlike the generic interpreter.
    b, n, g, d, dtype = case
    args = make_inputs(CASES.index(case), b, n, g, d, dtype)
    out = tree_attention_tpu(*args, block_sizes=BLOCKS, interpret=pltpu.InterpretParams())
    KernelCases().check(out, args, dtype)


def test_tree_masks_from_the_builder_are_trees_not_causal_masks():
    masks = real_tree_masks(np.random.default_rng(0), 3, 16)
    assert masks.shape == (3, 16, 16)
    assert np.all(masks[:, np.arange(16), np.arange(16)])  # every node sees itself
    assert not np.array_equal(masks, np.broadcast_to(np.tril(np.ones((16, 16), bool)), masks.shape))
    assert np.all(masks[:, :, 0])  # ... and the root


def _jaxpr(*args, **kwargs):
    # A fresh function each time: make_jaxpr caches traces per function, and the implementation is
    # chosen at trace time.
    return str(jax.make_jaxpr(lambda *a: tree_attention(*a, **kwargs))(*args))


def test_cpu_dispatch_is_pure_jnp_unless_a_kernel_is_forced():
    args = make_inputs(3, 3, 5, 4, 64, jnp.float32)
    assert pallas_kernels.default_implementation() == {"tpu": "tpu", "gpu": "gpu", "cpu": "cpu"}.get(
        jax.default_backend(), "reference")
    if jax.default_backend() == "cpu":
        assert "pallas_call" not in _jaxpr(*args)
        np.testing.assert_allclose(np.asarray(tree_attention(*args)), np.asarray(tree_attention_reference(*args)),
                                   rtol=2e-5, atol=2e-5)
    for name in ("tpu", "gpu"):
        with use_implementation(name, interpret=True, block_sizes=BLOCKS):
            jaxpr = _jaxpr(*args)
            out = tree_attention(*args)
        assert f"tree_attention_{name}" in jaxpr and "pallas_call" in jaxpr
        np.testing.assert_allclose(np.asarray(out), np.asarray(tree_attention_reference(*args)), rtol=2e-5, atol=2e-5)
    assert "tree_attention_gpu" in _jaxpr(*args, implementation="gpu", interpret=True)
    with use_implementation("tpu", interpret=True):  # an explicit implementation wins over the forced one
        assert "pallas_call" not in _jaxpr(*args, implementation="reference")
    with pytest.raises(ValueError, match="implementation"):
        tree_attention(*args, implementation="cuda")
    with pytest.raises(ValueError, match="implementation"):
        with use_implementation("triton"):
            pass


def test_the_backend_default_falls_back_to_the_reference_for_head_shapes_a_kernel_does_not_take():
    takes = sys.modules["pallas_kernels.tree_attention"]._kernel_takes
    q = lambda d: jnp.zeros((1, 1, 8, d))  # noqa: E731
    cache = lambda k, d: jnp.zeros((1, 8, k, d))  # noqa: E731
    assert takes("gpu", q(128), cache(8, 128)) and takes("gpu", q(64), cache(2, 64))
    assert not takes("gpu", q(12), cache(2, 12)) and not takes("gpu", q(80), cache(8, 80))
    assert takes("tpu", q(128), cache(8, 128)) and takes("tpu", q(256), cache(1, 256))
    assert takes("tpu", q(64), cache(1, 64))
    assert not takes("tpu", q(64), cache(3, 64))


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_q=24, block_kv=64), "block_q"),
    (dict(block_q=8, block_kv=64), "block_q"),
    (dict(block_q=64, block_kv=96), "block_kv"),
    (dict(block_q=64, block_kv=0), "block_kv"),
    (dict(block_q=64, block_kv=64, num_warps=3), "num_warps"),
    (dict(block_q=64, block_kv=64, num_stages=0), "num_stages"),
    (dict(block_q=64, block_kv=64, kv_splits=0), "kv_splits"),
    (dict(block_q=64.0, block_kv=64), "block_q"),
])
def test_block_sizes_are_validated_and_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}"):
        BlockSizes(**kwargs)
    assert BlockSizes(32, 16) == BlockSizes(block_q=32, block_kv=16)
    assert hash(BlockSizes.tpu_default()) == hash(BlockSizes(256, 256))  # usable as a static jit argument


def test_kernels_reject_shapes_that_do_not_fit():
    q, k, v, lengths, mask = make_inputs(0, 3, 5, 4, 64, jnp.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        tree_attention_tpu(q[:, :, :7], k, v, lengths, mask, interpret=True)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention_gpu(q, k, v, lengths, mask[:, :4], interpret=True)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        tree_attention_gpu(q[..., :48], k[..., :48], v[..., :48], lengths, mask)


def _lower(fn, platform, *shapes):
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []
    return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*shapes).mlir_module()


@pytest.mark.parametrize("n, g, d", [(1, 4, 128), (64, 4, 128), (16, 3, 64)])
def test_kernels_lower_for_their_hardware_at_serving_shapes(n, g, d):
    # Lowering runs each backend's Pallas rules (block tiling, op support) without the hardware:
    # Mosaic for TPU, Triton IR for CUDA. Llama-3-8B-like: 8 kv heads, bf16, a 4k cache.
    sd = jax.ShapeDtypeStruct
    shapes = (sd((8, n, 8 * g, d), jnp.bfloat16), sd((8, 4096, 8, d), jnp.bfloat16), sd((8, 4096, 8, d), jnp.bfloat16),
              sd((8,), jnp.int32), sd((8, n, n), jnp.bool_))
    assert "tpu_custom_call" in _lower(tree_attention_tpu, "tpu", *shapes)
    if d == 128:  # Triton needs a power-of-two head dim
        assert "triton" in _lower(tree_attention_gpu, "cuda", *shapes)


@pytest.mark.slow  # a fresh interpreter compiling every kernel case
def test_benchmark_smoke_run_writes_a_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    from doc_commands import argv, doc_command

    cmd = argv(doc_command("python benchmarks/tree_attention_kernels.py"), "--json", str(out))  # the README's
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["results"]
    assert {r["implementation"] for r in rows} == {"reference", "tpu", "gpu"}
    for r in rows:
        assert r["ms"] > 0 and r["gb_per_s"] > 0
        assert r["max_abs_err"] < 2e-2  # interpret-mode kernels agree with the reference
    assert "GB/s" in proc.stdout
