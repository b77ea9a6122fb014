"""The engine loop: continuous batching over static batch buckets, on one thread that owns the JAX state.

The running batch is one `DecodeState` (a target served without a head carries an empty draft cache) of a
batch bucket B (a power of two <= max_batch) and a fixed cache length (max_model_len + tree slack); with
`block_size`, its caches are paged and requests hold KV blocks by need (`serve.blocks`).
Each loop iteration:

1. drops cancelled requests (client went away, or a stop string was found): their slot is free at once;
2. admits waiting requests into free slots, one prefill batch at a time (at most `prefill_batches[-1]`
   requests and `prefill_tokens` padded prompt tokens), so running rows wait for at most one prefill
   between two of their steps (`serve.admission`). A prompt longer than `prefill_chunk` is prefilled
   alone, one chunk per iteration, and joins after its last chunk;
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
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.engine import engine_for
from eagle_jax.rows import clear_paged_rows, take_rows
from eagle_jax.serve.admission import Admission, Chunked
from eagle_jax.serve.blocks import PagedBlocks
from eagle_jax.serve.prepare import OnDemand, Preparation, choose_step, record_cost
from eagle_jax.serve.requests import (Event, QueueFull, Request, SchedulerConfig, ShuttingDown, bucket_lengths,
                                      cache_length, sampling_params)
from eagle_jax.sampling import SamplingParams
from eagle_jax.steps import DecodeState, draft_extra, tree_slack

log = logging.getLogger("eagle_jax.serve")


class Scheduler(Admission):
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
        # Paged caches (`serve.blocks`): every bucket's rows may hold max_model_len, the pool's blocks decide.
        self.blocks = None if not config.block_size else PagedBlocks(
            target, head, config.block_size, config.kv_cache_tokens, config.max_batch, self.cache_len, self.draft_len,
            tree_slack(trees))
        self.pages = None if self.blocks is None else self.blocks.pages
        if self.blocks is not None:
            self.lengths = {b: (config.max_model_len, self.cache_len) for b in self.lengths}
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
        # Several processes (`serve.replica`): the leader's new requests wait in _inbox until the next
        # iteration hands them to every process at once; the others find theirs by the leader's ids.
        self.replica = None
        self._inbox: list[Request] = []
        self._by_id: dict[int, Request] = {}
        self._cancel: dict[Request, str] = {}
        self._stop = False
        self._n_running = 0  # guarded by _lock (submit reads it)

        # Loop-thread state.
        self.state: DecodeState | None = None
        self.slots: list[Request | None] = []
        self.synced = np.zeros(0, bool)  # row has a draft in step with its target (plain steps keep it so)
        self._params = None  # device SamplingParams for the current slots
        self._small_steps = 0
        self._chunked: Chunked | None = None  # a long prompt being prefilled chunk by chunk
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
        if self.replica is not None and self.replica.leader:  # the others leave as their loops end
            self.replica.close()

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
            waiting = len(self._waiting) + len(self._inbox)
            if self._n_running + waiting >= self.config.max_batch + self.config.max_queue:
                raise QueueFull(f"{self._n_running} requests running and {waiting} waiting")
            (self._inbox if self.replica is not None else self._waiting).append(req)
            self._wake.notify_all()

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Ends a request early (its slot is freed before the next step). Idempotent."""
        with self._lock:
            if req.finish_reason is None:
                self._cancel[req] = reason
                self._wake.notify_all()

    def counts(self) -> dict:
        with self._lock:
            running, waiting = self._n_running, len(self._waiting) + len(self._inbox)
        out = {"running": running, "waiting": waiting, "bucket": len(self.slots), "batch": self.last_batch,
               "free": self.config.max_batch - running}
        return out if self.blocks is None else out | self.blocks.counts()

    # --- loop ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    idle = lambda: not (self._stop or self._waiting or self._cancel or self._n_running  # noqa: E731
                                        or self._inbox)
                    if self.replica is None:
                        while idle():
                            self._wake.wait()
                    elif self.replica.leader and idle():  # (the others wait in the exchange)
                        self._wake.wait(self.replica.heartbeat_s)
                    stop, cancels, inbox = self._stop, self._cancel, self._inbox
                    self._cancel, self._inbox = {}, []
                if self.replica is not None:
                    stop, cancels, inbox = self._sync(stop, cancels, inbox)
                if stop:
                    break
                with self._lock:
                    self._waiting.extend(inbox)
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

    def _sync(self, stop: bool, cancels: dict, inbox: list) -> tuple[bool, dict, list]:
        """Every process gets the leader's (stop, cancellations, new requests) of this iteration."""
        message = None
        if self.replica.leader:
            message = {"stop": stop, "cancel": [[r.id, why] for r, why in cancels.items()],
                       "new": [r.spec() for r in inbox]}
        message = self.replica.exchange(message)
        if self.replica.leader:
            return stop, cancels, inbox
        self._by_id = {i: r for i, r in self._by_id.items() if r.finish_reason is None}
        new = [Request.from_spec(spec) for spec in message["new"]]
        self._by_id.update((r.id, r) for r in new)
        cancels = {self._by_id[i]: why for i, why in message["cancel"] if i in self._by_id}
        return message["stop"], cancels, new

    def _fail(self, req: Request, message: str) -> None:
        if self.blocks is not None:
            self.blocks.release(req)
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
            if self.blocks is not None:
                self.blocks.release(req)
            with self._lock:
                self._n_running -= 1
            req.finish_reason = cancels[req]
            req.emit(Event("done", reason=cancels[req]))

    def _finish(self, slot: int, reason: str) -> None:
        req = self.slots[slot]
        self.slots[slot] = None
        if self.blocks is not None:  # the row lets go of its blocks before anyone else gets them
            self.state = clear_paged_rows(self.state, [slot])
            self.blocks.release(req)
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
            self.state = self.engine.empty_state(bucket, cache_len, draft_len, self.pages)
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

    def _sampling_params(self) -> SamplingParams:
        if self._params is None:
            p = sampling_params(self.slots, len(self.slots))
            self._params = SamplingParams(*(jnp.asarray(a) for a in (p.temperature, p.top_k, p.top_p, p.seed)))
        return self._params

    def _recover_if_broken(self) -> None:
        """After a failed jitted call the donated state may be gone: fail the running rows and start over."""
        if self.state is None:
            return
        try:
            leaves_ok = not any(getattr(x, "is_deleted", lambda: False)()
                                for x in jax.tree_util.tree_leaves(self.state))
        except Exception:
            leaves_ok = False
        if not leaves_ok:
            self._fail_running("engine state lost after an error")

    def _fail_running(self, message: str) -> None:
        """Every running row fails with `message`, and the batch state is dropped."""
        for slot, r in enumerate(self.slots):
            if r is not None:
                self._fail(r, message)
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
            self._fail_running(f"decoding step failed: {e}")
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
