"""The load-aware speculation harness: per step, the tree shape (or none) with the most tokens per second.

Two ingredients:

* a **cost profile** (`eagle_jax.profiles`), measured once per device + model + head: the seconds of
  one whole jitted step for every candidate and every batch bucket, at the server's cache length.
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
decode step (`steps.step` with no tree), so speculation never makes a step slower than plain decoding
by more than the estimation error, and a spec candidate must beat it by `margin`.

A plain step keeps the target's features for the draft (`steps.step` with the head), which
consumes them at the next speculative step, so rows move between "off" and trees freely. Rows without
a draft in step with the target (`synced`; e.g. a server without a head) count one token under any tree,
and only rows in sync teach the statistics.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Sequence

import numpy as np

from eagle_jax.profiles import Profile
from eagle_jax.tree import OFF, TreeConfig, parse_tree, tree_name

log = logging.getLogger("eagle_jax.harness")


# A chain, a small, the default (TreeConfig(): what `generate` and fixed-tree serving use, so auto can
# always match it) and a large tree, besides a plain step.
DEFAULT_CANDIDATES = tuple(dict.fromkeys(["off", "3,1,4", "3,4,8", TreeConfig().name, "6,4,24"]))


def default_trees() -> list[TreeConfig]:
    """The trees among DEFAULT_CANDIDATES."""
    return candidate_trees(DEFAULT_CANDIDATES)


def candidate_trees(candidates=None) -> list[TreeConfig]:
    """The distinct trees among `candidates` (TreeConfigs or "D,K,N" / "off" strings; None: DEFAULT_CANDIDATES;
    a plain step is always a candidate, so "off" adds nothing). At least one tree is needed: the harness
    compares trees against plain steps."""
    if candidates is None:
        candidates = DEFAULT_CANDIDATES
    trees = list(dict.fromkeys(t for t in map(parse_tree, candidates) if t is not None))
    if not trees:
        raise ValueError(f"candidates {list(map(str, candidates))} hold no draft tree: name at least one D,K,N")
    return trees


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
        name = tree_name(tree)
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
        name = tree_name(tree)
        n = self.n.get(name, 0.0)
        return (self.sum.get(name, 0.0) + self.blend * self.model_tokens(tree)) / (n + self.blend)

    def evidence(self, tree: TreeConfig) -> float:
        """How much is known about `tree`: its own steps and the depth-1 trials of trees of its width."""
        reached = self.reached_by_width.get(tree.topk)
        return self.n.get(tree_name(tree), 0.0) + (float(reached[1]) if reached is not None else 0.0)


class FixedPolicy:
    """Always the same candidate ('fixed:D,K,N' or 'off'); keeps acceptance statistics for the metrics."""

    def __init__(self, tree: TreeConfig | None):
        self.tree = tree
        depth = tree.depth if tree is not None else 1
        self.stats, self.sampled_stats = AcceptanceStats(depth), AcceptanceStats(depth)
        self.name = tree_name(tree)

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

    def choose(self, bucket: int, active: int, synced: int, sampled: int = 0, allowed=None) -> Choice:
        """`active` rows decode this step, `synced` of them have a draft in step with the target, and
        `sampled` of those sample (temperature > 0). `allowed` (default: every candidate) limits the trees
        to those a server has compiled and profiled at this bucket so far; a plain step is always allowed."""
        if not 0 <= sampled <= synced <= active:
            raise ValueError(f"choose: need 0 <= sampled ({sampled}) <= synced ({synced}) <= active ({active})")
        best, best_rate = None, -1.0
        any_sampled = sampled > 0  # a step with a sampling row costs that kind of step
        off_rate = active / self.profile.cost(bucket, OFF, any_sampled)
        pool = self.candidates if allowed is None else [None] + [t for t in self.candidates[1:] if t in allowed]
        for tree in pool:
            cost = self.profile.cost(bucket, tree_name(tree), any_sampled)
            rate = self._tokens(tree, active, synced, bonus=False, sampled=sampled) / cost
            if tree is not None and rate < off_rate * (1.0 + self.margin):
                continue  # speculation must clearly beat a plain step
            if rate > best_rate:
                best, best_rate = tree, rate
        explore = False
        if synced > 0:  # optimism about rarely tried trees; only rows in sync can teach us anything
            for tree in pool[1:]:
                cost = self.profile.cost(bucket, tree_name(tree), any_sampled)
                rate = self._tokens(tree, active, synced, bonus=True, sampled=sampled) / cost
                if rate > best_rate * (1.0 + self.margin) and tree is not best:
                    best, best_rate, explore = tree, rate, True
        name = tree_name(best)
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
                    "expected_tokens_per_row": {tree_name(t): st.expected_tokens(t) for t in self.candidates}}
        return {"mode": "auto", "candidates": [tree_name(t) for t in self.candidates],
                **part(self.stats), "sampled": part(self.sampled_stats), "choices": dict(self.counts),
                "last_choice": None if last is None else dataclasses.asdict(last) | {"tree": last.name},
                "profile": {"source": self.profile.source, "key": self.profile.key,
                            "step_seconds": {str(b): row for b, row in sorted(self.profile.seconds.items())}}}
