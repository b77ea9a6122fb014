"""GGUF checkpoints (llama.cpp's format): the config from its metadata, the tokenizer from its vocabulary,
and the weights dequantized through the `gguf` package into the model's parameters, or, with
keep_blocks, the quantized matrices kept in the file's blocks (`eagle_jax.gguf_blocks`, `quant.from_blocks`)."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eagle_jax import gguf_blocks
from eagle_jax.checkpoint import LoadError, Target, assemble
from eagle_jax.config import ConfigError, ModelConfig, RopeConfig, SUPPORTED_ARCHITECTURES

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

_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# Gemma 3 norms its sub-layers' outputs too (llama.cpp's ffn_norm is its pre-MLP norm, as for Llama).
GEMMA3_GGUF_NORMS = (
    ("blk.{i}.post_attention_norm.weight", ("layers", "post_attn_norm"), False),
    ("blk.{i}.post_ffw_norm.weight", ("layers", "post_mlp_norm"), False),
)
# Mixtral (architecture "llama" with an expert count): a router and each layer's experts stacked, [E, F, H]
# ([E, H, F] for down) in numpy order, each matrix transposed against the parameter's.
GGUF_EXPERTS = (
    ("blk.{i}.ffn_gate_inp.weight", ("layers", "router"), True),
    ("blk.{i}.ffn_gate_exps.weight", ("layers", "w_gate"), "last2"),
    ("blk.{i}.ffn_up_exps.weight", ("layers", "w_up"), "last2"),
    ("blk.{i}.ffn_down_exps.weight", ("layers", "w_down"), "last2"),
)
# Tensors a keep_blocks load still dequantizes: the MoE router and stacked experts.
KEPT_DENSE = ("ffn_gate_inp.weight", "_exps.weight")
GEMMA3_SWA_PATTERN = 6  # every sixth layer is global; GGUF does not store the pattern (llama.cpp fixes it too)
GEMMA3_LOCAL_ROPE_BASE = 10_000.0  # the sliding-window layers' rope base, likewise not stored


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
        extra = _gemma3_fields(meta, hidden, heads, head_dim, int(meta("block_count"))) if arch == "gemma3" else {}
        experts = int(meta("expert_count", 0, required=False) or 0)
        if experts and arch not in ("llama", "mistral"):
            raise LoadError(f"{source}: MoE GGUF files of architecture {arch!r} are not supported (Mixtral's are)")
        if experts:
            extra = {"num_experts": experts, "experts_per_token": int(meta("expert_used_count")), "norm_topk": True,
                     "expert_size": int(meta("expert_feed_forward_length", 0, required=False)
                                        or meta("feed_forward_length"))}
        return ModelConfig(
            arch="mixtral" if experts else _GGUF_ARCHS[arch],
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
            **extra,
        )
    except ConfigError as e:
        raise LoadError(f"{source}: {e}") from None


def _gemma3_fields(meta, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """Gemma 3's switches from GGUF metadata and the family's fixed values (as llama.cpp reads them)."""
    window = meta("attention.sliding_window", None, required=False)
    types = tuple("sliding_attention" if (i + 1) % GEMMA3_SWA_PATTERN else "full_attention" for i in range(layers))
    # The attention scale is 1/sqrt(head_dim) except for the 27B model (62 layers), which scales by
    # 1/sqrt(hidden / heads): its query_pre_attn_scalar.
    scalar = hidden // heads if layers == 62 else head_dim
    return {"norm_offset": 1.0, "activation": "gelu_tanh", "sandwich_norms": True,
            "embed_scale": float(hidden) ** 0.5, "query_scale": float(scalar) ** -0.5,
            "local_rope": RopeConfig(theta=GEMMA3_LOCAL_ROPE_BASE),
            "layer_types": types if window else (), "sliding_window": int(window) if window else None}


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


def load_gguf(path, dtype=jnp.float32, tokenizer: bool = True, name: str | None = None,
              keep_blocks: bool = False) -> Target:
    """The target in a GGUF file. keep_blocks: the attention, MLP, embedding and lm_head matrices stored in a
    block type `gguf_blocks` reads stay quantized, exactly as in the file (4-bit blocks as int4, the others
    as int8, with the file's groups, scales and minimums: `model.quantization` is ("gguf", None, True));
    other tensors, and MoE experts, are dequantized to dtype."""
    import gguf

    from eagle_jax.quant import QuantizeError, from_blocks

    path = Path(path)
    reader = gguf_reader(path)
    source = str(path)
    cfg = gguf_config(reader, source)
    tensors = {t.name: t for t in reader.tensors}
    permute = cfg.arch in ("llama", "mistral", "mixtral")

    def shape_of(n):
        # GGUF lists dims fastest-first; numpy order is the reverse.
        return tuple(int(d) for d in reversed(tensors[n].shape))

    def read(n):
        t = tensors[n]
        kind = t.tensor_type.name
        if keep_blocks and kind in gguf_blocks.LAYOUT and len(t.shape) == 2 and not n.endswith(KEPT_DENSE):
            try:
                return gguf_blocks.decode(t.data.reshape(int(t.shape[1]), -1), kind, int(t.shape[0]))
            except ValueError as e:
                raise LoadError(f"{source}: cannot read tensor {n!r}'s {kind} blocks: {e}") from None
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise LoadError(f"{source}: cannot dequantize tensor {n!r} ({t.tensor_type.name}): {e}") from None
        arr = np.asarray(arr, np.float32)
        if np.may_share_memory(arr, t.data):  # an f32 tensor, a view of the file's mapping: copy it, or
            arr = arr.copy()  # the model keeps the whole mapped file resident (93 MB for SmolLM2's)
        return arr.reshape(shape_of(n))

    def transform(n, arr):
        if isinstance(arr, gguf_blocks.Blocks):  # rows reordered like a dense tensor's, then the model's form
            if permute and (n.endswith("attn_q.weight") or n.endswith("attn_k.weight")):
                heads = cfg.num_heads if n.endswith("attn_q.weight") else cfg.num_kv_heads
                arr = arr.rows(unpermute_qk(np.arange(arr.shape[0]), heads))
            try:
                return from_blocks(arr, name=n)
            except QuantizeError as e:
                raise LoadError(f"{source}: tensor {n!r}: {e}") from None
        if cfg.norm_offset and n.endswith("norm.weight"):
            return arr - cfg.norm_offset  # llama.cpp's converter stores Gemma's (1 + w); the model adds the 1
        if permute and n.endswith("attn_q.weight"):
            return unpermute_qk(arr, cfg.num_heads)
        if permute and n.endswith("attn_k.weight"):
            return unpermute_qk(arr, cfg.num_kv_heads)
        return arr

    table = GGUF_TABLE + (GEMMA3_GGUF_NORMS if cfg.sandwich_norms else ())
    if cfg.num_experts:
        table = tuple(e for e in table if not e[0].startswith("blk.{i}.ffn_") or e[0] == "blk.{i}.ffn_norm.weight")
        table += GGUF_EXPERTS
    model = assemble(cfg, table, list(tensors), read, shape_of, source, GGUF_IGNORED, transform, dtype)
    if keep_blocks:
        model.quantization = ("gguf", None, True)
    tok = gguf_tokenizer(reader, source) if tokenizer else None
    return Target(model=model, tokenizer=tok, name=name or path.stem, source=source)
