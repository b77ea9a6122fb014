"""Speculative decoding with an EAGLE draft head: prefill, then one jitted step per TreeConfig.

Carried state per row (all static shapes, `SpecState`):
  target cache   committed tokens 0..L-1 (the root token at position L is not in it yet)
  draft cache    one pair (feature_i, token_{i+1}) per position i < L, so it is in step with the target
  root           the last emitted token (position L); the next tree hangs from it
  root_hidden    the draft's prediction of the feature at position L (its logits propose position L+1)
  lag_*          pairs (feature_i, token_{i+1}) of plain steps the draft has not consumed yet (lag_n per
                 row, at most CATCHUP): a plain step (`verify_step` with the head) keeps the target's
                 features here instead of running the draft, and the next speculative step (or a full
                 buffer) runs the draft over them once, so a row stepped plainly can speculate again

A step: draft the tree from (root, root_hidden) -> verify all N tree tokens with the target in one
forward (tree mask, positions L + depth) -> accept (lossless, `eagle_jax.accept`) -> move the accepted
path's K/V rows to contiguous slots -> run the draft over the accepted pairs to refresh its cache and
root_hidden. Emits `count` tokens (accepted drafts + the bonus token).

Every TreeConfig compiles its own step, and every step reads and writes the same `SpecState`, so a
scheduler can pick a different precompiled TreeConfig (including tree_tokens=1: no drafting, a plain
decode step that keeps the draft in sync) on every step without recompiling.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.accept import accept
from eagle_jax.engine import GenerationResult, StopChecker, TRACE_COUNTS, finish_result, prepare_batch
from eagle_jax.kv_cache import KVCache, gather_rows
from eagle_jax.sampling import SamplingParams, sample
from eagle_jax.tree import TreeConfig, select_tree


# Read at trace time. Tests set "broken" to prove the statistical test can fail (see eagle_jax.accept).
ACCEPT_RULE = "exact"


# Plain steps a row's draft may fall behind before a plain step runs the draft over them (one draft
# forward over CATCHUP pairs: about 1/CATCHUP of a draft step per plain step).
CATCHUP = 16


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cache", "draft_cache", "root", "root_hidden", "lag_feats", "lag_tokens", "lag_n"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SpecState:
    cache: KVCache
    draft_cache: KVCache
    root: jax.Array  # [B] int32
    root_hidden: jax.Array  # [B, H]
    lag_feats: jax.Array  # [B, CATCHUP, F] target features the draft has not consumed ([B, 0, 1] headless)
    lag_tokens: jax.Array  # [B, CATCHUP] the token after each of them
    lag_n: jax.Array  # [B] int32: how many are held

    def replace(self, **kw) -> "SpecState":
        return dataclasses.replace(self, **kw)


def no_lag(batch: int, head_cfg=None, dtype=jnp.float32):
    """Empty catch-up fields (lag_feats, lag_tokens, lag_n) for a batch; zero-width without a head."""
    width, feat = (CATCHUP, head_cfg.feature_size) if head_cfg is not None else (0, 1)
    return dict(lag_feats=jnp.zeros((batch, width, feat), dtype), lag_tokens=jnp.zeros((batch, width), jnp.int32),
                lag_n=jnp.zeros((batch,), jnp.int32))


def catch_up(target, head, s: SpecState) -> SpecState:
    """Runs the draft over each row's held pairs (one forward over CATCHUP inputs; rows holding none
    commit nothing) and commits them, so every row's draft is in step with its target again."""
    h, dcache = head(target, s.lag_feats, s.lag_tokens, s.draft_cache, fuse=True)
    n = s.lag_n
    last = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]
    return s.replace(draft_cache=dcache.replace(lengths=s.draft_cache.lengths + n),
                     root_hidden=jnp.where((n > 0)[:, None], last.astype(s.root_hidden.dtype), s.root_hidden),
                     lag_n=jnp.zeros_like(n))


def catch_up_if(pred, target, head, s: SpecState) -> SpecState:
    """`catch_up` where pred (a traced bool) holds. Only the draft's parts pass through the conditional:
    handing it the whole state would copy the target's KV cache in and out on every step."""
    parts = (s.draft_cache, s.root_hidden, s.lag_n)

    def run(p):
        x = catch_up(target, head, s.replace(draft_cache=p[0], root_hidden=p[1], lag_n=p[2]))
        return x.draft_cache, x.root_hidden, x.lag_n

    dcache, root_hidden, lag_n = jax.lax.cond(pred, run, lambda p: p, parts)
    return s.replace(draft_cache=dcache, root_hidden=root_hidden, lag_n=lag_n)


def target_features(out, head_cfg):
    """The features the head consumes from a target forward: [B, T, F]."""
    if head_cfg.kind == "eagle3":
        return jnp.concatenate(list(out.captured), axis=-1)  # low | mid | high
    return out.hidden


def _capture(head_cfg):
    return tuple(head_cfg.aux_layers) if head_cfg.kind == "eagle3" else ()


@functools.partial(jax.jit, static_argnames=("graphdef", "head_graphdef"),
                   donate_argnames=("cache", "draft_cache"))
def spec_prefill(graphdef, state, head_graphdef, head_state, tokens, prompt_lens, cache, draft_cache,
                 params: SamplingParams) -> SpecState:
    """Target prefill (sampling the root), then the draft over every prompt pair."""
    TRACE_COUNTS["spec_prefill"] += 1
    target = nnx.merge(graphdef, state)
    head = nnx.merge(head_graphdef, head_state)
    cache = cache.replace(lengths=jnp.zeros_like(cache.lengths))
    out = target(tokens, cache, capture_layers=_capture(head.cfg), logits_at=prompt_lens - 1)
    root = sample(out.logits, params, prompt_lens)
    # Pair i = (feature_i, token_{i+1}); the last pair's next token is the freshly sampled root.
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    nxt = jnp.where(jnp.arange(tokens.shape[1])[None, :] == (prompt_lens - 1)[:, None], root[:, None], nxt)
    draft_cache = draft_cache.replace(lengths=jnp.zeros_like(draft_cache.lengths))
    h, draft_cache = head(target, target_features(out, head.cfg), nxt, draft_cache, fuse=True)
    root_hidden = jnp.take_along_axis(h, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    return SpecState(out.cache.replace(lengths=prompt_lens), draft_cache.replace(lengths=prompt_lens),
                     root, root_hidden, **no_lag(tokens.shape[0], head.cfg, root_hidden.dtype))


def draft_tree(target, head, s: SpecState, tree: TreeConfig):
    """EAGLE-2 expansion from the root; returns the selected `Tree` (see eagle_jax.tree)."""
    b = s.root.shape[0]
    k, d = tree.topk, tree.depth
    logp = head.logprobs(target, s.root_hidden)  # [B, V_draft]
    top_lp, top_id = jax.lax.top_k(logp, k)
    pool_tokens = [head.to_target_ids(top_id)]
    pool_scores = [top_lp]
    pool_parents = [jnp.full((b, k), -1, jnp.int32)]
    frontier_slot = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # pool slots of the frontier
    frontier_tok = pool_tokens[0]
    frontier_score = top_lp
    frontier_in = jnp.broadcast_to(s.root_hidden[:, None, :], (b, k, s.root_hidden.shape[-1]))
    scratch = (d - 1) * k
    anc = jnp.zeros((b, k, max(scratch, 1)), bool)  # frontier nodes' ancestors among scratch slots
    dcache = s.draft_cache
    base = k  # next free pool slot
    for step in range(1, d):  # frontier at depth `step` proposes depth step + 1
        own = jax.nn.one_hot((step - 1) * k + jnp.arange(k), scratch, dtype=bool)  # [k, scratch]
        anc = anc | own[None]
        h, dcache = head(target, frontier_in, frontier_tok, dcache, fuse=False,
                         positions=jnp.broadcast_to(dcache.lengths[:, None] + step - 1, (b, k)),
                         tree_mask=anc, write_offset=(step - 1) * k)
        lp = head.logprobs(target, h)  # [B, k, V_draft]
        c_lp, c_id = jax.lax.top_k(lp, k)  # [B, k, k]
        c_score = (frontier_score[:, :, None] + c_lp).reshape(b, k * k)
        c_tok = head.to_target_ids(c_id).reshape(b, k * k)
        c_parent = jnp.repeat(frontier_slot, k, axis=1)  # [B, k*k]
        pool_tokens.append(c_tok)
        pool_scores.append(c_score)
        pool_parents.append(c_parent)
        if step < d - 1:
            best_score, best = jax.lax.top_k(c_score, k)  # next frontier
            parent_local = best // k  # index within the current frontier
            frontier_slot = (base + best).astype(jnp.int32)
            frontier_tok = jnp.take_along_axis(c_tok, best, axis=1)
            frontier_score = best_score
            frontier_in = jnp.take_along_axis(h, parent_local[:, :, None], axis=1)
            anc = jnp.take_along_axis(anc, parent_local[:, :, None], axis=1)
        base += k * k
    return select_tree(s.root, jnp.concatenate(pool_tokens, 1), jnp.concatenate(pool_scores, 1),
                       jnp.concatenate(pool_parents, 1), tree)


@functools.partial(jax.jit, static_argnames=("graphdef", "head_graphdef", "tree"), donate_argnames=("s",))
def spec_step(graphdef, state, head_graphdef, head_state, s: SpecState, params: SamplingParams, active,
              tree: TreeConfig):
    """One draft -> verify -> accept -> commit step. Returns (new state, emitted [B, D+1], count [B]).

    Rows with active=False commit nothing (their state is unchanged) and report count 0.
    """
    TRACE_COUNTS["spec_step"] += 1
    target = nnx.merge(graphdef, state)
    head = nnx.merge(head_graphdef, head_state)
    b = s.root.shape[0]
    # Rows stepped plainly since their last speculative step: their draft consumes those pairs first.
    s = catch_up_if(jnp.any(s.lag_n > 0), target, head, s)
    d = tree.depth if tree.tree_tokens > 1 else 0
    if tree.tree_tokens > 1:
        t = draft_tree(target, head, s, tree)
    else:  # no drafting: verify just the root (a plain decode step)
        from eagle_jax.tree import Tree

        t = Tree(s.root[:, None], jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1), jnp.int32),
                 jnp.ones((b, 1, 1), bool), jnp.full((b, 1), -1, jnp.int32))
    length = s.cache.lengths
    out = target(t.tokens, s.cache, positions=length[:, None] + t.depths, tree_mask=t.mask,
                 capture_layers=_capture(head.cfg), logits_at=None)
    acc = accept(t, out.logits, params, length, d, rule=ACCEPT_RULE)
    count = jnp.where(active, acc.count, 0)
    cache = gather_rows(out.cache, acc.path, count)
    # Tokens emitted: the accepted drafts below the root, then the bonus.
    path_tokens = jnp.take_along_axis(t.tokens, acc.path, axis=1)  # [B, D+1], [:, 0] = root
    slot = jnp.arange(d + 1)[None, :]
    nxt = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1)
    nxt = jnp.where(slot == (acc.count - 1)[:, None], acc.bonus[:, None], nxt)  # [B, D+1]
    # Refresh the draft with the accepted pairs (feature at each path node, the token after it).
    feats = jnp.take_along_axis(target_features(out, head.cfg), acc.path[:, :, None], axis=1)
    h, dcache = head(target, feats, nxt, s.draft_cache, fuse=True)
    root_hidden = jnp.take_along_axis(h, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    new = s.replace(
        cache=cache,
        draft_cache=dcache.replace(lengths=s.draft_cache.lengths + count),
        root=jnp.where(active, acc.bonus, s.root),
        root_hidden=jnp.where(active[:, None], root_hidden, s.root_hidden),
    )
    return new, nxt, count


class SpecEngine:
    def __init__(self, target, head):
        if head.cfg.hidden_size != target.cfg.hidden_size or head.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"draft head (hidden {head.cfg.hidden_size}, vocab {head.cfg.vocab_size}) does not fit the target "
                f"(hidden {target.cfg.hidden_size}, vocab {target.cfg.vocab_size})")
        self.target, self.head = target, head
        self.graphdef, self.state = nnx.split(target.model)
        self.head_graphdef, self.head_state = nnx.split(head)
        self._profiles = {}  # (batch, cache length, profile dir) -> harness cost profile (tree="auto")
        self.acceptance = None  # (greedy, sampled) harness.AcceptanceStats shared by this engine's tree="auto" calls

    def generate(self, prompt_ids, *, max_new_tokens: int, params: SamplingParams, tree, stop: Sequence[str] = (),
                 on_token=None, ignore_eos: bool = False, max_steps: int | None = None,
                 profile_dir=None) -> GenerationResult:
        """tree: a TreeConfig (every step drafts that tree) or "auto": every step the load-aware harness
        (`eagle_jax.harness.Harness`, as in the server) picks a tree from its default candidates or no
        speculation, from the step costs measured on this device for this batch and cache size (cached on
        disk, see `harness.load_or_measure`; `profile_dir` overrides where) and the acceptance seen so
        far. Rows move between plain steps and trees freely (the draft catches up on plain steps' tokens)."""
        from eagle_jax import harness

        policy = None
        if isinstance(tree, str):
            if tree != "auto":
                raise ValueError(f"tree must be a TreeConfig or 'auto', got {tree!r}")
            trees = [t for t in map(harness.parse_candidate, harness.DEFAULT_CANDIDATES) if t is not None]
        else:
            trees = [tree]
        slack, extra = harness.tree_slack(trees), harness.draft_extra(trees)
        max_depth = max(t.depth for t in trees)
        tokens, prompt_lens, params, s_len = prepare_batch(self.target.cfg, prompt_ids, max_new_tokens, params,
                                                           slack=slack)
        n, b, t = len(prompt_ids), tokens.shape[0], tokens.shape[1]
        if isinstance(tree, str):
            key = (b, s_len, str(profile_dir))
            if key not in self._profiles:
                prof = harness.load_or_measure(self.target, self.head, [b], [None] + trees, s_len, s_len + extra,
                                               cache_dir=profile_dir)
                if prof.source != "measured":  # measuring compiled every candidate; a cached profile did not
                    harness.compile_candidates(self.target, self.head, b, [None] + trees, s_len, s_len + extra)
                self._profiles[key] = prof
            if self.acceptance is None:  # acceptance statistics carry over from call to call, as in a server
                self.acceptance = (harness.AcceptanceStats(max_depth), harness.AcceptanceStats(max_depth))
            policy = harness.Harness(trees, self._profiles[key], stats=self.acceptance[0],
                                     sampled_stats=self.acceptance[1])
        row_samples = np.asarray(params.temperature) > 0  # [b]: the harness estimates greedy and sampled rows apart
        eos = () if ignore_eos else self.target.eos_token_ids
        rows = [StopChecker(self.target.tokenizer, eos, stop, max_new_tokens) for _ in range(n)]

        start = time.perf_counter()
        cache = self.target.model.init_cache(b, s_len)
        dcache = self.head.init_cache(b, s_len + extra)
        st = spec_prefill(self.graphdef, self.state, self.head_graphdef, self.head_state, jnp.asarray(tokens),
                          jnp.asarray(prompt_lens), cache, dcache, params)
        root = np.asarray(st.root)
        first_token_s = time.perf_counter() - start
        for r, row in enumerate(rows):
            row.push(int(root[r]))
            if on_token is not None:
                on_token(r, int(root[r]))
        steps, counts, choices = 1, [], {}
        active = np.array([row.reason is None for row in rows] + [False] * (b - n))
        dispatched = 1  # target forwards started (the prefill is the first)

        def dispatch():
            """Starts one step for the rows active now: (emitted, count, tree, rows in it)."""
            nonlocal st, dispatched
            step_tree = tree
            if policy is not None:
                # Every row's draft is in step (plain steps leave their pairs for it to catch up on).
                step_tree = policy.choose(b, int(active.sum()), int(active.sum()),
                                          int((active & row_samples).sum())).tree
            rows_in = active.copy()  # every one of them teaches the harness (all drafts are in step)
            if step_tree is None:  # a plain step; the draft catches up later (see verify_step)
                st, emitted, count = verify_step(self.graphdef, self.state, st, params, jnp.asarray(rows_in),
                                                 self.head_graphdef, self.head_state)
            else:
                st, emitted, count = spec_step(self.graphdef, self.state, self.head_graphdef, self.head_state, st,
                                               params, jnp.asarray(rows_in), step_tree)
            dispatched += 1
            return emitted, count, step_tree, rows_in

        # Step i + 1 is dispatched before the host reads step i's tokens, so stop checks, streaming and the
        # harness's bookkeeping overlap the device. A row that finishes in step i is still in step i + 1:
        # its tokens there are dropped. The cache slack has room for that one extra tree, and sampling keys
        # depend on positions only, so every kept token is what a step-by-step loop gives.
        def can_step():
            return active.any() and (max_steps is None or dispatched < max_steps)

        pending = dispatch() if can_step() else None
        while pending is not None and active.any():
            emitted, count, step_tree, rows_in = pending
            pending = dispatch() if can_step() else None
            emitted, count = np.asarray(emitted), np.asarray(count)
            steps += 1
            observed, observed_sampled = [], []
            for r, row in enumerate(rows):
                if not rows_in[r] or row.reason is not None:
                    continue
                counts.append(int(count[r]))
                observed.append(int(count[r]))
                observed_sampled.append(bool(row_samples[r]))
                for j in range(int(count[r])):
                    finished = row.push(int(emitted[r, j]))
                    if on_token is not None:
                        on_token(r, int(emitted[r, j]))
                    if finished:
                        break
                active[r] = row.reason is None
            if policy is not None:
                policy.observe(step_tree, observed, observed_sampled)
                name = harness.candidate_name(step_tree)
                choices[name] = choices.get(name, 0) + 1
        hist = np.bincount(np.asarray(counts, np.int64), minlength=max_depth + 2)[1:].tolist() if counts else []
        extra_stats = {"tree": dataclasses.asdict(tree)} if policy is None else {
            "tree": "auto", "choices": choices, "profile": policy.profile.source}
        return finish_result(
            rows, start, first_token_s, steps,
            tau=float(np.mean(counts)) if counts else 1.0,
            accepted_per_step=counts,
            accept_histogram=hist,  # hist[i] = verify steps that emitted i + 1 tokens
            buckets={"batch": b, "prompt": t, "cache": s_len},
            **extra_stats,
        )


_SPEC_ENGINES: dict[tuple[int, int], SpecEngine] = {}


def spec_engine_for(target, head) -> SpecEngine:
    key = (id(target), id(head))
    eng = _SPEC_ENGINES.get(key)
    if eng is None or eng.target is not target or eng.head is not head:
        eng = _SPEC_ENGINES[key] = SpecEngine(target, head)
    return eng


# --- batch-state helpers for continuous batching (eagle_jax.serve) ---------------------------------
# A server keeps one SpecState of a static batch bucket; requests join by being prefilled as their own
# small batch (same cache length) and scattered into free rows, and the bucket grows or shrinks by
# gathering rows into a state of another batch size. A target served without a head uses the same
# SpecState with an empty draft cache, so every helper below serves both.


def headless_state(cache: KVCache, root) -> SpecState:
    """A SpecState for a target served without a head (empty draft parts)."""
    b = root.shape[0]
    return SpecState(cache, KVCache((), (), jnp.zeros((b,), jnp.int32)), root, jnp.zeros((b, 1), jnp.float32),
                     **no_lag(b))


def empty_state(target, head, batch: int, cache_len: int, draft_len: int) -> SpecState:
    """A SpecState of `batch` rows that hold nothing (lengths 0)."""
    cache, root = target.model.init_cache(batch, cache_len), jnp.zeros((batch,), jnp.int32)
    if head is None:
        return headless_state(cache, root)
    return SpecState(cache, head.init_cache(batch, draft_len), root, jnp.zeros((batch, head.cfg.hidden_size), head.dtype),
                     **no_lag(batch, head.cfg, head.dtype))


@functools.partial(jax.jit, static_argnames=("graphdef", "head_graphdef"), donate_argnames=("s",))
def verify_step(graphdef, state, s: SpecState, params: SamplingParams, active, head_graphdef=None, head_state=None):
    """A plain decode step over a SpecState: feed each row's root, sample the next token, commit one slot.

    With the head (`head_graphdef`, `head_state`), the step keeps the target's features of the root
    and the sampled token as a pair the draft has not consumed (`lag_*`); when a row holds CATCHUP of
    them the draft runs over them here (`catch_up`), and the next `spec_step` consumes what is left,
    so rows stepped plainly can speculate again at any step. Without it the draft cache and
    root_hidden are left as they are and the draft falls behind for these rows: trees drafted for
    them later are poor (low acceptance) but still lossless, since verification never trusts the
    draft. Same math and sampling positions as `engine.decode_step`.
    Returns (new state, emitted [B, 1], count [B]) like `spec_step`.
    """
    TRACE_COUNTS["verify_step"] += 1
    model = nnx.merge(graphdef, state)
    head = None if head_graphdef is None else nnx.merge(head_graphdef, head_state)
    length = s.cache.lengths
    out = model(s.root[:, None], s.cache, logits_at=jnp.zeros_like(s.root),
                capture_layers=() if head is None else _capture(head.cfg))
    token = sample(out.logits, params, length + 1)
    count = active.astype(jnp.int32)
    new = s.replace(cache=out.cache.replace(lengths=length + count), root=jnp.where(active, token, s.root))
    if head is not None:
        rows, at = jnp.arange(token.shape[0]), jnp.where(active, s.lag_n, CATCHUP)  # inactive rows: dropped
        feat = target_features(out, head.cfg)[:, 0].astype(s.lag_feats.dtype)
        new = new.replace(lag_feats=s.lag_feats.at[rows, at].set(feat, mode="drop"),
                          lag_tokens=s.lag_tokens.at[rows, at].set(token, mode="drop"), lag_n=s.lag_n + count)
        new = catch_up_if(jnp.any(new.lag_n >= CATCHUP), model, head, new)
    return new, token[:, None], count


@functools.partial(jax.jit, donate_argnames=("s",))
def insert_rows(s: SpecState, new: SpecState, rows):
    """Writes the b rows of `new` into `s` at row indices rows [b]; indices >= s's batch are dropped
    (padding rows of the newcomers' prefill batch). Both states have the same cache lengths."""
    TRACE_COUNTS["insert_rows"] += 1
    return jax.tree_util.tree_map(lambda a, x: a.at[rows].set(x.astype(a.dtype), mode="drop"), s, new)


@jax.jit
def take_rows(s: SpecState, rows) -> SpecState:
    """A state of len(rows) rows: row i is s's row rows[i], or an empty row (length 0) where rows[i] < 0."""
    TRACE_COUNTS["take_rows"] += 1
    keep = rows >= 0
    out = jax.tree_util.tree_map(lambda a: jnp.take(a, jnp.maximum(rows, 0), axis=0), s)
    clear = lambda c: c.replace(lengths=jnp.where(keep, c.lengths, 0))
    return out.replace(cache=clear(out.cache), draft_cache=clear(out.draft_cache),
                       lag_n=jnp.where(keep, out.lag_n, 0))
