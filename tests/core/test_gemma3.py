"""Gemma 3 text models through the engine: plain greedy decoding equals transformers' and speculative
greedy output equals plain decoding, past the sliding window (tiny random configs; the prefill logits'
parity with transformers is test_model_parity.py's)."""

from __future__ import annotations

import pytest

import eagle_jax
from eagle_jax.draft import random_head

# An 8-key window: prompts and outputs run well past it, in decode and in tree verification.
GEMMA3 = {"head_dim": 16, "query_pre_attn_scalar": 24, "num_hidden_layers": 4, "sliding_window": 8,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]}


@pytest.mark.parametrize("kind, tree", [("eagle1", "3,2,6"), ("eagle3", "4,4,16")])
def test_speculative_greedy_equals_plain_on_gemma3(kind, tree, tiny_hf, tmp_path):
    import jax.numpy as jnp

    tiny_hf("gemma3_text", **GEMMA3).save_pretrained(tmp_path)
    target = eagle_jax.load_target(str(tmp_path), dtype=jnp.float32, tokenizer=False)
    assert target.cfg.arch == "gemma3_text" and target.cfg.sliding_window == 8
    head = random_head(target.cfg, kind, seed=1)
    prompts = [[5, 9, 11, 200], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [42]]
    plain = eagle_jax.generate(target, prompts, max_new_tokens=24, ignore_eos=True)
    spec = eagle_jax.generate(target, prompts, head, tree=tree, max_new_tokens=24, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert len(set(map(tuple, plain.token_ids))) == 3  # the rows differ: the check is not vacuous


def test_a_tree_verify_step_past_the_window_matches_transformers_on_every_path(tiny_hf, tmp_path):
    import jax.numpy as jnp

    from builders import tree_verify_vs_hf

    model = tiny_hf("gemma3_text", **GEMMA3)
    model.save_pretrained(tmp_path)
    target = eagle_jax.load_target(str(tmp_path), dtype=jnp.float32, tokenizer=False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # 12 tokens before the tree: the 8-key window cuts into them
    assert tree_verify_vs_hf(target, model, prompt) < 1e-4


def test_plain_greedy_decoding_equals_transformers_past_the_window(tiny_hf, tmp_path):
    import jax.numpy as jnp
    import torch

    model = tiny_hf("gemma3_text", **GEMMA3)
    model.save_pretrained(tmp_path)
    target = eagle_jax.load_target(str(tmp_path), dtype=jnp.float32, tokenizer=False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
    ours = eagle_jax.generate(target, [prompt], max_new_tokens=20, ignore_eos=True)
    assert ours.token_ids[0] == theirs[0, len(prompt):].tolist()


def test_generate_cli_with_a_random_head_on_gemma3_equals_plain(tiny_hf, tmp_path):
    """The CLI on a Gemma 3 directory with a tokenizer: `--draft random` gives plain decoding's text."""
    from builders import cli_texts_plain_and_random_head, write_tiny_chat_model

    model_dir = write_tiny_chat_model(tmp_path / "gemma")  # its character tokenizer and chat template...
    tiny_hf("gemma3_text", vocab_size=97, eos_token_id=2, bos_token_id=0, pad_token_id=0,
            **{**GEMMA3, "num_hidden_layers": 6, "layer_types": None}).save_pretrained(model_dir)  # ...a Gemma 3
    outs = cli_texts_plain_and_random_head(model_dir)
    assert outs[0]["model"] == "gemma" and len(outs[0]["token_ids"][0]) > 0
    assert outs[1]["token_ids"] == outs[0]["token_ids"] and outs[1]["texts"] == outs[0]["texts"]
