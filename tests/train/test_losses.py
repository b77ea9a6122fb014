"""Training objectives: the training-time-test unroll computes exactly what drafting computes."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.draft import random_head
from eagle_jax.train import losses
from builders import TINY, tiny_target

CFG = dataclasses.replace(TINY, num_layers=6)


@pytest.fixture(scope="module")
def pair():
    tgt = tiny_target(CFG)
    head = random_head(CFG, "eagle3", seed=2, draft_vocab_size=40)
    head.d2t[...] = jnp.asarray(np.arange(40) % 5, jnp.int32)
    return tgt, head


def _features(tgt, tokens, aux_layers):
    cache = tgt.model.init_cache(tokens.shape[0], tokens.shape[1])
    out = tgt.model(tokens, cache, capture_layers=aux_layers, logits_at=False)
    return out.hidden, jnp.concatenate(list(out.captured), axis=-1)


def _ttt_outputs(head, tgt, tokens, aux, steps):
    """h^j for j < steps, following eagle3_loss's unroll (kept in step with it by the test below)."""
    toks = tokens[:, 1:]
    b, t1 = toks.shape
    pos = jnp.broadcast_to(jnp.arange(t1), (b, t1))
    feats, fuse, keys, values, outs = aux[:, :-1], True, [], [], []
    for j in range(steps):
        residual, attn_in = head.inputs(tgt.model, feats, toks, fuse=fuse)
        q, k, v = head.qkv(attn_in, pos)
        keys.append(k)
        values.append(v)
        h = head.finish(residual, losses.ttt_attention(q, keys, values, j))
        outs.append(h)
        feats, fuse = losses._shift(h, 1), False
    return outs


@pytest.mark.slow
def test_training_time_test_unroll_matches_inference_drafting(pair):
    tgt, head = pair
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(1, 14)), jnp.int32)
    hidden, aux = _features(tgt, tokens, head.cfg.aux_layers)
    outs = _ttt_outputs(head, tgt, tokens, aux, steps=4)
    for start in (2, 5, 9):  # TTT step j at position start + j: draft steps after the real pairs up to start
        chain = np.asarray(_draft_chain(head, tgt.model, aux, tokens, start, 3))
        for j in range(4):
            np.testing.assert_allclose(chain[j], np.asarray(outs[j][0, start + j]), rtol=2e-5, atol=2e-5)


@functools.partial(nnx.jit, static_argnames=("start", "j"))
def _draft_chain(head, model, aux, tokens, start, j):
    """Inference: draft the real pairs 0..start, then a chain of j draft steps on its own outputs; returns
    the head's output after each of the j + 1 drafts [j + 1, H]."""
    cache = head.init_cache(1, 32)
    h, cache = head(model, aux[:, : start + 1], tokens[:, 1: start + 2], cache, fuse=True)
    cache = cache.replace(lengths=jnp.asarray([start + 1], jnp.int32))
    cur = h[:, -1:]
    chain = [cur[0, 0]]
    for s in range(1, j + 1):
        p = start + s
        cur, cache = head(model, cur, tokens[:, p + 1: p + 2], cache, fuse=False, positions=jnp.asarray([[p]]),
                          tree_mask=jnp.ones((1, 1, s), bool), write_offset=s - 1)
        chain.append(cur[0, 0])
    return jnp.stack(chain)


def test_eagle3_loss_steps_and_gradients(pair):
    tgt, head = pair
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 12)), jnp.int32)
    hidden, aux = _features(tgt, tokens, head.cfg.aux_layers)
    mask = jnp.ones((2, 12))
    loss, metrics = losses.eagle3_loss(head, tgt.model, tokens, hidden, aux, mask, ttt_length=3)
    assert metrics["step_loss"].shape == (3,) and metrics["acc"].shape == (3,)
    weights = 0.8 ** np.arange(3)
    np.testing.assert_allclose(float(loss), float(np.sum(weights * np.asarray(metrics["step_loss"]))), rtol=1e-6)
    assert np.all(np.asarray(metrics["step_loss"]) > 0)
