"""Cost profiles for the load-aware harness: what one whole jitted step costs on this device.

Measured once per device + model + head: the seconds of one `steps.step` (draft + verify + accept +
commit) for every candidate (a tree, or "off": a plain step) and every batch bucket, at the server's
cache length, with every row greedy ("<name>") and every row sampling ("<name>:sampled"). Measuring
whole steps is the most faithful way to capture what a candidate costs on this hardware. Profiles are
cached as JSON under $EAGLE_JAX_CACHE/harness (default ~/.cache/eagle_jax/harness), keyed by a hash of
everything that changes the numbers (device, JAX version, model and head configs, the step's code).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import sharding, steps
from eagle_jax.compiling import param_count
from eagle_jax.sampling import SamplingParams
from eagle_jax.tree import TreeConfig, tree_name

log = logging.getLogger("eagle_jax.harness")

SAMPLED = ":sampled"  # a profile entry "<candidate>:sampled" is that step's cost when a row samples


@dataclasses.dataclass
class Profile:
    key: str
    seconds: dict[int, dict[str, float]]  # batch bucket -> candidate name -> seconds of one step
    meta: dict
    source: str = "given"  # "measured" | "cache" | "given" | "online" (measured by a server as it serves)
    samples: dict = dataclasses.field(default_factory=dict, repr=False)  # (bucket, label) -> seconds observed
    provisional: set = dataclasses.field(default_factory=set, repr=False)
    stale: set = dataclasses.field(default_factory=set, repr=False)

    def cost(self, bucket: int, name: str, sampled: bool = False) -> float:
        """Step seconds at `bucket` (the nearest profiled bucket at or above it, else the largest); with
        `sampled`, of a step where some row samples (its acceptance and draws cost more), when measured."""
        buckets = sorted(self.seconds)
        b = next((x for x in buckets if x >= bucket), buckets[-1])
        row = self.seconds[b]
        if sampled and name + SAMPLED in row:
            return row[name + SAMPLED]
        if name not in row and name + SAMPLED in row:  # measured only with sampling rows so far
            return row[name + SAMPLED]
        if name not in row:
            raise KeyError(f"cost profile has no candidate {name!r} (has {', '.join(row)})")
        return row[name]

    def has(self, bucket: int, name: str, sampled: bool = False) -> bool:
        """Whether this exact bucket has a measured cost for `name` (sampled: its sampled-step cost)."""
        return name + (SAMPLED if sampled else "") in self.seconds.get(bucket, {})

    def record(self, bucket: int, name: str, seconds: float, sampled: bool = False, reps: int = 5,
               provisional: bool = False) -> bool:
        """One observed step of `name` at `bucket` (measured online, on real rows). The first observation
        of each entry is dropped (it may have compiled); the median of the next `reps` becomes its cost.
        `provisional` marks observations made while something else loaded the machine (background
        compiles): such an entry is measured again by `remeasure`. Returns True when an entry completed."""
        label = name + (SAMPLED if sampled else "")
        if self.has(bucket, name, sampled) and (bucket, label) not in self.stale:
            return False
        obs = self.samples.setdefault((bucket, label), [])
        obs.append(float(seconds))
        if provisional:
            self.provisional.add((bucket, label))
        if len(obs) < reps + 1:
            return False
        self.seconds.setdefault(bucket, {})[label] = float(np.median(obs[1:]))
        self.samples[(bucket, label)] = []
        self.stale.discard((bucket, label))
        return True

    def unmeasured(self, bucket: int, names, sampled: bool = False) -> str | None:
        """The first of `names` whose cost at `bucket` is not measured yet (or is stale), else None."""
        for name in names:
            label = name + (SAMPLED if sampled else "")
            if not self.has(bucket, name, sampled) or (bucket, label) in self.stale:
                return name
        return None

    def remeasure_provisional(self) -> None:
        """Marks the entries measured while the machine was loaded as stale: they are measured again (the
        old value is used until then)."""
        self.stale |= {k for k in self.provisional if k[1] in self.seconds.get(k[0], {})}
        self.provisional.clear()
        for k in self.stale:
            self.samples[k] = []

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
STEP_MODULES = ("steps", "layers", "accept", "sampling", "tree", "kv_cache", "model", "draft", "sharding")


def step_code_hash() -> str:
    """A hash of the source of the modules a step runs (`STEP_MODULES`)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in STEP_MODULES:
        h.update((here / f"{name}.py").read_bytes())
    return h.hexdigest()[:16]


def profile_key(target, head, buckets: Sequence[int], candidates: Sequence[str], cache_len: int | Sequence[int],
                sampling: bool = True, pages: tuple[int, int] | None = None) -> str:
    """A readable, file-safe key: model name + a hash of device, model and head configs, buckets,
    candidates, cache length, the step's code (head weights do not change step costs; its
    architecture does) and which programs were measured (`sampling`), so a profile is measured again
    after anything that changes the numbers."""
    ident = {
        "device": device_kind(), "jax": jax.__version__, "code": step_code_hash(),
        "model": target.name, "model_cfg": repr(target.cfg), "model_dtype": str(target.model.dtype),
        "head_cfg": None if head is None else repr(head.cfg), "head_dtype": None if head is None else str(head.dtype),
        "buckets": list(buckets), "candidates": list(candidates),
        "cache_len": int(cache_len) if isinstance(cache_len, int) else [int(c) for c in cache_len],
        "method": 3,  # bumped when the measurement changes (2: interleaved rounds; 3: sampled steps too)
    }
    if not sampling:
        ident["programs"] = "greedy"  # the all-greedy steps (the general ones keep their existing keys)
    if pages is not None:
        ident["pages"] = [int(p) for p in pages]  # paged caches: (block size, pool slots)
    if target.model.quantization is not None:  # quantized matrices change what every step costs
        ident["quantization"] = list(target.model.quantization)
    mesh = sharding.mesh_shape(target.model.mesh)
    if mesh != sharding.mesh_shape(None):  # a sharded target's steps cost what its mesh shape makes them
        ident["mesh"] = mesh
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", target.name)[:40]
    return f"{slug}-{digest}"


def cache_root() -> Path:
    """$EAGLE_JAX_CACHE, else ~/.cache/eagle_jax: cost profiles, compiled programs and the XLA cache live below."""
    return Path(os.environ.get("EAGLE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle_jax"))


def default_cache_dir() -> Path:
    return cache_root() / "harness"


def stepper(target, head, candidates, batch: int, cache_len: int, draft_len: int, context: int,
            sampling: bool = True):
    """(state, step): an empty DecodeState of these shapes and a function step(state, tree, sampled=False)
    running one step of one of the `candidates` on it (rows reset to `context` committed tokens first;
    every row greedy, or every row sampling at temperature 1), blocking until it is done.
    sampling=False runs the all-greedy programs (`Engine.run_step`), which take no sampled rows."""
    if head is None and any(t is not None for t in candidates):
        raise ValueError("speculation candidates need a draft head")
    g, st = nnx.split(target.model)
    hg, hs = nnx.split(head) if head is not None else (None, None)
    kinds = {False: SamplingParams.make(batch), True: SamplingParams.make(batch, 1.0, seed=np.arange(batch))}
    active = jnp.ones((batch,), bool)
    state = steps.empty_state(target, head, batch, cache_len, draft_len)
    n_params = param_count(st, hs)
    mesh, kv_heads = target.model.mesh, target.cfg.num_kv_heads  # a sharded target: inputs as the engine places them
    place = lambda x: sharding.place(x, mesh, kv_heads)  # noqa: E731
    if mesh is not None:
        hs = sharding.replicate(hs, mesh) if hs is not None else None
        kinds, active, state = place(kinds), place(active), place(state)

    def run(s, tree, sampled=False):
        # Back to `context` committed tokens each time (separate arrays: both caches are donated).
        s = s.replace(cache=s.cache.replace(lengths=jnp.full((batch,), context, jnp.int32)),
                      draft_cache=s.draft_cache.replace(lengths=jnp.full((batch,), context, jnp.int32)),
                      lag_n=jnp.zeros((batch,), jnp.int32))
        s = place(s)
        # As Engine.run_step calls it (the same arguments, positionally: the same compiled program).
        if sampled and not sampling:
            raise ValueError("the all-greedy programs cannot run sampled rows")
        s, _, count = steps.step(g, st, hg, hs, s, kinds[sampled], active, tree, False, None, sampling, n_params)
        count.block_until_ready()
        return s

    return state, run


def compile_candidates(target, head, batch: int, candidates: Sequence[TreeConfig | None], cache_len: int,
                       draft_len: int, sampling: bool = True) -> None:
    """Runs one step of every candidate at these shapes, so none is compiled the first time the harness
    picks it (measuring a profile does this too; a profile read from the cache does not)."""
    state, step = stepper(target, head, candidates, batch, cache_len, draft_len, max(1, cache_len // 4), sampling)
    for tree in candidates:
        state = step(state, tree)


def measure_profile(target, head, buckets: Sequence[int], candidates: Sequence[TreeConfig | None], cache_len: int,
                    draft_len: int, reps: int = 9, context: int | None = None,
                    sampling: bool = True) -> dict[int, dict[str, float]]:
    """Median seconds of one step per (bucket, candidate), rows filled to `context` tokens: every row
    greedy ("<name>") and every row sampling ("<name>:sampled"). sampling=False measures the all-greedy
    programs instead, greedy rows only (half the programs to compile, for runs that never sample)."""
    ctx = int(context if context is not None else max(1, cache_len // 4))
    out: dict[int, dict[str, float]] = {}
    runs = [(t, sampled) for sampled in ((False, True) if sampling else (False,)) for t in candidates]
    label = lambda t, sampled: tree_name(t) + (SAMPLED if sampled else "")
    for b in buckets:
        state, step = stepper(target, head, candidates, b, cache_len, draft_len, ctx, sampling)
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


def profile_file(key: str, cache_dir=None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"{key}.json"


def load_cached(key: str, cache_dir=None) -> Profile | None:
    """The cached profile of this key (possibly missing some buckets or candidates), or None."""
    file = profile_file(key, cache_dir)
    if not file.exists():
        return None
    try:
        prof = Profile.from_json(json.loads(file.read_text()), source="cache")
    except (ValueError, KeyError, TypeError) as e:
        log.warning("harness: ignoring unreadable cost profile %s (%s)", file, e)
        return None
    return prof if prof.key == key else None


def save(prof: Profile, cache_dir=None) -> None:
    """Writes the profile to its cache file (atomically); a warning, not an error, when that fails."""
    file = profile_file(prof.key, cache_dir)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps(prof.to_json(), indent=2))
        tmp.replace(file)
        log.info("harness: wrote cost profile %s", file)
    except OSError as e:
        log.warning("harness: cannot cache the cost profile in %s (%s)", file.parent, e)


def load_or_measure(target, head, buckets: Sequence[int], candidates: Sequence[TreeConfig | None], cache_len: int,
                    draft_len: int, *, cache_dir=None, reprofile: bool = False, reps: int = 9,
                    sampling: bool = True) -> Profile:
    """The cached profile for this device + model + head + settings, measuring (and caching) it if needed;
    sampling=False: of the all-greedy programs (`measure_profile`)."""
    names = [tree_name(t) for t in candidates]
    key = profile_key(target, head, buckets, names, cache_len, sampling)
    prof = None if reprofile else load_cached(key, cache_dir)
    if prof is not None and all(set(names) <= set(prof.seconds.get(int(b), {})) for b in buckets):
        log.info("harness: reusing cost profile %s", profile_file(key, cache_dir))
        return prof
    t0 = time.perf_counter()
    seconds = measure_profile(target, head, buckets, candidates, cache_len, draft_len, reps=reps, sampling=sampling)
    meta = {"device": device_kind(), "model": target.name, "cache_len": cache_len, "buckets": list(buckets),
            "candidates": names, "programs": "general" if sampling else "greedy", "measured_s": round(time.perf_counter() - t0, 2),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    prof = Profile(key=key, seconds=seconds, meta=meta, source="measured")
    save(prof, cache_dir)
    return prof
