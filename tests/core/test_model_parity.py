"""Round trip against transformers: tiny random models saved by HF, loaded here, logits equal at 1e-4.

Covers every switch the config knows (biases, q/k norms, explicit head_dim, tied embeddings, llama3
rope), both config.json rope layouts, sharded safetensors, and llama.cpp-style GGUF files.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import eagle_jax
from eagle_jax.config import ModelConfig

TOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so positions of a short test sequence land in all three llama3 frequency bands.
    "original_max_position_embeddings": 64,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
GEMMA3 = {"head_dim": 16, "query_pre_attn_scalar": 24, "num_hidden_layers": 3, "sliding_window": 16,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}


def tokens(batch=2, length=72, vocab=256, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int32)


def hf_logits(model, toks):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()


def eagle_logits(target, toks):
    """Logits [B, T, V] from one prefill of `toks` into a fresh cache."""
    import jax.numpy as jnp

    cache = target.model.init_cache(*toks.shape)
    return np.asarray(target.model(jnp.asarray(toks, jnp.int32), cache).logits)


def rel_err(ours, theirs):
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def load(path):
    import jax.numpy as jnp

    return eagle_jax.load_target(str(path), dtype=jnp.float32, tokenizer=False)


CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE, "num_hidden_layers": 3}),
    "llama-linear-rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen3-explicit-head-dim": ("qwen3", {"head_dim": 24}),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    "mistral": ("mistral", {}),
    "llama-tied-embeddings": ("llama", {"tie_word_embeddings": True}),
    # Gemma 3: (1 + w) norms, four norms a layer, GeGLU, scaled embeddings, its own attention scale (24, not
    # head_dim 16), and sliding-window layers with a rope base and a window (16 keys, shorter than the
    # 72-token test sequence) of their own.
    "gemma3": ("gemma3_text", GEMMA3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tiny_hf, tmp_path):
    arch, overrides = CASES[case]
    model = tiny_hf(arch, **overrides)
    model.save_pretrained(tmp_path)
    target = load(tmp_path)

    cfg = target.cfg
    assert cfg.arch == arch
    hf = model.config
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.tie_embeddings == bool(model.config.tie_word_embeddings)
    toks = tokens()
    assert rel_err(eagle_logits(target, toks), hf_logits(model, toks)) <= TOL


def test_checkpoint_parameters_are_not_trivial(tiny_hf, tmp_path):
    # Guards the parity tests: all-ones norms or zero biases would hide a dropped parameter.
    model = tiny_hf("qwen2")
    model.save_pretrained(tmp_path)
    for layer in load(tmp_path).model.layers:
        for name in ("attn_norm", "mlp_norm"):
            assert np.abs(np.asarray(getattr(layer, name)[...]) - 1).min() > 0
        for name in ("bq", "bk", "bv"):
            assert np.abs(np.asarray(getattr(layer, name)[...])).max() > 0.1


def test_llama3_rope_scaling_changes_the_logits(tiny_hf):
    # The llama3 case above would pass vacuously if the test sequence were too short for scaling to act.
    import transformers

    scaled = tiny_hf("llama", rope_parameters=LLAMA3_ROPE)
    plain_cfg = transformers.LlamaConfig(**{**scaled.config.to_dict(), "rope_parameters": {"rope_theta": 10000.0,
                                                                                       "rope_type": "default"}})
    plain = transformers.LlamaForCausalLM(plain_cfg).eval()
    plain.load_state_dict(scaled.state_dict())
    toks = tokens()
    assert rel_err(hf_logits(plain, toks), hf_logits(scaled, toks)) > 1e-2


def test_transformers5_writes_rope_parameters(tiny_hf, tmp_path):
    tiny_hf("llama", rope_parameters=LLAMA3_ROPE).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "llama3"
    assert saved["rope_parameters"]["rope_theta"] == 10000.0
    assert "rope_theta" not in saved and not saved.get("rope_scaling")


def to_legacy_rope_layout(directory):
    """Rewrites config.json into the transformers < 5 layout: top-level rope_theta + rope_scaling."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
    path.write_text(json.dumps(cfg, indent=2))
    return cfg


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default-rope", "llama3-rope"])
def test_legacy_rope_layout_loads_identically(rope, tiny_hf, tmp_path):
    import transformers

    model = tiny_hf("llama", **({"rope_parameters": rope} if rope else {}))
    new_dir, old_dir = tmp_path / "v5", tmp_path / "v4"
    model.save_pretrained(new_dir)
    model.save_pretrained(old_dir)
    legacy = to_legacy_rope_layout(old_dir)
    assert "rope_parameters" not in legacy and "rope_theta" in legacy

    new, old = load(new_dir), load(old_dir)
    assert old.cfg == new.cfg
    toks = tokens()
    ours = eagle_logits(old, toks)
    np.testing.assert_array_equal(ours, eagle_logits(new, toks))
    # transformers itself reads the rewritten file the same way, so the rewrite is faithful.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(old_dir, dtype="float32").eval()
    assert rel_err(ours, hf_logits(reloaded, toks)) <= TOL


def test_legacy_rope_scaling_spellings():
    base = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    legacy = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    new = ModelConfig.from_hf({**base, "rope_parameters": LLAMA3_ROPE})
    old = ModelConfig.from_hf({**base, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", **legacy}})
    # Configs from transformers 4.4x spell the key "type".
    older = ModelConfig.from_hf({**base, "rope_theta": 10000.0, "rope_scaling": {"type": "llama3", **legacy}})
    assert new.rope == old.rope == older.rope
    assert new.rope.kind == "llama3" and new.rope.original_max_position == 64


def test_sharded_checkpoint_matches(tiny_hf, tmp_path):
    model = tiny_hf("llama")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    toks = tokens()
    assert rel_err(eagle_logits(load(tmp_path), toks), hf_logits(model, toks)) <= TOL


@pytest.mark.parametrize(
    "overrides",
    [{}, {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}],
    ids=["llama", "llama3-rope-freqs-tied"],
)
def test_gguf_logits_match_transformers(overrides, tiny_hf, gguf_writer, tmp_path):
    model = tiny_hf("llama", **overrides)
    path = tmp_path / "tiny.gguf"
    gguf_writer(model, path)
    target = load(path)

    assert target.tokenizer is None
    assert target.cfg.tie_embeddings == bool(model.config.tie_word_embeddings)
    assert (target.cfg.rope.freq_factors is not None) == ("rope_parameters" in overrides)
    toks = tokens()
    assert rel_err(eagle_logits(target, toks), hf_logits(model, toks)) <= TOL


def test_gguf_q_k_unpermute_inverts_llama_cpp_permute():
    from eagle_jax.gguf_file import unpermute_qk

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)  # 8 heads of head_dim 16
    permuted = w.reshape(8, 2, 8, 3).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, 8), w)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_bias_switches_follow_transformers(arch, attention_bias, tiny_hf):
    # Which projections carry a bias is decided per architecture by transformers' modeling code, not
    # by config.json alone (Qwen2 always biases q/k/v, Mistral ignores attention_bias).
    model = tiny_hf(arch, attention_bias=attention_bias, num_hidden_layers=1)
    names = set(model.state_dict())
    cfg = ModelConfig.from_hf(json.loads(model.config.to_json_string()))
    assert cfg.qkv_bias == ("model.layers.0.self_attn.q_proj.bias" in names)
    assert cfg.o_bias == ("model.layers.0.self_attn.o_proj.bias" in names)


def test_gemma3_config_fields_and_both_rope_layouts(tiny_hf, tmp_path):
    """The Gemma 3 switches land in the config; the transformers < 5 layout (rope_theta +
    rope_local_base_freq) loads the same model; the sliding layers' own rope base matters."""
    model = tiny_hf("gemma3_text", **GEMMA3)
    new_dir, old_dir = tmp_path / "v5", tmp_path / "v4"
    model.save_pretrained(new_dir)
    model.save_pretrained(old_dir)
    cfg_json = json.loads((old_dir / "config.json").read_text())
    ropes = cfg_json.pop("rope_parameters")
    cfg_json.update(rope_theta=ropes["full_attention"]["rope_theta"],
                    rope_local_base_freq=ropes["sliding_attention"]["rope_theta"], rope_scaling=None)
    (old_dir / "config.json").write_text(json.dumps(cfg_json))
    new, old = load(new_dir), load(old_dir)
    assert new.cfg == old.cfg
    cfg = new.cfg
    assert (cfg.norm_offset, cfg.activation, cfg.sandwich_norms, cfg.qk_norm) == (1.0, "gelu_tanh", True, True)
    assert cfg.embed_scale == pytest.approx(64 ** 0.5) and cfg.query_scale == pytest.approx(24 ** -0.5)
    assert cfg.rope.theta == 1_000_000.0 and cfg.local_rope.theta == 100.0 and cfg.sliding_window == 16
    assert cfg.max_position == model.config.max_position_embeddings  # the window does not cap the context
    assert cfg.layer_rope(0) == cfg.local_rope and cfg.layer_rope(1) == cfg.rope
    toks = tokens()
    assert rel_err(eagle_logits(old, toks), hf_logits(model, toks)) <= TOL
    # The same weights with one rope base for every layer: the logits move, so the test above pins the
    # sliding layers' base.
    from flax import nnx

    from eagle_jax.model import from_arrays

    arrays = {tuple(str(p) for p in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(new.model))}
    one_rope = eagle_jax.Target(model=from_arrays(dataclasses.replace(cfg, local_rope=cfg.rope), arrays),
                                tokenizer=None, name="one-rope", source="test")
    assert rel_err(eagle_logits(one_rope, toks), hf_logits(model, toks)) > 1e-3
    # ...and with a window that holds the whole sequence (dense attention): they move too, so the window is pinned.
    dense = eagle_jax.Target(model=from_arrays(dataclasses.replace(cfg, sliding_window=128), arrays),
                             tokenizer=None, name="dense", source="test")
    assert rel_err(eagle_logits(dense, toks), hf_logits(model, toks)) > 1e-3
