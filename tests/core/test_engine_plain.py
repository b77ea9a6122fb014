"""Plain decoding on a tiny random Llama: batching, sampling, stopping, compile counts."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle_jax
from eagle_jax import engine, steps
from eagle_jax.sampling import SamplingParams, filter_logits
from builders import PROMPTS, TINY, tiny_target

@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def test_batched_ragged_greedy_equals_one_by_one(tiny):
    batch = eagle_jax.generate(tiny, PROMPTS, max_new_tokens=12)
    for i, p in enumerate(PROMPTS):
        single = eagle_jax.generate(tiny, [p], max_new_tokens=12)
        assert single.token_ids[0] == batch.token_ids[i]
    assert all(len(t) == 12 for t in batch.token_ids)
    assert batch.finish_reasons == ["length"] * 4


def test_batched_sampling_equals_one_by_one_with_the_same_row_seed(tiny):
    batch = eagle_jax.generate(tiny, PROMPTS, max_new_tokens=10, temperature=1.0, seed=17)
    for i, p in enumerate(PROMPTS):
        single = eagle_jax.generate(tiny, [p], max_new_tokens=10, temperature=1.0, seed=17 + i)
        assert single.token_ids[0] == batch.token_ids[i]


def test_greedy_matches_a_manual_full_recompute_loop(tiny):
    # Reference: no KV cache reuse; re-run the whole sequence each step and take the argmax.
    # The sequence is right-padded to one length so the reference compiles once (attention is causal:
    # padding after the last token cannot change its logits).
    prompt = PROMPTS[1]
    seq = list(prompt)
    width = len(prompt) + 8
    forward = nnx.jit(lambda model, tokens: model(tokens, model.init_cache(1, 64)).logits[0])
    for _ in range(8):
        tokens = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
        seq.append(int(jnp.argmax(forward(tiny.model, tokens)[len(seq) - 1])))
    got = eagle_jax.generate(tiny, [prompt], max_new_tokens=8).token_ids[0]
    assert got == seq[len(prompt):]


def test_sampling_with_a_fixed_seed_is_reproducible_and_seeds_differ(tiny):
    a = eagle_jax.generate(tiny, PROMPTS, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=3)
    b = eagle_jax.generate(tiny, PROMPTS, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=3)
    c = eagle_jax.generate(tiny, PROMPTS, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=4)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    greedy = eagle_jax.generate(tiny, PROMPTS, max_new_tokens=16)
    assert a.token_ids != greedy.token_ids


def test_top_k_1_equals_greedy(tiny):
    greedy = eagle_jax.generate(tiny, PROMPTS, max_new_tokens=16)
    topk1 = eagle_jax.generate(tiny, PROMPTS, max_new_tokens=16, temperature=1.5, top_k=1, seed=11)
    assert topk1.token_ids == greedy.token_ids


def test_eos_stops_a_row_and_keeps_the_eos_token(tiny):
    free = eagle_jax.generate(tiny, [PROMPTS[0], PROMPTS[1]], max_new_tokens=10).token_ids
    eos = free[0][4]
    # Same seed and shapes give the same weights; only the config's EOS id differs.
    stopping = tiny_target(dataclasses.replace(TINY, eos_token_ids=(eos,)))
    result = eagle_jax.generate(stopping, [PROMPTS[0], PROMPTS[1]], max_new_tokens=10)
    for row in range(2):
        if eos in free[row]:
            assert result.token_ids[row] == free[row][: free[row].index(eos) + 1]
            assert result.finish_reasons[row] == "stop"
        else:
            assert result.token_ids[row] == free[row]
            assert result.finish_reasons[row] == "length"


def test_compiles_once_per_bucket(tiny):
    # An all-greedy batch and a sampling one (its steps have the sampling paths): one program each.
    eagle_jax.generate(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=5)
    eagle_jax.generate(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=5, temperature=1.0)
    before = dict(steps.TRACE_COUNTS)
    # Different prompts, lengths and sampling settings inside the same buckets: no new traces.
    eagle_jax.generate(tiny, [[9, 8, 7, 6], [1]], max_new_tokens=7, temperature=0.7, top_k=5, seed=2)
    eagle_jax.generate(tiny, [[9, 8, 7, 6], [1]], max_new_tokens=7)
    assert dict(steps.TRACE_COUNTS) == before
    eagle_jax.generate(tiny, [[2, 2]], max_new_tokens=9)  # batch bucket 1: new shapes
    after_new_bucket = dict(steps.TRACE_COUNTS)
    eagle_jax.generate(tiny, [[3, 3, 3]], max_new_tokens=9)
    assert dict(steps.TRACE_COUNTS) == after_new_bucket
    assert after_new_bucket["step"] - before["step"] <= 1
    assert after_new_bucket["prefill"] - before["prefill"] <= 1


def test_a_minimum_cache_length_shares_one_set_of_shapes_and_changes_no_token(tiny):
    short, long = [[5, 6]], [[7] * 40]
    small = eagle_jax.generate(tiny, short, max_new_tokens=20)
    assert small.stats["buckets"]["cache"] == 128
    wide = eagle_jax.generate(tiny, short, max_new_tokens=20, cache_len=300)
    assert wide.stats["buckets"]["cache"] == 512 and wide.token_ids == small.token_ids
    before = dict(steps.TRACE_COUNTS)
    # A longer prompt and answer (a larger bucket on its own) under the same minimum: no new step.
    eagle_jax.generate(tiny, long, max_new_tokens=200, cache_len=300)
    assert dict(steps.TRACE_COUNTS)["step"] == before["step"]
    assert eagle_jax.generate(tiny, long, max_new_tokens=200).stats["buckets"]["cache"] == 256


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_attention_window_decodes_the_same_tokens_and_compiles_once_per_window(tiny, temperature):
    kw = dict(max_new_tokens=300, ignore_eos=True, temperature=temperature, seed=3)
    full = eagle_jax.generate(tiny, PROMPTS, **kw)
    assert full.stats["buckets"]["cache"] == 512
    before = dict(steps.TRACE_COUNTS)
    windowed = eagle_jax.generate(tiny, PROMPTS, attention_window=True, **kw)
    assert windowed.token_ids == full.token_ids
    after = dict(steps.TRACE_COUNTS)
    if temperature == 0.0:  # first windowed run: the prefill in a 128-slot window, steps at 128, 256, the whole cache
        assert after["step"] - before["step"] == 2 and after["prefill"] - before["prefill"] == 1
    eagle_jax.generate(tiny, PROMPTS, attention_window=True, **kw)
    assert dict(steps.TRACE_COUNTS) == after

def _np_filter(logits, temperature, top_k, top_p):
    x = logits / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, dtype=bool)
    srt = x[order]
    n = len(x) if top_k == 0 else top_k
    p = np.exp(srt[:n] - srt[0])
    p /= p.sum()
    before = np.cumsum(p) - p
    m = int(np.sum(before < top_p))
    keep[order[:m]] = True
    return keep


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.6), (7, 0.8), (1, 0.3)])
def test_filter_logits_keeps_exactly_the_top_k_top_p_set(top_k, top_p):
    rng = np.random.default_rng(top_k * 10 + int(top_p * 10))
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 2
    params = SamplingParams.make(3, temperature=0.8, top_k=top_k, top_p=top_p)
    out = np.asarray(filter_logits(jnp.asarray(logits), params))
    for r in range(3):
        want = _np_filter(logits[r], 0.8, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(out[r]), want)
        np.testing.assert_allclose(out[r][want], logits[r][want] / 0.8, rtol=1e-6)


def _np_filter_ties(x, top_k, top_p):
    """Sorting reference with ties: top-k keeps every token >= the k-th largest; top-p then keeps every
    token >= the first one (in descending order) whose predecessors hold < top_p of the pool's mass."""
    srt = np.sort(x)[::-1]
    pool = x >= (srt[top_k - 1] if top_k > 0 else -np.inf)
    xs = np.sort(x[pool])[::-1].astype(np.float64)
    p = np.exp(xs - xs[0])
    p /= p.sum()
    before = np.cumsum(p) - p
    m = int(np.sum(before < top_p)) if top_p < 1 else len(xs)
    return pool & (x >= xs[m - 1])


def test_filter_logits_matches_a_sorting_reference_row_by_row():
    # Mixed per-row settings in one batch, a [B, N, V] tree of logits, logits rounded to produce ties,
    # and one very peaked row; each row's kept set must equal the sort-based reference and must not
    # depend on the other rows of the batch.
    rng = np.random.default_rng(7)
    b, n, v = 6, 3, 4000
    logits = rng.normal(size=(b, n, v)).astype(np.float32) * 3
    logits[1] = np.round(logits[1] * 2) / 2  # many ties
    logits[4, :, 17] += 40.0  # one token holds almost all the mass
    temps = np.array([0.7, 1.0, 1.3, 1.0, 1.0, 0.9], np.float32)
    ks = np.array([0, 50, 3, 0, 0, 1], np.int32)
    ps = np.array([0.9, 0.8, 1.0, 0.999, 0.5, 0.3], np.float32)
    params = SamplingParams.make(b, temps, ks, ps)
    out = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), params)))
    for r in range(b):
        alone = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits[r:r + 1]),
                                                     SamplingParams.make(1, temps[r], ks[r], ps[r]))))[0]
        np.testing.assert_array_equal(out[r], alone)
        for j in range(n):
            want = _np_filter_ties(logits[r, j] / temps[r], int(ks[r]), float(ps[r]))
            np.testing.assert_array_equal(out[r, j], want, err_msg=f"row {r} node {j}")
    assert out[4].sum() == n and out[4][:, 17].all()  # the peaked row keeps its one token


def test_sampled_token_frequencies_follow_the_filtered_distribution():
    # Chi-square goodness of fit of 4000 draws against softmax(filtered logits).
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(12,)).astype(np.float32)
    n = 4000
    params = SamplingParams.make(n, temperature=1.3, top_k=8, top_p=0.9, seed=np.arange(n))
    from eagle_jax.sampling import probs, sample

    toks = np.asarray(sample(jnp.tile(jnp.asarray(logits), (n, 1)), params, jnp.zeros(n, jnp.int32)))
    p = np.asarray(probs(jnp.asarray(logits)[None], SamplingParams.make(1, 1.3, 8, 0.9)))[0]
    counts = np.bincount(toks, minlength=12)
    assert np.all(counts[p == 0] == 0)
    support = p > 0
    expected = p[support] * n
    chi2 = float(np.sum((counts[support] - expected) ** 2 / expected))
    # 99.9% quantile of chi-square with <= 7 degrees of freedom is 24.3.
    assert chi2 < 24.3, (chi2, counts, expected)


def test_bad_arguments_raise_clear_errors(tiny):
    with pytest.raises(ValueError, match="temperature"):
        eagle_jax.generate(tiny, PROMPTS, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        eagle_jax.generate(tiny, PROMPTS, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="context length 512"):
        eagle_jax.generate(tiny, [[1] * 500], max_new_tokens=20)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eagle_jax.generate(tiny, PROMPTS, max_new_tokens=0)
    with pytest.raises(ValueError, match="no tokenizer"):
        eagle_jax.generate(tiny, "hello")


def test_engines_live_and_die_with_their_target():
    import gc
    import weakref

    tgt = tiny_target()
    eagle_jax.generate(tgt, [[1, 2, 3]], max_new_tokens=2)
    assert engine.engine_for(tgt) is engine.engine_for(tgt)  # compiled steps are reused
    ref = weakref.ref(tgt)
    del tgt
    gc.collect()
    assert ref() is None  # nothing global holds the target (or its engine) alive
