"""The load-aware harness: its choices under synthetic cost profiles, its statistics, its profile cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_jax import profiles
from eagle_jax.harness import AcceptanceStats, Harness
from eagle_jax.profiles import Profile
from eagle_jax.tree import parse_tree, tree_name
from eagle_jax.tree import TreeConfig

TREES = [TreeConfig.chain(3), TreeConfig(4, 4, 8), TreeConfig(5, 4, 16), TreeConfig(6, 4, 24)]
BUCKETS = (1, 2, 4, 8, 16, 32)


def profile_from(cost):
    """A Profile whose step seconds are cost(batch, tree_tokens) for every bucket and candidate."""
    seconds = {b: {tree_name(t): cost(b, 1 if t is None else t.tree_tokens) for t in [None] + TREES}
               for b in BUCKETS}
    return Profile("synthetic", seconds, {})


STEEP = profile_from(lambda b, n: 0.01 * (1 + 0.2 * n * b))  # verify cost grows with N x B (compute-bound)
FLAT = profile_from(lambda b, n: 0.01 * (1 + 0.002 * n))  # an accelerator far from its compute limit


def good_head_stats(alpha=0.8, steps=200, rows=8, seed=0):
    """Statistics after `steps` steps of each tree in turn with a head whose drafts are accepted with
    probability `alpha` at every depth."""
    rng = np.random.default_rng(seed)
    stats = AcceptanceStats(max_depth=6)
    for i in range(steps):
        tree = TREES[i % len(TREES)]
        accepted = np.minimum(rng.geometric(1 - alpha, size=rows) - 1, tree.depth)
        stats.observe(tree, (accepted + 1).tolist())
    return stats


def test_steep_costs_choose_no_speculation_at_large_batch_and_a_tree_at_batch_one():
    h = Harness(TREES, STEEP, stats=good_head_stats())
    assert h.choose(32, 32, 32).name == "off"
    assert h.choose(16, 16, 16).name == "off"
    small = h.choose(1, 1, 1)
    assert small.tree is not None and not small.explore
    # What it picks maximises expected tokens per second among the candidates.
    rates = {tree_name(t): h._tokens(t, 1, 1, bonus=False) / STEEP.cost(1, tree_name(t))
             for t in h.candidates}
    assert small.name == max(rates, key=rates.get)


def test_flat_costs_choose_the_deepest_tree_at_every_batch():
    h = Harness(TREES, FLAT, stats=good_head_stats())
    for b in BUCKETS:
        c = h.choose(b, b, b)
        assert c.tree == TreeConfig(6, 4, 24), (b, c)
        assert c.expected_tokens > 3.5 * b


def test_a_useless_head_gets_no_speculation_even_when_trees_are_cheap():
    stats = AcceptanceStats(max_depth=6)
    for _ in range(300):
        for t in TREES:  # every tree tried; nothing is ever accepted
            stats.observe(t, [1] * 8)
    h = Harness(TREES, FLAT, stats=stats)
    assert [h.choose(b, b, b).name for b in (1, 8, 32)] == ["off"] * 3


def test_rows_out_of_sync_with_their_draft_count_one_token():
    h = Harness(TREES, FLAT, stats=good_head_stats())
    assert h.choose(8, 8, 0).name == "off"  # no row can use a tree: a plain step is cheaper
    c = h.choose(8, 8, 4)
    assert c.tree is not None
    assert c.expected_tokens == pytest.approx(4 * h.stats.expected_tokens(c.tree) + 4)


def test_untried_trees_are_explored_and_dropped_when_they_disappoint():
    stats = AcceptanceStats(max_depth=6)
    h = Harness([TreeConfig.chain(3)], Profile("p", {1: {"off": 0.010, "3,1,4": 0.015}}, {}), stats=stats)
    first = h.choose(1, 1, 1)  # no evidence yet: the prior and the optimism bonus want a look
    assert first.tree == TreeConfig.chain(3)
    for _ in range(50):
        stats.observe(TreeConfig.chain(3), [1])
    later = h.choose(1, 1, 1)
    assert later.name == "off" and not later.explore
    # Close to a break-even cost, the optimism bonus alone asks for a look (exploration).
    h.profile = Profile("p", {1: {"off": 0.010, "3,1,4": 0.0105}}, {})
    assert h.choose(1, 1, 1).explore
    # Evidence decays, so a tree not run for a long time is tried again at any cost that could pay.
    h.profile = Profile("p", {1: {"off": 0.010, "3,1,4": 0.015}}, {})
    for _ in range(6000):
        stats.observe(None, [])
    assert h.choose(1, 1, 1).tree == TreeConfig.chain(3)


def _run_one_row(alpha, steps=4000, seed=0):
    """A batch-1 run under this CPU's measured step costs (ms) where every draft token is accepted
    with probability alpha[topk > 1] at each depth: (time relative to plain steps, choices)."""
    ms = {"off": 20.6, "3,1,4": 29.5, "3,4,8": 34.9, "4,4,16": 43.7, "6,4,24": 55.4}
    trees = [parse_tree(n) for n in ms if n != "off"]
    h = Harness(trees, Profile("cpu", {1: {n: v / 1e3 for n, v in ms.items()}}, {}))
    rng = np.random.default_rng(seed)
    spent = tokens = 0.0
    for _ in range(steps):
        c = h.choose(1, 1, 1, 1)
        n = 1
        if c.tree is not None:
            while n <= c.tree.depth and rng.random() < alpha[c.tree.topk > 1]:
                n += 1
        h.observe(c.tree, [n], [True])
        spent, tokens = spent + ms[c.name], tokens + n
    return (tokens / spent) * ms["off"], h.counts


def test_exploring_costs_little_when_no_tree_pays_and_trees_win_when_they_do():
    # Sampled rows with a poor head (as at temperature 1 on CPU): every tree is slower than a plain
    # step, so the harness may only look now and then.
    speed, counts = _run_one_row(alpha=(0.22, 0.3))
    assert counts["off"] >= 0.98 * 4000 and speed > 0.99, counts
    # A head whose drafts are usually kept: trees nearly all the time, clearly faster than plain.
    speed, counts = _run_one_row(alpha=(0.6, 0.75))
    assert counts.get("off", 0) < 0.05 * 4000 and speed > 1.4, counts


def test_acceptance_rates_are_censored_at_the_tree_depth():
    stats = AcceptanceStats(max_depth=6, prior_accept=0.5, prior_strength=2.0)
    for _ in range(100):
        stats.observe(TreeConfig.chain(2), [3, 3, 2, 1])  # accepted 2, 2, 1, 0 drafts
    a = stats.alpha()
    # depth 1: 3 of 4 rows passed; depth 2: 2 of the 3 that got there; depth 3+: never at risk -> prior.
    assert a[1] == pytest.approx(0.75, abs=0.01) and a[2] == pytest.approx(2 / 3, abs=0.01)
    assert a[3] == pytest.approx(0.5)
    assert stats.expected_tokens(TreeConfig.chain(2)) == pytest.approx(2.25, abs=0.02)  # its own mean dominates
    assert stats.model_tokens(TreeConfig.chain(4)) == pytest.approx(1 + 0.75 + 0.5 + 0.25 + 0.125, abs=0.02)


def test_acceptance_is_modelled_per_tree_width():
    chain, tree = TreeConfig.chain(3), TreeConfig(3, 4, 8)
    stats = AcceptanceStats(max_depth=6)
    for _ in range(300):  # many chain steps: the top-1 draft is accepted 40% of the time at every depth
        stats.observe(chain, [1, 1, 1, 2, 2, 3, 1, 1, 4, 1])  # accepted 0,0,0,1,1,2,0,0,3,0
    assert stats.alpha(1)[1] == pytest.approx(0.4, abs=0.01)
    # A top-4 tree has barely run, but its width's rates lean on the chains' only as a weak prior, and
    # the chains' evidence is not its own, so the optimism bonus still asks for a look at it.
    assert stats.evidence(tree) == 0 and stats.evidence(chain) > 100
    for _ in range(10):
        stats.observe(tree, [3, 4, 2, 3])  # accepted 2, 3, 1, 2 of 3 levels
    assert stats.alpha(4)[1] > 0.85 and stats.alpha(1)[1] == pytest.approx(0.4, abs=0.02)
    assert stats.model_tokens(tree) > 2.5 > 1.75 > stats.model_tokens(chain)
    h = Harness([chain, tree], Profile("p", {1: {"off": 0.010, "3,1,4": 0.015, "3,4,8": 0.017}}, {}), stats=stats)
    assert h.choose(1, 1, 1).name == "3,4,8"


def test_a_batch_with_sampling_rows_is_costed_as_one():
    tree = TreeConfig.chain(3)
    prof = Profile("p", {1: {"off": 0.010, "3,1,4": 0.015, "off:sampled": 0.011, "3,1,4:sampled": 0.040}}, {})
    stats = AcceptanceStats(max_depth=3)
    for _ in range(300):
        stats.observe(tree, [3])
    h = Harness([tree], prof, stats=stats, sampled_stats=stats)  # the same acceptance for both kinds
    assert h.choose(1, 1, 1).name == "3,1,4"  # 3 tokens for 1.5x
    c = h.choose(1, 1, 1, sampled=1)  # 3 tokens for 3.6x a plain step: plain is faster
    assert c.name == "off" and c.seconds == pytest.approx(0.011)
    assert prof.cost(1, "3,1,4", sampled=True) == 0.040
    assert Profile("q", {1: {"off": 0.01}}, {}).cost(1, "off", sampled=True) == 0.01  # not measured: greedy's


def test_candidates_parse_from_strings():
    assert parse_tree("off") is None and parse_tree("4,4,16") == TreeConfig(4, 4, 16)
    assert parse_tree("5,4,12") == TreeConfig(5, 4, 12) and parse_tree("3,2,1") is None
    assert tree_name(TreeConfig(6, 4, 24)) == "6,4,24" == TreeConfig.parse("6,4,24").name and tree_name(None) == "off"
    for bad in ("deep", "4,4", "4,4,99", "d5k4n12"):  # one way to write a tree
        with pytest.raises(ValueError):
            parse_tree(bad)


def test_cost_profile_is_measured_once_cached_on_disk_and_remeasured_on_request(tmp_path, monkeypatch):
    from builders import oracle_pair

    tgt, head = oracle_pair()
    cands = [None, TreeConfig.chain(2)]
    kw = dict(cache_dir=tmp_path, reps=2)
    first = profiles.load_or_measure(tgt, head, (1, 2), cands, 128, 140, **kw)
    assert first.source == "measured"
    assert set(first.seconds) == {1, 2}
    assert set(first.seconds[1]) == {"off", "2,1,3", "off:sampled", "2,1,3:sampled"}  # greedy and sampling rows
    assert all(s > 0 for row in first.seconds.values() for s in row.values())
    files = list(tmp_path.glob("*.json"))
    assert [f.name for f in files] == [first.key + ".json"]
    assert json.loads(files[0].read_text())["meta"]["device"] == profiles.device_kind()

    def no_measuring(*a, **k):
        raise AssertionError("the cached profile should have been used")

    monkeypatch.setattr(profiles, "measure_profile", no_measuring)
    again = profiles.load_or_measure(tgt, head, (1, 2), cands, 128, 140, **kw)
    assert again.source == "cache" and again.seconds == first.seconds
    with pytest.raises(AssertionError, match="cached profile"):
        profiles.load_or_measure(tgt, head, (1, 2), cands, 128, 140, reprofile=True, **kw)
    # Other settings (here a longer cache) are another key, so another measurement.
    other = profiles.profile_key(tgt, head, (1, 2), ["off", "2,1,3"], 256)
    assert other != first.key
    # So is other step code (a step that got cheaper or dearer must be measured again).
    monkeypatch.setattr(profiles, "step_code_hash", lambda: "0" * 16)
    assert profiles.profile_key(tgt, head, (1, 2), ["off", "2,1,3"], 128) != first.key


def test_greedy_and_sampled_rows_are_estimated_apart():
    tree = TreeConfig.chain(3)
    prof = Profile("p", {1: {"off": 0.010, "3,1,4": 0.015}, 2: {"off": 0.010, "3,1,4": 0.015}}, {})
    h = Harness([tree], prof)
    for _ in range(300):  # greedy rows accept the whole chain; sampled rows accept nothing
        h.observe(tree, [4, 1], [False, True])
    assert h.stats.expected_tokens(tree) == pytest.approx(4.0, abs=0.05)
    assert h.sampled_stats.expected_tokens(tree) == pytest.approx(1.0, abs=0.05)
    assert h.choose(1, 1, 1).name == "3,1,4"  # a greedy row: 4 tokens for 1.5x the cost
    assert h.choose(1, 1, 1, sampled=1).name == "off"  # a sampled row: 1 token for 1.5x the cost
    mixed = h.choose(2, 2, 2, sampled=1)
    assert mixed.name == "3,1,4" and mixed.expected_tokens == pytest.approx(5.0, abs=0.1)
    snap = h.snapshot()
    assert snap["tau_ema"] == pytest.approx(4.0) and snap["sampled"]["tau_ema"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sampled flags"):
        h.observe(tree, [4, 1], [False])
    with pytest.raises(ValueError, match="sampled"):
        h.choose(1, 1, 1, sampled=2)
