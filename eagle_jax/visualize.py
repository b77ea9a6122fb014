"""One speculative step made visible: the draft tree the head proposes and the path the target accepts.

    trace = eagle_jax.visualize.trace_step(target, head, "Why is the sky blue?", tree=TreeConfig(4, 4, 16))
    trace.accepted_tokens          # the tokens this step emits (accepted drafts + the target's bonus)
    eagle_jax.visualize.plot_tree(trace, target.tokenizer)   # matplotlib: nodes by depth, path highlighted

The trace runs exactly the pieces of `eagle_jax.speculative.spec_step` (prefill, EAGLE-2 expansion,
tree verification, lossless acceptance) on one prompt and returns them as numpy arrays, so the
accepted path is the one speculative decoding would take from this prompt.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.accept import accept
from eagle_jax.engine import encode_prompts, prepare_batch
from eagle_jax.sampling import SamplingParams
from eagle_jax.speculative import _capture, draft_tree, spec_prefill
from eagle_jax.tree import TreeConfig


@dataclasses.dataclass(frozen=True)
class StepTrace:
    tokens: np.ndarray  # [N] node tokens, node 0 = the root (the token sampled from the prompt)
    parents: np.ndarray  # [N] parent node index (the root points at itself)
    depths: np.ndarray  # [N]
    path: np.ndarray  # accepted node indices from the root down (length = accepted nodes)
    bonus: int  # the target's token after the path (the next step's root)
    tree: TreeConfig

    @property
    def accepted_tokens(self) -> list[int]:
        """Tokens the step emits: the accepted drafts below the root, then the bonus token."""
        return [int(self.tokens[i]) for i in self.path[1:]] + [self.bonus]


@functools.partial(jax.jit, static_argnames=("graphdef", "head_graphdef", "tree"))
def _trace(graphdef, state, head_graphdef, head_state, s, params, tree: TreeConfig):
    target = nnx.merge(graphdef, state)
    head = nnx.merge(head_graphdef, head_state)
    t = draft_tree(target, head, s, tree)
    length = s.cache.lengths
    out = target(t.tokens, s.cache, positions=length[:, None] + t.depths, tree_mask=t.mask,
                 capture_layers=_capture(head.cfg), logits_at=None)
    acc = accept(t, out.logits, params, length, tree.depth)
    return t.tokens, t.parents, t.depths, acc.path, acc.count, acc.bonus


def trace_step(target, head, prompt, tree: TreeConfig = TreeConfig(), temperature: float = 0.0, seed: int = 0,
               chat: bool = True) -> StepTrace:
    """The first speculative step after `prompt` (a string, a chat message list or token ids)."""
    if tree.tree_tokens < 2:
        raise ValueError(f"trace_step needs a tree with tree_tokens >= 2, got {tree}")
    ids = encode_prompts(target.tokenizer, [prompt], chat)
    params = SamplingParams.make(1, temperature, 0, 1.0, seed)
    tokens, lens, params, s_len = prepare_batch(target.cfg, ids, 1, params, slack=tree.tree_tokens + tree.depth)
    graphdef, state = nnx.split(target.model)
    head_graphdef, head_state = nnx.split(head)
    cache = target.model.init_cache(tokens.shape[0], s_len)
    dcache = head.init_cache(tokens.shape[0], s_len + (tree.depth - 1) * tree.topk + tree.depth + 1)
    s = spec_prefill(graphdef, state, head_graphdef, head_state, jnp.asarray(tokens), jnp.asarray(lens),
                     cache, dcache, params)
    toks, parents, depths, path, count, bonus = jax.device_get(
        _trace(graphdef, state, head_graphdef, head_state, s, params, tree))
    return StepTrace(tokens=toks[0], parents=parents[0], depths=depths[0], path=path[0, : int(count[0])],
                     bonus=int(bonus[0]), tree=tree)


def plot_tree(trace: StepTrace, tokenizer=None, ax=None, title: str | None = None):
    """Draws the draft tree left to right by depth; the accepted path and the bonus token are highlighted.
    Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    n = len(trace.tokens)
    label = (lambda t: repr(tokenizer.decode([int(t)]))[1:-1] or "·") if tokenizer is not None else str
    # Leaves get consecutive rows; a parent sits at the mean row of its children.
    children = {i: [j for j in range(1, n) if trace.parents[j] == i] for i in range(n)}
    row: dict[int, float] = {}
    nxt = [0.0]

    def place(i):
        if not children[i]:
            row[i] = nxt[0]
            nxt[0] += 1
        else:
            for c in children[i]:
                place(c)
            row[i] = float(np.mean([row[c] for c in children[i]]))

    place(0)
    on_path = set(int(i) for i in trace.path)
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 * (int(trace.depths.max()) + 2), 0.45 * max(nxt[0], 3) + 1))
    for j in range(1, n):
        p = int(trace.parents[j])
        hit = j in on_path and p in on_path
        ax.plot([trace.depths[p], trace.depths[j]], [row[p], row[j]], color="tab:green" if hit else "0.75",
                lw=2.5 if hit else 1, zorder=1)
    for i in range(n):
        hit = i in on_path
        ax.text(trace.depths[i], row[i], label(trace.tokens[i]), ha="center", va="center", fontsize=9, zorder=2,
                bbox=dict(boxstyle="round", fc="palegreen" if hit else "white", ec="tab:green" if hit else "0.6"))
    last = int(trace.path[-1])
    ax.annotate(label(trace.bonus), xy=(trace.depths[last], row[last]),
                xytext=(trace.depths[last] + 1, row[last]), ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round", fc="gold", ec="darkorange"),
                arrowprops=dict(arrowstyle="->", color="darkorange"))
    ax.set_xlim(-0.6, trace.depths.max() + 1.6)
    ax.set_ylim(nxt[0] - 0.4, -0.6)
    ax.set_xticks(range(int(trace.depths.max()) + 2))
    ax.set_xlabel("depth (0 = root; gold = the target's bonus token)")
    ax.set_yticks([])
    ax.set_title(title or f"draft tree {trace.tree.depth},{trace.tree.topk},{trace.tree.tree_tokens}: "
                          f"{len(trace.path) - 1} of {trace.tree.depth} draft tokens accepted")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    return ax
