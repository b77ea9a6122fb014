"""Plain (non-speculative) decoding: jitted prefill and decode steps, and the `generate` API.

Shapes are bucketed so a compiled step is reused across calls: batch rounds up to a power of two,
prompt length to a half-octave bucket (16, 24, 32, 48, ...), cache length to a power of two that holds the prompt and
every new token. The host loop dispatches step i+1 before it reads step i's tokens, so device work
and host bookkeeping (stop checks, detokenisation) overlap.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.kv_cache import KVCache
from eagle_jax.sampling import SamplingParams, sample

# Trace counts per jitted step (incremented at trace time): tests assert compiles happen once per bucket.
TRACE_COUNTS: collections.Counter = collections.Counter()


def next_pow2(n: int, minimum: int = 1) -> int:
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def length_bucket(n: int, minimum: int = 16) -> int:
    """Rounds up to 16, 24, 32, 48, 64, 96, 128, ...: at most 1.5x padding, two buckets per octave."""
    p = next_pow2(n, minimum)
    return p * 3 // 4 if p > minimum and n <= p * 3 // 4 else p


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def prefill_step(graphdef, state, tokens, prompt_lens, cache: KVCache, params: SamplingParams):
    """Runs the prompts [B, T] (right-padded; true lengths prompt_lens [B]) and samples token one."""
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    cache = cache.replace(lengths=jnp.zeros_like(cache.lengths))
    out = model(tokens, cache, logits_at=prompt_lens - 1)
    token = sample(out.logits, params, prompt_lens)
    return token, out.cache.replace(lengths=prompt_lens)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def decode_step(graphdef, state, token, cache: KVCache, params: SamplingParams):
    """Feeds the last sampled token [B] and samples the next one; commits one slot per row."""
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    out = model(token[:, None], cache, logits_at=jnp.zeros_like(token))
    cache = out.cache.replace(lengths=cache.lengths + 1)
    return sample(out.logits, params, cache.lengths), cache


def prepare_batch(cfg, prompt_ids, max_new_tokens: int, params: SamplingParams, slack: int = 0):
    """Validates lengths and pads prompts into the static buckets.

    Returns (tokens [b, t], prompt_lens [b], params padded to b, cache length s). `slack` is extra
    cache room past the last token (a speculative step writes its whole tree there).
    """
    n = len(prompt_ids)
    lens = np.array([len(p) for p in prompt_ids], np.int32)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i in range(n):
        if lens[i] + max_new_tokens + slack > cfg.max_position:
            extra = f" (+{slack} speculative slack)" if slack else ""
            raise ValueError(
                f"prompt {i} has {lens[i]} tokens; with max_new_tokens={max_new_tokens}{extra} that exceeds the "
                f"model's context length {cfg.max_position}")
    b = next_pow2(n)
    t = length_bucket(int(lens.max()))
    s = next_pow2(max(t, int(lens.max()) + max_new_tokens + 1 + slack), 128)
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = p
    prompt_lens = np.concatenate([lens, np.ones(b - n, np.int32)])
    return tokens, prompt_lens, params.pad_to(b), s


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


class StopChecker:
    """Host-side end-of-sequence logic for one row: EOS ids, stop strings, max_new_tokens."""

    def __init__(self, tokenizer, eos_ids, stop: Sequence[str], max_new_tokens: int):
        self.tokenizer = tokenizer
        self.eos = set(eos_ids)
        self.stop = [s for s in stop if s]
        self.max_new = max_new_tokens
        self.tokens: list[int] = []
        self.text_cut: int | None = None
        self.reason: str | None = None

    def push(self, token: int) -> bool:
        """Adds a token; returns True when the row is finished."""
        if self.reason is not None:
            return True
        self.tokens.append(int(token))
        if token in self.eos:
            self.reason = "stop"
        elif self.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            hits = [text.find(s) for s in self.stop if s in text]
            if hits:
                self.text_cut = min(hits)
                self.reason = "stop"
        if self.reason is None and len(self.tokens) >= self.max_new:
            self.reason = "length"
        return self.reason is not None

    def text(self) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return text[: self.text_cut] if self.text_cut is not None else text


class PlainEngine:
    """Holds the split model so repeated `generate` calls reuse compiled steps."""

    def __init__(self, target):
        self.target = target
        self.graphdef, self.state = nnx.split(target.model)

    def generate(self, prompt_ids: list[list[int]], *, max_new_tokens: int, params: SamplingParams,
                 stop: Sequence[str] = (), on_token=None, ignore_eos: bool = False,
                 max_steps: int | None = None) -> GenerationResult:
        """max_steps stops after that many target forwards (benchmark warm-ups: real buckets, little work)."""
        tokens, prompt_lens, params, s = prepare_batch(self.target.cfg, prompt_ids, max_new_tokens, params)
        n, b, t = len(prompt_ids), tokens.shape[0], tokens.shape[1]
        eos = () if ignore_eos else self.target.eos_token_ids
        tok = self.target.tokenizer
        rows = [StopChecker(tok, eos, stop, max_new_tokens) for _ in range(n)]

        start = time.perf_counter()
        cache = self.target.model.init_cache(b, s)
        current, cache = prefill_step(self.graphdef, self.state, jnp.asarray(tokens), jnp.asarray(prompt_lens),
                                      cache, params)
        first_token_s = None
        steps = 0
        for i in range(max_new_tokens):
            last = i == max_new_tokens - 1
            if not last:
                nxt, cache = decode_step(self.graphdef, self.state, current, cache, params)  # async
            steps += 1  # target forwards whose token was used (the prefill is the first)
            host = np.asarray(current)
            if first_token_s is None:
                first_token_s = time.perf_counter() - start
            done = True
            for r, row in enumerate(rows):
                was_done = row.reason is not None
                finished = row.push(int(host[r]))
                if on_token is not None and not was_done:
                    on_token(r, int(host[r]))
                done &= finished
            if done or last or (max_steps is not None and steps >= max_steps):
                break
            current = nxt
        return finish_result(rows, start, first_token_s, steps, accepted_per_step=[1.0], tau=1.0,
                             buckets={"batch": b, "prompt": t, "cache": s})


def finish_result(rows: Sequence[StopChecker], start: float, first_token_s, steps: int, **extra) -> GenerationResult:
    """Texts, ids, finish reasons and the common stats (plus engine-specific `extra`) of a finished run."""
    elapsed = time.perf_counter() - start
    generated = sum(len(r.tokens) for r in rows)
    stats = {
        "steps": steps,
        "generated_tokens": generated,
        "wall_s": elapsed,
        "time_to_first_token_s": first_token_s,
        "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
        **extra,
    }
    return GenerationResult(texts=[r.text() for r in rows], token_ids=[r.tokens for r in rows],
                            finish_reasons=[r.reason or "length" for r in rows], stats=stats)


_ENGINES: dict[int, PlainEngine] = {}


def _engine_for(target) -> PlainEngine:
    eng = _ENGINES.get(id(target))
    if eng is None or eng.target is not target:
        eng = _ENGINES[id(target)] = PlainEngine(target)
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
) -> GenerationResult:
    """Generates continuations for a batch of prompts.

    prompts: a string, or a list of strings / chat message lists / token-id lists (ragged is fine).
    temperature 0 is greedy. `seed` is per call; row r uses seed + r. `stop` strings end a row (the
    text is cut before the stop string; token ids keep the tokens that completed it).
    on_token(row, token_id) is called for each new token as soon as it is on the host.
    ignore_eos=True keeps generating past EOS tokens (every row gets exactly max_new_tokens unless a
    stop string ends it); meant for benchmarks.
    draft: an EAGLE head (`eagle_jax.load_draft` / `eagle_jax.draft.random_head`) turns on speculative
    decoding with `tree`: a `TreeConfig` (default depth 4, top-k 4, 16 tree tokens), or "auto" (the
    load-aware harness picks a tree or plain decoding every step from costs measured on this device,
    so speculation that does not pay is switched off). The output is the same as without it: token
    for token when greedy, in distribution when sampling.
    """
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts is empty")
    if isinstance(stop, str):
        stop = [stop]
    ids = encode_prompts(target.tokenizer, prompts, chat)
    n = len(ids)
    params = SamplingParams.make(n, temperature, top_k, top_p, [seed + r for r in range(n)])
    if draft is not None:
        from eagle_jax.speculative import spec_engine_for
        from eagle_jax.tree import TreeConfig

        return spec_engine_for(target, draft).generate(
            ids, max_new_tokens=max_new_tokens, params=params, tree=tree or TreeConfig(), stop=stop,
            on_token=on_token, ignore_eos=ignore_eos, max_steps=max_steps)
    return _engine_for(target).generate(ids, max_new_tokens=max_new_tokens, params=params, stop=stop,
                                        on_token=on_token, ignore_eos=ignore_eos, max_steps=max_steps)
