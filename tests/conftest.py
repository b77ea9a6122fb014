"""Shared tiny-model builders: random transformers models (torch, f32) and their GGUF twins.

Exposed as factory fixtures so test modules need no imports from here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def make_tiny_hf(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random `{arch}ForCausalLM` in eval mode, every parameter randomised.

    Norm weights are drawn around 1 and biases around 0 but never equal to them, so a loader that
    drops or misplaces a norm or a bias shows up in the logits.
    """
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: interleaves the two rotary halves.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(cfg) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: per-frequency divisors.
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_llama_gguf(model, path, *, vocab_size_key: bool = True) -> None:
    """Writes a transformers Llama as an F32 GGUF laid out like llama.cpp's converter output."""
    import gguf

    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if vocab_size_key:
        w.add_vocab_size(cfg.vocab_size)
    # add_tensor takes numpy-ordered arrays and writes GGUF's reversed (fastest-first) dims itself.
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight",
                     _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight",
                     _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_hf():
    """Factory: tiny_hf(arch='llama', seed=0, **config_overrides) -> torch model."""
    return make_tiny_hf


@pytest.fixture
def gguf_writer():
    """write_llama_gguf(model, path, *, vocab_size_key=True)."""
    return write_llama_gguf


@pytest.fixture
def tiny_llama_dir(tmp_path):
    """A saved tiny random Llama: (torch model, directory with config.json + model.safetensors)."""
    model = make_tiny_hf("llama")
    directory = tmp_path / "tiny-llama"
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture
def tiny_llama_gguf(tmp_path):
    """A tiny random Llama written as F32 GGUF: (torch model, path to the .gguf file)."""
    model = make_tiny_hf("llama")
    path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(model, path)
    return model, path
