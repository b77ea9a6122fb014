"""What the engine loop takes and gives: requests, their events, the loop's settings and its refusals."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import Callable, Sequence

from eagle_jax.sampling import SamplingParams
from eagle_jax.steps import tree_slack
from eagle_jax.stream import TokenStream

log = logging.getLogger("eagle_jax.serve")


class QueueFull(Exception):
    """The server holds max_batch running + max_queue waiting requests already."""


class ShuttingDown(Exception):
    pass


@dataclasses.dataclass
class Event:
    kind: str  # "tokens" | "done" | "error"
    tokens: tuple[int, ...] = ()
    reason: str | None = None  # done: "stop" (EOS or a stop string) | "length" | "cancelled"
    message: str | None = None
    text: str = ""  # tokens / done: text that can be shown now (see eagle_jax.stream.TokenStream)


_ids = itertools.count()


class Request:
    """One generation request as the scheduler sees it (token ids in, token ids out)."""

    def __init__(self, prompt_ids: Sequence[int], max_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, ignore_eos: bool = False, stop: Sequence[str] = (),
                 sink: Callable[[Event], None] | None = None):
        self.id = next(_ids)
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.max_tokens = int(max_tokens)
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.seed = int(seed) % (2**32)
        # Checked here, on the caller's thread: a bad request must fail alone, not inside a shared prefill.
        if not self.prompt_ids or self.max_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_tokens >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0 and 0 < self.top_p <= 1
                and 0 <= self.top_k < 2**31):
            raise ValueError(f"invalid sampling parameters: temperature {temperature}, top_p {top_p}, top_k {top_k}")
        self.ignore_eos = ignore_eos
        self.stop = [str(s) for s in stop if s]
        self.sink = sink
        self.stream: TokenStream | None = None  # EOS, stop strings, max_tokens, text: set when it gets a slot
        self.finish_reason: str | None = None
        self.slot: int | None = None
        self.blocks: list[int] | None = None  # KV blocks it holds (a paged server: `serve.blocks`)

    def spec(self) -> dict:
        """What another process needs to run this request alike (`from_spec`): JSON-safe."""
        return {"id": self.id, "prompt_ids": self.prompt_ids, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "ignore_eos": self.ignore_eos, "stop": self.stop}

    @classmethod
    def from_spec(cls, spec: dict) -> "Request":
        """The request another process described with `spec` (the same id; no sink)."""
        spec = dict(spec)
        rid = spec.pop("id")
        req = cls(spec.pop("prompt_ids"), spec.pop("max_tokens"), **spec)
        req.id = rid
        return req

    def emit(self, event: Event) -> None:
        if self.sink is None:
            return
        try:
            self.sink(event)
        except Exception:  # a closed event loop must not take the engine down
            log.debug("request %d: sink failed", self.id, exc_info=True)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 32
    max_model_len: int = 1024  # prompt + generated tokens per request
    batch_buckets: tuple[int, ...] = ()  # default: powers of two up to max_batch, and max_batch
    prefill_batches: tuple[int, ...] = (1, 4)  # batch buckets of a prefill (the largest caps one prefill)
    prefill_tokens: int = 2048  # padded prompt tokens per prefill of short prompts
    # A prompt longer than this is prefilled alone, this many tokens per loop iteration (each chunk
    # continues the caches the last one wrote), so running rows step between its chunks.
    prefill_chunk: int = 64
    max_queue: int = 256  # waiting requests beyond the running ones before QueueFull
    shrink_patience: int = 8
    # KV cache slots the running rows share (0: no limit, every row holds max_model_len). A batch bucket
    # of b rows gets kv_cache_tokens / b slots a row (at most max_model_len's): larger buckets take only
    # shorter requests (prompt + max_tokens), and their caches and attention cost what they hold.
    kv_cache_tokens: int = 0
    # Batch buckets whose tree programs a prepared server keeps loaded (0: all). The least recently stepped
    # bucket's are dropped beyond that and loaded again from the program store when it is stepped again
    # (`serve.prepare.Preparation`): a bucket's trees hold 0.2-0.6 GB of compiled programs for SmolLM2.
    resident_tree_buckets: int = 0
    # Paged KV cache (`serve.blocks`): blocks of this many slots in one pool of kv_cache_tokens slots
    # (0: max_batch rows of max_model_len), handed to requests by need; 0: contiguous rows as above.
    block_size: int = 0

    def __post_init__(self):
        if self.prefill_chunk < 16:
            raise ValueError(f"prefill_chunk must be >= 16 tokens, got {self.prefill_chunk}")
        if self.kv_cache_tokens < 0:
            raise ValueError(f"kv_cache_tokens must be >= 0 (0: no limit), got {self.kv_cache_tokens}")
        if self.block_size < 0:
            raise ValueError(f"block_size must be >= 0 (0: contiguous rows), got {self.block_size}")
        if self.resident_tree_buckets < 0:
            raise ValueError(f"resident_tree_buckets must be >= 0 (0: all), got {self.resident_tree_buckets}")

    def buckets(self) -> tuple[int, ...]:
        if self.batch_buckets:
            b = sorted({int(x) for x in self.batch_buckets if 0 < int(x) <= self.max_batch} | {self.max_batch})
            return tuple(b)
        out, b = [], 1
        while b < self.max_batch:
            out.append(b)
            b *= 2
        return tuple(out + [self.max_batch])


def sampling_params(reqs: Sequence[Request | None], batch: int) -> SamplingParams:
    """The requests' sampling parameters, `batch` rows (greedy where there is no request)."""
    reqs = list(reqs) + [None] * (batch - len(reqs))
    return SamplingParams.make(batch, [r.temperature if r else 0.0 for r in reqs], [r.top_k if r else 0 for r in reqs],
                               [r.top_p if r else 1.0 for r in reqs], [r.seed if r else 0 for r in reqs])


def cache_length(max_model_len: int, trees) -> int:
    """Target cache length: max_model_len plus the tree slack, rounded up to a multiple of 128."""
    need = max_model_len + tree_slack(trees)
    return -(-need // 128) * 128


def bucket_lengths(config: SchedulerConfig, trees) -> dict[int, tuple[int, int]]:
    """Batch bucket -> (the longest request, prompt + max_tokens, one of its rows holds; its target cache
    length). Without `kv_cache_tokens` every bucket holds max_model_len; with it, a bucket of b rows gets
    kv_cache_tokens / b slots a row, rounded down to a multiple of 128, but never less than room for a
    64-token request nor more than the full length."""
    full = cache_length(config.max_model_len, trees)
    least = cache_length(min(64, config.max_model_len), trees)
    out = {}
    for b in config.buckets():
        cache = full if not config.kv_cache_tokens else min(full, max(least, config.kv_cache_tokens // b // 128 * 128))
        out[b] = (min(config.max_model_len, cache - tree_slack(trees)), cache)
    return out
