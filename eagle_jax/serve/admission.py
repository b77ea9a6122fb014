"""Admission for the engine loop (`serve.scheduler`): which waiting requests join the running batch, their
prefill (batched, or chunk by chunk for a long prompt) and their placement in free rows.

Newcomers are prefilled as their own batch (prompt-length bucket, the running cache length) and scattered
into free rows (`rows.insert_rows`); when the bucket is too small the batch is first gathered into a larger
one. With a paged KV cache (`serve.blocks`) a request joins only once the pool has its blocks, and its
prefill writes into the running batch's pools directly.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax.numpy as jnp
import numpy as np

from eagle_jax.rows import clear_paged_rows, insert_paged_rows, insert_rows, next_pow2, pad_prompts, pools, with_pools
from eagle_jax.serve.requests import Request, sampling_params
from eagle_jax.steps import DecodeState
from eagle_jax.stream import TokenStream

log = logging.getLogger("eagle_jax.serve")


@dataclasses.dataclass
class Chunked:
    """A long prompt's prefill in progress: its request, the batch-1 state its chunks have written so
    far (None before the first), and how many of its tokens that holds."""

    req: Request
    state: DecodeState | None = None
    done: int = 0
    seconds: float = 0.0


class Admission:
    """The scheduler's admission half (mixed into `Scheduler`, whose state it reads and updates)."""

    def _target_bucket(self, reqs) -> int | None:
        """The batch bucket the running rows plus `reqs` move to (the smallest compiled one with room for
        them all), or None when none holds them (a bucket's rows are at most `lengths[b][0]` tokens long)."""
        rows = [r for r in self.slots if r is not None] + list(reqs)
        need = max((len(r.prompt_ids) + r.max_tokens for r in rows), default=0)
        b = next((x for x in self._ready_buckets() if x >= len(rows)), None)
        return b if b is not None and need <= self.lengths[b][0] else None

    def _take_newcomers(self, free: int) -> list[Request]:
        cap = min(free, self.prefill_batches[-1])
        out: list[Request] = []
        with self._lock:
            while self._waiting and len(out) < cap:
                nxt = self._waiting[0]
                if len(nxt.prompt_ids) > self.config.prefill_chunk:  # alone, chunk by chunk (`_prefill_chunk`)
                    if not out and self._chunked is None and (self.blocks is None or self.blocks.reserve(nxt)):
                        self._chunked = Chunked(self._waiting.popleft())
                        self._n_running += 1
                    break
                longest = max([len(r.prompt_ids) for r in out] + [len(nxt.prompt_ids)])
                b = next(x for x in self.prefill_batches if x >= len(out) + 1)
                if out and b * self.prompt_bucket(longest) > self.config.prefill_tokens:
                    break
                # Room for the request (and a long prompt still being prefilled) in the bucket they need.
                if self._target_bucket(out + [nxt] + ([self._chunked.req] if self._chunked else [])) is None:
                    break
                if not self.ready.prefill_ready(b, self.prompt_bucket(longest)):
                    if not out:  # compiled next; running rows keep stepping meanwhile
                        self.ready.want_prefill(b, self.prompt_bucket(longest))
                    break
                if self.blocks is not None and not self.blocks.reserve(nxt):
                    break  # waits until running requests give blocks back
                out.append(self._waiting.popleft())
            self._n_running += len(out)
        return out

    def _ready_buckets(self) -> list[int]:
        return [b for b in self.buckets if self.ready.bucket_ready(b)]

    def _admit(self) -> None:
        ready = self._ready_buckets()
        free = (ready[-1] if ready else 0) - self._n_running
        if free <= 0 or not self._waiting:
            return
        newcomers = self._take_newcomers(free)
        if not newcomers:
            return
        try:
            k = len(newcomers)
            b = next(x for x in self.prefill_batches if x >= k)
            t = self.prompt_bucket(max(len(r.prompt_ids) for r in newcomers))
            tokens, lens = pad_prompts([r.prompt_ids for r in newcomers], b, t)
            t0 = time.perf_counter()
            new = self._prefill(tokens, lens, sampling_params(newcomers, b), reqs=newcomers)
            first = self._place(newcomers, new, b)
            dt = time.perf_counter() - t0
        except Exception as e:
            self._prefill_failed(newcomers, e)
            return
        self._count_prefill(newcomers, dt)
        self._started(newcomers, first)

    def _prefill_chunk(self) -> bool:
        """The next chunk of the long prompt being prefilled (`SchedulerConfig.prefill_chunk` tokens,
        continuing the caches its last chunk wrote); after the last one its row joins the batch. False
        while that chunk's program is still being compiled (running rows keep stepping)."""
        job, c = self._chunked, self.config.prefill_chunk
        ids = job.req.prompt_ids
        n = min(c, len(ids) - job.done)
        last = job.done + n == len(ids)
        t = self.prompt_bucket(n)
        if not self.ready.prefill_ready(1, t):
            self.ready.want_prefill(1, t)
            return False
        if last and self._target_bucket([job.req]) is None:
            return False
        try:
            tokens, lens = pad_prompts([ids[job.done: job.done + n]], 1, t)
            t0 = time.perf_counter()
            job.state = self._prefill(tokens, lens, sampling_params([job.req], 1), prev=job.state,
                                      follow=[-1 if last else ids[job.done + n]], reqs=[job.req])
            job.done += n
            job.seconds += time.perf_counter() - t0
            if not last:
                job.state.root.block_until_ready()  # one chunk per loop iteration, then the running rows' step
                return True
            t0 = time.perf_counter()
            first = self._place([job.req], job.state, 1)
            job.seconds += time.perf_counter() - t0
        except Exception as e:
            self._chunked = None
            self._prefill_failed([job.req], e)
            return True
        self._chunked = None
        self._count_prefill([job.req], job.seconds)
        self._started([job.req], first)
        return True

    def _place(self, newcomers, new: DecodeState, b: int):
        """Scatters prefilled rows (`new`, b rows, the first len(newcomers) real) into free slots of the
        batch, gathering it into a larger bucket first when it is full. Returns their first tokens."""
        need = sum(r is not None for r in self.slots) + len(newcomers)
        longest = max(len(r.prompt_ids) + r.max_tokens for r in self.slots + list(newcomers) if r is not None)
        if self.state is None or need > len(self.slots) or longest > self.lengths[len(self.slots)][0]:
            self._resize(self._target_bucket(newcomers))  # a bucket with room: checked when they were taken
        free_slots = [i for i, r in enumerate(self.slots) if r is None][: len(newcomers)]
        dst = np.asarray(free_slots + [len(self.slots)] * (b - len(newcomers)), np.int32)
        insert = insert_rows if self.blocks is None else insert_paged_rows
        self.state = insert(self.state, new, jnp.asarray(dst))
        first = np.asarray(new.root)
        for slot, r in zip(free_slots, newcomers):
            self.slots[slot] = r
            r.slot = slot
        return first

    def _prefill_failed(self, newcomers, e: Exception) -> None:
        log.exception("prefill failed")
        with self._lock:
            self._n_running -= len(newcomers)
        placed = []
        for r in newcomers:
            if r.slot is not None and r.slot < len(self.slots) and self.slots[r.slot] is r:
                self.slots[r.slot] = None
                placed.append(r.slot)
            self._fail(r, f"prefill failed: {e}")
        self._recover_if_broken()
        if placed and self.blocks is not None and self.state is not None:  # their blocks are free again
            self.state = clear_paged_rows(self.state, placed)

    def _count_prefill(self, newcomers, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.count_prefill(sum(len(r.prompt_ids) for r in newcomers), seconds)

    def _started(self, newcomers, first) -> None:
        """Newcomers placed in the batch: their streams, and their first token (the prefill's root)."""
        self._params = None
        for r in newcomers:
            r.stream = TokenStream(self.target.tokenizer, max_tokens=r.max_tokens,
                                   eos_ids=() if r.ignore_eos else self.eos, stop=r.stop)
            self.synced[r.slot] = self.head is not None
        for i, r in enumerate(newcomers):
            self._deliver(r.slot, [int(first[i])])

    def prompt_bucket(self, n: int) -> int:
        # Octaves (16, 32, 64, ...), never wider than the cache the prompt is written into: each prefill
        # program stays resident (35-40 MB for SmolLM2), so half-octaves would cost 4 more for 1.5x less padding.
        return min(next_pow2(n, 16), self.cache_len)

    def _prefill(self, tokens, lens, params, prev=None, follow=None, reqs=()) -> DecodeState:
        """Prefills a batch of newcomers [b, t] (requests `reqs`) into a fresh state of the running cache
        length, or the next chunk of a long prompt into `prev` (see `Engine.run_prefill`). Paged: into
        the running batch's pools, which it hands back to the batch (`serve.blocks`)."""
        if self.blocks is None:
            return self.engine.run_prefill(tokens, lens, self.cache_len, self.draft_len, params, prev=prev,
                                           follow=follow)
        if self.state is None:
            self._resize(self.buckets[0])
        prev = (self.blocks.prefill_state(reqs, tokens.shape[0], self.state) if prev is None
                else with_pools(prev, pools(self.state)))
        new = self.engine.run_prefill(tokens, lens, self.cache_len, self.draft_len, params, prev=prev, follow=follow)
        self.state = with_pools(self.state, pools(new))
        return new
