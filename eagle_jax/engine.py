"""The host loop: `generate` for a batch of prompts, plain or speculative, on the jitted step family.

One loop serves plain decoding (no tree), a fixed draft tree and the load-aware harness (`tree="auto"`):
prefill (`steps.prefill`), then one `steps.step` per iteration with the tree the policy picks, each row's
tokens going through its `TokenStream` (EOS, stop strings, max tokens, text). Step i+1 is dispatched
before the host reads step i, so stop checks, streaming and the harness's bookkeeping overlap the
device. A row that finishes in step i is still in step i+1: its tokens there are dropped. The cache slack
has room for that one extra step, and sampling keys depend on positions only, so every kept token is
what a step-by-step loop gives.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import harness, profiles, sharding, steps
from eagle_jax.compiling import param_count
from eagle_jax.paging import BlockPool, block_table, blocks_for
from eagle_jax.prepared import PreparedPrograms
from eagle_jax.programs import ProgramStore
from eagle_jax.quant import weight_bytes
from eagle_jax.rows import attention_window as window_bucket
from eagle_jax.rows import batch_shapes, next_pow2, pad_prompts
from eagle_jax.sampling import SamplingParams
from eagle_jax.stream import TokenStream
from eagle_jax.tree import TreeConfig, tree_name


@dataclasses.dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]  # "stop" (EOS or stop string) or "length"
    stats: dict[str, Any]


def encode_prompts(tokenizer, prompts: Sequence, chat: bool) -> list[list[int]]:
    """Token ids per prompt. A prompt is a string, a list of chat messages, or a list of token ids."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (list, tuple)) and (len(p) == 0 or isinstance(p[0], (int, np.integer))):
            ids = [int(x) for x in p]
        else:
            if tokenizer is None:
                raise ValueError("this target has no tokenizer: pass prompts as lists of token ids")
            if chat or not isinstance(p, str):
                messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
                if not getattr(tokenizer, "chat_template", None):
                    raise ValueError("chat=True but the tokenizer has no chat template; use chat=False")
                enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                ids = enc["input_ids"] if not isinstance(enc, list) else enc
            else:
                ids = tokenizer(p)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        out.append(list(ids))
    return out


class Engine(PreparedPrograms):
    """A target (and optionally a draft head) split once, so repeated `generate` calls reuse compiled
    steps; `tree="auto"` keeps its cost profiles and acceptance statistics from call to call.

    A target sharded over a mesh (`eagle_jax.sharding`) runs sharded: the head is replicated on the
    mesh, and every state and per-row input is placed on the mesh's layout before a step sees it."""

    def __init__(self, target, head=None):
        if head is not None and (head.cfg.hidden_size != target.cfg.hidden_size
                                 or head.cfg.vocab_size != target.cfg.vocab_size):
            raise ValueError(
                f"draft head (hidden {head.cfg.hidden_size}, vocab {head.cfg.vocab_size}) does not fit the target "
                f"(hidden {target.cfg.hidden_size}, vocab {target.cfg.vocab_size})")
        self.target, self.head = target, head
        self.graphdef, self.state = nnx.split(target.model)
        self.quantization = target.model.quantization
        self.head_graphdef, self.head_state = nnx.split(head) if head is not None else (None, None)
        self.mesh = target.model.mesh
        if self.mesh is not None and head is not None:
            self.head_state = sharding.replicate(self.head_state, self.mesh)
        self.n_params = param_count(self.state, self.head_state)  # small steps compile unoptimised
        # Programs compiled (or loaded) ahead of time through a ProgramStore, by shapes and static
        # arguments; run_prefill / run_step call them directly (`use_store`).
        self.store: ProgramStore | None = None
        self.programs: dict[tuple, Any] = {}
        self._profiles: dict = {}  # (batch, cache length, profile dir, candidates) -> cost profile (tree="auto")
        # Candidates' depth -> (greedy, sampled) AcceptanceStats shared by this engine's tree="auto" calls.
        self.acceptance: dict[int, tuple] = {}

    def run_prefill(self, tokens, prompt_lens, cache_len: int, draft_len: int, params,
                    window: int | None = None, sampling: bool = True, prev: steps.DecodeState | None = None,
                    follow=None) -> steps.DecodeState:
        """The prefill (see `steps.prefill`); sampling=False compiles the all-greedy program. prev: the
        state an earlier chunk of the same prompts left (donated), which this chunk continues; follow [B]:
        each prompt's token after this chunk (-1 where the chunk ends its prompt)."""
        b = tokens.shape[0]
        if prev is None:
            cache = self.place(self.target.model.init_cache(b, cache_len))
            dcache = self.place(self.head.init_cache(b, draft_len), heads=None) if self.head is not None else None
        else:
            prev = self.place(prev)
            cache, dcache = prev.cache, prev.draft_cache if self.head is not None else None
        follow = jnp.full((b,), -1, jnp.int32) if follow is None else jnp.asarray(follow, jnp.int32)
        tokens, prompt_lens, params, follow = self.place((jnp.asarray(tokens, jnp.int32),
                                                          jnp.asarray(prompt_lens, jnp.int32), params, follow))
        prog = None if window is not None else self.programs.get(
            self.prefill_key(b, tokens.shape[1], cache.max_len, self._draft_len(dcache), sampling, pages_of(cache)))
        if prog is not None:
            return prog(self.state, self.head_state, tokens, prompt_lens, cache, dcache, params, follow)
        return steps.prefill(self.graphdef, self.state, self.head_graphdef, self.head_state, tokens, prompt_lens, cache,
                             dcache, params, window, sampling, self.n_params, follow)

    def run_step(self, s: steps.DecodeState, params, active, tree: TreeConfig | None, trace: bool = False,
                 window: int | None = None, sampling: bool = True):
        """One step (see `steps.step`); the head rides along with plain steps so its draft can catch up.
        sampling=False compiles the all-greedy program (only for batches whose rows are all greedy)."""
        # (on a mesh, row surgery between steps may leave another layout: back to the one steps compile for)
        s, params, active = self.place((s, params, jnp.asarray(active)))
        if not trace and window is None and self.programs:
            prog = self.programs.get(self.step_key(s.root.shape[0], s.cache.max_len, self._draft_len(s.draft_cache),
                                                   tree, sampling, pages_of(s.cache)))
            if prog is not None:
                return prog(self.state, self.head_state, s, params, jnp.asarray(active))
        return steps.step(self.graphdef, self.state, self.head_graphdef, self.head_state, s, params,
                          jnp.asarray(active), tree, trace, window, sampling, self.n_params)

    def empty_state(self, batch: int, cache_len: int, draft_len: int, pages: tuple[int, int] | None = None):
        """A state of `batch` rows holding nothing: contiguous caches of these lengths, or with pages =
        (num_blocks, block_size) paged ones (pools of num_blocks blocks; rows hold no block yet, and the
        table addresses max(cache_len, draft_len) slots)."""
        draft_len = draft_len if self.head is not None else 0
        if pages is None:
            return self.place(steps.empty_state(self.target, self.head, batch, cache_len, draft_len))
        table = np.full((batch, blocks_for(max(cache_len, draft_len), pages[1])), -1, np.int32)
        return self.place(steps.empty_state(self.target, self.head, batch, cache_len, draft_len, pages=(*pages, table)))

    def place(self, tree, heads="target"):
        """tree (a DecodeState, a KVCache, per-row inputs) on this engine's mesh layout
        (`sharding.place`); unchanged on one device. heads=None: a KV cache whose heads are replicated
        (the draft's)."""
        kv_heads = self.target.cfg.num_kv_heads if heads == "target" else None
        return sharding.place(tree, self.mesh, kv_heads)

    @staticmethod
    def _draft_len(draft_cache) -> int:
        return draft_cache.max_len if draft_cache is not None and draft_cache.k else 0

    def auto_policy(self, batch: int, cache_len: int, draft_len: int, trees, profile_dir=None,
                    sampling: bool = True) -> harness.Harness:
        """The load-aware harness for this batch bucket and cache length: the cost profile is measured
        once (or read from the disk cache, then every candidate is compiled up front) and acceptance
        statistics carry over from call to call, as in a server. sampling=False: the all-greedy steps
        (a call whose rows are all greedy) are the ones profiled and compiled."""
        key = (batch, cache_len, str(profile_dir), tuple(t.name for t in trees), sampling)
        if key not in self._profiles:
            prof = profiles.load_or_measure(self.target, self.head, [batch], [None] + trees, cache_len, draft_len,
                                            cache_dir=profile_dir, sampling=sampling)
            if prof.source != "measured":  # measuring compiled every candidate; a cached profile did not
                profiles.compile_candidates(self.target, self.head, batch, [None] + trees, cache_len, draft_len,
                                            sampling)
            self._profiles[key] = prof
        depth = max(t.depth for t in trees)
        if depth not in self.acceptance:
            self.acceptance[depth] = (harness.AcceptanceStats(depth), harness.AcceptanceStats(depth))
        greedy, sampled = self.acceptance[depth]
        return harness.Harness(trees, self._profiles[key], stats=greedy, sampled_stats=sampled)

    def paged_state(self, needs: Sequence[int], batch: int, cache_len: int, draft_len: int,
                    block_size: int) -> steps.DecodeState:
        """An empty state on paged caches (`eagle_jax.kv_cache`) whose row i holds the blocks for needs[i]
        slots (target and draft alike) and rows past len(needs) none; the pools hold just those blocks,
        and the table addresses max(cache_len, draft_len) slots."""
        width = blocks_for(max(cache_len, draft_len), block_size)
        per_row = [min(blocks_for(n, block_size), width) for n in needs]
        pool = BlockPool(max(sum(per_row), 1), block_size)
        table = block_table([pool.take(n) for n in per_row] + [[]] * (batch - len(needs)), width)
        return self.place(steps.empty_state(self.target, self.head, batch, cache_len, draft_len,
                                            pages=(pool.num_blocks, block_size, table)))

    def generate(self, prompt_ids: list[list[int]], *, max_new_tokens: int, params: SamplingParams,
                 tree: TreeConfig | str | None = None, stop: Sequence[str] = (), on_token=None,
                 ignore_eos: bool = False, max_steps: int | None = None, profile_dir=None,
                 attention_window: bool = False, cache_len: int | None = None,
                 candidates: Sequence[TreeConfig] | None = None, block_size: int | None = None) -> GenerationResult:
        """tree: None (plain decoding), a TreeConfig (every step drafts that tree; needs a head) or "auto"
        (every step the harness picks a tree from `candidates` (default `harness.DEFAULT_CANDIDATES`) or a
        plain step, from the step costs measured on this device and the acceptance seen so far; fewer
        candidates measure and compile fewer steps). max_steps stops after that many
        target forwards, the prefill included (benchmark warm-ups: real buckets, little work).
        attention_window: each step's attention reads only a power-of-two window of the cache that holds
        the longest row (`rows.attention_window`; one compile per window), so long generations do not pay
        for the cache's full length from their first token.
        cache_len: the KV cache holds at least this many slots (rounded up to a power of two, >= 128), so
        calls with different prompts compile and profile the same shapes (benchmarks pass one value for
        the whole run).
        block_size: a paged KV cache (`eagle_jax.paging`) with blocks of this many slots, each row holding
        only the blocks its prompt, max_new_tokens and the tree's slack need; None: one contiguous cache
        of the bucket's length per row."""
        if isinstance(tree, str) and tree != "auto":
            raise ValueError(f"tree must be a TreeConfig, None or 'auto', got {tree!r}")
        if tree is not None and self.head is None:
            raise ValueError("speculative decoding (a tree) needs a draft head")
        auto = tree == "auto"
        if candidates is not None and not auto:
            raise ValueError("candidates are the trees tree='auto' chooses from; pass tree='auto' with them")
        trees = harness.candidate_trees(candidates) if auto else [tree]
        slack = steps.tree_slack(trees) if self.head is not None else 0
        draft_len_extra = steps.draft_extra(trees)
        b, t, s_len = batch_shapes(self.target.cfg.max_position, prompt_ids, max_new_tokens, slack)
        dp = sharding.mesh_shape(self.mesh)["data"]
        b = -(-b // dp) * dp  # rows split evenly over the data axis
        if block_size is not None and dp > 1:
            raise ValueError("a paged KV cache (block_size) is shared by every row: it needs data_parallel 1")
        if cache_len is not None:
            s_len = max(s_len, next_pow2(cache_len, 128))
        tokens, prompt_lens = pad_prompts(prompt_ids, b, t)
        params = params.pad_to(b)
        n = len(prompt_ids)
        samples = np.asarray(params.temperature) > 0  # [b]: the harness estimates greedy and sampled rows apart
        # An all-greedy call compiles steps without the sampling paths (about half the compile time), with
        # the harness too: its profile measures the programs the call runs.
        sampling = bool(samples.any())
        policy = self.auto_policy(b, s_len, s_len + draft_len_extra, trees, profile_dir, sampling) if auto else None
        eos = () if ignore_eos else self.target.eos_token_ids
        rows = [TokenStream(self.target.tokenizer, max_tokens=max_new_tokens, eos_ids=eos, stop=stop)
                for _ in range(n)]

        def deliver(r: int, ids) -> int:
            kept = rows[r].push(ids)
            if on_token is not None:
                for tok in ids[:kept]:
                    on_token(r, int(tok))
            return kept

        start = time.perf_counter()
        lens = np.asarray(prompt_lens).copy()  # committed cache length per row, as of the steps read so far
        prev = None
        if block_size is not None:
            extra = draft_len_extra if self.head is not None else 0
            prev = self.paged_state([len(p) + max_new_tokens + 1 + slack + extra for p in prompt_ids], b, s_len,
                                    s_len + draft_len_extra if self.head is not None else 0, block_size)
        st = self.run_prefill(tokens, prompt_lens, s_len, s_len + draft_len_extra, params,
                              window_bucket(t, s_len) if attention_window else None, sampling, prev=prev)
        root = np.asarray(st.root)
        first_token_s = time.perf_counter() - start
        for r in range(n):
            deliver(r, [int(root[r])])
        active = np.array([not row.done for row in rows] + [False] * (b - n))
        counts, choices = [], {}
        dispatched = 1  # target forwards started (the prefill is the first)
        pending: list = []  # steps dispatched whose counts are not in `lens` yet (the first is being read)

        def can_step(in_flight: int) -> bool:
            if max_steps is not None and dispatched >= max_steps:
                return False
            # A step in flight gives every active row at least one token: no new step when those end them all.
            return any(active[r] and rows[r].remaining > in_flight for r in range(n))

        def dispatch():
            nonlocal st, dispatched
            step_tree = tree
            if policy is not None:  # every row's draft is in step (plain steps leave pairs to catch up on)
                n_act = int(active.sum())
                step_tree = policy.choose(b, n_act, n_act, int((active & samples).sum())).tree
            rows_in = active.copy()
            window = None
            if attention_window:  # room for what the steps in flight may commit, then this step's tree
                ahead = lens + sum(np.where(p[3], 1 + (p[2].depth if p[2] is not None else 0), 0) for p in pending)
                n_new = step_tree.tree_tokens if step_tree is not None else 1
                window = window_bucket(int(ahead[rows_in].max(initial=0)) + n_new, s_len)
            st, emitted, count = self.run_step(st, params, rows_in, step_tree, window=window, sampling=sampling)
            dispatched += 1
            pending.append((emitted, count, step_tree, rows_in))

        if can_step(0):
            dispatch()
        read = 0  # steps whose tokens were used
        while pending:
            emitted, count, step_tree, rows_in = pending[0]  # stays in flight until its counts are read
            if can_step(len(pending)):
                dispatch()
            read += 1
            emitted, count = np.asarray(emitted), np.asarray(count)
            lens += count
            pending.pop(0)
            observed, observed_sampled = [], []
            for r in range(n):
                if not rows_in[r] or rows[r].done:
                    continue
                c = int(count[r])
                counts.append(c)
                observed.append(c)
                observed_sampled.append(bool(samples[r]))
                deliver(r, emitted[r, :c].tolist())
                active[r] = not rows[r].done
            if policy is not None:
                policy.observe(step_tree, observed, observed_sampled)
                choices[tree_name(step_tree)] = choices.get(tree_name(step_tree), 0) + 1
            if not active.any():
                pending.clear()  # a step dispatched for rows that have all finished since: nothing to keep
        elapsed = time.perf_counter() - start
        depth = max((x.depth for x in trees if x is not None), default=0)
        hist = np.bincount(np.asarray(counts, np.int64), minlength=depth + 2)[1:].tolist() if counts else []
        generated = sum(len(row.ids) for row in rows)
        stats = {
            "steps": 1 + read,  # target forwards whose tokens were used (the prefill is the first)
            "generated_tokens": generated,
            "wall_s": elapsed,
            "time_to_first_token_s": first_token_s,
            "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            "tau": float(np.mean(counts)) if counts else 1.0,
            "accepted_per_step": counts,
            "accept_histogram": hist,  # hist[i] = row-steps that emitted i + 1 tokens
            "buckets": {"batch": b, "prompt": t, "cache": s_len},
            "mesh": sharding.mesh_shape(self.mesh),
            "weight_bytes": weight_bytes(self.state),  # the target's parameters in device memory
            "quantization": None if self.quantization is None else self.quantization[0],
        }
        if auto:
            stats.update(tree="auto", choices=choices, profile=policy.profile.source)
        elif tree is not None:
            stats["tree"] = dataclasses.asdict(tree)
        return GenerationResult(texts=[row.text for row in rows], token_ids=[row.ids for row in rows],
                                finish_reasons=[row.reason or "length" for row in rows], stats=stats)


def pages_of(cache) -> tuple[int, int] | None:
    """(num_blocks, block_size) of a paged cache's pools; None for a contiguous cache."""
    return tuple(cache.k[0].shape[:2]) if cache.paged else None


def engine_for(target, head=None) -> Engine:
    """The engine of this target and head, made on first use and kept on the target (`Target.engines`),
    so it is released with the target (no global cache keeps targets alive)."""
    eng = target.engines.get(id(head))
    if eng is None or eng.head is not head:
        eng = target.engines[id(head)] = Engine(target, head)
    return eng


def generate(
    target,
    prompts,
    draft=None,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = True,
    stop: Sequence[str] | str = (),
    on_token=None,
    ignore_eos: bool = False,
    tree=None,
    max_steps: int | None = None,
    attention_window: bool = False,
    cache_len: int | None = None,
    candidates=None,
    block_size: int | None = None,
    tensor_parallel: int | None = None,
    data_parallel: int | None = None,
) -> GenerationResult:
    """Generates continuations for a batch of prompts.

    prompts: a string, or a list of strings / chat message lists / token-id lists (ragged is fine).
    temperature 0 is greedy. `seed` is per call; row r uses seed + r. `stop` strings end a row (the
    text is cut before the stop string; token ids keep the tokens that completed it).
    on_token(row, token_id) is called for each new token as soon as it is on the host.
    ignore_eos=True keeps generating past EOS tokens (every row gets exactly max_new_tokens unless a
    stop string ends it); meant for benchmarks.
    draft: an EAGLE head (`eagle_jax.load_draft` / `eagle_jax.draft.random_head`) turns on speculative
    decoding with `tree`: a `TreeConfig` or "D,K,N" (default depth 4, top-k 4, 16 tree tokens), or "auto"
    (the load-aware harness picks a tree or plain decoding every step from costs measured on this device,
    so speculation that does not pay is switched off; `candidates`, a list of trees or "D,K,N" strings, narrows
    what it chooses from). The output is the same as without it: token
    for token when greedy, in distribution when sampling.
    attention_window=True lets each step's attention read only the part of the KV cache the rows fill
    (a power-of-two window; one compile per window): faster for long generations, the same tokens up
    to float rounding. cache_len: a minimum KV cache length (see `Engine.generate`).
    block_size: a paged KV cache with blocks of this many slots, each row holding only what it needs
    (see `Engine.generate`); the same tokens as the contiguous cache.
    tensor_parallel / data_parallel: run on a mesh of that many devices (`eagle_jax.sharding`; the target
    is re-placed if it was loaded for another one); None keeps the target's layout.
    """
    if tensor_parallel is not None or data_parallel is not None:
        now = sharding.mesh_shape(target.model.mesh)
        sharding.shard_target(target, tensor_parallel or now["model"], data_parallel or now["data"],
                              expert_parallel=now.get("expert", 1))
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts is empty")
    if isinstance(stop, str):
        stop = [stop]
    ids = encode_prompts(target.tokenizer, prompts, chat)
    n = len(ids)
    params = SamplingParams.make(n, temperature, top_k, top_p, [seed + r for r in range(n)])
    if draft is None:
        if tree is not None:
            raise ValueError("tree= needs a draft head (draft=...)")
    elif tree is None:
        tree = TreeConfig()
    elif tree != "auto":
        tree = TreeConfig.parse(tree)
    return engine_for(target, draft).generate(ids, max_new_tokens=max_new_tokens, params=params, tree=tree,
                                              stop=stop, on_token=on_token, ignore_eos=ignore_eos,
                                              max_steps=max_steps, attention_window=attention_window,
                                              cache_len=cache_len, candidates=candidates, block_size=block_size)
