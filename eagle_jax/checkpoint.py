"""What every checkpoint loader shares: the loaded `Target`, `LoadError`, and `assemble`.

Weight mapping is declarative: a table of (checkpoint tensor name, parameter path, transpose). The
assembler reads each tensor once, checks its shape against the parameter, stacks per-layer tensors
on the layer axis, and finishes by checking that every tensor in the checkpoint was consumed and
every parameter filled. Errors name the file, the tensor and both shapes. The formats' own readers
are `eagle_jax.loader` (Hugging Face directories, the entry point) and `eagle_jax.gguf_file` (GGUF).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from eagle_jax.config import ModelConfig
from eagle_jax.model import Transformer, from_arrays, param_shapes
from eagle_jax.weights import fill


class LoadError(ValueError):
    """A checkpoint could not be loaded; the message names the file and tensor."""


@dataclasses.dataclass(eq=False)  # compared by identity
class Target:
    """A loaded target model with its tokenizer."""

    model: Transformer
    tokenizer: Any  # transformers tokenizer, or None for weight-only checkpoints
    name: str
    source: str
    # Engines (compiled steps, harness state) made for this target, by draft head: they live and die with it.
    engines: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


def assemble(
    cfg: ModelConfig,
    table,
    tensor_names: list[str],
    read: Callable[[str], np.ndarray],
    shape_of: Callable[[str], tuple[int, ...]],
    source: str,
    ignored=(),
    transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
    dtype=jnp.float32,
) -> Transformer:
    """Fills every model parameter from checkpoint tensors following `table`.

    Per-layer table entries ("{i}" in the name, path (group, name)) fill parameters (group, i, name);
    per-expert entries ("{e}" too) fill one expert's slice of a parameter stacked over experts.
    """
    shapes = dict(param_shapes(cfg))
    entries, stacked = [], {}
    for pattern, path, transpose in table:
        layers = range(cfg.num_layers) if "{i}" in pattern else (None,)
        experts = range(cfg.num_experts) if "{e}" in pattern else (None,)
        for i in layers:
            key = path if i is None else (path[0], str(i)) + path[1:]
            for e in experts:
                if e is not None and key in shapes:  # one expert's slice: its own key, stacked below
                    stacked[key] = cfg.num_experts
                    shapes[key + (f"[expert {e}]",)] = shapes[key][1:]
                entries.append((pattern.format(i=i, e=e), key if e is None else key + (f"[expert {e}]",),
                                transpose))
    for key in stacked:
        del shapes[key]
    # A tied checkpoint may still carry a copy of the embedding as lm_head: accept and skip it.
    tied_copy = lambda name, key: key == ("lm_head",) and cfg.tie_embeddings
    arrays = fill(entries, shapes, tensor_names, read, shape_of, source=source, error=LoadError,
                  kind=f"a {cfg.arch} model", ignored=ignored, optional=tied_copy, transform=transform,
                  describe=lambda key: "parameter " + ".".join(key),
                  context=(f" (config: {cfg.arch}, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
                           f"{cfg.num_kv_heads}, head_dim {cfg.head_dim}"
                           + (f", {cfg.num_experts} experts of {cfg.expert_size}" if cfg.num_experts else "") + ")"))
    for key, count in stacked.items():
        arrays[key] = np.stack([arrays.pop(key + (f"[expert {e}]",)) for e in range(count)])
    return from_arrays(cfg, arrays, dtype=dtype)
