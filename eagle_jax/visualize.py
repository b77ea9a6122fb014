"""One speculative step made visible: the draft tree the head proposes and the path the target accepts.

    trace = eagle_jax.visualize.trace_step(target, head, "Why is the sky blue?", tree=TreeConfig(4, 4, 16))
    trace.accepted_tokens          # the tokens this step emits (accepted drafts + the target's bonus)
    eagle_jax.visualize.plot_tree(trace, target.tokenizer)   # matplotlib: nodes by depth, path highlighted

The trace runs the engine's prefill and one `eagle_jax.steps.step` (EAGLE-2 expansion, tree
verification, lossless acceptance) on one prompt with trace=True and returns the tree and its
acceptance as numpy arrays, so the accepted path is the one speculative decoding takes from this prompt.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from eagle_jax.engine import encode_prompts, engine_for
from eagle_jax.rows import batch_shapes, pad_prompts
from eagle_jax.sampling import SamplingParams
from eagle_jax.steps import draft_extra, tree_slack
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


def trace_step(target, head, prompt, tree: TreeConfig = TreeConfig(), temperature: float = 0.0, seed: int = 0,
               chat: bool = True) -> StepTrace:
    """The first speculative step after `prompt` (a string, a chat message list or token ids): the
    engine's own step (`steps.step` with trace=True), so what is drawn is what decoding does."""
    if tree.tree_tokens < 2:
        raise ValueError(f"trace_step needs a tree with tree_tokens >= 2, got {tree}")
    eng = engine_for(target, head)
    ids = encode_prompts(target.tokenizer, [prompt], chat)
    b, t, s_len = batch_shapes(target.cfg.max_position, ids, 1, slack=tree_slack([tree]))
    tokens, lens = pad_prompts(ids, b, t)
    params = SamplingParams.make(1, temperature, 0, 1.0, seed).pad_to(b)
    sampling = temperature > 0  # as `generate` compiles it
    s = eng.run_prefill(tokens, lens, s_len, s_len + draft_extra([tree]), params, sampling=sampling)
    active = np.arange(b) < 1
    _, _, _, info = eng.run_step(s, params, active, tree, trace=True, sampling=sampling)
    info = jax.device_get(info)
    return StepTrace(tokens=info["tokens"][0], parents=info["parents"][0], depths=info["depths"][0],
                     path=info["path"][0, : int(info["count"][0])], bonus=int(info["bonus"][0]), tree=tree)


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
