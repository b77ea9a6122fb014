"""The engine end to end with a Pallas kernel (or the CPU implementation) forced in place of the reference.

Every attention call of the run (prompt prefill, plain decode with N = 1, draft expansion, tree
verification) goes through the interpreted kernel, and greedy output must equal plain greedy decoding
through the reference, token for token.

The oracle pair's attention is scaled up (attn_scale=8) so that outputs depend on it: with the
default scale a verifier that ignored the tree's shape would still pass (the last test checks that
this one would not).
"""

import importlib

import jax
import jax.numpy as jnp
import pytest

import eagle_jax
from eagle_jax.tree import TreeConfig
from pallas_kernels import BlockSizes, use_implementation
from builders import MORE_PROMPTS, oracle_pair

# Small blocks so the tiny prompts still cross several KV blocks and partial ones.
BLOCKS = BlockSizes(block_q=16, block_kv=16, kv_splits=2)
TREE = TreeConfig(depth=4, topk=4, tree_tokens=16)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def oracle_and_plain():
    tgt, head = oracle_pair(attn_scale=8.0)
    prompts = MORE_PROMPTS[:4]
    jax.clear_caches()
    with use_implementation("reference"):  # the reference path
        plain = eagle_jax.generate(tgt, prompts, max_new_tokens=NEW_TOKENS)
    jax.clear_caches()
    return tgt, head, prompts, plain


@pytest.mark.parametrize("implementation", [pytest.param("tpu", marks=pytest.mark.slow), "gpu", "cpu"])
def test_greedy_with_the_kernel_forced_on_equals_plain_greedy(oracle_and_plain, implementation, monkeypatch):
    tgt, head, prompts, plain = oracle_and_plain
    module = importlib.import_module(f"pallas_kernels.{implementation}")
    name = "tree_attention_rows" if implementation == "cpu" else f"tree_attention_{implementation}"
    kernel = getattr(module, name)
    traced = []

    def counting(*args, **kwargs):
        traced.append(args[4].shape)  # tree_mask [B, N, M]
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    # The engine's step functions are jitted and the implementation is picked at trace time: drop
    # the traces made through the reference, and the kernel's afterwards.
    jax.clear_caches()
    try:
        with use_implementation(implementation, interpret=True, block_sizes=BLOCKS):
            plain_kernel = eagle_jax.generate(tgt, prompts, max_new_tokens=NEW_TOKENS)
            spec_kernel = eagle_jax.generate(tgt, prompts, draft=head, tree=TREE, max_new_tokens=NEW_TOKENS)
    finally:
        jax.clear_caches()
    assert plain_kernel.token_ids == plain.token_ids
    assert spec_kernel.token_ids == plain.token_ids
    assert spec_kernel.stats["tau"] > 2.0  # deep drafts were accepted: verification ran on real trees
    n_m = {mask_shape[1:] for mask_shape in traced}
    assert (1, 1) in n_m  # plain decode
    assert (16, 16) in n_m  # tree verification
    assert (4, 12) in n_m  # draft expansion: 4 frontier nodes over 12 scratch keys


def test_a_verifier_that_ignores_the_tree_shape_fails_this_comparison(oracle_and_plain, monkeypatch):
    # Attention that treats the tree as a chain (causal mask) is exact for prefill and decode but
    # wrong for branching trees; the comparison above must be able to see that.
    tgt, head, prompts, plain = oracle_and_plain
    module = importlib.import_module("pallas_kernels.tree_attention")
    reference = module.tree_attention_reference

    def chain_attention(q, k, v, lengths, tree_mask, **kwargs):
        n, m = tree_mask.shape[1:]
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((n, m), bool)), tree_mask.shape)
        return reference(q, k, v, lengths, causal, **kwargs)

    monkeypatch.setattr(module, "tree_attention_reference", chain_attention)
    jax.clear_caches()
    try:
        with use_implementation("reference"):
            broken = eagle_jax.generate(tgt, prompts, draft=head, tree=TREE, max_new_tokens=NEW_TOKENS)
    finally:
        jax.clear_caches()
    assert broken.token_ids != plain.token_ids
