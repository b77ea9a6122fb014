"""The engine loop: continuous batching over static batch buckets, on one thread that owns the JAX state.

The running batch is one `SpecState` (a target served without a head carries an empty draft cache) of a
batch bucket B (a power of two <= max_batch) and a fixed cache length (max_model_len + tree slack).
Each loop iteration:

1. drops cancelled requests (client went away, or a stop string was found): their slot is free at once;
2. admits waiting requests into free slots, one prefill batch at a time (at most `prefill_batches[-1]`
   requests and `prefill_tokens` padded prompt tokens), so running rows wait for at most one prefill
   between two of their steps. Newcomers are prefilled as their own batch (prompt-length bucket, same
   cache length) and scattered into free rows (`rows.insert_rows`); when the bucket is too
   small the state is first gathered into a larger one (`rows.take_rows`). A prompt longer than
   `prefill_chunk` is prefilled alone, one chunk per iteration, and joins after its last chunk;
3. runs one step for all rows with the candidate the policy picks (the harness, a fixed tree, or plain
   decoding); rows without a request pass active=False and commit nothing;
4. hands each request its new tokens; rows that hit EOS or max_tokens leave, and the batch shrinks to
   a smaller bucket once that has sufficed for `shrink_patience` steps.

Requests talk to the loop through thread-safe calls (`submit`, `cancel`); tokens go back through each
request's `sink`, called on this thread (the server turns it into an asyncio queue put). Sampling
parameters are per row, and a row's random key depends only on its seed and position, so a request's
output does not depend on its batch neighbours.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.engine import engine_for
from eagle_jax.rows import insert_rows, next_pow2, pad_prompts, take_rows
from eagle_jax.serve.prepare import OnDemand, Preparation, choose_step, record_cost
from eagle_jax.serve.requests import (Event, QueueFull, Request, SchedulerConfig, ShuttingDown, bucket_lengths,
                                      cache_length)
from eagle_jax.sampling import SamplingParams
from eagle_jax.steps import DecodeState, draft_extra, empty_state
from eagle_jax.stream import TokenStream

log = logging.getLogger("eagle_jax.serve")


@dataclasses.dataclass
class _Chunked:
    """A long prompt's prefill in progress: its request, the batch-1 state its chunks have written so
    far (None before the first), and how many of its tokens that holds."""

    req: Request
    state: DecodeState | None = None
    done: int = 0
    seconds: float = 0.0


class Scheduler:
    def __init__(self, target, head, policy, config: SchedulerConfig = SchedulerConfig(), metrics=None, *,
                 profile_dir=None, profile_reps: int = 5):
        trees = [t for t in getattr(policy, "candidates", [getattr(policy, "tree", None)]) if t is not None]
        if trees and head is None:
            raise ValueError("speculation needs a draft head; use plain decoding (speculation 'off') without one")
        self.target, self.head, self.policy, self.config, self.metrics = target, head, policy, config, metrics
        self.engine = engine_for(target, head)  # the same jitted steps as generate and bench
        self.buckets = config.buckets()
        self.prefill_batches = tuple(sorted(set(config.prefill_batches)))
        self.cache_len = cache_length(config.max_model_len, trees)  # a prefill's (a full-length row's)
        self.draft_len = self.cache_len + draft_extra(trees)
        self.lengths = bucket_lengths(config, trees)  # bucket -> (longest request, cache length) of its rows
        self.eos = set(target.eos_token_ids)
        self.trees = trees
        # What may run now (everything, compiled on first use, unless `prepare_in_background`), and the
        # harness's cost profile, which real steps fill in (`prepare.choose_step`).
        self.ready = OnDemand()
        self.profile = getattr(policy, "profile", None)
        self.profile_dir, self.profile_reps = profile_dir, profile_reps

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque[Request] = collections.deque()
        self._cancel: dict[Request, str] = {}
        self._stop = False
        self._n_running = 0  # guarded by _lock (submit reads it)

        # Loop-thread state.
        self.state: DecodeState | None = None
        self.slots: list[Request | None] = []
        self.synced = np.zeros(0, bool)  # row has a draft in step with its target (plain steps keep it so)
        self._params = None  # device SamplingParams for the current slots
        self._small_steps = 0
        self._chunked: _Chunked | None = None  # a long prompt being prefilled chunk by chunk
        self.last_batch = 0
        self.steps = 0
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    # --- public, thread-safe ------------------------------------------------------------------------
    def prepare_in_background(self, prompt_len: int | None = None) -> Preparation:
        """Serves while compiling: `start` then starts a Preparation thread, and steps use only what it
        has compiled (`eagle_jax.serve.prepare`). Call before `start`."""
        self.ready = Preparation(self, prompt_len, on_progress=self.wake)
        return self.ready

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="eagle-jax-scheduler", daemon=True)
            self.thread.start()
            if isinstance(self.ready, Preparation):
                self.ready.start()

    def wake(self) -> None:
        with self._lock:
            self._wake.notify_all()

    def shutdown(self, timeout: float = 30.0) -> None:
        if isinstance(self.ready, Preparation):
            self.ready.stop()
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and not self._stop

    def submit(self, req: Request) -> None:
        """Queues a request; raises QueueFull when max_batch + max_queue requests are in already."""
        n, vocab = len(req.prompt_ids), self.target.cfg.vocab_size
        if n + req.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt ({n}) + max_tokens ({req.max_tokens}) exceeds max_model_len "
                             f"{self.config.max_model_len}")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        with self._lock:
            if self._stop:
                raise ShuttingDown("the server is shutting down")
            if self._n_running + len(self._waiting) >= self.config.max_batch + self.config.max_queue:
                raise QueueFull(f"{self._n_running} requests running and {len(self._waiting)} waiting")
            self._waiting.append(req)
            self._wake.notify_all()

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Ends a request early (its slot is freed before the next step). Idempotent."""
        with self._lock:
            if req.finish_reason is None:
                self._cancel[req] = reason
                self._wake.notify_all()

    def counts(self) -> dict:
        with self._lock:
            running, waiting = self._n_running, len(self._waiting)
        return {"running": running, "waiting": waiting, "bucket": len(self.slots), "batch": self.last_batch,
                "free": self.config.max_batch - running}

    # --- loop ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._stop or self._waiting or self._cancel or self._n_running):
                        self._wake.wait()
                    if self._stop:
                        break
                    cancels, self._cancel = self._cancel, {}
                self._drop(cancels)
                self._admit()
                chunked = self._chunked is not None and self._prefill_chunk()
                if any(r is not None for r in self.slots):
                    self._step()
                elif (self._waiting or self._chunked is not None) and not chunked:
                    with self._lock:  # waiting for a program the preparation is compiling
                        self._wake.wait(0.05)
                if not self._n_running and not self._waiting and self.state is not None:
                    self._release()
        except BaseException as e:  # keep serving impossible, but fail every request loudly
            log.exception("scheduler loop crashed")
            self.failure = e
        finally:
            with self._lock:
                self._stop = True
                pending = list(self._waiting) + [r for r in self.slots if r is not None]
                pending += [self._chunked.req] if self._chunked is not None else []
                self._waiting.clear()
            for r in pending:
                self._fail(r, "the server is shutting down" if self.failure is None else f"engine failure: {self.failure}")

    def _fail(self, req: Request, message: str) -> None:
        if req.finish_reason is None:
            req.finish_reason = "error"
            req.emit(Event("error", message=message))

    def _release(self) -> None:
        """Idle: drop the state (the next request starts a fresh one at the smallest bucket it needs)."""
        self.state, self.slots, self.synced = None, [], np.zeros(0, bool)
        self._params = None

    def _drop(self, cancels: dict) -> None:
        if not cancels:
            return
        with self._lock:
            kept = collections.deque(r for r in self._waiting if r not in cancels)
            dropped_waiting = [r for r in self._waiting if r in cancels]
            self._waiting = kept
        for r in dropped_waiting:
            r.finish_reason = cancels[r]
            r.emit(Event("done", reason=cancels[r]))
        for slot, r in enumerate(self.slots):
            if r is not None and r in cancels:
                self._finish(slot, cancels[r])
        if self._chunked is not None and self._chunked.req in cancels:
            req, self._chunked = self._chunked.req, None
            with self._lock:
                self._n_running -= 1
            req.finish_reason = cancels[req]
            req.emit(Event("done", reason=cancels[req]))

    def _finish(self, slot: int, reason: str) -> None:
        req = self.slots[slot]
        self.slots[slot] = None
        with self._lock:
            self._n_running -= 1
        if req.finish_reason is None:
            req.finish_reason = reason
            rest = req.stream.delta(final=True) if req.stream is not None and reason != "cancelled" else ""
            req.emit(Event("done", reason=reason, text=rest))

    # --- batch state ----------------------------------------------------------------------------------
    def _resize(self, bucket: int) -> None:
        """Gathers the running rows (compacted to the front) into a state of `bucket` rows."""
        rows = [i for i, r in enumerate(self.slots) if r is not None]
        cache_len, draft_len = self.caches(bucket)
        if self.state is None:
            self.state = empty_state(self.target, self.head, bucket, cache_len, draft_len)
        else:
            src = np.asarray(rows + [-1] * (bucket - len(rows)), np.int32)
            # One array of the old state at a time (`take_rows(consume=True)`); if the move fails part-way,
            # the old state keeps its deleted arrays and `_recover_if_broken` starts over.
            self.state = take_rows(self.state, src, consume=True, cache_len=cache_len, draft_len=draft_len)
        self.slots = [self.slots[i] for i in rows] + [None] * (bucket - len(rows))
        synced = np.zeros(bucket, bool)
        synced[: len(rows)] = self.synced[rows] if len(rows) else False
        self.synced = synced
        for i, r in enumerate(self.slots):
            if r is not None:
                r.slot = i
        self._params = None
        self._small_steps = 0

    def caches(self, bucket: int) -> tuple[int, int]:
        """(target, draft) cache lengths of a batch bucket's state (`SchedulerConfig.kv_cache_tokens`)."""
        c = self.lengths[bucket][1]
        return c, c + self.draft_len - self.cache_len

    def _target_bucket(self, reqs) -> int | None:
        """The batch bucket the running rows plus `reqs` move to (the smallest compiled one with room for
        them all), or None when none holds them (a bucket's rows are at most `lengths[b][0]` tokens long)."""
        rows = [r for r in self.slots if r is not None] + list(reqs)
        need = max((len(r.prompt_ids) + r.max_tokens for r in rows), default=0)
        b = next((x for x in self._ready_buckets() if x >= len(rows)), None)
        return b if b is not None and need <= self.lengths[b][0] else None

    def _sampling_params(self) -> SamplingParams:
        if self._params is None:
            reqs = self.slots
            p = SamplingParams.make(
                len(reqs),
                [r.temperature if r else 0.0 for r in reqs], [r.top_k if r else 0 for r in reqs],
                [r.top_p if r else 1.0 for r in reqs], [r.seed if r else 0 for r in reqs])
            self._params = SamplingParams(*(jnp.asarray(a) for a in (p.temperature, p.top_k, p.top_p, p.seed)))
        return self._params

    def _take_newcomers(self, free: int) -> list[Request]:
        cap = min(free, self.prefill_batches[-1])
        out: list[Request] = []
        with self._lock:
            while self._waiting and len(out) < cap:
                nxt = self._waiting[0]
                if len(nxt.prompt_ids) > self.config.prefill_chunk:  # alone, chunk by chunk (`_prefill_chunk`)
                    if not out and self._chunked is None:
                        self._chunked = _Chunked(self._waiting.popleft())
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
            new = self._prefill(tokens, lens, self._newcomer_params(newcomers, b))
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
            job.state = self._prefill(tokens, lens, self._newcomer_params([job.req], 1), prev=job.state,
                                      follow=[-1 if last else ids[job.done + n]])
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

    def _newcomer_params(self, newcomers, b: int) -> SamplingParams:
        return SamplingParams.make(len(newcomers), [r.temperature for r in newcomers], [r.top_k for r in newcomers],
                                   [r.top_p for r in newcomers], [r.seed for r in newcomers]).pad_to(b)

    def _place(self, newcomers, new: DecodeState, b: int):
        """Scatters prefilled rows (`new`, b rows, the first len(newcomers) real) into free slots of the
        batch, gathering it into a larger bucket first when it is full. Returns their first tokens."""
        need = sum(r is not None for r in self.slots) + len(newcomers)
        longest = max(len(r.prompt_ids) + r.max_tokens for r in self.slots + list(newcomers) if r is not None)
        if self.state is None or need > len(self.slots) or longest > self.lengths[len(self.slots)][0]:
            self._resize(self._target_bucket(newcomers))  # a bucket with room: checked when they were taken
        free_slots = [i for i, r in enumerate(self.slots) if r is None][: len(newcomers)]
        dst = np.asarray(free_slots + [len(self.slots)] * (b - len(newcomers)), np.int32)
        self.state = insert_rows(self.state, new, jnp.asarray(dst))
        first = np.asarray(new.root)
        for slot, r in zip(free_slots, newcomers):
            self.slots[slot] = r
            r.slot = slot
        return first

    def _prefill_failed(self, newcomers, e: Exception) -> None:
        log.exception("prefill failed")
        with self._lock:
            self._n_running -= len(newcomers)
        for r in newcomers:
            if r.slot is not None and r.slot < len(self.slots) and self.slots[r.slot] is r:
                self.slots[r.slot] = None
            self._fail(r, f"prefill failed: {e}")
        self._recover_if_broken()

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

    def _prefill(self, tokens, lens, params, prev=None, follow=None) -> DecodeState:
        """Prefills a batch of newcomers [b, t] into a fresh state of the running cache length, or the
        next chunk of a long prompt into `prev` (see `Engine.run_prefill`)."""
        return self.engine.run_prefill(tokens, lens, self.cache_len, self.draft_len, params, prev=prev, follow=follow)

    def _recover_if_broken(self) -> None:
        """After a failed jitted call the donated state may be gone: fail the running rows and start over."""
        if self.state is None:
            return
        try:
            leaves_ok = not any(getattr(x, "is_deleted", lambda: False)()
                                for x in jax.tree_util.tree_leaves(self.state))
        except Exception:
            leaves_ok = False
        if leaves_ok:
            return
        for slot, r in enumerate(self.slots):
            if r is not None:
                self._fail(r, "engine state lost after an error")
                self.slots[slot] = None
                with self._lock:
                    self._n_running -= 1
        self._release()

    # --- one step -------------------------------------------------------------------------------------
    def _step(self) -> None:
        bucket = len(self.slots)
        active = np.array([r is not None for r in self.slots])
        n_active = int(active.sum())
        n_synced = int((active & self.synced).sum())
        samples = np.array([r is not None and r.temperature > 0 for r in self.slots])  # estimated apart from greedy
        n_sampled, kind = int((active & self.synced & samples).sum()), bool((active & samples).any())
        choice = choose_step(self.policy, self.ready, self.profile, bucket, n_active, n_synced, n_sampled, kind)
        params = self._sampling_params()
        t0 = time.perf_counter()
        try:
            self.state, emitted, count = self.engine.run_step(self.state, params, active, choice.tree,
                                                              sampling=self.ready.step_sampling(choice.tree, kind))
            emitted, count = np.asarray(emitted), np.asarray(count)
        except Exception as e:
            log.exception("decoding step failed")
            for slot, r in enumerate(self.slots):
                if r is not None:
                    self._fail(r, f"decoding step failed: {e}")
                    self.slots[slot] = None
                    with self._lock:
                        self._n_running -= 1
            self._release()
            return
        dt = time.perf_counter() - t0
        self.steps += 1
        record_cost(self.profile, self.ready.busy, bucket, choice.name, dt, kind, self.profile_reps, self.profile_dir)
        self.last_batch = n_active
        observed = [r for r in range(bucket) if active[r] and self.synced[r]]
        self.policy.observe(choice.tree, [int(count[r]) for r in observed], [bool(samples[r]) for r in observed])
        for slot in range(bucket):
            if active[slot]:
                self._deliver(slot, emitted[slot, : int(count[slot])].tolist())
        if self.metrics is not None:
            self.metrics.count_step(choice.name, n_active, int(count[active].sum()), dt, choice.explore)
        self._maybe_shrink()

    def _deliver(self, slot: int, tokens: list[int]) -> int:
        """Hands a row's new tokens (and the text they complete) to its request, stopping at EOS, a stop
        string or max_tokens. Returns tokens delivered."""
        req = self.slots[slot]
        out = tokens[: req.stream.push(tokens)]
        if out:
            req.emit(Event("tokens", tokens=tuple(out), text=req.stream.delta()))
            if self.metrics is not None:
                self.metrics.inc("eagle_generation_tokens_total", len(out))
        if req.stream.done:
            self._finish(slot, req.stream.reason)
        return len(out)

    def _maybe_shrink(self) -> None:
        n = sum(r is not None for r in self.slots)
        smaller = next(b for b in self.buckets if b >= max(n, 1) and self.ready.bucket_ready(b))
        if smaller < len(self.slots) and not self._waiting:
            self._small_steps += 1
            if self._small_steps >= self.config.shrink_patience:
                self._resize(smaller)
        else:
            self._small_steps = 0
