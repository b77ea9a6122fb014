"""eagle_jax.visualize: the traced step is the step speculative decoding takes, and it draws."""

import pytest

import eagle_jax
from eagle_jax.tree import TreeConfig
from eagle_jax.visualize import plot_tree, trace_step
from builders import PROMPTS, oracle_pair


def test_the_traced_step_emits_the_next_plain_greedy_tokens():
    tree = TreeConfig(4, 4, 16)
    tgt, head = oracle_pair()
    accepted = 0
    for prompt in PROMPTS:
        trace = trace_step(tgt, head, prompt, tree=tree, chat=False)
        plain = eagle_jax.generate(tgt, [prompt], max_new_tokens=tree.depth + 2, chat=False).token_ids[0]
        # Node 0 is the token sampled after the prompt; the step then emits accepted drafts + bonus.
        assert int(trace.tokens[0]) == plain[0]
        emitted = trace.accepted_tokens
        assert emitted == plain[1: 1 + len(emitted)]
        assert len(trace.tokens) == tree.tree_tokens and 1 <= len(trace.path) <= tree.depth + 1
        # The path walks parent -> child one depth at a time.
        assert trace.path[0] == 0
        for a, b in zip(trace.path[:-1], trace.path[1:]):
            assert trace.parents[b] == a and trace.depths[b] == trace.depths[a] + 1
        accepted += len(trace.path) - 1
    assert accepted >= len(PROMPTS)  # the oracle head's drafts are usually accepted: paths are not trivial


def test_plot_tree_draws_every_node_and_highlights_the_path():
    import matplotlib

    matplotlib.use("Agg")
    tgt, head = oracle_pair()
    trace = trace_step(tgt, head, PROMPTS[0], tree=TreeConfig(4, 4, 16), chat=False)
    ax = plot_tree(trace)
    texts = [t for t in ax.texts]
    assert len(texts) == len(trace.tokens) + 1  # every node and the bonus token
    green = [t for t in texts if t.get_bbox_patch().get_facecolor()[:3] == matplotlib.colors.to_rgb("palegreen")]
    assert len(green) == len(trace.path)
    with pytest.raises(ValueError, match="tree_tokens"):
        trace_step(tgt, head, PROMPTS[0], tree=TreeConfig(1, 1, 1), chat=False)
