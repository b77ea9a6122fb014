"""Lossless acceptance of a verified draft tree (greedy and sampling in one rule).

Walk down from the root. At the current node u the target's distribution for the next token is
p = probs(target logits at u) (temperature / top-k / top-p applied; one-hot argmax for greedy rows).
The draft proposed u's children c_1, c_2, ... deterministically (top-k), in draft order. Try them in
order: accept c_i with probability r_i(c_i), where r_1 = p and r_{i+1} is r_i with c_i zeroed and
renormalised. Equivalently, with distinct tokens, accept c_i with probability
p(c_i) / (1 - p(c_1) - ... - p(c_{i-1})). If every child is rejected, the bonus token is drawn from
the final residual (p with all children zeroed, renormalised) and the walk stops.

Why this is exact: the probability that token x is emitted at u is p(c_1) if x = c_1; otherwise
(1 - p(c_1)) * r_2(x) = p(x) when x = c_2 (by the definition of r_2), and so on down the list; a token
outside the children is emitted with probability (1 - sum_i p(c_i)) * p(x) / (1 - sum_i p(c_i)) = p(x).
So each emitted token has exactly the target's distribution given the prefix, whichever children the
draft proposed: speculative sampling with point-mass proposals. For greedy rows p is one-hot, so the
rule accepts exactly the child equal to the argmax and otherwise emits the argmax.

Random numbers for the token at sequence position q come from fold_in(PRNGKey(seed), q), so a step
never reuses the randomness of an earlier step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from eagle_jax.sampling import SamplingParams, probs, row_keys
from eagle_jax.tree import Tree


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["path", "count", "bonus"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Acceptance:
    path: jax.Array  # [B, D+1] node indices from the root down the accepted path (padded with the last)
    count: jax.Array  # [B] accepted nodes including the root, 1..D+1 (= tokens emitted this step)
    bonus: jax.Array  # [B] the token drawn at the end of the path (the next step's root)


def accept(tree: Tree, target_logits, params: SamplingParams, root_positions, depth: int,
           rule: str = "exact", sampling: bool = True) -> Acceptance:
    """target_logits [B, N, V] from verifying `tree`; root_positions [B] = sequence position of node 0.

    A batch with no sampling row takes `accept_greedy` (the same result without the vocabulary-wide
    distributions and random draws, which cost a CPU step several milliseconds); sampling=False (static)
    means the caller knows every row is greedy: only `accept_greedy` is in the program.
    `rule="broken"` exists only so tests can show the statistical test rejects a wrong rule: it
    skips the renormalisation after a rejection.
    """
    if not sampling:
        return accept_greedy(tree, target_logits, depth)
    return jax.lax.cond(jnp.any(params.temperature > 0),
                        lambda: accept_sampled(tree, target_logits, params, root_positions, depth, rule),
                        lambda: accept_greedy(tree, target_logits, depth))


def _children(tree: Tree):
    n = tree.tokens.shape[1]
    # child_of[b, u, c]: node c is a child of node u.
    return (tree.parents[:, None, :] == jnp.arange(n)[None, :, None]) & (jnp.arange(n) > 0)[None, None, :]


def accept_greedy(tree: Tree, target_logits, depth: int) -> Acceptance:
    """The rule for greedy rows: follow the child equal to the target's argmax; the bonus is the argmax
    where no child matches. (Siblings carry distinct tokens, so at most one child matches, and the
    general rule with one-hot p does exactly this.)"""
    b = tree.tokens.shape[0]
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    child_of = _children(tree)
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    done = jnp.zeros((b,), bool)
    count = jnp.ones((b,), jnp.int32)
    bonus = jnp.zeros((b,), jnp.int32)
    path = [cur]
    for level in range(depth + 1):
        want = best[rows, cur]  # [B]
        hit = child_of[rows, cur] & (tree.tokens == want[:, None])
        any_hit = jnp.any(hit, axis=1)
        first = jnp.argmax(hit, axis=1).astype(jnp.int32)
        stop_here = ~done & ~any_hit
        bonus = jnp.where(stop_here, want, bonus)
        advance = ~done & any_hit
        cur = jnp.where(advance, first, cur)
        count = count + advance.astype(jnp.int32)
        done = done | stop_here
        if level < depth:
            path.append(cur)
    return Acceptance(jnp.stack(path, axis=1), count, bonus)


def accept_sampled(tree: Tree, target_logits, params: SamplingParams, root_positions, depth: int,
                    rule: str) -> Acceptance:
    b, n = tree.tokens.shape
    p_all = probs(target_logits, params)  # [B, N, V]
    child_of = _children(tree)
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    done = jnp.zeros((b,), bool)
    count = jnp.ones((b,), jnp.int32)
    path = [cur]
    # The keys of positions root + 1 .. root + depth + 1 and each level's uniforms, drawn at once (one
    # hash in the compiled step instead of one per level; the same numbers either way).
    keys = row_keys(params.seed, root_positions[:, None] + 1 + jnp.arange(depth + 1))  # [B, D+1, 2]
    uniforms = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (n,))))(keys)
    for level in range(depth + 1):
        p = p_all[rows, cur]  # [B, V]
        kids = child_of[rows, cur]  # [B, N]
        p_kid = jnp.where(kids, jnp.take_along_axis(p, tree.tokens, axis=1), 0.0)  # [B, N]
        before = jnp.cumsum(p_kid, axis=1) - p_kid
        if rule == "exact":
            denom = 1.0 - before
            a = jnp.where(denom > 1e-9, p_kid / jnp.maximum(denom, 1e-9), 1.0)
        else:
            a = p_kid
        hit = kids & (uniforms[:, level] < a)  # the token at position root + level + 1
        any_hit = jnp.any(hit, axis=1)
        first = jnp.argmax(hit, axis=1).astype(jnp.int32)  # lowest node index = first in draft order
        advance = ~done & any_hit
        done = done | ~any_hit
        cur = jnp.where(advance, first, cur)
        count = count + advance.astype(jnp.int32)
        if level < depth:
            path.append(cur)
    # Every row stopped at `cur` (a node at the tree's depth has no children), rejecting its children:
    # the bonus is drawn once, from the residual there (p with those children's tokens zeroed,
    # renormalised), with the key of its position root + count.
    key = keys[rows, count - 1]
    p = p_all[rows, cur]
    vocab = p.shape[-1]
    kid_tokens = jnp.where(child_of[rows, cur], tree.tokens, vocab)  # out of range = not a child: dropped
    residual = p.at[rows[:, None], kid_tokens].set(0.0, mode="drop")
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p)  # float safety
    bonus = jax.vmap(lambda k, r: jax.random.categorical(jax.random.fold_in(k, 2), jnp.log(r)))(key, residual)
    return Acceptance(jnp.stack(path, axis=1), count, bonus.astype(jnp.int32))
