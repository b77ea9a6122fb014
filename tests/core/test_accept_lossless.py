"""Speculative sampling is lossless over several steps: a two-sample chi-square test on whole sequences.

A one-layer target with a 12-token vocabulary and an EAGLE-1 head that nearly reproduces it (the
`oracle_pair` of builders.py), so drafts are mostly accepted and a depth-3 tree often emits four
tokens in one step. Each arm decodes NEW tokens for N rows of the same prompt: plain decoding with seeds
0..N-1, speculative decoding with seeds 10**6..10**6+N-1 (independent of the plain arm's). Token 1 comes
from the prefill, tokens 2..NEW from verify steps; a row takes two or more of them, so the test covers deep
accepts, the KV commit of an accepted path, the draft refresh after it and the keys of later steps.

The statistic is the joint distribution of all NEW tokens. A sequence seen fewer than MIN_CELL times in
both arms together is not a cell of its own: it is pooled with the other rare sequences sharing its
longest well-populated prefix (a prefix tree, cut where counts get thin), down to one cell for the rarest
first tokens. The cells depend on pooled counts only, so they treat both arms alike; each holds at least
MIN_CELL draws (about 5 expected per arm), which keeps the chi-square approximation sound (a
permutation test of the same table gives the same p-value to within a factor of two).

Observed with these seeds (exact rule): p = 0.0028 (t1, ~1550 cells), 0.41 (t0.7-topk4), 0.027
(topp0.8). The t1 value is a chance low: four other seed pairs gave 0.21-0.71, and 102,400 speculative
draws pooled over five seed sets against the target's exact sequence probabilities give p = 0.49 (the
plain arm at these seeds alone gives 0.01 on that check). The broken rule gives p = 0.0 (underflow) in
every setting, with tau 2.4-3.0 against 2.8-3.5 for the exact rule.
"""


import jax
import numpy as np
import pytest

import eagle_jax
from eagle_jax import steps
from eagle_jax.tree import TreeConfig
from builders import SMALL_VOCAB, oracle_pair

NEW = 6  # tokens per row: one from the prefill, up to four from each depth-3 step
N = 20480  # draws per arm
CHUNK = 4096  # rows per generate call (CPU: about 1 s per plain and 4 s per speculative call once compiled)
PROMPT = [3, 1, 4]
PLAIN_SEED, SPEC_SEED = 0, 10**6  # row r of a chunk starting at s uses seed base + s + r: the arms never overlap
TREE = TreeConfig(3, 3, 10)  # depth 3; three children at the root, so a rejection tries a second and third
MIN_CELL = 10
# Three sampled settings tested apiece: 1e-4 each keeps the chance that a correct implementation fails
# (an unlucky set of seeds) below 3e-4 (Bonferroni); the broken rule's p-values underflow to 0.
ALPHA = 1e-4

SETTINGS = {  # name -> (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "t1": (1.0, 0, 1.0),
    "t0.7-topk4": (0.7, 4, 1.0),
    "topp0.8": (1.0, 0, 0.8),
}


def use_accept_rule(monkeypatch, rule: str) -> None:
    """Selects the acceptance rule the speculative step traces with ("exact" or "broken"), and drops
    jit caches so the next step retraces. The only place this module names the hook."""
    monkeypatch.setattr(steps, "ACCEPT_RULE", rule)
    jax.clear_caches()


@pytest.fixture(scope="module")
def small_oracle():
    tgt, head = oracle_pair(SMALL_VOCAB, attn_scale=1.0, seed=4)
    tgt.model.lm_head[...] = tgt.model.lm_head[...] * 15  # a few nats' spread: peaked, not one-hot
    return tgt, head


_DRAWS = {}  # (arm, setting, rule) -> (tokens [N, NEW], per-step counts, accept histogram); plain arms are reused


def _draws(tgt, head, setting: str, rule: str = "exact", n: int = N):
    arm = "plain" if head is None else "spec"
    key = (arm, setting, rule if head is not None else "-", n)
    if key not in _DRAWS:
        temperature, top_k, top_p = SETTINGS[setting]
        base = PLAIN_SEED if head is None else SPEC_SEED
        rows, counts, hist = [], [], np.zeros(TREE.depth + 1, np.int64)
        for start in range(0, n, CHUNK):
            r = eagle_jax.generate(tgt, [PROMPT] * CHUNK, draft=head, tree=None if head is None else TREE,
                                   max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p,
                                   seed=base + start, ignore_eos=True)
            rows += r.token_ids
            if head is not None:
                counts += r.stats["accepted_per_step"]
                hist[: len(r.stats["accept_histogram"])] += r.stats["accept_histogram"]
        tokens = np.asarray(rows, np.int64)
        assert tokens.shape == (n, NEW)
        _DRAWS[key] = tokens, np.asarray(counts), hist
    return _DRAWS[key]


def prefix_tree_cells(a, b, min_cell: int = MIN_CELL):
    """Counts [2, K] of sequences a [n, T] and b [m, T] in cells of the pooled prefix tree (module doc)."""
    seqs = [tuple(s) for s in a] + [tuple(s) for s in b]
    arm = np.array([0] * len(a) + [1] * len(b))
    cell = [None] * len(seqs)
    pending = list(range(len(seqs)))
    for depth in range(len(seqs[0]), -1, -1):
        groups = {}
        for i in pending:
            groups.setdefault(seqs[i][:depth], []).append(i)
        pending = []
        for prefix, members in groups.items():
            if len(members) >= min_cell or depth == 0:
                for i in members:
                    cell[i] = prefix
            else:
                pending += members
    ids = {c: k for k, c in enumerate(sorted(set(cell)))}
    out = np.zeros((2, len(ids)), np.int64)
    np.add.at(out, (arm, [ids[c] for c in cell]), 1)
    return out


def joint_p(a, b) -> float:
    from scipy.stats import chi2_contingency

    table = prefix_tree_cells(a, b)
    return float(chi2_contingency(table)[1]) if table.shape[1] > 1 else 1.0


def test_prefix_tree_cells_pool_rare_sequences_under_their_prefix():
    common = [(1, 2, 3)] * 12
    rare_12 = [(1, 2, 4)] * 6 + [(1, 2, 5)] * 5  # 11 together: one cell (1, 2)
    rare = [(7, 7, 7)] * 3 + [(8, 0, 0)] * 2  # thin all the way down: the root cell ()
    a = np.array(common[:6] + rare_12[:6] + rare[:3])
    b = np.array(common[6:] + rare_12[6:] + rare[3:])
    table = prefix_tree_cells(a, b)
    # cells in order (), (1, 2), (1, 2, 3)
    np.testing.assert_array_equal(table, [[3, 6, 6], [2, 5, 6]])
    assert table.sum() == len(a) + len(b)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_sampling_matches_plain_sampling_jointly_over_six_tokens(small_oracle, setting):
    tgt, head = small_oracle
    if setting == "greedy":
        # Greedy output does not depend on the seed: many prompts (same length, so the same compiled
        # steps), and every row must match plain decoding token for token.
        prompts = np.random.default_rng(0).integers(0, SMALL_VOCAB.vocab_size, (CHUNK, len(PROMPT))).tolist()
        plain = eagle_jax.generate(tgt, prompts, max_new_tokens=NEW, ignore_eos=True)
        spec = eagle_jax.generate(tgt, prompts, draft=head, tree=TREE, max_new_tokens=NEW, ignore_eos=True)
        assert spec.token_ids == plain.token_ids
        assert len({tuple(t) for t in plain.token_ids}) > 5  # not one sequence repeated (9 here)
        tau, hist = spec.stats["tau"], spec.stats["accept_histogram"]
    else:
        plain, _, _ = _draws(tgt, None, setting)
        spec, counts, hist = _draws(tgt, head, setting)
        tau = counts.mean()
        p = joint_p(plain, spec)
        assert p > ALPHA, f"{setting}: speculative sequences differ from plain ones (chi-square p = {p:.3g})"
    # The step really accepts deep paths: over 1.5 tokens per step, and full-depth accepts happen.
    assert tau > 1.5, tau
    assert len(hist) == TREE.depth + 1 and hist[TREE.depth] > 0.1 * sum(hist), hist


@pytest.mark.slow
def test_a_wrong_residual_fails_the_six_token_test(small_oracle, monkeypatch):
    """The test has power: the "broken" rule (no renormalisation after a rejected sibling) is caught, with
    a fifth of the draws in its arm (one chunk: p was 1e-153 to 1e-177 over three seed sets)."""
    tgt, head = small_oracle
    plain, _, _ = _draws(tgt, None, "t1")
    use_accept_rule(monkeypatch, "broken")
    try:
        spec, counts, _ = _draws(tgt, head, "t1", rule="broken", n=CHUNK)
    finally:
        use_accept_rule(monkeypatch, "exact")
    assert counts.mean() > 1.5
    p = joint_p(plain, spec)
    assert p < 1e-6, f"the broken rule passed the chi-square test (p = {p:.3g})"
