"""The jitted step family: one prefill and one decode step, for plain and speculative decoding alike.

Carried state per row (all static shapes, `DecodeState`):
  cache          the target's KV cache: committed tokens 0..L-1 (the root token at position L is not in it yet)
  root           the last emitted token (position L); the next step feeds it (and hangs its tree from it)
  draft_cache    the head's one-layer cache: one pair (feature_i, token_{i+1}) per position i < L
  root_hidden    the draft's prediction of the feature at position L (its logits propose position L+1)
  lag_*          pairs (feature_i, token_{i+1}) of plain steps the draft has not consumed yet (lag_n per
                 row, at most CATCHUP): a plain step keeps the target's features here instead of running
                 the draft, and the next speculative step (or a full buffer) runs the draft over them once,
                 so a row stepped plainly can speculate again at any step
Without a head the draft parts are empty (zero-width) and every step is plain.

`step(..., tree=None)` is a plain decode step: feed the root, sample the next token, commit one slot.
`step(..., tree=TreeConfig)` (which needs the head) drafts the tree from (root, root_hidden) (EAGLE-2 expansion), verifies
all N tree tokens with the target in one forward (tree mask, positions L + depth), accepts losslessly
(`eagle_jax.accept`), moves the accepted path's K/V rows to contiguous slots and runs the draft over
the accepted pairs to refresh its cache and root_hidden. Both emit `count` tokens per row, and every
variant reads and writes the same state, so a caller may pick a different precompiled variant
(a tree, or none) on every step without recompiling.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax import sharding
from eagle_jax.accept import accept
from eagle_jax.compiling import jit_pair, param_count, quick
from eagle_jax.kv_cache import KVCache, gather_rows
from eagle_jax.sampling import SamplingParams, sample
from eagle_jax.tree import Tree, TreeConfig, select_tree

# Trace counts per jitted function (incremented at trace time): tests assert compiles happen once per bucket.
TRACE_COUNTS: collections.Counter = collections.Counter()

# Read at trace time. Tests set "broken" to prove the statistical tests can fail (see eagle_jax.accept).
ACCEPT_RULE = "exact"

# Plain steps a row's draft may fall behind before a plain step runs the draft over them (one draft
# forward over CATCHUP pairs: about 1/CATCHUP of a draft step per plain step).
CATCHUP = 16

# Steps whose parameters x rows are under this compile without LLVM optimisation (`eagle_jax.compiling`).
# Measured on XLA:CPU, 1-layer model (55k parameters with its head), 3,2,6 tree step, optimised vs not:
#   2 rows:    compile 4.4 s vs 2.6 s, run 0.3 ms vs 1.4 ms a step  (even after about 1,700 steps)
#   64 rows:   compile 5.3 s vs 2.4 s, run 4.5 ms vs 11.6 ms        (even after about 400 steps)
#   1024 rows: compile 5.7 s vs 2.8 s, run 66 ms vs 173 ms          (even after about 30 steps)
QUICK_COMPILE_WORK = 1 << 21


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cache", "draft_cache", "root", "root_hidden", "lag_feats", "lag_tokens", "lag_n"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: KVCache
    draft_cache: KVCache  # empty (no layers) without a head
    root: jax.Array  # [B] int32
    root_hidden: jax.Array  # [B, H] ([B, 1] without a head)
    lag_feats: jax.Array  # [B, CATCHUP, F] target features the draft has not consumed ([B, 0, 1] without a head)
    lag_tokens: jax.Array  # [B, CATCHUP] the token after each of them
    lag_n: jax.Array  # [B] int32: how many are held

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)


def draft_parts(batch: int, head=None, draft_len: int = 0, pages=None) -> dict:
    """The draft fields of a DecodeState that holds nothing yet; zero-width without a head. pages:
    (num_blocks, block_size, table) of a paged cache (see `empty_state`)."""
    if head is None:
        return dict(draft_cache=KVCache((), (), jnp.zeros((batch,), jnp.int32)),
                    root_hidden=jnp.zeros((batch, 1), jnp.float32), lag_feats=jnp.zeros((batch, 0, 1), jnp.float32),
                    lag_tokens=jnp.zeros((batch, 0), jnp.int32), lag_n=jnp.zeros((batch,), jnp.int32))
    c = head.cfg
    dcache = (head.init_cache(batch, draft_len) if pages is None else
              KVCache.create_paged(1, *pages, c.num_kv_heads, c.head_dim, head.dtype))
    return dict(draft_cache=dcache,
                root_hidden=jnp.zeros((batch, c.hidden_size), head.dtype),
                lag_feats=jnp.zeros((batch, CATCHUP, c.feature_size), head.dtype),
                lag_tokens=jnp.zeros((batch, CATCHUP), jnp.int32), lag_n=jnp.zeros((batch,), jnp.int32))


def empty_state(target, head, batch: int, cache_len: int, draft_len: int = 0, pages=None) -> DecodeState:
    """A DecodeState of `batch` rows that hold nothing (lengths 0). pages: (num_blocks, block_size,
    table [batch, NB]) for paged caches: the target's and the draft's pools have num_blocks blocks each
    and the same table (a row's slot s sits in the same block of both; two arrays, as both caches are
    donated), which must address cache_len and draft_len slots (`eagle_jax.paging`)."""
    if pages is None:
        cache = target.model.init_cache(batch, cache_len)
    else:
        cfg = target.cfg
        cache = KVCache.create_paged(cfg.num_layers, *pages, cfg.num_kv_heads, cfg.head_dim, target.model.dtype)
    return DecodeState(cache, root=jnp.zeros((batch,), jnp.int32), **draft_parts(batch, head, draft_len, pages))


# --- cache sizes ------------------------------------------------------------------------------------

def tree_slack(trees: Iterable[TreeConfig | None]) -> int:
    """Cache room past the last committed token a step may write: N tree tokens (+ depth for safety)."""
    return max([t.tree_tokens + t.depth for t in trees if t is not None] + [1])


def draft_extra(trees: Iterable[TreeConfig | None]) -> int:
    """Extra draft-cache slots past the target's cache length (tree expansion scratch, and room for the
    catch-up after plain steps, which writes CATCHUP slots)."""
    need = [(t.depth - 1) * t.topk + t.depth + 1 for t in trees if t is not None]
    return max(need + [CATCHUP]) if need else CATCHUP


# --- the draft's side -------------------------------------------------------------------------------

def capture_layers(head_cfg) -> tuple[int, ...]:
    """The target layers whose outputs the head consumes (EAGLE-3's low / mid / high); none otherwise."""
    return tuple(head_cfg.aux_layers) if head_cfg is not None and head_cfg.kind == "eagle3" else ()


def target_features(out, head_cfg):
    """The features the head consumes from a target forward: [B, T, F]."""
    if head_cfg.kind == "eagle3":
        return jnp.concatenate(list(out.captured), axis=-1)  # low | mid | high
    return out.hidden


def catch_up(target, head, s: DecodeState) -> DecodeState:
    """Runs the draft over each row's held pairs (one forward over CATCHUP inputs; rows holding none
    commit nothing) and commits them, so every row's draft is in step with its target again."""
    h, dcache = head(target, s.lag_feats, s.lag_tokens, s.draft_cache, fuse=True)
    n = s.lag_n
    last = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]
    return s.replace(draft_cache=dcache.replace(lengths=s.draft_cache.lengths + n),
                     root_hidden=jnp.where((n > 0)[:, None], last.astype(s.root_hidden.dtype), s.root_hidden),
                     lag_n=jnp.zeros_like(n))


def catch_up_if(pred, target, head, s: DecodeState) -> DecodeState:
    """`catch_up` where pred (a traced bool) holds. Only the draft's parts pass through the conditional:
    handing it the whole state would copy the target's KV cache in and out on every step."""
    parts = (s.draft_cache, s.root_hidden, s.lag_n)

    def run(p):
        x = catch_up(target, head, s.replace(draft_cache=p[0], root_hidden=p[1], lag_n=p[2]))
        return x.draft_cache, x.root_hidden, x.lag_n

    dcache, root_hidden, lag_n = jax.lax.cond(pred, run, lambda p: p, parts)
    return s.replace(draft_cache=dcache, root_hidden=root_hidden, lag_n=lag_n)


def draft_tree(target, head, s: DecodeState, tree: TreeConfig) -> Tree:
    """EAGLE-2 expansion from the root; returns the selected `Tree` (see eagle_jax.tree).

    The pool of candidates holds the root's top-k (slots [0, k)) and then, for each level 1..D-1, the
    top-k children of that level's k frontier nodes (k*k slots each). The levels run in a `fori_loop`,
    so the program holds one draft forward however deep the tree (compile time does not grow with D)."""
    b = s.root.shape[0]
    k, d = tree.topk, tree.depth
    logp = head.logprobs(target, s.root_hidden)  # [B, V_draft]
    top_lp, top_id = jax.lax.top_k(logp, k)
    first_tok = head.to_target_ids(top_id)
    pool = k + (d - 1) * k * k
    pad = lambda x, fill: jnp.concatenate([x, jnp.full((b, pool - k), fill, x.dtype)], axis=1)  # noqa: E731
    scratch = max((d - 1) * k, 1)
    carry = dict(
        tokens=pad(first_tok, 0), scores=pad(top_lp, -jnp.inf),
        parents=jnp.full((b, pool), -1, jnp.int32),
        slot=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)),  # pool slots of the frontier
        tok=first_tok, score=top_lp,
        inp=jnp.broadcast_to(s.root_hidden[:, None, :], (b, k, s.root_hidden.shape[-1])),
        anc=jnp.zeros((b, k, scratch), bool),  # frontier nodes' ancestors among scratch slots
        dcache=s.draft_cache)

    def level_step(level, c):  # the frontier at depth `level` proposes depth level + 1
        first = (level - 1) * k
        own = jnp.arange(scratch)[None, :] == first + jnp.arange(k)[:, None]  # [k, scratch]
        anc = c["anc"] | own[None]
        dcache = c["dcache"]
        h, dcache = head(target, c["inp"], c["tok"], dcache, fuse=False,
                         positions=jnp.broadcast_to(dcache.lengths[:, None] + level - 1, (b, k)),
                         tree_mask=anc, write_offset=first)
        lp = head.logprobs(target, h)  # [B, k, V_draft]
        c_lp, c_id = jax.lax.top_k(lp, k)  # [B, k, k]
        c_score = (c["score"][:, :, None] + c_lp).reshape(b, k * k)
        c_tok = head.to_target_ids(c_id).reshape(b, k * k)
        c_parent = jnp.repeat(c["slot"], k, axis=1)  # [B, k*k]
        base = k + first * k  # this level's first pool slot
        put = lambda pool_x, x: jax.lax.dynamic_update_slice_in_dim(pool_x, x, base, axis=1)  # noqa: E731
        best_score, best = jax.lax.top_k(c_score, k)  # next frontier (unused after the last level)
        parent_local = best // k  # index within the current frontier
        return dict(
            tokens=put(c["tokens"], c_tok), scores=put(c["scores"], c_score), parents=put(c["parents"], c_parent),
            slot=(base + best).astype(jnp.int32), tok=jnp.take_along_axis(c_tok, best, axis=1), score=best_score,
            inp=jnp.take_along_axis(h, parent_local[:, :, None], axis=1),
            anc=jnp.take_along_axis(anc, parent_local[:, :, None], axis=1), dcache=dcache)

    if d > 1:  # (the body is traced even for an empty loop, and a depth-1 pool has no room for it)
        carry = jax.lax.fori_loop(1, d, level_step, carry)
    return select_tree(s.root, carry["tokens"], carry["scores"], carry["parents"], tree)


# --- the jitted steps -------------------------------------------------------------------------------

def prefill(graphdef, state, head_graphdef, head_state, tokens, prompt_lens, cache: KVCache, draft_cache,
            params: SamplingParams, window: int | None = None, sampling: bool = True,
            n_params: int | None = None, follow=None) -> DecodeState:
    """Runs the prompts [B, T] (right-padded; true lengths prompt_lens [B]) after what `cache` (and
    `draft_cache`) already hold, and samples the root (the token after them); with a head (head_graphdef
    not None), then runs the draft over every new pair. Fresh caches (lengths 0) give a whole prefill;
    caches of an earlier call give the next chunk of a long prompt (chunked prefill: the same program
    for the same shapes), where follow [B] is the prompt's token after this chunk (-1, the default: the
    chunk ends the prompt, and its last pair's next token is the root just sampled).
    window (static, >= the lengths after the call): the target's attention reads cache slots [0, window) only.
    sampling (static): False when every row is greedy (temperature 0): a smaller program, the same tokens.
    cache and draft_cache are donated. n_params: `param_count(state, head_state)`, when the caller knows it."""
    n = param_count(state, head_state) if n_params is None else n_params
    fn = _PREFILL[quick(n * tokens.shape[0], QUICK_COMPILE_WORK, tokens, state)]
    if follow is None:
        follow = jnp.full((tokens.shape[0],), -1, jnp.int32)
    return fn(graphdef, state, head_graphdef, head_state, tokens, prompt_lens, cache, draft_cache, params, follow,
              window, sampling)


def _prefill(graphdef, state, head_graphdef, head_state, tokens, prompt_lens, cache: KVCache, draft_cache,
             params: SamplingParams, follow, window: int | None = None, sampling: bool = True) -> DecodeState:
    TRACE_COUNTS["prefill"] += 1
    target = nnx.merge(graphdef, state)
    head = None if head_graphdef is None else nnx.merge(head_graphdef, head_state)
    b = tokens.shape[0]
    start = cache.lengths  # [B]: what the caches hold already (0 for a fresh prefill)
    out = target(tokens, cache, capture_layers=capture_layers(None if head is None else head.cfg),
                 logits_at=prompt_lens - 1, window=window)
    root = sample(out.logits, params, start + prompt_lens, sampling)
    cache = out.cache.replace(lengths=start + prompt_lens)
    if head is None:
        return _placed(target, DecodeState(cache, root=root, **draft_parts(b)))
    # Pair i = (feature_i, token_{i+1}); the last pair's next token is the prompt's next one, or the root.
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    last = jnp.where(follow >= 0, follow, root)
    nxt = jnp.where(jnp.arange(tokens.shape[1])[None, :] == (prompt_lens - 1)[:, None], last[:, None], nxt)
    h, draft_cache = head(target, target_features(out, head.cfg), nxt, draft_cache, fuse=True)
    root_hidden = jnp.take_along_axis(h, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    parts = draft_parts(b, head, 0)
    parts.update(draft_cache=draft_cache.replace(lengths=draft_cache.lengths + prompt_lens), root_hidden=root_hidden)
    return _placed(target, DecodeState(cache, root=root, **parts))


def _placed(target, s: DecodeState) -> DecodeState:
    """s on the layout `sharding.state_shardings` gives (with a mesh), so the next step's inputs have the
    layout every step is compiled for."""
    return sharding.constrain(s, target.mesh, target.cfg.num_kv_heads)


def plain_step(target, head, s: DecodeState, params: SamplingParams, active, window=None, sampling=True):
    """Feeds each row's root, samples the next token, commits one slot.

    With a head, the step keeps the target's features of the root and the sampled token as a pair the
    draft has not consumed (`lag_*`); when a row holds CATCHUP of them the draft runs over them here
    (`catch_up`), and the next speculative step consumes what is left."""
    length = s.cache.lengths
    out = target(s.root[:, None], s.cache, logits_at=jnp.zeros_like(s.root),
                 capture_layers=capture_layers(None if head is None else head.cfg), window=window)
    token = sample(out.logits, params, length + 1, sampling)
    count = active.astype(jnp.int32)
    new = s.replace(cache=out.cache.replace(lengths=length + count), root=jnp.where(active, token, s.root))
    if head is not None:
        rows, at = jnp.arange(token.shape[0]), jnp.where(active, s.lag_n, CATCHUP)  # inactive rows: dropped
        feat = target_features(out, head.cfg)[:, 0].astype(s.lag_feats.dtype)
        new = new.replace(lag_feats=s.lag_feats.at[rows, at].set(feat, mode="drop"),
                          lag_tokens=s.lag_tokens.at[rows, at].set(token, mode="drop"), lag_n=s.lag_n + count)
        new = catch_up_if(jnp.any(new.lag_n >= CATCHUP), target, head, new)
    return new, token[:, None], count, None


def tree_step(target, head, s: DecodeState, params: SamplingParams, active, tree: TreeConfig, window=None,
              sampling=True):
    """Draft -> verify -> accept -> commit; see the module docstring."""
    # Rows stepped plainly since their last speculative step: their draft consumes those pairs first.
    s = catch_up_if(jnp.any(s.lag_n > 0), target, head, s)
    if tree.tree_tokens > 1:
        t, d = draft_tree(target, head, s, tree), tree.depth
    else:  # no drafting: verify the root alone, and refresh the draft with it at once
        b = s.root.shape[0]
        t, d = Tree(s.root[:, None], jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1), jnp.int32),
                    jnp.ones((b, 1, 1), bool), jnp.full((b, 1), -1, jnp.int32)), 0
    length = s.cache.lengths
    out = target(t.tokens, s.cache, positions=length[:, None] + t.depths, tree_mask=t.mask,
                 capture_layers=capture_layers(head.cfg), logits_at=None, window=window)
    acc = accept(t, out.logits, params, length, d, rule=ACCEPT_RULE, sampling=sampling)
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
    info = {"tokens": t.tokens, "parents": t.parents, "depths": t.depths, "path": acc.path, "count": acc.count,
            "bonus": acc.bonus}
    return new, nxt, count, info


def step(graphdef, state, head_graphdef, head_state, s: DecodeState, params: SamplingParams, active,
         tree: TreeConfig | None = None, trace: bool = False, window: int | None = None, sampling: bool = True,
         n_params: int | None = None):
    """One decode step for every row: plain (tree None; a head, when given, keeps its pairs to catch up
    on) or speculative (a TreeConfig, which needs the head). Rows with active=False commit nothing
    (their state is unchanged) and report count 0.

    window (static): the target's attention reads cache slots [0, window) only; every active row must
    have length + N <= window (N tree tokens, 1 for a plain step). Inactive rows' outputs are dropped.

    sampling (static): False when the caller knows every row is greedy (temperature 0): the program then
    holds no sampling or sampled-acceptance path (a smaller compile, the same tokens); True serves any
    mix of rows, and an all-greedy batch skips the sampling work at run time.

    Returns (new state, emitted [B, D+1] (D = 0 for a plain step), count [B]); with trace=True also the
    drafted tree and its acceptance (tokens, parents, depths, path, count, bonus) for visualisation.
    s is donated. n_params: `param_count(state, head_state)`, when the caller knows it (counting walks
    over the parameters).
    """
    n = param_count(state, head_state) if n_params is None else n_params
    fn = _STEP[quick(n * s.root.shape[0], QUICK_COMPILE_WORK, s.root, state)]
    return fn(graphdef, state, head_graphdef, head_state, s, params, active, tree, trace, window, sampling)


def _step(graphdef, state, head_graphdef, head_state, s: DecodeState, params: SamplingParams, active,
          tree: TreeConfig | None = None, trace: bool = False, window: int | None = None, sampling: bool = True):
    TRACE_COUNTS["step"] += 1
    target = nnx.merge(graphdef, state)
    head = None if head_graphdef is None else nnx.merge(head_graphdef, head_state)
    if tree is not None:  # (a tree of one token verifies the root alone and refreshes the draft at once)
        if head is None:
            raise ValueError(f"tree {tree.name} needs a draft head")
        new, emitted, count, info = tree_step(target, head, s, params, active, tree, window, sampling)
    else:
        new, emitted, count, info = plain_step(target, head, s, params, active, window, sampling)
    new = _placed(target, new)
    emitted, count, info = sharding.replicated((emitted, count, info), target.mesh)  # what the host reads
    return (new, emitted, count, info) if trace else (new, emitted, count)


def compile_prefill(graphdef, state, head_graphdef, head_state, tokens, prompt_lens, cache, draft_cache, params,
                    window: int | None = None, sampling: bool = True, n_params: int | None = None,
                    fresh: bool = False):
    """Compiles the prefill `prefill` would run for arguments of these shapes (jax.ShapeDtypeStruct trees
    or arrays) without running it or allocating its buffers: a later `prefill` call of the same shapes
    dispatches the compiled program. Returns it (a jax Compiled, called with the non-static arguments:
    state, head_state, tokens, prompt_lens, cache, draft_cache, params, follow). fresh: compiled outside
    JAX's caches (`JitPair.fresh`), so the returned program is the only one and is freed with it (a later
    `prefill` call compiles again; for callers that keep and call the program itself)."""
    n = param_count(state, head_state) if n_params is None else n_params
    is_quick = quick(n * tokens.shape[0], QUICK_COMPILE_WORK, state)
    fn = _PREFILL.fresh(is_quick) if fresh else _PREFILL[is_quick]
    follow = jax.ShapeDtypeStruct((tokens.shape[0],), jnp.int32, sharding=getattr(prompt_lens, "sharding", None))
    return fn.lower(graphdef, state, head_graphdef, head_state, tokens, prompt_lens, cache, draft_cache, params,
                    follow, window, sampling).compile()


def compile_step(graphdef, state, head_graphdef, head_state, s, params, active, tree: TreeConfig | None = None,
                 window: int | None = None, sampling: bool = True, n_params: int | None = None, fresh: bool = False):
    """Compiles the step `step` would run for arguments of these shapes (as `compile_prefill`, fresh
    included); returns it (called with state, head_state, s, params, active)."""
    n = param_count(state, head_state) if n_params is None else n_params
    is_quick = quick(n * s.root.shape[0], QUICK_COMPILE_WORK, state)
    fn = _STEP.fresh(is_quick) if fresh else _STEP[is_quick]
    return fn.lower(graphdef, state, head_graphdef, head_state, s, params, active, tree, False, window,
                    sampling).compile()


_PREFILL = jit_pair(_prefill, static_argnames=("graphdef", "head_graphdef", "window", "sampling"),
                    donate_argnames=("cache", "draft_cache"))
_STEP = jit_pair(_step, static_argnames=("graphdef", "head_graphdef", "tree", "trace", "window", "sampling"),
                 donate_argnames=("s",))
