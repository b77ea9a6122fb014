"""What a started server compiles in the background, in the order requests need it, and which step it
may run meanwhile.

The server listens as soon as the model is loaded. A `Preparation` thread then compiles, ahead of time
(`Engine.compile_step` / `compile_prefill`: nothing runs and no batch state is allocated, so preparing
costs no memory beyond the programs), every program serving runs:

1. the plain step, the row scatters and the bucket changes of batch bucket 1, then prefills of one
   prompt from the shortest prompt bucket up: a request can be answered once its prefill is in;
2. the same for every larger batch bucket, and prefills of up to `prefill_batches[-1]` prompts;
3. prefills of prompt buckets above 128 tokens, up to `prefill_chunk` (a longer prompt is prefilled in
   chunks of the compiled sizes);
4. every candidate tree's all-greedy step at every batch bucket (speculation joins a bucket tree by
   tree), except where the cost profile already shows the tree cannot beat plain decoding
   (`hopeless`): such a program is skipped, which saves its memory (tens of MB of compiled code each)
   and, on a restart from a cached profile, its load time;
5. later, only once a step at some batch bucket has a sampling row: the trees' general steps at that
   bucket (`want_bucket(bucket, sampled=True)`), first in the queue. Until they are in, such steps are
   plain steps (the plain step and the prefills are the general programs, which serve any mix of rows).

Programs kept through the engine's program store are warmed (`_warm`: one run on small empty inputs,
since XLA:CPU builds a program's dot pipelines on its first run), and only the tree programs of the
`SchedulerConfig.resident_tree_buckets` most recently stepped batch buckets stay loaded (`_evict`): a
dropped bucket's load again from the store, first in the queue, when a step there wants them.

All-greedy tree programs (`sampling=False`) hold no sampling or sampled-acceptance path (SmolLM2, 3,4,8
at bucket 32: 42 against 81 MB resident, 122 against 255 MB of temporaries); a server whose clients
never sample never holds the general tree programs.

A request whose prefill is not compiled yet moves that prefill to the front of the queue and waits in
the scheduler's queue, while running rows keep stepping: nothing compiles inside a served step. The
bucket in use has its trees prepared next, after the programs that admit requests (`_bump`).

`choose_step` is the scheduler's per-step choice: a plain step until a tree is compiled at the bucket
(for the kind of step: all-greedy, or with a sampling row),
then each compiled tree measured on real steps (a few steps each, median; any candidate is a lossless
step, so measuring costs only the difference in speed), then the policy's choice among the measured
trees. Costs measured while compiles ran (`busy`) are measured again once none runs. Without a
Preparation (`OnDemand`, the --no-warmup server and tests) everything counts as compiled, each program
compiles the first time it is needed, and every step runs the general program.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import jax
import jax.numpy as jnp

from eagle_jax import profiles
from eagle_jax.harness import Choice
from eagle_jax.rows import compile_take_rows, insert_rows, without_pools
from eagle_jax.serve.memory import release_free_memory
from eagle_jax.serve.metrics import CompileCounter
from eagle_jax.tree import tree_name

log = logging.getLogger("eagle_jax.serve")

# Programs run once when prepared (`Engine.warm`) if their empty inputs take at most this (SmolLM2: steps of
# buckets 1-2, one-prompt prefills); larger ones would add to the peak while serving, to save 0.3-0.5 s once.
WARM_BYTES = 128 << 20
LEARNED = ("online", "cache")  # profiles a server completes by measuring real steps (not "given" or "measured")


class OnDemand:
    """Readiness when nothing is prepared ahead: every program counts as ready and compiles on first use."""

    complete = True
    servable = True
    busy = False  # whether a compile may be running beside the steps (their times are provisional)

    def bucket_ready(self, bucket: int) -> bool:
        return True

    def prefill_ready(self, batch: int, tokens: int) -> bool:
        return True

    def tree_ready(self, bucket: int, tree, sampled: bool = False) -> bool:
        return True

    def step_sampling(self, tree, sampled: bool) -> bool:
        """The `sampling` flag of the program a step runs (`Engine.run_step`): here always the general one."""
        return True

    def want_prefill(self, batch: int, tokens: int) -> None:
        pass

    def want_bucket(self, bucket: int, sampled: bool = False) -> None:
        pass

    def touch(self, bucket: int) -> None:
        pass

    def snapshot(self) -> dict:
        return {"mode": "on-demand", "complete": True, "servable": True}


class Preparation(OnDemand):
    """Compiles a scheduler's programs on a background thread, most needed first (see the module doc)."""

    def __init__(self, scheduler, prompt_len: int | None = None, on_progress=None):
        self.s = scheduler
        self.on_progress = on_progress or (lambda: None)
        self._lock = threading.Lock()
        self._done: set = set()
        self._tasks: collections.OrderedDict = collections.OrderedDict()  # key -> callable, in run order
        self._failed: dict = {}
        self._skipped: dict = {}  # key -> why the program is not needed (`hopeless`)
        self._stop = False
        self._wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.started_at = self.finished_at = None
        self.current = None
        # Tree programs of at most `keep` batch buckets stay loaded (0: all; see `_evict`).
        self.keep = scheduler.config.resident_tree_buckets
        self._recent: collections.OrderedDict = collections.OrderedDict()  # buckets with trees, least recent first
        self.in_use = None  # the bucket the scheduler steps now: its programs are never dropped
        self._evicted: set = set()  # tree tasks whose programs were dropped (loaded again when wanted)
        self.evictions = 0
        # Longer prompts are prefilled in chunks of at most prefill_chunk tokens: no program beyond that.
        longest = min(prompt_len or scheduler.config.max_model_len - 1, scheduler.config.max_model_len - 1,
                      scheduler.config.prefill_chunk)
        self._plan(longest)
        self.total = len(self._tasks)

    # --- the plan -----------------------------------------------------------------------------------
    def _plan(self, longest: int) -> None:
        s = self.s
        prompt_buckets = sorted({s.prompt_bucket(n) for n in range(1, longest + 1)})
        short = [t for t in prompt_buckets if t <= 128]
        long = [t for t in prompt_buckets if t > 128]
        cap = s.config.prefill_tokens
        fits = lambda b, t: b == 1 or b * t <= cap  # a single prompt of any length goes alone
        add = self._tasks.__setitem__
        for i, bucket in enumerate(s.buckets):
            add(("step", bucket, "off"), lambda b=bucket: self._compile_step(b, None))
            add(("rows", bucket), lambda b=bucket, smaller=s.buckets[:i]: self._compile_rows(b, smaller))
            for pb in s.prefill_batches:
                if pb <= bucket and ("prefill", pb, short[0]) not in self._tasks:
                    for t in short:
                        if fits(pb, t):
                            add(("prefill", pb, t), lambda b=pb, t=t: self._compile_prefill(b, t))
        for t in long:
            for pb in s.prefill_batches:
                if fits(pb, t):
                    add(("prefill", pb, t), lambda b=pb, t=t: self._compile_prefill(b, t))
        for bucket in s.buckets:
            for tree in s.trees:
                add(("step", bucket, tree.name), lambda b=bucket, tr=tree: self._compile_step(b, tr, False))

    def _abstract_state(self, batch: int, full: bool = False):
        """The shapes of a batch bucket's state (full: of a prefill's, whose caches hold max_model_len)."""
        s = self.s
        lengths = (s.cache_len, s.draft_len) if full else s.caches(batch)
        return jax.eval_shape(lambda: s.engine.empty_state(batch, *lengths, s.pages))

    def _compile_step(self, bucket: int, tree, sampling: bool = True) -> None:
        self.s.engine.compile_step(bucket, *self.s.caches(bucket), tree, sampling=sampling, pages=self.s.pages)

    def _skip(self, key) -> str | None:
        """Why the program of this task is not needed (a tree step the cost profile shows cannot win at its
        bucket: `hopeless`), or None."""
        if key[0] != "step" or key[2] == "off":
            return None
        return hopeless(self.s.profile, key[1], next(t for t in self.s.trees if t.name == key[2]))

    def _compile_prefill(self, batch: int, tokens: int) -> None:
        self.s.engine.compile_prefill(batch, tokens, self.s.cache_len, self.s.draft_len, pages=self.s.pages)

    def _compile_rows(self, bucket: int, smaller) -> None:
        """Newcomers' scatters into this bucket, and the gathers between it and every smaller bucket."""
        # (paged: the rows' part alone moves; the pools stay where they are)
        part = (lambda x: x) if self.s.pages is None else without_pools  # noqa: E731
        state = part(self._abstract_state(bucket))
        for pb in self.s.prefill_batches:
            insert_rows.lower(state, part(self._abstract_state(pb, full=True)),
                              jax.ShapeDtypeStruct((pb,), jnp.int32)).compile()
        for other in smaller:
            compile_take_rows(state, other, *self.s.caches(other))
            compile_take_rows(part(self._abstract_state(other)), bucket, *self.s.caches(bucket))

    # --- the thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self.thread is None:
            self.started_at = time.monotonic()
            self.thread = threading.Thread(target=self._run, name="eagle-jax-prepare", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                idle = not self._tasks
                if idle and not self._stop:
                    self._wake.clear()
            if idle:  # all planned programs are in: wait for programs asked for later
                self._drained()
                self._wake.wait()
                continue
            with self._lock:
                key, fn = next(iter(self._tasks.items()))
                self.current = key
            t0 = time.perf_counter()
            skipped = self._skip(key)
            stored = skipped is None and self._left_stored(key)
            try:
                if skipped is None and not stored:
                    fn()
                    self._warm(key)
            except Exception as e:  # a program that cannot compile is compiled on first use instead
                log.exception("preparing %s failed", key)
                self._failed[key] = f"{type(e).__name__}: {e}"
            dt = time.perf_counter() - t0
            with self._lock:
                self._tasks.pop(key, None)
                if skipped is not None:
                    self._skipped[key] = skipped
                elif stored:
                    self._evicted.add(key)
                else:
                    self._done.add(key)
                self.current = None
                left = len(self._tasks)
            if skipped is None and not stored:
                self._evict(key)
                release_free_memory()
            name = " ".join(map(str, key))
            if skipped is not None:
                log.info("skipped %s: %s (%d of %d, %d left)", name, skipped, self.total - left, self.total, left)
            elif stored:
                log.info("left %s in the program store until its bucket is stepped (%d of %d, %d left)", name,
                         self.total - left, self.total, left)
            else:
                log.log(logging.INFO if key[0] != "rows" else logging.DEBUG, "prepared %s in %.1f s (%d of %d, %d left)",
                        name, dt, self.total - left, self.total, left)
            self.on_progress()

    def _evict(self, key) -> None:
        """After tree program `key` is in: drops the tree programs (kept through the engine's store) of
        the least recently stepped buckets beyond `keep`; one prepared but never stepped counts as least
        recent. `want_bucket` loads them again (about 0.5 s each for SmolLM2); plain steps meanwhile. The
        bucket a step runs at is `in_use` from `touch` (in `choose_step`, before readiness is asked) until
        the next step's `touch`, and never dropped: a tree step never finds its program gone."""
        if key[0] != "step" or key[2] == "off":
            return
        engine, dropped = self.s.engine, []
        with self._lock:
            if key[1] not in self._recent:
                self._recent[key[1]] = None
                self._recent.move_to_end(key[1], last=False)
            if not self.keep:
                return
            for b in self._victims():
                for k in [k for k in self._done if k[:2] == ("step", b) and self._kept(k)]:
                    self._done.discard(k)
                    self._evicted.add(k)
                    dropped.append(k)
        for k in dropped:
            engine.drop(self._engine_key(k))
        if dropped:
            self.evictions += len(dropped)
            log.log(logging.DEBUG if dropped == [key] else logging.INFO,  # (a bucket prepared but not stepped)
                    "dropped the tree programs of batch bucket(s) %s (keeping %d buckets' loaded; they load "
                    "again when stepped)", sorted({k[1] for k in dropped}), self.keep)

    def _victims(self, candidate=None) -> list:
        """The buckets `_evict` drops now (with `candidate`'s programs counted in, least recent if new)."""
        order = list(self._recent)
        if candidate is not None and candidate not in order:
            order.insert(0, candidate)
        resident = [b for b in order if b == candidate or any(self._kept(k) for k in self._done if k[:2] == ("step", b))]
        return [b for b in resident if b != self.in_use][:max(len(resident) - self.keep, 0)]

    def _left_stored(self, key) -> bool:
        """A planned tree program that `_evict` would drop as soon as it is in, and which the program store
        holds: it stays there (a restart does not load programs only to drop them)."""
        if not self.keep or key[0] != "step" or key[2] == "off":
            return False
        with self._lock:
            if key[1] not in self._victims(key[1]):
                return False
        return self.s.engine.stored(self._engine_key(key))

    def _tree(self, key):
        return next(t for t in self.s.trees if t.name == key[2])

    def _kept(self, key) -> bool:
        """Whether a done tree task's program is kept by the engine (through its store), so it can be dropped."""
        return key[0] == "step" and key[2] != "off" and self._engine_key(key) in self.s.engine.programs

    def _engine_key(self, key):
        """The engine's key (`Engine.programs`) of a step or prefill task's program."""
        e, s = self.s.engine, self.s
        if key[0] == "prefill":
            return e.prefill_key(key[1], key[2], s.cache_len, s.draft_len, pages=s.pages)
        tree = None if key[2] == "off" else self._tree(key)
        return e.step_key(key[1], *s.caches(key[1]), tree, tree is None or key[-1] == "sampled", pages=s.pages)

    def _warm(self, key) -> None:
        """A step or prefill program's first run, on empty inputs of at most WARM_BYTES (`Engine.warm`)."""
        if key[0] not in ("step", "prefill"):
            return
        try:
            self.s.engine.warm(self._engine_key(key), WARM_BYTES)
        except Exception as e:  # only the first served run's speed is at stake
            log.warning("warming %s failed (%s: %s)", " ".join(map(str, key)), type(e).__name__, e)

    def _drained(self) -> None:
        """Nothing left to compile: the first time, the preparation is complete."""
        if self.finished_at is not None or self._stop:
            return
        self.finished_at = time.monotonic()
        built = CompileCounter.counts()
        log.info("preparation complete: %d programs in %.0f s, %d skipped (this process so far: %d XLA programs "
                 "compiled, %d read from the persistent compilation cache, %d loaded from the program store)",
                 self.total - len(self._skipped), self.finished_at - self.started_at, len(self._skipped),
                 built["compiled"], built["cache"], built["store"])
        self.on_progress()

    def _bump(self, keys) -> None:
        """Moves these tasks to the front of the queue, in order; tree steps only to the front of the tree
        steps: the programs that admit requests at all (plain steps, row moves, prefills) go first."""
        tree = lambda k: k[0] == "step" and k[2] != "off"  # noqa: E731
        with self._lock:
            front = [k for k in keys if k in self._tasks]
            if any(map(tree, front)):
                admit = [k for k in self._tasks if not tree(k) and k not in front]
                front = [k for k in front if not tree(k)] + admit + [k for k in front if tree(k)]
            for key in reversed(front):
                self._tasks.move_to_end(key, last=False)

    # --- what the scheduler asks ----------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Whether every planned program is in (general tree steps asked for later may still compile)."""
        return self.finished_at is not None

    @property
    def busy(self) -> bool:
        return bool(self._tasks) or self.current is not None

    @property
    def servable(self) -> bool:
        """Whether a one-prompt request can be admitted once its prefill is compiled."""
        return self.bucket_ready(self.s.buckets[0])

    def _has(self, key) -> bool:
        return key in self._done or key in self._failed

    def bucket_ready(self, bucket: int) -> bool:
        return self._has(("step", bucket, "off")) and self._has(("rows", bucket))

    def prefill_ready(self, batch: int, tokens: int) -> bool:
        return self._has(("prefill", batch, tokens)) or ("prefill", batch, tokens) not in self._tasks

    def tree_ready(self, bucket: int, tree, sampled: bool = False) -> bool:
        return self._has(("step", bucket, tree_name(tree)) + (("sampled",) if sampled else ()))

    def step_sampling(self, tree, sampled: bool) -> bool:
        """Plain steps run the general program; tree steps the all-greedy one unless some row samples."""
        return tree is None or sampled

    def want_prefill(self, batch: int, tokens: int) -> None:
        self._bump([("prefill", batch, tokens)])

    def want_bucket(self, bucket: int, sampled: bool = False) -> None:
        """The trees' steps at this bucket are needed now (sampled: their general programs, planned now;
        programs dropped by `_evict` are planned again)."""
        keys = [("step", bucket, t.name) + (("sampled",) if sampled else ()) for t in self.s.trees]
        with self._lock:
            new = [k for k in keys if k not in self._tasks and not self._has(k) and k not in self._skipped
                   and (sampled or k in self._evicted)]
            for k, tree in zip(keys, self.s.trees):
                if k in new:
                    self._tasks[k] = lambda b=bucket, tr=tree: self._compile_step(b, tr, sampled)
                    self._evicted.discard(k)
            self.total += len(new)
        if new:
            self._wake.set()
        self._bump(keys)

    def touch(self, bucket: int) -> None:
        """A step at this batch bucket is being chosen: its programs stay loaded (see `_evict`)."""
        with self._lock:
            self.in_use = bucket
            self._recent[bucket] = None
            self._recent.move_to_end(bucket)

    def snapshot(self) -> dict:
        with self._lock:
            done, pending, current = len(self._done) + len(self._skipped), list(self._tasks), self.current
            skipped = {" ".join(map(str, k)): v for k, v in self._skipped.items()}
        now = self.finished_at or time.monotonic()
        s = self.s
        return {"mode": "background", "complete": self.complete, "servable": self.servable,
                "programs_done": done, "programs_total": self.total, "programs_skipped": skipped,
                "seconds": round(now - self.started_at, 1) if self.started_at else 0.0,
                "compiling": None if current is None else " ".join(map(str, current)), "pending": len(pending),
                "plain_buckets": [b for b in s.buckets if self.bucket_ready(b)],
                "speculation": {str(b): [t.name for t in s.trees if self.tree_ready(b, t)] for b in s.buckets},
                "sampled_speculation": {str(b): [t.name for t in s.trees if self.tree_ready(b, t, True)]
                                        for b in s.buckets},
                "resident_tree_buckets": [b for b in s.buckets if any(self.tree_ready(b, t, k) for t in s.trees
                                                                       for k in (False, True))],
                "tree_programs_dropped": self.evictions,
                "prefills_pending": sorted({f"{k[1]}x{k[2]}" for k in pending if k[0] == "prefill"}),
                "failed": {" ".join(map(str, k)): v for k, v in self._failed.items()}}


def choose_step(policy, ready, profile, bucket: int, active: int, synced: int, sampled: int, kind: bool) -> Choice:
    """The candidate for this step (see the module doc). `profile` is the harness's cost profile (None for
    a fixed tree or plain decoding; only an "online" or cached one is completed by measuring); `kind`: whether some row samples (such a step costs more); trees not
    compiled at this bucket yet are never chosen."""
    ready.touch(bucket)
    trees = [t for t in getattr(policy, "candidates", [getattr(policy, "tree", None)]) if t is not None]
    compiled = [t for t in trees if ready.tree_ready(bucket, t, kind)]
    if len(compiled) < len(trees):
        ready.want_bucket(bucket, kind)
    if profile is None or profile.source not in LEARNED:  # a fixed tree, or costs given: no measuring
        if trees and not compiled:
            return Choice("off", None, float(active), 0.0 if profile is None else profile.cost(bucket, "off", kind))
        if profile is None or len(compiled) == len(trees):
            return policy.choose(bucket, active, synced, sampled)
        return policy.choose(bucket, active, synced, sampled, allowed=compiled)
    todo = profile.unmeasured(bucket, ["off"] + [t.name for t in compiled], kind)
    if todo is not None:  # measure it on this (real, lossless) step
        tree = next((t for t in compiled if t.name == todo), None)
        return Choice(todo, tree, float(active), 0.0, explore=True)
    measured = [t for t in compiled if profile.has(bucket, t.name, kind)]
    if not measured:
        return Choice("off", None, float(active), profile.cost(bucket, "off", kind))
    return policy.choose(bucket, active, synced, sampled, allowed=measured)


def record_cost(profile, busy: bool, bucket: int, name: str, seconds: float, sampled: bool, reps: int,
                profile_dir) -> None:
    """A served step's time, for a cost profile the server completes (`LEARNED`; saved whenever an entry
    of it completes). busy: a compile ran beside it, so the cost is measured again once none does."""
    if profile is None or profile.source not in LEARNED:
        return
    if not busy and profile.provisional:  # costs measured beside compiles: again, now
        profile.remeasure_provisional()
    if profile.record(bucket, name, seconds, sampled, reps, provisional=busy):
        log.info("harness: measured batch bucket %d %s%s: %.2f ms", bucket, name, " (sampled)" if sampled else "",
                 profile.cost(bucket, name, sampled) * 1e3)
        profiles.save(profile, profile_dir)


def hopeless(profile, bucket: int, tree) -> str | None:
    """Why `tree` cannot beat plain decoding at batch bucket `bucket`, or None when it may.

    A tree step emits at most depth + 1 tokens a row where a plain step emits one, so a tree whose step
    costs more than depth + 1 plain steps loses however much of the draft is accepted. The profile's
    largest measured bucket at or below `bucket` decides (its greedy costs, else its sampled ones): a
    tree step's cost grows faster with the batch than a plain step's (the verify forward holds rows x
    tree tokens), so a tree that cannot win at a smaller bucket cannot win at a larger one. Without a
    profile (a fixed tree, or plain decoding) nothing is hopeless."""
    if profile is None:
        return None
    for b in sorted((b for b in profile.seconds if b <= bucket), reverse=True):
        for kind in (False, True):
            if profile.has(b, tree.name, kind) and profile.has(b, "off", kind):
                ratio = profile.cost(b, tree.name, kind) / profile.cost(b, "off", kind)
                if ratio <= tree.depth + 1:
                    return None
                return (f"at batch bucket {b} its step costs {ratio:.1f} plain steps, more than the "
                        f"{tree.depth + 1} tokens a row it can emit")
    return None
