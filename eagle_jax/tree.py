"""Static-shape dynamic draft trees (EAGLE-2).

The draft expands a tree depth by depth: the root's top-k children form the first frontier; each
later depth takes the top-k children of every frontier node (k*k candidates), scores them by
cumulative draft log-probability, and keeps the k best as the next frontier. Every candidate ever
produced goes into a pool; the final tree is the root plus the N-1 best-scoring candidates.

Why the result is always a connected tree: a child's score is its parent's score plus a log-prob
(<= 0), so it never beats its parent; `lax.top_k` breaks ties by lower index, and a parent always
has a lower pool index than its children (pools are filled depth by depth). So whenever a child is
selected its parent is too.

Nodes of the output tree are ordered by pool index: node 0 is the root, parents come before
children, and siblings appear in draft order (descending draft probability). Every array has a
static shape fixed by the `TreeConfig`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """depth: draft steps; topk: children per expanded node and frontier width; tree_tokens: N,
    the number of tokens the target verifies per step (root included)."""

    depth: int = 4
    topk: int = 4
    tree_tokens: int = 16

    def __post_init__(self):
        if self.depth < 1:
            raise ValueError(f"TreeConfig.depth must be >= 1, got {self.depth}")
        if self.topk < 1:
            raise ValueError(f"TreeConfig.topk must be >= 1, got {self.topk}")
        if not 1 <= self.tree_tokens <= 1 + self.pool_size:
            raise ValueError(
                f"TreeConfig.tree_tokens must be in [1, {1 + self.pool_size}] for depth {self.depth} and "
                f"topk {self.topk} (root + every candidate), got {self.tree_tokens}"
            )

    @property
    def pool_size(self) -> int:
        """Candidates produced by the expansion: k at depth 1, k*k at each later depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def name(self) -> str:
        """"D,K,N": the one way trees are written (CLI flags, presets, stats, metrics labels)."""
        return f"{self.depth},{self.topk},{self.tree_tokens}"

    @classmethod
    def parse(cls, text) -> "TreeConfig":
        """A TreeConfig from "D,K,N" (e.g. "4,4,16"); a ValueError naming the text otherwise."""
        if isinstance(text, cls):
            return text
        parts = str(text).strip().split(",")
        try:
            depth, topk, tokens = (int(x) for x in parts)
        except ValueError:
            raise ValueError(f"a tree is DEPTH,TOPK,TOKENS (e.g. 4,4,16), got {text!r}") from None
        return cls(depth, topk, tokens)

    @classmethod
    def chain(cls, depth: int) -> "TreeConfig":
        return cls(depth=depth, topk=1, tree_tokens=depth + 1)

    def pool_depths(self):
        """Depth (1-based) of each pool slot, a static numpy array [C]."""
        import numpy as np

        k = self.topk
        return np.concatenate([np.ones(k, np.int32)] + [np.full(k * k, j, np.int32) for j in range(2, self.depth + 1)])


OFF = "off"  # the name of a plain step (no speculation)


def tree_name(tree: "TreeConfig | None") -> str:
    """"D,K,N" for a tree, "off" for a plain step (None)."""
    return OFF if tree is None else tree.name


def parse_tree(text) -> "TreeConfig | None":
    """"off" (also "none" / "plain") -> None; "D,K,N" -> a TreeConfig (one of 1 token is a plain step: None)."""
    if text is None or isinstance(text, TreeConfig):
        return None if text is not None and text.tree_tokens == 1 else text
    if str(text).strip().lower() in (OFF, "none", "plain"):
        return None
    tree = TreeConfig.parse(text)
    return None if tree.tree_tokens == 1 else tree


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "parents", "depths", "mask", "pool_index"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Tree:
    tokens: jax.Array  # [B, N] node 0 = root
    parents: jax.Array  # [B, N] node index of the parent; the root points at itself (0)
    depths: jax.Array  # [B, N] 0 for the root
    mask: jax.Array  # [B, N, N] bool: mask[b, i, j] = node j is an ancestor of node i (or i itself)
    pool_index: jax.Array  # [B, N] pool slot of each node; -1 for the root


def select_tree(root_tokens, pool_tokens, pool_scores, pool_parents, tree: TreeConfig) -> Tree:
    """Keeps the root plus the N-1 best pool candidates.

    root_tokens [B]; pool_tokens / pool_scores / pool_parents [B, C] with C = tree.pool_size, where
    pool_parents holds the pool slot of each candidate's parent (-1 for the root's children).
    """
    b, c = pool_tokens.shape
    n = tree.tree_tokens
    depth_of_slot = jnp.asarray(tree.pool_depths())
    if n > 1:
        _, chosen = jax.lax.top_k(pool_scores, n - 1)  # [B, N-1], best first; ties -> lower slot
        # Pool order: parents before children, siblings in draft order. The N-1 slots are distinct, so each
        # one's place is how many chosen slots are smaller; placed by a one-hot sum rather than a sort
        # (XLA:CPU cannot serialize a sort's comparator, and stored programs must be serializable).
        rank = jnp.sum(chosen[:, None, :] < chosen[:, :, None], axis=-1)  # [B, N-1]
        place = rank[:, :, None] == jnp.arange(n - 1, dtype=rank.dtype)[None, None, :]  # [B, from, to]
        chosen = jnp.sum(jnp.where(place, chosen[:, :, None], 0), axis=1).astype(jnp.int32)
    else:
        chosen = jnp.zeros((b, 0), jnp.int32)
    node_of_slot = jnp.full((b, c), -1, jnp.int32)
    node_of_slot = jax.vmap(lambda row, idx: row.at[idx].set(jnp.arange(1, n, dtype=jnp.int32)))(node_of_slot, chosen)
    parent_slot = jnp.take_along_axis(pool_parents, chosen, axis=1)  # [B, N-1]
    parent_node = jnp.where(parent_slot < 0, 0,
                            jnp.take_along_axis(node_of_slot, jnp.maximum(parent_slot, 0), axis=1))
    tokens = jnp.concatenate([root_tokens[:, None], jnp.take_along_axis(pool_tokens, chosen, axis=1)], axis=1)
    parents = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent_node], axis=1)
    depths = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depth_of_slot[chosen]], axis=1)
    pool_index = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), chosen.astype(jnp.int32)], axis=1)
    return Tree(tokens.astype(jnp.int32), parents, depths, ancestor_mask(parents, tree.depth), pool_index)


def ancestor_mask(parents, depth: int):
    """[B, N, N] ancestor closure (self included) from parent pointers; `depth` bounds the path length."""
    b, n = parents.shape
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
    mask = eye
    for _ in range(depth):
        mask = eye | jnp.take_along_axis(mask, parents[:, :, None], axis=1)
    return mask
