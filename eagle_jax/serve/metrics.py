"""Prometheus text-format metrics, without a client library: a few labelled counters plus gauges that
are read from the scheduler and the harness at scrape time."""

from __future__ import annotations

import threading

from eagle_jax.programs import ProgramStore

# name -> (type, help). Counters only change by `Metrics.inc`; gauges come from `render(gauges=...)`.
DESCRIPTIONS = {
    "eagle_requests_total": ("counter", "Requests by outcome: completed, cancelled (client went away), error, "
                                        "invalid (4xx), rejected (queue full)."),
    "eagle_prompt_tokens_total": ("counter", "Prompt tokens prefilled."),
    "eagle_generation_tokens_total": ("counter", "Tokens generated and delivered to requests."),
    "eagle_prefills_total": ("counter", "Prefill batches run (newcomers joining the running batch)."),
    "eagle_prefill_seconds_total": ("counter", "Seconds spent in prefill batches."),
    "eagle_steps_total": ("counter", "Decoding steps by the tree shape chosen ('off' = no speculation)."),
    "eagle_step_rows_total": ("counter", "Active rows summed over steps, by tree shape."),
    "eagle_step_tokens_total": ("counter", "Tokens emitted by steps, by tree shape (tokens / rows = tau)."),
    "eagle_step_seconds_total": ("counter", "Seconds spent in decoding steps, by tree shape."),
    "eagle_harness_explore_total": ("counter", "Steps the harness ran a tree to re-estimate it (exploration)."),
    "eagle_requests_running": ("gauge", "Requests holding a batch slot."),
    "eagle_requests_waiting": ("gauge", "Requests queued for a slot (queue depth)."),
    "eagle_batch_size": ("gauge", "Active rows in the last decoding step."),
    "eagle_batch_bucket": ("gauge", "Static batch size (bucket) of the running state."),
    "eagle_slots_free": ("gauge", "Free batch slots (max_batch minus running requests)."),
    "eagle_tau": ("gauge", "Recent tokens per row per speculative step (EMA, rows whose draft is in sync), "
                           "greedy and sampled rows apart."),
    "eagle_process_resident_bytes": ("gauge", "Resident memory of the server process now (VmRSS)."),
    "eagle_process_peak_resident_bytes": ("gauge", "Peak resident memory of the server process (VmHWM)."),
    "eagle_xla_programs_total": ("counter", "XLA programs this process built, by source: compiled, or read from "
                                            "the persistent compilation cache (a restart compiles nothing it has)."),
    "eagle_preparation_programs_done": ("gauge", "Programs compiled by the background preparation so far."),
    "eagle_preparation_programs_total": ("gauge", "Programs the background preparation compiles in all."),
    "eagle_harness_choice": ("gauge", "1 for the tree shape chosen for the last step."),
    "eagle_harness_expected_tokens": ("gauge", "Harness estimate of tokens per in-sync row per step, by shape, "
                                               "greedy and sampled rows apart."),
}

UNLABELLED_COUNTERS = ("eagle_prompt_tokens_total", "eagle_generation_tokens_total", "eagle_prefills_total",
                       "eagle_prefill_seconds_total", "eagle_harness_explore_total")


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        # Counters without labels are exported from the first scrape on, at 0, so that a rate or a
        # difference taken against an early scrape never meets a missing series.
        self._counters: dict[tuple[str, tuple], float] = {(name, ()): 0.0 for name in UNLABELLED_COUNTERS}

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value

    def count_step(self, config: str, rows: int, tokens: int, seconds: float, explore: bool) -> None:
        """One decoding step of candidate `config` over `rows` rows that emitted `tokens` tokens."""
        self.inc("eagle_steps_total", config=config)
        self.inc("eagle_step_rows_total", rows, config=config)
        self.inc("eagle_step_tokens_total", tokens, config=config)
        self.inc("eagle_step_seconds_total", seconds, config=config)
        if explore:
            self.inc("eagle_harness_explore_total")

    def count_prefill(self, prompt_tokens: int, seconds: float) -> None:
        self.inc("eagle_prefills_total")
        self.inc("eagle_prefill_seconds_total", seconds)
        self.inc("eagle_prompt_tokens_total", prompt_tokens)

    def get(self, name: str, **labels) -> float:
        with self._lock:
            return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def render(self, gauges: list[tuple[str, dict, float]] = ()) -> str:
        with self._lock:
            samples = [(name, dict(lbl), v) for (name, lbl), v in self._counters.items()]
        samples += list(gauges)
        by_name: dict[str, list] = {}
        for name, lbl, v in samples:
            by_name.setdefault(name, []).append((lbl, v))
        lines = []
        for name in sorted(by_name):
            kind, text = DESCRIPTIONS.get(name, ("gauge", name))
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")
            for lbl, v in sorted(by_name[name], key=lambda x: sorted(x[0].items())):
                lines.append(f"{name}{_labels(lbl)} {float(v):.10g}")
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (for tests and the load-test client)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def process_memory() -> dict[str, int]:
    """{'VmRSS': bytes, 'VmHWM': bytes} of this process ({} where /proc is not there)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class CompileCounter:
    """Counts the XLA programs this process builds, and how many of them came from JAX's persistent
    compilation cache (JAX's monitoring events; one listener per process, installed by `watch`)."""

    BUILD = "/jax/core/compile/backend_compile_duration"  # every backend build, cache hits included
    HIT = "/jax/compilation_cache/cache_hits"
    _lock = threading.Lock()
    _installed = False
    built = 0
    from_cache = 0

    @classmethod
    def watch(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
            jax.monitoring.register_event_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _on_duration(cls, event: str, duration: float, **kwargs) -> None:
        if event == cls.BUILD:
            cls.built += 1

    @classmethod
    def _on_event(cls, event: str, **kwargs) -> None:
        if event == cls.HIT:
            cls.from_cache += 1

    @classmethod
    def counts(cls) -> dict[str, int]:
        """{'compiled': programs XLA compiled, 'cache': programs read from the persistent cache, 'store':
        executables loaded from a program store (`eagle_jax.programs`: not traced, not compiled)}."""
        return {"compiled": max(cls.built - cls.from_cache, 0), "cache": cls.from_cache, "store": ProgramStore.loaded}
