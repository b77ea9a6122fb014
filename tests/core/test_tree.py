"""Draft tree selection: connectivity, ancestor masks, depths, best-N against brute force."""


import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.tree import TreeConfig, ancestor_mask, select_tree


def simulated_pool(rng, tree: TreeConfig, batch: int, vocab: int = 50):
    """An EAGLE-2 expansion in numpy with random draft log-probs: (tokens, scores, parents) [B, C]."""
    k = tree.topk
    toks, scores, parents = [], [], []
    for _ in range(batch):
        t, s, p = [], [], []

        def children(parent_score):
            logits = rng.normal(size=vocab) * 2
            logp = logits - np.log(np.exp(logits).sum())
            top = np.argsort(-logp, kind="stable")[:k]
            return top, parent_score + logp[top]

        ct, cs = children(0.0)
        t += ct.tolist(); s += cs.tolist(); p += [-1] * k
        frontier = list(range(k))
        for _ in range(2, tree.depth + 1):
            start = len(t)
            for f in frontier:
                ct, cs = children(s[f])
                t += ct.tolist(); s += cs.tolist(); p += [f] * k
            level = np.arange(start, len(t))
            frontier = level[np.argsort(-np.asarray(s)[level], kind="stable")[:k]].tolist()
        toks.append(t); scores.append(s); parents.append(p)
    return (np.asarray(toks, np.int32), np.asarray(scores, np.float32), np.asarray(parents, np.int32))


def brute_force(scores, n):
    """Best n-1 slots by (score desc, slot asc), returned in slot order."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(order[: n - 1])


@pytest.mark.parametrize("depth,topk,n", [(1, 1, 2), (3, 1, 4), (2, 3, 7), (4, 2, 9), (3, 4, 1), (5, 4, 26),
                                          (3, 3, 1 + 3 + 9 + 9)])
def test_selected_tree_is_connected_masked_by_ancestors_and_matches_brute_force(depth, topk, n):
    rng = np.random.default_rng(depth * 100 + topk * 10 + n)
    tree = TreeConfig(depth=depth, topk=topk, tree_tokens=n)
    toks, scores, parents = simulated_pool(rng, tree, batch=3)
    root = np.array([7, 8, 9], np.int32)
    out = select_tree(jnp.asarray(root), jnp.asarray(toks), jnp.asarray(scores), jnp.asarray(parents), tree)
    depths_of_slot = tree.pool_depths()
    for b in range(3):
        chosen = brute_force(scores[b].tolist(), n)
        np.testing.assert_array_equal(np.asarray(out.pool_index[b, 1:]), chosen)
        assert int(out.tokens[b, 0]) == root[b]
        np.testing.assert_array_equal(np.asarray(out.tokens[b, 1:]), toks[b, chosen])
        par = np.asarray(out.parents[b])
        dep = np.asarray(out.depths[b])
        assert par[0] == 0 and dep[0] == 0
        for i in range(1, n):
            assert par[i] < i  # connected, parents first
            slot = chosen[i - 1]
            want_parent_slot = parents[b, slot]
            assert (par[i] == 0) if want_parent_slot < 0 else (chosen[par[i] - 1] == want_parent_slot)
            assert dep[i] == dep[par[i]] + 1 == depths_of_slot[slot]
        mask = np.asarray(out.mask[b])
        for i in range(n):
            anc, j = {i}, i
            while j != 0:
                j = par[j]
                anc.add(j)
            assert set(np.flatnonzero(mask[i])) == anc


def test_chain_tree_is_the_greedy_draft_path():
    tree = TreeConfig.chain(4)
    assert tree.pool_size == 4 and tree.tree_tokens == 5
    toks = jnp.asarray([[11, 12, 13, 14]])
    scores = jnp.asarray([[-0.1, -0.5, -0.9, -2.0]])
    parents = jnp.asarray([[-1, 0, 1, 2]])
    out = select_tree(jnp.asarray([10]), toks, scores, parents, tree)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), [10, 11, 12, 13, 14])
    np.testing.assert_array_equal(np.asarray(out.parents[0]), [0, 0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(out.mask[0]), np.tril(np.ones((5, 5), bool)))


def test_ties_between_parent_and_child_keep_the_tree_connected():
    # A child with log-prob 0 ties its parent; the parent has the lower slot and must win the tie.
    tree = TreeConfig(depth=2, topk=2, tree_tokens=3)
    toks = jnp.asarray([[1, 2, 3, 4, 5, 6]])
    scores = jnp.asarray([[-1.0, -3.0, -1.0, -5.0, -4.0, -6.0]])
    parents = jnp.asarray([[-1, -1, 0, 0, 1, 1]])
    out = select_tree(jnp.asarray([0]), toks, scores, parents, tree)
    np.testing.assert_array_equal(np.asarray(out.pool_index[0]), [-1, 0, 2])
    np.testing.assert_array_equal(np.asarray(out.parents[0]), [0, 0, 1])


def test_tree_config_validates_its_fields():
    with pytest.raises(ValueError, match="depth"):
        TreeConfig(depth=0)
    with pytest.raises(ValueError, match="tree_tokens"):
        TreeConfig(depth=2, topk=2, tree_tokens=8)  # root + 2 + 4 = 7 at most
    assert TreeConfig(depth=2, topk=2, tree_tokens=7).pool_size == 6


def test_ancestor_mask_of_a_hand_built_tree():
    parents = jnp.asarray([[0, 0, 0, 1, 1, 3]])
    m = np.asarray(ancestor_mask(parents, depth=3)[0]).astype(int)
    want = np.array([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                     [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 0, 1, 0, 1]])
    np.testing.assert_array_equal(m, want)
