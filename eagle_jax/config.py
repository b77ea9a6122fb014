"""Model configuration for Llama-family, Gemma 3 and Mixture-of-Experts (Mixtral, Qwen3-MoE) targets.

One frozen dataclass covers Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3, SmolLM2 and Gemma 3 text
models: the architectures differ only in a handful of switches (biases, q/k norms, head_dim, tied
embeddings, rope scaling; for Gemma 3 also (1 + w) norms, norms after attention and after the MLP,
GeLU-tanh, scaled embeddings, its own attention scale and a second rope for its sliding-window layers;
for MoE models the experts' count, size and routing).
Being frozen and hashable, a config is a valid static jit argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping


class ConfigError(ValueError):
    """A model config names an unsupported architecture or holds an invalid field."""


# model_type -> architecture switches that differ from plain Llama.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma3_text": {"qk_norm": True, "norm_offset": 1.0, "activation": "gelu_tanh", "sandwich_norms": True},
    "mixtral": {},
    "qwen3_moe": {"qk_norm": True},
}
ACTIVATIONS = ("silu", "gelu_tanh")
SUPPORTED_ARCHITECTURES = tuple(_ARCH_DEFAULTS)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `kind` is 'default', 'linear' or 'llama3'."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # Per-frequency divisors stored explicitly (GGUF llama3 files carry `rope_freqs`).
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.kind not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"rope scaling type {self.kind!r} is not supported (supported: default, linear, llama3)"
            )
        if self.theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.theta}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q, k, v
    o_bias: bool = False  # Llama `attention_bias=True` also biases o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    max_position: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3 switches (the defaults are Llama's):
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): Gemma stores w around 0
    activation: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU)
    sandwich_norms: bool = False  # a norm on the attention output and on the MLP output too
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # attention scores' scale (None: head_dim ** -0.5)
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention" (empty: all full)
    local_rope: RopeConfig | None = None  # the rope of sliding_attention layers (None: `rope`)
    sliding_window: int | None = None  # keys a sliding_attention layer's query sees, its own included
    # Mixture of Experts (Mixtral, Qwen3-MoE): every layer's MLP is num_experts SwiGLU experts of
    # expert_size, experts_per_token of them per token (0 experts: a dense MLP of intermediate_size).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk: bool = True  # renormalise the chosen experts' softmax weights to sum to 1

    def __post_init__(self):
        if self.arch not in _ARCH_DEFAULTS:
            raise ConfigError(
                f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ConfigError(f"layer_types holds {bad}: supported are full_attention and sliding_attention")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.expert_size > 0):
            raise ConfigError(f"a MoE config needs 0 < experts_per_token ({self.experts_per_token}) <= num_experts "
                              f"({self.num_experts}) and a positive expert_size ({self.expert_size})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")

    def layer_rope(self, i: int) -> RopeConfig:
        """The rope of layer i (a sliding-window layer may have its own base)."""
        if self.local_rope is not None and self.layer_types and self.layer_types[i] == "sliding_attention":
            return self.local_rope
        return self.rope

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Builds a config from a Hugging Face `config.json` dict (transformers 4.x or 5.x)."""
        model_type = hf.get("model_type")
        if model_type == "gemma3" and isinstance(hf.get("text_config"), Mapping):  # the multimodal wrapper
            hf, model_type = {**hf["text_config"], "model_type": "gemma3_text"}, "gemma3_text"
        if model_type not in _ARCH_DEFAULTS:
            archs = hf.get("architectures")
            raise ConfigError(
                f"{source}: unsupported architecture model_type={model_type!r} architectures={archs!r}"
                f" (supported model_type: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        # transformers >= 5 nests text fields under text_config for some families; not needed here.

        def need(key):
            if key not in hf:
                raise ConfigError(f"{source}: missing required field {key!r}")
            return hf[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = hf.get("head_dim") or hidden // heads
        switches = dict(_ARCH_DEFAULTS[model_type])
        # Llama and Qwen3 bias all four projections when attention_bias is set; Qwen2 always biases
        # q/k/v (never o) and Mistral never reads the field, so both ignore it as transformers does.
        if hf.get("attention_bias") and model_type in ("llama", "qwen3", "qwen3_moe"):
            switches["qkv_bias"] = True
            switches["o_bias"] = True
        if hf.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        rope = rope_from_hf(hf, source)
        if model_type == "gemma3_text":
            switches.update(_gemma3_fields(hf, hidden, source))
            rope = switches.pop("rope")
        if model_type in ("mixtral", "qwen3_moe"):
            switches.update(_moe_fields(hf, model_type, source))
        return cls(
            arch=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_embeddings=bool(hf.get("tie_word_embeddings", model_type == "gemma3_text")),
            max_position=_max_position(hf, switches.get("sliding_window")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **switches,
        )


def _gemma3_fields(hf: Mapping[str, Any], hidden: int, source: str) -> dict[str, Any]:
    """Gemma 3's fields of a text config: two ropes (full-attention layers and sliding-window layers),
    the layer pattern, the attention scale and the embedding scale; softcapping is refused."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ConfigError(f"{source}: {key}={hf[key]} is not supported (Gemma 3 models set it to null)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (Gemma 3 uses gelu_pytorch_tanh)")
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:  # transformers >= 5
        rope = rope_from_hf({"rope_parameters": params["full_attention"]}, source)
        local = rope_from_hf({"rope_parameters": params.get("sliding_attention") or {}}, source)
    else:
        rope = rope_from_hf({"rope_theta": 1_000_000.0, **hf}, source)
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))
    layers = int(hf.get("num_hidden_layers", 0))
    types = hf.get("layer_types")
    if not types:
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return {"rope": rope, "local_rope": local, "layer_types": tuple(types), "embed_scale": float(hidden) ** 0.5,
            "query_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            "sliding_window": int(hf.get("sliding_window") or 4096)}


def _moe_fields(hf: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The experts of a Mixtral / Qwen3-MoE config (every layer sparse; dense layers between are refused)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ConfigError(f"{source}: a {model_type} config needs num_local_experts (or num_experts)")
    if model_type == "qwen3_moe":
        step, dense = int(hf.get("decoder_sparse_step") or 1), list(hf.get("mlp_only_layers") or [])
        if step != 1 or dense:
            raise ConfigError(f"{source}: decoder_sparse_step={step} / mlp_only_layers={dense}: dense layers between "
                              f"MoE layers are not supported (every layer must be sparse)")
        size, norm = hf.get("moe_intermediate_size"), bool(hf.get("norm_topk_prob", False))
    else:  # Mixtral: experts of intermediate_size, weights always renormalised
        size, norm = hf.get("intermediate_size"), True
    return {"num_experts": int(experts), "experts_per_token": int(hf.get("num_experts_per_tok") or 2),
            "expert_size": int(size or 0), "norm_topk": norm}


def _max_position(hf: Mapping[str, Any], exact_window: int | None = None) -> int:
    limit = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    if window and not exact_window and (hf.get("use_sliding_window", True)) and int(window) < limit:
        # Mistral / Qwen2 attention here is dense: it equals their sliding-window attention only while the
        # whole context fits in the window, so the window is the usable context length. (Gemma 3's
        # sliding-window layers are exact at any length: `sliding_window`.)
        limit = int(window)
    return limit


def rope_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> RopeConfig:
    """Reads rope settings from either layout.

    transformers < 5: `rope_theta` at the top level and an optional `rope_scaling` dict.
    transformers >= 5: one `rope_parameters` dict holding `rope_theta` and `rope_type`.
    """
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" not in params and params:
        # Per-layer-type dicts (e.g. {"full_attention": {...}}): all Llama-family layers share one.
        params = next(iter(params.values()))
    scaling = dict(params or hf.get("rope_scaling") or {})
    theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    try:
        return RopeConfig(
            theta=float(theta),
            kind=kind,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def rope_inv_freq(rope: RopeConfig, head_dim: int):
    """Inverse frequencies [head_dim // 2] as float64 numpy, with scaling applied."""
    import numpy as np

    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(is_mid, mid, scaled)
    if rope.freq_factors is not None:
        factors = np.asarray(rope.freq_factors, dtype=np.float64)
        if factors.shape != inv.shape:
            raise ConfigError(f"rope_freqs has shape {factors.shape}, expected {inv.shape}")
        inv = inv / factors
    return inv
