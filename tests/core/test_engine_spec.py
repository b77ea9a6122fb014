"""Speculative decoding is lossless: greedy token for token, sampling in distribution."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle_jax
from eagle_jax import engine, profiles, rows, steps
from eagle_jax.sampling import SamplingParams
from eagle_jax.tree import parse_tree
from eagle_jax.draft import DraftLoadError, load_draft, random_head, save_draft
from eagle_jax.tree import TreeConfig
from builders import MORE_PROMPTS, PROMPTS, SMALL_VOCAB, TINY, oracle_pair, tiny_target, two_sample_p
from builders import write_profile as _profile

@pytest.fixture(scope="module")
def oracle():
    return oracle_pair()


@pytest.fixture(scope="module")
def deep_target():
    return tiny_target(dataclasses.replace(TINY, num_layers=6))


TREES = [TreeConfig.chain(1), TreeConfig.chain(2), TreeConfig.chain(4), TreeConfig.chain(8), TreeConfig(2, 2, 1),
         TreeConfig(3, 3, 10), TreeConfig(4, 4, 26), TreeConfig(4, 8, 64), TreeConfig(1, 8, 5), TreeConfig(6, 2, 20),
         TreeConfig(3, 5, 31)]


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_greedy_speculative_equals_plain_greedy_for_every_tree_shape(oracle, tree):
    tgt, head = oracle
    plain = eagle_jax.generate(tgt, MORE_PROMPTS, max_new_tokens=24)
    spec = eagle_jax.generate(tgt, MORE_PROMPTS, draft=head, tree=tree, max_new_tokens=24)
    assert spec.token_ids == plain.token_ids
    if tree.tree_tokens > 1:
        assert spec.stats["tau"] > 1.5  # the oracle head's drafts are mostly accepted
    assert sum((i + 1) * c for i, c in enumerate(spec.stats["accept_histogram"])) == sum(
        spec.stats["accepted_per_step"])


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
def test_greedy_speculative_equals_plain_for_ragged_batches(oracle, batch):
    tgt, head = oracle
    prompts = MORE_PROMPTS[:batch]
    plain = eagle_jax.generate(tgt, prompts, max_new_tokens=17)
    spec = eagle_jax.generate(tgt, prompts, draft=head, tree=TreeConfig(3, 2, 7), max_new_tokens=17)
    assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("tree", [TreeConfig.chain(8), TreeConfig(4, 4, 16)], ids=str)
def test_greedy_speculative_with_an_attention_window_equals_plain(oracle, tree):
    """Windows grow as rows do, with room for a step in flight and its tree (tau > 2: several tokens a step)."""
    tgt, head = oracle
    plain = eagle_jax.generate(tgt, MORE_PROMPTS, max_new_tokens=140)  # cache 256: windows of 128, then all
    spec = eagle_jax.generate(tgt, MORE_PROMPTS, draft=head, tree=tree, max_new_tokens=140, attention_window=True)
    assert spec.token_ids == plain.token_ids and spec.stats["tau"] > 2


@pytest.mark.parametrize("tree", [None, TreeConfig.chain(8), TreeConfig(4, 4, 16)], ids=str)
def test_every_windowed_step_holds_its_rows_and_their_tree(oracle, tree, monkeypatch):
    """The host picks each window before it has read the steps in flight: it must leave room for what
    they may commit plus this step's tree, for every active row (checked against the device's lengths)."""
    tgt, head = oracle
    eng = engine.Engine(tgt, head)
    run_step, seen = eng.run_step, []

    def checked(s, params, active, step_tree, trace=False, window=None, sampling=True):
        lengths = np.asarray(s.cache.lengths)[np.asarray(active)]
        need = int(lengths.max(initial=0)) + (step_tree.tree_tokens if step_tree is not None else 1)
        seen.append((need, window))
        return run_step(s, params, active, step_tree, trace, window, sampling)

    monkeypatch.setattr(eng, "run_step", checked)
    eng.generate([list(p) for p in MORE_PROMPTS], max_new_tokens=140, params=SamplingParams.make(len(MORE_PROMPTS)),
                 tree=tree, attention_window=True)
    assert {w for _, w in seen} == {128, None}  # the window grew past 128 during the run
    assert all(need <= w for need, w in seen if w is not None), [x for x in seen if x[1] and x[0] > x[1]]
    assert max(need for need, w in seen if w == 128) > 128 - 8  # rows came right up to the window's edge


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("tree", [TreeConfig.chain(3), TreeConfig(3, 4, 12)], ids=str)
def test_untrained_random_heads_are_lossless_on_a_deeper_target(deep_target, kind, tree):
    head = random_head(deep_target.cfg, kind, seed=3, draft_vocab_size=60)
    plain = eagle_jax.generate(deep_target, MORE_PROMPTS, max_new_tokens=16)
    spec = eagle_jax.generate(deep_target, MORE_PROMPTS, draft=head, tree=tree, max_new_tokens=16)
    assert spec.token_ids == plain.token_ids
    assert 1.0 <= spec.stats["tau"] < 1.5


def test_rows_that_stop_early_do_not_disturb_the_others(oracle):
    tgt, head = oracle
    free = eagle_jax.generate(tgt, MORE_PROMPTS, max_new_tokens=20).token_ids
    eos = free[0][3]
    stopping_tgt = tiny_target(dataclasses.replace(tgt.cfg, eos_token_ids=(eos,)))
    stopping_tgt.model.layers[0].wo[...] = tgt.model.layers[0].wo[...]
    stopping_tgt.model.final_norm[...] = tgt.model.final_norm[...]
    plain = eagle_jax.generate(stopping_tgt, MORE_PROMPTS, max_new_tokens=20)
    spec = eagle_jax.generate(stopping_tgt, MORE_PROMPTS, draft=head, tree=TreeConfig(4, 2, 9), max_new_tokens=20)
    assert spec.token_ids == plain.token_ids
    assert spec.finish_reasons == plain.finish_reasons
    assert "stop" in spec.finish_reasons and "length" in spec.finish_reasons


def test_no_recompilation_across_steps_or_calls(oracle):
    tgt, head = oracle
    tree = TreeConfig(3, 2, 6)
    # A cache length no other test uses, so this process has not compiled these programs before.
    eagle_jax.generate(tgt, [PROMPTS[0], PROMPTS[3]], draft=head, tree=tree, max_new_tokens=12, cache_len=1024)
    greedy = dict(steps.TRACE_COUNTS)
    # A sampling call compiles the steps with sampling paths, once (an all-greedy call's have none).
    eagle_jax.generate(tgt, [PROMPTS[3], PROMPTS[0]], draft=head, tree=tree, max_new_tokens=12, temperature=1.0,
                       cache_len=1024)
    before = dict(steps.TRACE_COUNTS)
    assert before == {k: greedy.get(k, 0) + 1 for k in ("prefill", "step")} | {
        k: v for k, v in greedy.items() if k not in ("prefill", "step")}
    # Same buckets (batch 2, prompts <= 16 tokens, cache 1024), other prompts, lengths and sampling settings.
    r = eagle_jax.generate(tgt, [PROMPTS[2], [5] * 9], draft=head, tree=tree, max_new_tokens=20,
                           temperature=0.8, top_k=5, top_p=0.9, seed=5, cache_len=1024)
    assert r.stats["steps"] > 3
    r = eagle_jax.generate(tgt, [PROMPTS[2], [5] * 9], draft=head, tree=tree, max_new_tokens=20, cache_len=1024)
    assert r.stats["steps"] > 3
    assert dict(steps.TRACE_COUNTS) == before


_PLAIN_PAIRS = {}  # (n, temperature, top_k, top_p) -> plain decoding's pairs, shared by the tests below


def _first_two(tgt, head, n, temperature, top_k, top_p, tree=None):
    """First two sampled tokens of n independent rows (seeds 0..n-1), in chunks of 4096 rows."""
    key = (n, temperature, top_k, top_p)
    if head is None and key in _PLAIN_PAIRS:
        return _PLAIN_PAIRS[key]
    out = []
    chunk = 4096
    for start in range(0, n, chunk):
        prompts = [[3, 1, 4]] * min(chunk, n - start)
        r = eagle_jax.generate(tgt, prompts, draft=head, tree=tree, max_new_tokens=2, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=start, ignore_eos=True)
        out += [tuple(t[:2]) for t in r.token_ids]
    if head is None:
        _PLAIN_PAIRS[key] = out
    return out


@pytest.fixture(scope="module")
def small_oracle():
    tgt, head = oracle_pair(SMALL_VOCAB, attn_scale=1.0, seed=4)
    # Logits of a few nats' spread: peaked enough that a wrong acceptance rule shows, not one-hot.
    tgt.model.lm_head[...] = tgt.model.lm_head[...] * 15
    return tgt, head


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 1.0), (1.2, 0, 0.8)])
def test_sampled_speculation_matches_plain_sampling_jointly_over_two_tokens(small_oracle, temperature, top_k, top_p):
    tgt, head = small_oracle
    n = 20480
    plain = _first_two(tgt, None, n, temperature, top_k, top_p)
    spec = _first_two(tgt, head, n, temperature, top_k, top_p, TreeConfig(2, 3, 7))
    assert two_sample_p(plain, spec, 12) > 0.01


@pytest.mark.slow
def test_a_broken_acceptance_rule_fails_the_two_token_test(small_oracle, monkeypatch):
    tgt, head = small_oracle
    n = 20480
    plain = _first_two(tgt, None, n, 1.0, 0, 1.0)
    monkeypatch.setattr(steps, "ACCEPT_RULE", "broken")
    jax.clear_caches()
    try:  # a fifth of the draws in the broken arm: enough to reject it (p below 1e-6 at 4096)
        spec = _first_two(tgt, head, 4096, 1.0, 0, 1.0, TreeConfig(2, 3, 7))
    finally:
        monkeypatch.setattr(steps, "ACCEPT_RULE", "exact")
        jax.clear_caches()
    assert two_sample_p(plain, spec, 12) < 0.01


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_official_layout_round_trip_gives_identical_outputs(deep_target, tmp_path, kind):
    head = random_head(deep_target.cfg, kind, seed=7, draft_vocab_size=60)
    if kind == "eagle3":
        head.d2t[...] = jnp.asarray(np.arange(60) % 7, jnp.int32)  # a non-trivial vocabulary map
    save_draft(head, tmp_path / kind)
    from safetensors import safe_open

    with safe_open(str(tmp_path / kind / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    if kind == "eagle3":
        assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
                "lm_head.weight", "d2t", "t2d"} <= names
    else:
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= names
    loaded = eagle_jax.load_draft(tmp_path / kind, deep_target.cfg)
    a = eagle_jax.generate(deep_target, PROMPTS, draft=head, tree=TreeConfig(3, 3, 9), max_new_tokens=8,
                           temperature=0.9, seed=1)
    b = eagle_jax.generate(deep_target, PROMPTS, draft=loaded, tree=TreeConfig(3, 3, 9), max_new_tokens=8,
                           temperature=0.9, seed=1)
    assert a.token_ids == b.token_ids and a.stats["accepted_per_step"] == b.stats["accepted_per_step"]
    for name in ("fc", "wq", "w_down"):
        np.testing.assert_array_equal(np.asarray(getattr(head, name)[...]), np.asarray(getattr(loaded, name)[...]))


def test_bfloat16_storage_halves_the_file_and_rounds_weights(deep_target, tmp_path):
    import ml_dtypes

    head = random_head(deep_target.cfg, "eagle3", seed=3, draft_vocab_size=60)
    save_draft(head, tmp_path / "f32")
    save_draft(head, tmp_path / "bf16", dtype="bfloat16")
    f32 = (tmp_path / "f32" / "model.safetensors").stat().st_size
    bf16 = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert bf16 < 0.6 * f32
    loaded = eagle_jax.load_draft(tmp_path / "bf16", deep_target.cfg)
    want = np.asarray(head.fc[...]).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(loaded.fc[...]), want)
    assert loaded.fc[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded.d2t[...]), np.asarray(head.d2t[...]))
    with pytest.raises(ValueError, match="dtype"):
        save_draft(head, tmp_path / "x", dtype="float16")


def test_loading_a_broken_head_names_the_tensor(deep_target, tmp_path):
    from safetensors.numpy import load_file, save_file

    head = random_head(deep_target.cfg, "eagle3", draft_vocab_size=60)
    save_draft(head, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    bad = dict(tensors, **{"midlayer.self_attn.q_proj.weight": np.zeros((3, 5), np.float32)})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftLoadError, match=r"midlayer\.self_attn\.q_proj\.weight.*\(3, 5\).*\(48, 96\)"):
        load_draft(tmp_path, deep_target.cfg)
    missing = {k: v for k, v in tensors.items() if k != "norm.weight"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftLoadError, match=r"missing tensor 'norm\.weight'"):
        load_draft(tmp_path, deep_target.cfg)
    with pytest.raises(DraftLoadError, match="config.json"):
        load_draft(tmp_path / "nowhere")


def test_a_vocabulary_map_that_is_not_one_to_one_is_refused(deep_target, tmp_path):
    """Two draft ids on one target id would let sibling drafts share a token (the acceptance rule needs
    distinct siblings); a target id outside the vocabulary is no token at all. save_draft refuses both
    before writing anything; load_draft refuses a file that has one, naming the file, `d2t` and an example."""
    import re

    from safetensors.numpy import load_file, save_file

    vocab = deep_target.cfg.vocab_size  # 97
    head = random_head(deep_target.cfg, "eagle3", draft_vocab_size=60)
    good = tmp_path / "good"
    save_draft(head, good)
    weights = good / "model.safetensors"
    tensors = load_file(str(weights))
    identity = np.zeros(60, np.int64)
    colliding = identity.copy()
    colliding[5] = -2  # draft id 5 -> target id 3, as draft id 3
    colliding[40] = -1  # draft id 40 -> target id 39, as draft id 39
    too_high = identity.copy()
    too_high[59] = vocab - 59  # draft id 59 -> target id 97
    negative = identity.copy()
    negative[0] = -1  # draft id 0 -> target id -1
    cases = [(colliding, r"draft ids 3 and 5 both map to target id 3 \(2 draft ids repeat"),
             (too_high, rf"draft id 59 maps to target id 97, outside the target vocabulary \[0, {vocab}\)"),
             (negative, rf"draft id 0 maps to target id -1, outside the target vocabulary \[0, {vocab}\)")]
    for d2t, why in cases:
        head.d2t[...] = jnp.asarray(d2t, jnp.int32)
        with pytest.raises(ValueError, match=r"save_draft: head\.d2t .*" + why):
            save_draft(head, tmp_path / "refused")
        assert not (tmp_path / "refused").exists()
        save_file(dict(tensors, d2t=d2t), str(weights))
        with pytest.raises(DraftLoadError, match=re.escape(str(weights)) + r": tensor 'd2t' .*" + why):
            load_draft(good, deep_target.cfg)
    save_file(tensors, str(weights))
    assert load_draft(good, deep_target.cfg).cfg.draft_vocab_size == 60  # the file itself was fine


@pytest.mark.slow
def test_switching_tree_configs_between_steps_needs_no_recompile_and_stays_lossless(oracle):
    """A scheduler may pick any precompiled TreeConfig (or none) per step over the same state."""
    from eagle_jax.sampling import SamplingParams

    tgt, head = oracle
    prompts = MORE_PROMPTS[:4]
    plain = eagle_jax.generate(tgt, prompts, max_new_tokens=30).token_ids
    eng = engine.engine_for(tgt, head)
    trees = [TreeConfig(4, 4, 1), TreeConfig.chain(3), TreeConfig(4, 4, 16), TreeConfig(2, 2, 5)]
    b, s_len = 4, 128
    depth, topk = 4, 4  # the draft cache is sized for the largest tree
    tokens = np.zeros((b, 24), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    params = SamplingParams.make(b)
    st = steps.prefill(eng.graphdef, eng.state, eng.head_graphdef, eng.head_state, jnp.asarray(tokens),
                                  jnp.asarray([len(p) for p in prompts], jnp.int32), tgt.model.init_cache(b, s_len),
                                  head.init_cache(b, s_len + (depth - 1) * topk + depth + 1), params)
    out = [[int(t)] for t in np.asarray(st.root)]
    active = jnp.ones((b,), bool)
    for tree in trees:  # compile each once
        steps.step(eng.graphdef, eng.state, eng.head_graphdef, eng.head_state,
                              jax.tree_util.tree_map(jnp.copy, st), params, active, tree)
    before = dict(steps.TRACE_COUNTS)
    step = 0
    while min(len(o) for o in out) < 30:
        st, emitted, count = steps.step(eng.graphdef, eng.state, eng.head_graphdef, eng.head_state, st,
                                                   params, active, trees[step % len(trees)])
        for r in range(b):
            out[r] += np.asarray(emitted)[r, : int(count[r])].tolist()
        step += 1
    assert dict(steps.TRACE_COUNTS) == before
    assert [o[:30] for o in out] == plain


@pytest.mark.parametrize("plain", [5, steps.CATCHUP + 3], ids=["held", "past-a-full-buffer"])
def test_plain_steps_leave_pairs_the_draft_catches_up_on(deep_target, plain):
    """A plain step with the head keeps the target's features; the draft consumes them at the next
    speculative step (or when CATCHUP are held) and ends where a draft refreshed every step ends."""
    from eagle_jax.sampling import SamplingParams

    tgt = deep_target
    head = random_head(tgt.cfg, "eagle3", seed=5, draft_vocab_size=60)
    eng = engine.Engine(tgt, head)
    prompts = MORE_PROMPTS[:2]
    b, s_len = 2, 96
    tokens = np.zeros((b, 24), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    params = SamplingParams.make(b)
    sync = TreeConfig(1, 1, 1)  # verify the root only, refreshing the draft every step
    parts = (eng.graphdef, eng.state, eng.head_graphdef, eng.head_state)

    def prefill():
        return steps.prefill(*parts, jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32),
                                        tgt.model.init_cache(b, s_len), head.init_cache(b, s_len + 32), params)

    # Row 1 sits out the first two steps (inactive rows hold nothing and commit nothing).
    masks = [jnp.asarray([True, i >= 2]) for i in range(plain)]
    a, ref, emitted_a, emitted_ref = prefill(), prefill(), [], []
    for m in masks:
        a, e, c = steps.step(*parts, a, params, m)
        emitted_a.append((np.asarray(e)[:, 0] * np.asarray(c)).tolist())
        ref, e, c = steps.step(*parts, ref, params, m, sync)
        emitted_ref.append((np.asarray(e)[:, 0] * np.asarray(c)).tolist())
    assert emitted_a == emitted_ref
    held = np.zeros(b, int)  # a row reaching CATCHUP makes the draft catch up on every row
    for m in masks:
        held += np.asarray(m)
        held = held * (held.max() < steps.CATCHUP)
    np.testing.assert_array_equal(np.asarray(a.lag_n), held)
    assert held.sum() > 0 and (plain < steps.CATCHUP or held.max() < plain - 2)
    np.testing.assert_array_equal(np.asarray(a.draft_cache.lengths) + np.asarray(a.lag_n),
                                  np.asarray(ref.draft_cache.lengths))

    def same_draft(x, y):
        np.testing.assert_array_equal(np.asarray(x.lag_n), [0, 0])
        np.testing.assert_array_equal(np.asarray(x.draft_cache.lengths), np.asarray(y.draft_cache.lengths))
        np.testing.assert_allclose(np.asarray(x.root_hidden), np.asarray(y.root_hidden), atol=1e-4)
        for r, n in enumerate(np.asarray(y.draft_cache.lengths)):
            for u, v in zip(x.draft_cache.k + x.draft_cache.v, y.draft_cache.k + y.draft_cache.v):
                np.testing.assert_allclose(np.asarray(u)[r, :n], np.asarray(v)[r, :n], atol=1e-4)

    from flax import nnx

    caught_up = jax.jit(lambda s: steps.catch_up(nnx.merge(eng.graphdef, eng.state),
                                                       nnx.merge(eng.head_graphdef, eng.head_state), s))
    same_draft(caught_up(jax.tree_util.tree_map(jnp.copy, a)), ref)
    # A speculative step catches up first, then steps exactly like the reference.
    a, e_a, c_a = steps.step(*parts, a, params, jnp.ones((b,), bool), TreeConfig.chain(2))
    ref, e_r, c_r = steps.step(*parts, ref, params, jnp.ones((b,), bool), TreeConfig.chain(2))
    np.testing.assert_array_equal(np.asarray(c_a), np.asarray(c_r))
    np.testing.assert_array_equal(np.asarray(e_a), np.asarray(e_r))
    same_draft(a, ref)


# --- tree="auto": the harness picks a tree or a plain step every step ----------------------------------

@pytest.mark.slow
def test_auto_tree_is_lossless_and_follows_the_costs(tmp_path):
    from eagle_jax import harness

    tgt, head = oracle_pair()
    prompts = [PROMPTS[0]]
    plain = eagle_jax.generate(tgt, prompts, max_new_tokens=24, chat=False)
    eng = engine.Engine(tgt, head)
    params = SamplingParams.make(1)
    trees = [t for t in map(parse_tree, harness.DEFAULT_CANDIDATES) if t is not None]
    _, _, s_len = rows.batch_shapes(tgt.cfg.max_position, [PROMPTS[0]], 24, slack=steps.tree_slack(trees))
    extra = steps.draft_extra(trees)
    # Verifying is free (an accelerator far from its limits): the harness drafts, and the oracle head's
    # drafts are accepted, so tau is high.
    flat = tmp_path / "flat"
    flat.mkdir()
    _profile(flat, tgt, head, 1, s_len, extra, lambda t: 0.01)
    r = eng.generate([PROMPTS[0]], max_new_tokens=24, params=params, tree="auto", profile_dir=flat)
    assert r.token_ids == plain.token_ids
    assert r.stats["tree"] == "auto" and r.stats["choices"].get("off", 0) == 0 and r.stats["tau"] > 2
    # Greedy and sampled rows teach separate statistics (sampled acceptance is much lower in general).
    (greedy, sampled), = eng.acceptance.values()
    assert sum(greedy.n.values()) > 0 and sum(sampled.n.values()) == 0
    r = eng.generate([PROMPTS[0]], max_new_tokens=24, params=SamplingParams.make(1, temperature=1.0, seed=3),
                     tree="auto", profile_dir=flat)
    assert len(r.token_ids[0]) == 24 and sum(sampled.n.values()) > 0 and eng.acceptance == {6: (greedy, sampled)}
    # Every token verified costs a full step (a slow CPU): plain steps win and are chosen.
    steep = tmp_path / "steep"
    steep.mkdir()
    eng2 = engine.Engine(tgt, head)
    _profile(steep, tgt, head, 1, s_len, extra, lambda t: 0.01 * (1 if t is None else t.tree_tokens))
    r = eng2.generate([PROMPTS[0]], max_new_tokens=24, params=params, tree="auto", profile_dir=steep)
    assert r.token_ids == plain.token_ids
    assert set(r.stats["choices"]) == {"off"} and r.stats["tau"] == 1.0
    with pytest.raises(ValueError, match="'auto'"):
        eng.generate([PROMPTS[0]], max_new_tokens=4, params=params, tree="sometimes")


@pytest.mark.slow  # heavy on a cold cache: CI runs it, the quick loop does not
def test_auto_tree_compiles_every_candidate_up_front_when_the_profile_comes_from_the_cache(tmp_path, monkeypatch):
    from eagle_jax import harness

    tgt, head = oracle_pair()
    params = SamplingParams.make(1)
    trees = [t for t in map(parse_tree, harness.DEFAULT_CANDIDATES) if t is not None]
    _, _, s_len = rows.batch_shapes(tgt.cfg.max_position, [PROMPTS[2]], 40, slack=steps.tree_slack(trees))
    # Costs that make the harness switch among trees and plain steps: nothing may compile mid-generation
    # (a bench or a server would time the compile), so all candidates compile before the first step.
    _profile(tmp_path, tgt, head, 1, s_len, None, lambda t: 0.01 * (1 if t is None else 1 + 0.05 * t.tree_tokens))
    compiled = []  # trace counts right after the up-front compile
    real = profiles.compile_candidates

    def spy(*args, **kwargs):
        real(*args, **kwargs)
        compiled.append({k: steps.TRACE_COUNTS[k] for k in ("step",)})

    monkeypatch.setattr(profiles, "compile_candidates", spy)
    before = {k: steps.TRACE_COUNTS[k] for k in ("step",)}
    eng = engine.Engine(tgt, head)
    r = eng.generate([PROMPTS[2]], max_new_tokens=40, params=params, tree="auto", profile_dir=tmp_path)
    assert r.stats["profile"] == "cache" and len(r.stats["choices"]) >= 2
    assert len(compiled) == 1
    after = {k: steps.TRACE_COUNTS[k] for k in ("step",)}
    assert after == compiled[0], (before, compiled, after)  # nothing compiled once the steps began
    # At most one trace per candidate overall (fewer when an earlier test compiled these shapes).
    assert after["step"] - before["step"] <= len(trees) + 1


@pytest.mark.slow  # heavy on a cold cache: CI runs it, the quick loop does not
def test_auto_tree_measures_a_profile_when_none_is_cached(tmp_path, monkeypatch):
    tgt, head = oracle_pair()
    batch = [PROMPTS[0], PROMPTS[1]]
    plain = eagle_jax.generate(tgt, batch, max_new_tokens=12, chat=False)
    measure, traced = profiles.measure_profile, []

    def measured(*a, **k):
        out = measure(*a, **k)
        traced.append(steps.TRACE_COUNTS["step"])
        return out

    monkeypatch.setattr(profiles, "measure_profile", measured)
    r = engine.Engine(tgt, head).generate(
        [list(p) for p in batch], max_new_tokens=12, params=SamplingParams.make(2), tree="auto",
        profile_dir=tmp_path)
    assert r.token_ids == plain.token_ids and r.stats["profile"] == "measured"
    assert len(list(tmp_path.glob("*.json"))) == 1  # cached for the next call
    # Measuring compiled each candidate exactly as the engine calls it: generating compiled nothing more.
    assert traced == [steps.TRACE_COUNTS["step"]]


@pytest.mark.parametrize("head_kind", [None, "eagle3"], ids=["plain", "eagle3"])
def test_a_prefill_in_chunks_leaves_the_state_a_whole_prefill_leaves(deep_target, head_kind):
    """Chunks continue the caches the last chunk wrote (`follow` is the prompt's next token, so the
    draft's pair at each chunk boundary is right): the target and draft caches, the root and the
    draft's root prediction equal those of one prefill over the whole prompt."""
    tgt = deep_target
    head = None if head_kind is None else random_head(tgt.cfg, head_kind, seed=2, draft_vocab_size=60)
    eng = engine.Engine(tgt, head)
    prompt = [(7 * i + 5) % 90 + 3 for i in range(37)]
    s_len, d_len, params = 64, 80, SamplingParams.make(1)
    whole = eng.run_prefill(*rows.pad_prompts([prompt], 1, 48), s_len, d_len, params)
    st = None
    for a, n, t in ((0, 16, 16), (16, 16, 16), (32, 5, 16)):  # 16 + 16 + 5 (right-padded)
        follow = [prompt[a + n] if a + n < len(prompt) else -1]
        st = eng.run_prefill(*rows.pad_prompts([prompt[a:a + n]], 1, t), s_len, d_len, params, prev=st,
                             follow=follow)
    assert int(st.root[0]) == int(whole.root[0]) and int(st.cache.lengths[0]) == len(prompt)
    n = len(prompt)
    for got, want in zip(st.cache.k + st.cache.v, whole.cache.k + whole.cache.v):
        np.testing.assert_allclose(np.asarray(got)[:, :n], np.asarray(want)[:, :n], rtol=1e-5, atol=1e-5)
    if head is not None:
        assert int(st.draft_cache.lengths[0]) == int(whole.draft_cache.lengths[0]) == n
        for got, want in zip(st.draft_cache.k + st.draft_cache.v, whole.draft_cache.k + whole.draft_cache.v):
            np.testing.assert_allclose(np.asarray(got)[:, :n], np.asarray(want)[:, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(st.root_hidden), np.asarray(whole.root_hidden), rtol=1e-5, atol=1e-5)
