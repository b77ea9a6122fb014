"""Draft-head objectives: EAGLE-1 feature regression + classification, EAGLE-3 training-time test.

Shapes: B rows, T tokens, pair i = (target feature at position i, token i+1); the head's output for
pair i predicts the feature at i+1, whose lm_head distribution is the target's next-token
distribution for position i+2.

Training-time test (EAGLE-3): the head is unrolled `ttt_length` times on its own outputs, with the
attention pattern drafting uses. At unroll step j the query at position i stands for a draft chain
that started from the real feature at position i - j: it sees the step-0 keys (real features) at
positions <= i - j and, for each earlier unroll step s = 1..j, exactly one key, the chain's own, at
position i - j + s. Step j's input at position i is step j-1's output at position i - 1. Every step
predicts the same target (the token at i + 2), weighted 0.8^j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.quant import dequantize


def _masked_mean(x, m):
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def causal_attention(q, k, v):
    """q [B,T,Hq,D], k/v [B,T,K,D] -> [B,T,Hq,D]."""
    b, t, hq, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, hq // kh, d)
    s = jnp.einsum("BTKGD,BSKD->BKGTS", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("BKGTS,BSKD->BTKGD", p.astype(v.dtype), v).reshape(b, t, hq, d)


def _shift(x, n):
    """x[:, i] -> x[:, i - n] along axis 1, zero-filled (n >= 0)."""
    if n == 0:
        return x
    pad = jnp.zeros_like(x[:, :n])
    return jnp.concatenate([pad, x[:, :-n]], axis=1)


def ttt_attention(q, keys, values, j):
    """Attention of unroll step j (see module docstring). keys/values: lists for steps 0..j."""
    b, t, hq, d = q.shape
    kh = keys[0].shape[2]
    g = hq // kh
    qg = q.reshape(b, t, kh, g, d).astype(jnp.float32)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    i = jnp.arange(t)
    s0 = jnp.einsum("BTKGD,BSKD->BKGTS", qg, keys[0].astype(jnp.float32)) * scale
    s0 = jnp.where(i[None, :] <= (i[:, None] - j), s0, -jnp.inf)  # [.., T(query), S(key)]
    diag_s, diag_v = [], []
    for s in range(1, j + 1):
        ks, vs = _shift(keys[s], j - s), _shift(values[s], j - s)  # the chain's key at i - j + s
        sc = jnp.einsum("BTKGD,BTKD->BKGT", qg, ks.astype(jnp.float32)) * scale
        diag_s.append(jnp.where(i >= j - s, sc, -jnp.inf)[..., None])
        diag_v.append(vs)
    scores = jnp.concatenate([s0] + diag_s, axis=-1)  # [B, K, G, T, T + j]
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", p[..., :t], values[0].astype(jnp.float32))
    for s in range(1, j + 1):
        out = out + jnp.einsum("BKGT,BTKD->BTKGD", p[..., t + s - 1], diag_v[s - 1].astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


def eagle1_loss(head, target, tokens, hidden, mask, noise=None, reg_weight=1.0, cls_weight=0.1):
    """tokens [B,T], hidden [B,T,H] (target final normed hidden), mask [B,T] float (answer & valid)."""
    feats = hidden[:, :-1] if noise is None else hidden[:, :-1] + noise
    toks = tokens[:, 1:]
    t1 = toks.shape[1]
    residual, attn_in = head.inputs(target, feats, toks, fuse=True)
    q, k, v = head.qkv(attn_in, jnp.broadcast_to(jnp.arange(t1), toks.shape))
    h = head.finish(residual, causal_attention(q, k, v))  # predicts hidden[:, 1:]
    goal = hidden[:, 1:]
    m = mask[:, 1:]
    diff = jnp.abs(h - goal)
    reg = jnp.mean(jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), axis=-1)
    p = jax.nn.softmax(target.logits(goal), axis=-1)
    logq = jax.nn.log_softmax(target.logits(h), axis=-1)
    cls = -jnp.sum(p * logq, axis=-1)
    acc = (jnp.argmax(logq, -1) == jnp.argmax(p, -1)).astype(jnp.float32)
    loss = reg_weight * _masked_mean(reg, m) + cls_weight * _masked_mean(cls, m)
    return loss, {"loss": loss, "reg": _masked_mean(reg, m), "cls": _masked_mean(cls, m),
                  "acc": _masked_mean(acc, m)[None]}


def eagle3_loss(head, target, tokens, hidden, aux, mask, ttt_length=7, step_decay=0.8):
    """Training-time test. aux [B,T,3H] (low|mid|high), hidden [B,T,H] for the target's distribution.

    Soft cross-entropy against the target's next-token distribution restricted to the draft
    vocabulary and renormalised; accuracy = draft top-1 equals the target's top-1 within the draft
    vocabulary (where the draft can match at all).
    """
    toks = tokens[:, 1:]
    b, t1 = toks.shape
    positions = jnp.broadcast_to(jnp.arange(t1), (b, t1))
    draft_ids = jnp.arange(head.cfg.draft_vocab_size) + head.d2t[...]
    w = dequantize(target.lm_head_weight())[:, draft_ids]  # [H, Vd] (a quantized lm_head, dequantized)
    target_logits = jnp.einsum("BTH,HV->BTV", hidden[:, 1:], w, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(target_logits, axis=-1)
    target_top = jnp.argmax(target_logits, axis=-1)
    m = mask[:, 1:]
    feats, fuse = aux[:, :-1], True
    keys, values = [], []
    total, accs, losses = 0.0, [], []
    for j in range(ttt_length):
        residual, attn_in = head.inputs(target, feats, toks, fuse=fuse)
        q, k, v = head.qkv(attn_in, positions)
        keys.append(k)
        values.append(v)
        h = head.finish(residual, ttt_attention(q, keys, values, j))
        logq = head.logprobs(target, h)  # [B, T1, Vd]
        mj = m * (jnp.arange(t1) >= j)[None, :]
        lj = _masked_mean(-jnp.sum(p * logq, axis=-1), mj)
        total = total + (step_decay ** j) * lj
        losses.append(lj)
        accs.append(_masked_mean((jnp.argmax(logq, -1) == target_top).astype(jnp.float32), mj))
        feats, fuse = _shift(h, 1), False
    return total, {"loss": total, "step_loss": jnp.stack(losses), "acc": jnp.stack(accs)}
