"""Server settings: one frozen dataclass, filled from a preset TOML and the command line (the CLI wins).

A preset's keys are the field names below (the CLI flags with '_' for '-'); an unknown key or a value
of the wrong type is an error that names the file and the key.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from eagle_jax.config import ConfigError  # one ConfigError for model and server settings
from eagle_jax.harness import DEFAULT_CANDIDATES
from eagle_jax.tree import parse_tree


# On CPU the reference attention reads the whole preallocated cache every step, so the default stays modest.
DEFAULT_MAX_MODEL_LEN = 1024


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str = "smollm2-135m-instruct"
    draft: str = "auto"  # auto | default | random | none | head directory (eagle_jax.loader.resolve_draft)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the target's name
    max_batch: int = 32
    max_model_len: int | None = None  # default: the model's context, at most DEFAULT_MAX_MODEL_LEN
    speculation: str = "auto"  # auto | off | fixed:D,K,N
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES  # trees the harness chooses from ('off' is always one)
    max_queue: int = 256
    batch_buckets: tuple[int, ...] = ()  # default: powers of two up to max_batch
    prefill_batches: tuple[int, ...] = (1, 4)
    prefill_tokens: int = 2048
    prefill_chunk: int = 64
    # KV cache slots the running rows share (default: 8 rows of max_model_len; 0: max_batch rows of
    # max_model_len). Paged (block_size > 0), requests take the blocks they need from that pool;
    # contiguous (block_size 0), larger batch buckets hold shorter requests (`SchedulerConfig`).
    kv_cache_tokens: int | None = None
    block_size: int = 16  # KV cache block (slots); 0: contiguous rows (`serve.blocks`)
    # Batch buckets whose tree programs stay loaded (0: all; `SchedulerConfig.resident_tree_buckets`).
    resident_tree_buckets: int = 2
    profile_dir: str | None = None  # default ~/.cache/eagle_jax/harness
    reprofile: bool = False
    profile_reps: int = 5
    warmup: bool = True
    warmup_prompt_len: int | None = None  # prefills compiled ahead for prompts up to this long (default: all)
    compile_cache: str | None = None  # persistent XLA compilation cache directory ("" = off)
    log_level: str = "info"
    tensor_parallel: int = 1  # devices the target is sharded over (`eagle_jax.sharding`)
    data_parallel: int = 1  # groups of tensor_parallel devices that batch rows are split over
    quantize: str | None = None  # "int8" / "fp8" / "int4" / "gguf": the target's matrices weight-only quantized
    expert_parallel: int = 1  # MoE targets: groups of tensor_parallel devices each layer's experts are split over
    distributed: bool = False  # join other processes (jax.distributed); process 0 serves HTTP

    def mesh_problem(self) -> str | None:
        """Why the parallel settings cannot serve together, or None."""
        if min(self.tensor_parallel, self.data_parallel, self.expert_parallel) < 1:
            return (f"tensor_parallel, data_parallel and expert_parallel must be >= 1, got {self.tensor_parallel}, "
                    f"{self.data_parallel}, {self.expert_parallel}")
        if self.data_parallel > 1 and self.block_size:
            return ("data_parallel > 1 needs contiguous KV rows (block_size 0): a paged KV pool is shared by every "
                    "row, so it cannot be split by rows")
        if self.max_batch % self.data_parallel:
            return f"max_batch {self.max_batch} must be a multiple of data_parallel {self.data_parallel}"
        if self.distributed and self.speculation_mode()[0] == "auto":
            return ("speculation 'auto' measures step costs in each process, which would choose apart: with "
                    "distributed, use 'off' or 'fixed:D,K,N'")
        return None

    def __post_init__(self):
        for name in ("max_batch", "max_model_len", "prefill_tokens", "profile_reps", "warmup_prompt_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_chunk < 16:
            raise ConfigError(f"prefill_chunk must be >= 16 tokens, got {self.prefill_chunk}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 0:
            raise ConfigError(f"kv_cache_tokens must be >= 0 (0: no limit), got {self.kv_cache_tokens}")
        if self.block_size < 0:
            raise ConfigError(f"block_size must be >= 0 (0: contiguous rows), got {self.block_size}")
        if self.resident_tree_buckets < 0:
            raise ConfigError(f"resident_tree_buckets must be >= 0 (0: all), got {self.resident_tree_buckets}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if any(b < 1 for b in self.batch_buckets) or any(b < 1 for b in self.prefill_batches) or not self.prefill_batches:
            raise ConfigError("batch_buckets and prefill_batches must be positive integers")
        self.speculation_mode()  # validates
        if self.mesh_problem():
            raise ConfigError(self.mesh_problem())
        for c in self.candidates:
            try:
                parse_tree(c)
            except ValueError as e:
                raise ConfigError(f"candidates: {e}") from None

    def speculation_mode(self):
        """('auto', None) | ('off', None) | ('fixed', TreeConfig)."""
        s = str(self.speculation).strip().lower()
        if s in ("auto", "off"):
            return s, None
        if s.startswith("fixed:"):
            try:
                tree = parse_tree(s[len("fixed:"):])
            except ValueError as e:
                raise ConfigError(f"speculation: {e}") from None
            return ("fixed", tree) if tree is not None else ("off", None)
        raise ConfigError(f"speculation must be 'auto', 'off' or 'fixed:D,K,N' (e.g. fixed:4,4,16), got {self.speculation!r}")

    def model_len(self, context: int) -> int:
        """max_model_len for a model with `context` positions (an explicit value above it is an error)."""
        if self.max_model_len is None:
            return min(DEFAULT_MAX_MODEL_LEN, context)
        if self.max_model_len > context:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's context length {context}")
        return self.max_model_len

    def candidate_trees(self):
        return [parse_tree(c) for c in self.candidates]


FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}
_TUPLES = {"candidates": str, "batch_buckets": int, "prefill_batches": int}


def _check_type(source: str, key: str, value: Any):
    f = FIELDS[key]
    if key in _TUPLES:
        if not isinstance(value, list) or not all(isinstance(v, _TUPLES[key]) and not isinstance(v, bool)
                                                  for v in value):
            raise ConfigError(f"{source}: {key} must be a list of {_TUPLES[key].__name__}, got {value!r}")
        return tuple(value)
    kind = str(f.type)
    want = bool if kind.startswith("bool") else int if kind.startswith("int") else str
    if want is bool:
        ok = isinstance(value, bool)
    elif want is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"{source}: {key} must be of type {want.__name__}, got {type(value).__name__} {value!r}")
    return value


def load_preset(path) -> dict:
    """Reads a preset TOML into a dict of ServeConfig fields (validated keys and types)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: preset file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    out = {}
    for key, value in data.items():
        norm = key.replace("-", "_")
        if norm not in FIELDS:
            raise ConfigError(f"{path}: unknown key {key!r} (known keys: {', '.join(sorted(FIELDS))})")
        out[norm] = _check_type(str(path), norm, value)
    return out
