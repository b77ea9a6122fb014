"""Per-row sampling parameters and the logits processing shared by plain and speculative decoding.

Every row of a batch carries its own temperature, top-k, top-p and seed as arrays, so requests with
different settings share one compiled step. Temperature 0 means greedy. The random key for a row at
sequence position p is fold_in(PRNGKey(seed), p): a row samples the same tokens whatever batch it is
in and whichever engine (plain or speculative) produced its prefix.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["temperature", "top_k", "top_p", "seed"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: jax.Array  # [B] f32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] f32; 1 = off
    seed: jax.Array  # [B] uint32

    @classmethod
    def make(cls, batch: int, temperature=0.0, top_k=0, top_p=1.0, seed=0) -> "SamplingParams":
        def col(v, dtype):
            a = np.asarray(v, dtype=dtype)
            return np.broadcast_to(a, (batch,)).copy() if a.ndim == 0 else a

        p = cls(col(temperature, np.float32), col(top_k, np.int32), col(top_p, np.float32),
                col(np.asarray(seed, np.int64) % (2**32), np.uint32))
        validate(p)
        return p

    def pad_to(self, batch: int) -> "SamplingParams":
        n = len(self.temperature)
        pad = lambda a, v: np.concatenate([np.asarray(a), np.full((batch - n,), v, np.asarray(a).dtype)])
        return SamplingParams(pad(self.temperature, 0.0), pad(self.top_k, 0), pad(self.top_p, 1.0),
                              pad(self.seed, 0))


def validate(p: SamplingParams) -> None:
    t, k, tp = np.asarray(p.temperature), np.asarray(p.top_k), np.asarray(p.top_p)
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {t.tolist()}")
    if np.any(k < 0):
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {k.tolist()}")
    if not np.all(np.isfinite(tp)) or np.any(tp <= 0) or np.any(tp > 1):
        raise ValueError(f"top_p must be in (0, 1], got {tp.tolist()}")


def row_keys(seed, positions):
    """The PRNG key of each row's seed [B] at sequence positions [B] (or [B, L]: L positions per row,
    one hash for all of them, which keeps the compiled program small): [B, 2] (or [B, L, 2])."""
    key = lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p)
    if positions.ndim == 2:
        key = jax.vmap(key, in_axes=(None, 0))
    return jax.vmap(key)(seed, positions)


def _order_key(x):
    """f32 -> int32 with the same order (-0.0 just below +0.0; no NaNs in logits)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _largest_key(keys, holds):
    """Per row, the largest v among the int32 order keys such that holds(v) ([..., 1] bool), for a
    predicate that gets false as v grows and holds at the row's smallest key. 32 halvings of the
    key range: exact, and each is one pass over the vocabulary (a sort costs far more on CPU)."""
    lo = jnp.min(keys, axis=-1, keepdims=True)
    hi = jnp.max(keys, axis=-1, keepdims=True)
    u32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint32)

    def halve(_, bounds):
        lo, hi = bounds
        gap = u32(hi) - u32(lo)  # hi >= lo, so the unsigned difference does not wrap
        mid = jax.lax.bitcast_convert_type(u32(lo) + (gap >> 1) + (gap & 1), jnp.int32)  # upper midpoint
        ok = holds(mid) & (hi > lo)
        return jnp.where(ok, mid, lo), jnp.where(ok | (hi <= lo), hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def filter_logits(logits, params: SamplingParams):
    """Temperature, top-k then top-p applied to logits [B, ..., V] (f32). Excluded tokens get -inf.

    top-k keeps the tokens at least as likely as the k-th most likely; top-p then keeps the fewest most
    likely of those whose probability (renormalised over them) reaches top_p, i.e. every token whose
    more likely predecessors hold less than top_p (ties at a boundary are kept). Both thresholds are
    found by bisection over the logits' order keys, not by sorting the vocabulary. Each row's result
    depends on that row alone. Rows with temperature 0 are returned unscaled (their argmax is what matters).
    """
    logits = logits.astype(jnp.float32)
    extra = logits.ndim - 2
    bshape = (-1,) + (1,) * (extra + 1)
    t = params.temperature.reshape(bshape)
    scaled = jnp.where(t > 0, logits / jnp.where(t > 0, t, 1.0), logits)
    k = params.top_k.reshape(bshape)
    top_p = params.top_p.reshape(bshape)
    lowest = jnp.iinfo(jnp.int32).min

    def truncate(x):
        keys = _order_key(x)
        # top-k: the largest v with at least k tokens at or above it (the k-th largest logit).
        count_at_least = lambda v: jnp.sum(keys >= v, axis=-1, keepdims=True, dtype=jnp.int32) >= k
        kth = jax.lax.cond(jnp.any(params.top_k > 0), lambda: _largest_key(keys, count_at_least),
                           lambda: jnp.full(keys.shape[:-1] + (1,), lowest, jnp.int32))
        kth = jnp.where(k > 0, kth, lowest)
        inside = keys >= kth
        e = jnp.where(inside, jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)), 0.0)
        mass = top_p * jnp.sum(e, axis=-1, keepdims=True)
        # top-p: the largest v whose tokens at or above it (within top-k) hold at least top_p of the mass.
        reaches = lambda v: jnp.sum(jnp.where(keys >= v, e, 0.0), axis=-1, keepdims=True) >= mass
        pth = jax.lax.cond(jnp.any(params.top_p < 1.0), lambda: _largest_key(keys, reaches),
                           lambda: jnp.full(kth.shape, lowest, jnp.int32))
        pth = jnp.where(top_p < 1.0, pth, lowest)
        return jnp.where(inside & (keys >= pth), x, -jnp.inf)

    # The searches are the costly part; skip them when no row asks for truncation.
    needed = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    return jax.lax.cond(needed, truncate, lambda x: x, scaled)


def sample(logits, params: SamplingParams, positions, sampling: bool = True):
    """Next token per row from logits [B, V]; greedy rows take the argmax. sampling=False (static): the
    caller knows every row is greedy, and the program holds no sampling path at all."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampling:
        return greedy

    def draw(_):
        keys = row_keys(params.seed, positions)
        drawn = jax.vmap(jax.random.categorical)(keys, filter_logits(logits, params))
        return jnp.where(params.temperature > 0, drawn, greedy).astype(jnp.int32)

    # An all-greedy batch skips the vocabulary-wide random draw.
    return jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda _: greedy, None)


def probs(logits, params: SamplingParams):
    """The distribution a row samples from (one-hot argmax for greedy rows), [B, ..., V]."""
    filtered = filter_logits(logits, params)
    soft = jax.nn.softmax(filtered, axis=-1)
    hard = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=soft.dtype)
    t = params.temperature.reshape((-1,) + (1,) * (logits.ndim - 1))
    return jnp.where(t > 0, soft, hard)
