"""Acceptance rule: greedy picks the argmax path; sampling emits exactly the target's distribution."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.accept import accept_sampled, accept, accept_greedy
from eagle_jax.sampling import SamplingParams, probs, row_keys
from eagle_jax.tree import Tree, ancestor_mask

# Root (node 0) with children 1, 2, 3 (tokens 2, 0, 4); node 1 has children 4, 5 (tokens 1, 3).
PARENTS = np.array([0, 0, 0, 0, 1, 1])
TOKENS = np.array([5, 2, 0, 4, 1, 3])
DEPTH = 2
V = 6


def _tree(batch):
    parents = jnp.asarray(np.tile(PARENTS, (batch, 1)), jnp.int32)
    depths = jnp.asarray(np.tile([0, 1, 1, 1, 2, 2], (batch, 1)), jnp.int32)
    return Tree(jnp.asarray(np.tile(TOKENS, (batch, 1)), jnp.int32), parents, depths,
                ancestor_mask(parents, DEPTH), jnp.zeros((batch, 6), jnp.int32))


def _logits(batch):
    rng = np.random.default_rng(0)
    node_logits = rng.normal(size=(6, V)).astype(np.float32) * 1.5
    return jnp.asarray(np.tile(node_logits, (batch, 1, 1)))


def test_the_keys_of_several_positions_per_row_are_each_positions_own_key():
    """accept_sampled draws every level's randomness with one call over [B, L] positions: it must be the key
    fold_in(PRNGKey(seed), position) of each position, whichever other positions share the call."""
    import jax

    seeds = jnp.asarray([0, 7, 2**32 - 1], jnp.uint32)
    positions = jnp.asarray([[1, 2, 3, 4], [10, 11, 12, 13], [0, 5, 9, 100]], jnp.int32)
    grid = np.asarray(row_keys(seeds, positions))
    assert grid.shape == (3, 4, 2)
    for j in range(4):
        np.testing.assert_array_equal(grid[:, j], np.asarray(row_keys(seeds, positions[:, j])))
    for b in range(3):
        own = jax.random.fold_in(jax.random.PRNGKey(seeds[b]), positions[b, 2])
        np.testing.assert_array_equal(grid[b, 2], np.asarray(own))
    assert len({tuple(k) for k in grid.reshape(-1, 2).tolist()}) == 12  # all distinct


def test_greedy_acceptance_follows_the_argmax_path():
    logits = np.zeros((1, 6, V), np.float32)
    logits[0, 0, 2] = 5  # root argmax = token 2 = node 1: accept
    logits[0, 1, 3] = 5  # node 1 argmax = token 3 = node 5: accept
    logits[0, 5, 1] = 5  # node 5 is a leaf: bonus = its argmax
    out = accept(_tree(1), jnp.asarray(logits), SamplingParams.make(1), jnp.asarray([10]), DEPTH)
    assert int(out.count[0]) == 3 and int(out.bonus[0]) == 1
    np.testing.assert_array_equal(np.asarray(out.path[0]), [0, 1, 5])
    logits[0, 1] = 0
    logits[0, 1, 5] = 5  # node 1's argmax (token 5) is not among its children: stop, bonus 5
    out = accept(_tree(1), jnp.asarray(logits), SamplingParams.make(1), jnp.asarray([10]), DEPTH)
    assert int(out.count[0]) == 2 and int(out.bonus[0]) == 5
    np.testing.assert_array_equal(np.asarray(out.path[0]), [0, 1, 1])


@pytest.mark.slow
def test_the_greedy_fast_path_equals_the_general_rule():
    # Random logits over a small vocabulary, so children often match the argmax at every depth.
    rng = np.random.default_rng(1)
    n = 64
    logits = jnp.asarray(rng.normal(size=(n, 6, V)).astype(np.float32))
    logits = logits.at[:, :, TOKENS[1]].add(jnp.asarray(rng.choice([0.0, 3.0], size=(n, 6)), jnp.float32))
    greedy = SamplingParams.make(n)
    fast = accept(_tree(n), logits, greedy, jnp.zeros((n,), jnp.int32), DEPTH)
    general = accept_sampled(_tree(n), logits, greedy, jnp.zeros((n,), jnp.int32), DEPTH, "exact")
    for a, b in ((fast.path, general.path), (fast.count, general.count), (fast.bonus, general.bonus)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(set(np.asarray(fast.count).tolist())) == 3  # counts 1, 2 and 3 all occur
    # In a batch with one sampling row the general rule runs; its greedy rows come out the same.
    mixed = SamplingParams.make(n, temperature=np.r_[np.zeros(n - 1), 1.0], seed=np.arange(n))
    out = accept(_tree(n), logits, mixed, jnp.zeros((n,), jnp.int32), DEPTH)
    ref = accept_greedy(_tree(n), logits, DEPTH)
    np.testing.assert_array_equal(np.asarray(out.path)[:-1], np.asarray(ref.path)[:-1])
    np.testing.assert_array_equal(np.asarray(out.bonus)[:-1], np.asarray(ref.bonus)[:-1])


def _emitted_pairs(rule, temperature=1.0, top_k=0, top_p=1.0, n=20000):
    params = SamplingParams.make(n, temperature, top_k, top_p, seed=np.arange(n))
    out = accept(_tree(n), _logits(n), params, jnp.zeros((n,), jnp.int32), DEPTH, rule=rule)
    tokens = np.asarray(_tree(1).tokens[0])
    path, count, bonus = np.asarray(out.path), np.asarray(out.count), np.asarray(out.bonus)
    first = np.where(count >= 2, tokens[path[:, 1]], bonus)
    second = np.where(count >= 3, tokens[path[:, 2]], np.where(count == 2, bonus, -1))
    return first, second, params


def _chi2(counts, p):
    support = p > 1e-12
    assert counts[~support].sum() == 0
    exp = p[support] * counts.sum()
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    from scipy.stats import chi2

    return chi2.sf(stat, df=max(int(support.sum()) - 1, 1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8)])
def test_sampled_acceptance_emits_the_target_distribution(temperature, top_k, top_p):
    first, second, params = _emitted_pairs("exact", temperature, top_k, top_p)
    p = np.asarray(probs(_logits(1), SamplingParams.make(1, temperature, top_k, top_p)))[0]  # [6, V]
    assert _chi2(np.bincount(first, minlength=V), p[0]) > 0.01
    # Given the first token was node 1's token (2), the second follows the target at node 1.
    sel = first == TOKENS[1]
    assert sel.sum() > 1000
    assert _chi2(np.bincount(second[sel], minlength=V), p[1]) > 0.01


def test_a_broken_acceptance_rule_fails_the_same_test():
    first, _, _ = _emitted_pairs("broken")
    p = np.asarray(probs(_logits(1), SamplingParams.make(1, 1.0)))[0]
    assert _chi2(np.bincount(first, minlength=V), p[0]) < 0.01
