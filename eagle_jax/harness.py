"""The load-aware speculation harness: per step, the tree shape (or none) with the most tokens per second.

Two ingredients:

* a **cost profile**, measured once per device + model + head: the seconds of one whole jitted step
  (draft + verify + accept + commit) for every candidate and every batch bucket, at the server's
  cache length. Measuring whole steps is the most faithful way to capture what a candidate costs on
  this hardware (draft steps, verify of N tree tokens, acceptance, KV moves). Profiles are cached as
  JSON under ~/.cache/eagle_jax/harness/ (or `cache_dir`), keyed by a hash of everything that changes
  the numbers; `reprofile=True` measures again.
* **running acceptance statistics** (`AcceptanceStats`, one set for greedy rows and one for sampled
  rows, whose acceptance is much lower): tokens each row emitted per step under each
  candidate (an exponentially decayed mean), and per-depth conditional acceptance rates per tree
  width (top-k), pooled over the candidates of that width that ran (a decayed, censoring-aware
  estimate: a row that accepted its whole tree says nothing about deeper levels). A candidate's expected tokens per row blend its own mean with the
  per-depth model 1 + sum_j prod_{i<=j} alpha_i, so candidates that did not run recently are still
  estimated, and an optimism bonus that shrinks with evidence makes the harness try them again now
  and then (exploration).

Each step `Harness.choose` returns the candidate maximising expected tokens per second for the batch:
(tokens of the active rows) / step_seconds(bucket, candidate). "off" is always a candidate: a plain
decode step (`speculative.verify_step`), so speculation never makes a step slower than plain decoding
by more than the estimation error, and a spec candidate must beat it by `margin`.

A plain step keeps the target's features for the draft (`speculative.verify_step` with the head), which
consumes them at the next speculative step, so rows move between "off" and trees freely. Rows without
a draft in step with the target (`synced`; e.g. a server without a head) count one token under any tree,
and only rows in sync teach the statistics.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.tree import TreeConfig

log = logging.getLogger("eagle_jax.harness")

OFF = "off"
SAMPLED = ":sampled"  # a profile entry "<candidate>:sampled" is that step's cost when a row samples


def _default_candidates() -> tuple[str, ...]:
    # A chain, a small, the default (TreeConfig(): what `generate` and fixed-tree serving use, so auto can
    # always match it) and a large tree.
    d = TreeConfig()
    out = ["off", "3,1,4", "3,4,8", f"{d.depth},{d.topk},{d.tree_tokens}", "6,4,24"]
    return tuple(dict.fromkeys(out))


DEFAULT_CANDIDATES = _default_candidates()


def candidate_name(tree: TreeConfig | None) -> str:
    return OFF if tree is None else f"d{tree.depth}k{tree.topk}n{tree.tree_tokens}"


def parse_candidate(text) -> TreeConfig | None:
    """'off' (no speculation), 'D,K,N' or 'dDkKnN' -> a TreeConfig (None for off)."""
    if isinstance(text, TreeConfig) or text is None:
        return text
    s = str(text).strip().lower()
    if s in (OFF, "none", "plain"):
        return None
    m = re.fullmatch(r"(\d+),(\d+),(\d+)", s) or re.fullmatch(r"d(\d+)k(\d+)n(\d+)", s)
    if not m:
        raise ValueError(f"speculation candidate must be 'off', 'D,K,N' or 'dDkKnN' (e.g. 4,4,16), got {text!r}")
    tree = TreeConfig(*(int(x) for x in m.groups()))
    return None if tree.tree_tokens == 1 else tree


def tree_slack(trees: Iterable[TreeConfig | None]) -> int:
    """Cache room past the last committed token a step may write: N tree tokens (+ depth for safety)."""
    return max([t.tree_tokens + t.depth for t in trees if t is not None] + [1])


def draft_extra(trees: Iterable[TreeConfig | None]) -> int:
    """Extra draft-cache slots past the target's cache length (tree expansion scratch, and room for the
    catch-up after plain steps, which writes `speculative.CATCHUP` slots)."""
    from eagle_jax.speculative import CATCHUP

    need = [(t.depth - 1) * t.topk + t.depth + 1 for t in trees if t is not None]
    return max(need + [CATCHUP]) if need else 0


# --- cost profiles ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Profile:
    key: str
    seconds: dict[int, dict[str, float]]  # batch bucket -> candidate name -> seconds of one step
    meta: dict
    source: str = "given"  # "measured" | "cache" | "given"

    def cost(self, bucket: int, name: str, sampled: bool = False) -> float:
        """Step seconds at `bucket` (the nearest profiled bucket at or above it, else the largest); with
        `sampled`, of a step where some row samples (its acceptance and draws cost more), when measured."""
        buckets = sorted(self.seconds)
        b = next((x for x in buckets if x >= bucket), buckets[-1])
        row = self.seconds[b]
        if sampled and name + SAMPLED in row:
            return row[name + SAMPLED]
        if name not in row:
            raise KeyError(f"cost profile has no candidate {name!r} (has {', '.join(row)})")
        return row[name]

    def to_json(self) -> dict:
        return {"key": self.key, "meta": self.meta,
                "seconds": {str(b): row for b, row in sorted(self.seconds.items())}}

    @classmethod
    def from_json(cls, data: dict, source: str = "cache") -> "Profile":
        return cls(key=data["key"], meta=data.get("meta", {}),
                   seconds={int(b): {k: float(v) for k, v in row.items()} for b, row in data["seconds"].items()},
                   source=source)


def device_kind() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', 'unknown')}:{jax.device_count()}"


# The modules whose code makes up a step: a change to any of them changes what a step costs.
STEP_MODULES = ("speculative", "accept", "sampling", "tree", "kv_cache", "model", "draft", "engine")


def step_code_hash() -> str:
    """A hash of the source of the modules a step runs (`STEP_MODULES`)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in STEP_MODULES:
        h.update((here / f"{name}.py").read_bytes())
    return h.hexdigest()[:16]


def profile_key(target, head, buckets: Sequence[int], candidates: Sequence[str], cache_len: int) -> str:
    """A readable, file-safe key: model name + a hash of device, model and head configs, buckets,
    candidates, cache length and the step's code (head weights do not change step costs; its
    architecture does), so a profile is measured again after anything that changes the numbers."""
    ident = {
        "device": device_kind(), "jax": jax.__version__, "code": step_code_hash(),
        "model": target.name, "model_cfg": repr(target.cfg), "model_dtype": str(target.model.dtype),
        "head_cfg": None if head is None else repr(head.cfg), "head_dtype": None if head is None else str(head.dtype),
        "buckets": list(buckets), "candidates": list(candidates), "cache_len": int(cache_len),
        "method": 3,  # bumped when the measurement changes (2: interleaved rounds; 3: sampled steps too)
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", target.name)[:40]
    return f"{slug}-{digest}"


def default_cache_dir() -> Path:
    root = os.environ.get("EAGLE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle_jax")
    return Path(root) / "harness"


def _stepper(target, head, candidates, batch: int, cache_len: int, draft_len: int, context: int):
    """(state, step): an empty SpecState of these shapes and a function step(state, tree, sampled=False)
    running one step of one of the `candidates` on it (rows reset to `context` committed tokens first;
    every row greedy, or every row sampling at temperature 1), blocking until it is done."""
    from flax import nnx

    from eagle_jax import speculative
    from eagle_jax.sampling import SamplingParams

    if head is None and any(t is not None for t in candidates):
        raise ValueError("speculation candidates need a draft head")
    g, st = nnx.split(target.model)
    hg, hs = nnx.split(head) if head is not None else (None, None)
    kinds = {False: SamplingParams.make(batch), True: SamplingParams.make(batch, 1.0, seed=np.arange(batch))}
    active = jnp.ones((batch,), bool)
    state = speculative.empty_state(target, head, batch, cache_len, draft_len)

    def step(s, tree, sampled=False):
        params = kinds[sampled]
        # Back to `context` committed tokens each time (separate arrays: both caches are donated).
        s = s.replace(cache=s.cache.replace(lengths=jnp.full((batch,), context, jnp.int32)),
                      draft_cache=s.draft_cache.replace(lengths=jnp.full((batch,), context, jnp.int32)),
                      lag_n=jnp.zeros((batch,), jnp.int32))
        if tree is None:
            s, _, count = speculative.verify_step(g, st, s, params, active, hg, hs)
        else:
            s, _, count = speculative.spec_step(g, st, hg, hs, s, params, active, tree)
        count.block_until_ready()
        return s

    return state, step


def compile_candidates(target, head, batch: int, candidates: Sequence[TreeConfig | None], cache_len: int,
                       draft_len: int) -> None:
    """Runs one step of every candidate at these shapes, so none is compiled the first time the harness
    picks it (measuring a profile does this too; a profile read from the cache does not)."""
    state, step = _stepper(target, head, candidates, batch, cache_len, draft_len, max(1, cache_len // 4))
    for tree in candidates:
        state = step(state, tree)


def measure_profile(target, head, buckets: Sequence[int], candidates: Sequence[TreeConfig | None], cache_len: int,
                    draft_len: int, reps: int = 9, context: int | None = None) -> dict[int, dict[str, float]]:
    """Median seconds of one step per (bucket, candidate), rows filled to `context` tokens: every row
    greedy ("<name>") and every row sampling ("<name>:sampled")."""
    ctx = int(context if context is not None else max(1, cache_len // 4))
    out: dict[int, dict[str, float]] = {}
    runs = [(t, sampled) for sampled in (False, True) for t in candidates]
    label = lambda t, sampled: candidate_name(t) + (SAMPLED if sampled else "")
    for b in buckets:
        state, step = _stepper(target, head, candidates, b, cache_len, draft_len, ctx)
        for tree, sampled in runs:
            state = step(step(state, tree, sampled), tree, sampled)  # compile, warm
        # Rounds over all candidates, so a burst of load from elsewhere on the machine inflates every
        # candidate's time alike instead of one candidate's; the median over rounds drops the bursts.
        times = {label(t, sampled): [] for t, sampled in runs}
        for _ in range(reps):
            for tree, sampled in runs:
                t0 = time.perf_counter()
                state = step(state, tree, sampled)
                times[label(tree, sampled)].append(time.perf_counter() - t0)
        row = {name: float(np.median(ts)) for name, ts in times.items()}
        for name, sec in row.items():
            log.info("harness profile: batch %d %-10s %.2f ms", b, name, sec * 1e3)
        out[int(b)] = row
    return out


def load_or_measure(target, head, buckets: Sequence[int], candidates: Sequence[TreeConfig | None], cache_len: int,
                    draft_len: int, *, cache_dir=None, reprofile: bool = False, reps: int = 9) -> Profile:
    """The cached profile for this device + model + head + settings, measuring (and caching) it if needed."""
    names = [candidate_name(t) for t in candidates]
    key = profile_key(target, head, buckets, names, cache_len)
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    file = path / f"{key}.json"
    if file.exists() and not reprofile:
        try:
            prof = Profile.from_json(json.loads(file.read_text()), source="cache")
            if prof.key == key and all(set(names) <= set(prof.seconds.get(int(b), {})) for b in buckets):
                log.info("harness: reusing cost profile %s", file)
                return prof
        except (ValueError, KeyError, TypeError) as e:
            log.warning("harness: ignoring unreadable cost profile %s (%s)", file, e)
    t0 = time.perf_counter()
    seconds = measure_profile(target, head, buckets, candidates, cache_len, draft_len, reps=reps)
    meta = {"device": device_kind(), "model": target.name, "cache_len": cache_len, "buckets": list(buckets),
            "candidates": names, "measured_s": round(time.perf_counter() - t0, 2),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    prof = Profile(key=key, seconds=seconds, meta=meta, source="measured")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps(prof.to_json(), indent=2))
        tmp.replace(file)
        log.info("harness: wrote cost profile %s", file)
    except OSError as e:
        log.warning("harness: cannot cache the cost profile in %s (%s)", path, e)
    return prof


# --- acceptance statistics and the choice --------------------------------------------------------------

@dataclasses.dataclass
class Choice:
    name: str
    tree: TreeConfig | None
    expected_tokens: float  # tokens the whole batch is expected to emit this step
    seconds: float  # profiled step cost (0 when there is no profile)
    explore: bool = False


class AcceptanceStats:
    """Decayed running statistics of how many tokens rows emit per step (see the module docstring).

    Per-depth acceptance is kept per tree width (top-k): a chain proposes one token per level and a
    top-4 tree four, so their rates differ, and pooling them would misjudge one from the other (a head
    seen only through chains looks poor to a wider tree, and the chains' evidence would stop the harness
    from trying the tree). A width with little evidence leans on the pooled rates as its prior."""

    def __init__(self, max_depth: int, decay: float = 0.999, prior_accept: float = 0.5, prior_strength: float = 2.0,
                 blend: float = 4.0):
        self.decay, self.prior_accept, self.prior_strength, self.blend = decay, prior_accept, prior_strength, blend
        self.max_depth = max_depth
        self.reached_by_width: dict[int, np.ndarray] = {}  # top-k -> [j]: row-steps whose tree could accept depth j
        self.passed_by_width: dict[int, np.ndarray] = {}  # top-k -> [j]: ... that accepted depth j
        self.sum: dict[str, float] = {}
        self.n: dict[str, float] = {}
        self.tau_ema: float | None = None  # tokens per synced row per speculative step
        self._alpha: dict[int | None, np.ndarray] = {}  # alpha(width), until the next observation

    @property
    def reached(self) -> np.ndarray:
        return sum(self.reached_by_width.values(), np.zeros(self.max_depth + 1))

    @property
    def passed(self) -> np.ndarray:
        return sum(self.passed_by_width.values(), np.zeros(self.max_depth + 1))

    def observe(self, tree: TreeConfig | None, counts: Sequence[int]) -> None:
        """One step: counts = tokens emitted by each row whose draft was in sync (incl. the bonus)."""
        self._alpha.clear()
        for arrays in (self.reached_by_width, self.passed_by_width):
            for a in arrays.values():
                a *= self.decay
        for k in self.n:
            self.n[k] *= self.decay
            self.sum[k] *= self.decay
        if tree is None or len(counts) == 0:
            return
        name = candidate_name(tree)
        c = np.asarray(counts, np.float64)
        self.sum[name] = self.sum.get(name, 0.0) + float(c.sum())
        self.n[name] = self.n.get(name, 0.0) + len(c)
        accepted = c - 1
        reached = self.reached_by_width.setdefault(tree.topk, np.zeros(self.max_depth + 1))
        passed = self.passed_by_width.setdefault(tree.topk, np.zeros(self.max_depth + 1))
        for j in range(1, min(tree.depth, self.max_depth) + 1):
            reached[j] += float(np.sum(accepted >= j - 1))
            passed[j] += float(np.sum(accepted >= j))
        mean = float(c.mean())
        self.tau_ema = mean if self.tau_ema is None else 0.9 * self.tau_ema + 0.1 * mean

    def alpha(self, width: int | None = None) -> np.ndarray:
        """Per-depth conditional acceptance rates [max_depth + 1] (index 0 unused): pooled over every
        tree width, or for trees of top-k `width` (with the pooled rates as its prior). Kept until the
        next observation: every candidate asks for them on every step."""
        if width not in self._alpha:
            if width is None:
                self._alpha[None] = ((self.passed + self.prior_accept * self.prior_strength)
                                     / (self.reached + self.prior_strength))
            else:
                zero = np.zeros(self.max_depth + 1)
                reached, passed = self.reached_by_width.get(width, zero), self.passed_by_width.get(width, zero)
                self._alpha[width] = (passed + self.alpha() * self.prior_strength) / (reached + self.prior_strength)
        return self._alpha[width]

    def model_tokens(self, tree: TreeConfig) -> float:
        a = self.alpha(tree.topk)
        return 1.0 + float(np.sum(np.cumprod(a[1: tree.depth + 1])))

    def expected_tokens(self, tree: TreeConfig | None) -> float:
        """Expected tokens one in-sync row emits per step under `tree` (1 for off)."""
        if tree is None:
            return 1.0
        name = candidate_name(tree)
        n = self.n.get(name, 0.0)
        return (self.sum.get(name, 0.0) + self.blend * self.model_tokens(tree)) / (n + self.blend)

    def evidence(self, tree: TreeConfig) -> float:
        """How much is known about `tree`: its own steps and the depth-1 trials of trees of its width."""
        reached = self.reached_by_width.get(tree.topk)
        return self.n.get(candidate_name(tree), 0.0) + (float(reached[1]) if reached is not None else 0.0)


class FixedPolicy:
    """Always the same candidate ('fixed:D,K,N' or 'off'); keeps acceptance statistics for the metrics."""

    def __init__(self, tree: TreeConfig | None):
        self.tree = tree
        depth = tree.depth if tree is not None else 1
        self.stats, self.sampled_stats = AcceptanceStats(depth), AcceptanceStats(depth)
        self.name = candidate_name(tree)

    def choose(self, bucket: int, active: int, synced: int, sampled: int = 0) -> Choice:
        exp = batch_tokens(self.stats, self.sampled_stats, self.tree, active, synced, sampled)
        return Choice(self.name, self.tree, exp, 0.0)

    def observe(self, tree, counts, sampled=None) -> None:
        observe_by_class(self.stats, self.sampled_stats, tree, counts, sampled)

    def snapshot(self) -> dict:
        def part(st):
            return {"tau_ema": st.tau_ema, "expected_tokens_per_row": {self.name: st.expected_tokens(self.tree)}}
        return {"mode": "fixed", "candidates": [self.name], **part(self.stats), "sampled": part(self.sampled_stats)}


def batch_tokens(greedy: AcceptanceStats, sampled_stats: AcceptanceStats, tree, active: int, synced: int,
                 sampled: int, ucb: float | None = None) -> float:
    """Tokens a batch is expected to emit under `tree`: `synced` rows in step with their draft (`sampled`
    of them sampling, each kind by its own statistics); rows out of step emit one. With `ucb`, each
    estimate gets an optimism bonus that shrinks with evidence (capped at the tree's depth + 1)."""
    if tree is None:
        return float(active)
    total = 0.0
    for stats, rows in ((greedy, synced - sampled), (sampled_stats, sampled)):
        if rows <= 0:
            continue
        per_row = stats.expected_tokens(tree)
        if ucb is not None:
            per_row = min(tree.depth + 1.0, per_row + ucb * tree.depth / math.sqrt(1.0 + stats.evidence(tree)))
        total += rows * per_row
    return total + (active - synced)


def observe_by_class(greedy: AcceptanceStats, sampled_stats: AcceptanceStats, tree, counts, sampled) -> None:
    """One step's counts into the greedy and the sampled statistics (`sampled[i]`: row i samples; None:
    every row is greedy). Both decay every step, as time passes for both."""
    counts = list(counts)
    flags = [False] * len(counts) if sampled is None else [bool(x) for x in sampled]
    if len(flags) != len(counts):
        raise ValueError(f"observe: {len(counts)} counts but {len(flags)} sampled flags")
    greedy.observe(tree, [c for c, f in zip(counts, flags) if not f])
    sampled_stats.observe(tree, [c for c, f in zip(counts, flags) if f])


class Harness:
    """Chooses the candidate with the most expected tokens per second for the current batch."""

    def __init__(self, candidates: Sequence[TreeConfig | None], profile: Profile, *, margin: float = 0.03,
                 ucb: float = 0.3, stats: AcceptanceStats | None = None,
                 sampled_stats: AcceptanceStats | None = None):
        trees = [t for t in candidates if t is not None]
        self.candidates: list[TreeConfig | None] = [None] + trees  # off is always a candidate
        self.profile = profile
        self.margin, self.ucb = margin, ucb
        depth = max([t.depth for t in trees] + [1])
        # Greedy and sampled rows accept drafts at very different rates (a sampled row keeps a draft token
        # only with probability min(1, p/q)), so each kind has its own statistics and a batch's expected
        # tokens add up its greedy and its sampled rows.
        self.stats = stats or AcceptanceStats(depth)  # rows decoding greedily
        self.sampled_stats = sampled_stats or AcceptanceStats(depth)  # rows sampling (temperature > 0)
        self.last: dict[int, str] = {}  # bucket -> name of the last choice (for logging changes)
        self.logged_at: dict[int, float] = {}
        self.counts: dict[str, int] = {}  # choices made, by candidate
        self.last_choice: Choice | None = None

    def _tokens(self, tree, active: int, synced: int, bonus: bool, sampled: int = 0) -> float:
        return batch_tokens(self.stats, self.sampled_stats, tree, active, synced, sampled,
                            self.ucb if bonus else None)

    def choose(self, bucket: int, active: int, synced: int, sampled: int = 0) -> Choice:
        """`active` rows decode this step, `synced` of them have a draft in step with the target, and
        `sampled` of those sample (temperature > 0)."""
        if not 0 <= sampled <= synced <= active:
            raise ValueError(f"choose: need 0 <= sampled ({sampled}) <= synced ({synced}) <= active ({active})")
        best, best_rate = None, -1.0
        any_sampled = sampled > 0  # a step with a sampling row costs that kind of step
        off_rate = active / self.profile.cost(bucket, OFF, any_sampled)
        for tree in self.candidates:
            cost = self.profile.cost(bucket, candidate_name(tree), any_sampled)
            rate = self._tokens(tree, active, synced, bonus=False, sampled=sampled) / cost
            if tree is not None and rate < off_rate * (1.0 + self.margin):
                continue  # speculation must clearly beat a plain step
            if rate > best_rate:
                best, best_rate = tree, rate
        explore = False
        if synced > 0:  # optimism about rarely tried trees; only rows in sync can teach us anything
            for tree in self.candidates[1:]:
                cost = self.profile.cost(bucket, candidate_name(tree), any_sampled)
                rate = self._tokens(tree, active, synced, bonus=True, sampled=sampled) / cost
                if rate > best_rate * (1.0 + self.margin) and tree is not best:
                    best, best_rate, explore = tree, rate, True
        name = candidate_name(best)
        choice = Choice(name, best, self._tokens(best, active, synced, bonus=False, sampled=sampled),
                        self.profile.cost(bucket, name, any_sampled), explore)
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.last.get(bucket) != name:
            # Changes are logged at INFO at most every few seconds per bucket (choices can flip every step).
            now = time.monotonic()
            level = logging.INFO if not explore and now - self.logged_at.get(bucket, -1e9) >= 5.0 else logging.DEBUG
            if level == logging.INFO:
                self.logged_at[bucket] = now
            log.log(level, "harness: batch bucket %d, %d rows (%d in sync): %s%s, expected %.2f tokens/step in "
                    "%.2f ms (off: %.2f ms)", bucket, active, synced, name, " (exploring)" if explore else "",
                    choice.expected_tokens, choice.seconds * 1e3, self.profile.cost(bucket, OFF, any_sampled) * 1e3)
            self.last[bucket] = name
        self.last_choice = choice
        return choice

    def observe(self, tree, counts, sampled=None) -> None:
        """One step: `counts[i]` tokens emitted by the i-th in-sync row, `sampled[i]` whether it samples."""
        observe_by_class(self.stats, self.sampled_stats, tree, counts, sampled)

    def snapshot(self) -> dict:
        """Top-level estimates are the greedy rows'; `sampled` holds the sampled rows'."""
        last = self.last_choice

        def part(st):
            return {"tau_ema": st.tau_ema, "alpha": st.alpha()[1:].tolist(),
                    "alpha_by_width": {str(k): st.alpha(k)[1:].tolist() for k in sorted(st.reached_by_width)},
                    "expected_tokens_per_row": {candidate_name(t): st.expected_tokens(t) for t in self.candidates}}
        return {"mode": "auto", "candidates": [candidate_name(t) for t in self.candidates],
                **part(self.stats), "sampled": part(self.sampled_stats), "choices": dict(self.counts),
                "last_choice": None if last is None else dataclasses.asdict(last) | {"tree": last.name},
                "profile": {"source": self.profile.source, "key": self.profile.key,
                            "step_seconds": {str(b): row for b, row in sorted(self.profile.seconds.items())}}}
