"""Weight-only quantization (`eagle_jax.quant`): the schemes' error bounds, the dequantizing product, the
quantized embedding lookup, GGUF blocks kept exactly as the file holds them, a quantized target's size,
and speculation that stays lossless with respect to the quantized target."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle_jax
from builders import SMALL_VOCAB, TINY, make_tiny_hf, tiny_target, two_sample_p, write_llama_gguf
from eagle_jax import gguf_blocks, quant
from eagle_jax.draft import random_head

RNG = np.random.default_rng(0)
W = RNG.normal(size=(128, 96)).astype(np.float32) * 0.05
X = RNG.normal(size=(3, 5, 128)).astype(np.float32)


DENSE_SCHEMES = ("int8", "fp8", "int4")


@pytest.mark.parametrize("scheme", DENSE_SCHEMES)
def test_dequantized_weights_are_within_the_schemes_error_bound(scheme):
    q = quant.quantize(W, scheme, group=32)
    err = np.abs(np.asarray(quant.dequantize(q)) - W)
    if scheme == "int8":  # half a step of amax / 127 per column
        bound = np.abs(W).max(axis=0) / 127 / 2
    elif scheme == "fp8":  # e4m3: 3 mantissa bits, relative 2^-4 (and the subnormal step near 0)
        bound = np.abs(W) * 2.0 ** -4 + np.abs(W).max(axis=0) / 448 * 2.0 ** -9
    else:  # half a step of (max - min) / 15 per group of 32 rows (scale and minimum rounded to float16)
        g = W.reshape(4, 32, 96)
        bound = np.repeat((g.max(axis=1) - g.min(axis=1)) / 15 / 2, 32, axis=0) + 2.0 ** -10 * np.abs(W).max()
        assert q.scale.dtype == q.bias.dtype == jnp.float16 and q.values.shape == (64, 96)
    assert np.all(err <= bound * 1.001 + 1e-7)
    assert err.max() > 0  # it did quantize


@pytest.mark.parametrize("scheme", DENSE_SCHEMES)
def test_the_dequantizing_product_and_lookup_equal_the_dequantized_matrix(scheme):
    q = quant.quantize(W, scheme, group=32)
    dense = np.asarray(quant.dequantize(q))
    np.testing.assert_allclose(np.asarray(quant.matmul(jnp.asarray(X), q)), X @ dense, rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([[3, 95], [0, 3]])
    np.testing.assert_array_equal(np.asarray(quant.take_columns(q, ids, jnp.float32)), dense.T[np.asarray(ids)])


F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208]}  # byte offsets of each block's float16 scales / minimums


def _random_blocks(kind: str, rows: int, k: int):
    """Random bytes in `kind`'s block layout (every bit pattern of the codes and 6-bit scales is valid),
    with finite float16 scales: [rows, bytes a row]."""
    per, size = gguf_blocks.LAYOUT[kind]
    raw = RNG.integers(0, 256, size=(rows * k // per, size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        raw[:, at:at + 2] = (RNG.normal(size=(len(raw), 1)) * 0.02).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(gguf_blocks.LAYOUT))
def test_gguf_blocks_are_kept_exactly_and_multiply_like_the_dequantized_matrix(kind):
    import gguf

    rows, k = 48, 512
    raw = _random_blocks(kind, rows, k)
    file_matrix = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(rows, k)  # [N, K]
    q = quant.from_blocks(gguf_blocks.decode(raw, kind, k), name="t")
    assert q.scheme == ("int4" if kind in gguf_blocks.FOUR_BIT else "int8") and q.shape == (k, rows)
    assert q.groups == k // (16 if kind == "Q6_K" else 32)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(q)), file_matrix.T)  # bit for bit
    x = RNG.normal(size=(2, 3, k)).astype(np.float32)
    want = x @ file_matrix.T.astype(np.float64)
    np.testing.assert_allclose(np.asarray(quant.matmul(jnp.asarray(x), q)), want, rtol=1e-4,
                               atol=1e-5 * np.abs(want).max())
    ids = jnp.asarray([[3, 47], [0, 3]])
    np.testing.assert_array_equal(np.asarray(quant.take_columns(q, ids, jnp.float32)), file_matrix[np.asarray(ids)])
    with pytest.raises(ValueError, match=f"{kind} rows of {k + 256} values need"):
        gguf_blocks.decode(raw, kind, k + 256)


GGUF_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q5_1", "ffn_": "Q8_0",
              "token_embd": "Q8_0", "output.weight": "Q4_1"}  # (first match: attn_output is Q5_1)


def test_a_gguf_target_loads_with_its_blocks_kept_and_speculation_equals_its_plain_decoding(tmp_path):
    from eagle_jax.loader import LoadError

    path = tmp_path / "blocks.gguf"
    write_llama_gguf(make_tiny_hf("llama", num_hidden_layers=4), path, block_types=GGUF_TYPES)
    dense = eagle_jax.load_target(str(path), tokenizer=False)
    kept = eagle_jax.load_target(str(path), tokenizer=False, quantize="gguf")
    assert kept.model.quantization == ("gguf", None, True)
    for i, layer in enumerate(kept.model.layers):
        for name in quant.MATRICES:
            w = getattr(layer, name)[...]
            assert isinstance(w, quant.QuantizedWeight), (i, name)
            np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), np.asarray(getattr(dense.model.layers[i], name)[...]))
    assert kept.model.layers[0].wq[...].scheme == "int4" and kept.model.layers[0].wv[...].scheme == "int8"
    np.testing.assert_array_equal(np.asarray(quant.dequantize(kept.model.embed[...])).T, np.asarray(dense.model.embed[...]))
    assert kept.model.lm_head[...].scheme == "int4"  # untied: the file's output.weight, kept too
    np.testing.assert_array_equal(np.asarray(quant.dequantize(kept.model.lm_head[...])), np.asarray(dense.model.lm_head[...]))
    assert quant.weight_bytes(nnx.state(kept.model)) < 0.35 * quant.weight_bytes(nnx.state(dense.model))
    ids = jnp.asarray([[5, 9, 11, 200, 3]], jnp.int32)
    logits = lambda t: np.asarray(t.model(ids, t.model.init_cache(1, 16)).logits)
    np.testing.assert_allclose(logits(kept), logits(dense), rtol=1e-4, atol=1e-4 * np.abs(logits(dense)).max())
    prompts = [[5, 9, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
    plain = eagle_jax.generate(kept, prompts, max_new_tokens=12, ignore_eos=True)
    spec = eagle_jax.generate(kept, prompts, random_head(kept.cfg, "eagle3", seed=1), tree="3,2,6",
                              max_new_tokens=12, ignore_eos=True)
    assert spec.token_ids == plain.token_ids and plain.stats["quantization"] == "gguf"
    with pytest.raises(quant.QuantizeError, match="keeps a GGUF file's blocks as it loads"):
        quant.quantize_model(dense.model, "gguf")
    # A damaged block row names the tensor.
    with pytest.raises(LoadError, match="blk.0.attn_q.weight"):
        from eagle_jax.gguf_file import load_gguf
        import unittest.mock as mock

        with mock.patch.object(gguf_blocks, "LAYOUT", {**gguf_blocks.LAYOUT, "Q4_0": (32, 17)}):
            load_gguf(path, tokenizer=False, keep_blocks=True)


def test_bad_settings_name_the_problem():
    with pytest.raises(quant.QuantizeError, match="one of"):
        quant.quantize(W, "int3")
    with pytest.raises(quant.QuantizeError, match=r"int4 groups of 48 rows do not divide wq's 128 rows"):
        quant.quantize(W, "int4", group=48, name="wq")


CFG = dataclasses.replace(TINY, hidden_size=64, head_dim=16, intermediate_size=128, num_layers=4, tie_embeddings=True)


@pytest.mark.parametrize("scheme, ratio", [("int8", 0.30), ("fp8", 0.30), ("int4", 0.20)])
def test_a_quantized_target_is_small_and_speculation_equals_its_own_plain_decoding(scheme, ratio):
    full = tiny_target(CFG)
    target = tiny_target(CFG)
    quant.quantize_model(target.model, scheme, group=32)
    assert quant.weight_bytes(nnx.state(target.model)) <= ratio * quant.weight_bytes(nnx.state(full.model))
    prompts = [[5, 9, 11], [3, 1, 4, 1, 5, 9, 2, 6], [42]]
    plain = eagle_jax.generate(target, prompts, max_new_tokens=16, ignore_eos=True)
    for kind, tree in (("eagle3", "4,4,16"), ("eagle1", "3,2,6")):
        spec = eagle_jax.generate(target, prompts, random_head(CFG, kind, seed=1), tree=tree, max_new_tokens=16,
                                  ignore_eos=True)
        assert spec.token_ids == plain.token_ids, kind
    assert plain.stats["quantization"] == scheme
    assert plain.stats["weight_bytes"] == quant.weight_bytes(nnx.state(target.model))
    reference = eagle_jax.generate(full, prompts, max_new_tokens=16, ignore_eos=True).token_ids
    assert reference[0][:2] == plain.token_ids[0][:2]  # close to the full-precision model at first


@pytest.mark.slow
def test_sampled_speculation_over_an_int4_target_matches_its_plain_sampling():
    """Temperature 1: the first two tokens of 8192 samples, speculative (EAGLE-1 head, a 2,3,7 tree) against
    the quantized target's own plain sampling, by chi-square over the 12 x 12 pairs."""
    target = tiny_target(SMALL_VOCAB, seed=4)
    target.model.embed[...] = target.model.embed[...] * (15 / 25)  # a few nats of spread: not one-hot
    quant.quantize_model(target.model, "int4", group=16)

    def first_two(head, tree=None):
        r = eagle_jax.generate(target, [[3, 1, 4]] * 8192, draft=head, tree=tree, max_new_tokens=2,
                               temperature=1.0, seed=0, ignore_eos=True)
        return [tuple(t[:2]) for t in r.token_ids]

    plain, spec = first_two(None), first_two(random_head(SMALL_VOCAB, "eagle1", seed=2), "2,3,7")
    assert len(set(plain)) > 20  # sampling, not a near-greedy single answer
    assert two_sample_p(plain, spec, 12) > 0.01


def test_a_quantized_target_has_cost_profiles_of_its_own():
    from eagle_jax.profiles import profile_key

    full, q8, q4 = tiny_target(CFG), tiny_target(CFG), tiny_target(CFG)
    quant.quantize_model(q8.model, "int8")
    quant.quantize_model(q4.model, "int4", group=32)
    keys = {profile_key(t, None, [1], ["off"], 64) for t in (full, q8, q4)}
    assert len(keys) == 3
    with pytest.raises(quant.QuantizeError, match="already quantized"):
        quant.quantize_model(q8.model, "int4")


def test_quantize_on_load_and_on_the_command_line(tiny_chat_model):
    with pytest.raises(quant.QuantizeError, match="is not a .gguf file"):
        eagle_jax.load_target(tiny_chat_model, quantize="gguf")
    with pytest.raises(quant.QuantizeError, match="cannot be sharded"):
        eagle_jax.load_target(tiny_chat_model, quantize="int8", tensor_parallel=2)
    with pytest.raises(quant.QuantizeError, match="quantize must be one of"):
        eagle_jax.load_target(tiny_chat_model, quantize="int2")
    target = eagle_jax.load_target(tiny_chat_model, quantize="int8")
    assert target.model.quantization[0] == "int8"
    assert isinstance(target.model.layers[0].wq[...], quant.QuantizedWeight)
    cmd = [sys.executable, "-m", "eagle_jax.generate", "--model", tiny_chat_model, "--prompt", "Hello there",
           "--max-new-tokens", "8", "--json", "--quantize", "int8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout)["stats"]
    assert stats["quantization"] == "int8" and 0 < stats["weight_bytes"]
    ours = eagle_jax.generate(target, [[{"role": "user", "content": "Hello there"}]], max_new_tokens=8)
    assert json.loads(out.stdout)["token_ids"] == ours.token_ids


def test_smollm2_with_its_gguf_blocks_kept_holds_the_file_s_weights_in_the_file_s_size(smollm2):
    """The built-in SmolLM2 file (Q4_1 matrices, a Q8_0 embedding) loaded with quantize="gguf": every matrix
    dequantizes bit for bit to what the full-precision load holds, in about the file's bytes, and the
    shipped head's speculation equals the kept model's own plain decoding."""
    from eagle_jax.loader import builtin_path, resolve_draft

    kept = eagle_jax.load_target("smollm2-135m-instruct", quantize="gguf")
    for i in (0, 17, 29):
        for name in quant.MATRICES:
            w = getattr(kept.model.layers[i], name)[...]
            assert w.scheme == "int4" and w.groups == w.shape[0] // 32, (i, name)
            np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), np.asarray(getattr(smollm2.model.layers[i], name)[...]))
    assert kept.model.embed[...].scheme == "int8"
    np.testing.assert_array_equal(np.asarray(quant.dequantize(kept.model.embed[...])).T, np.asarray(smollm2.model.embed[...]))
    size = quant.weight_bytes(nnx.state(kept.model))
    assert size <= 0.2 * quant.weight_bytes(nnx.state(smollm2.model))
    assert size <= builtin_path("smollm2-135m-instruct").stat().st_size
    # One prompt, 12 tokens: a quantized step is slow on XLA:CPU (it converts every matrix to f32 per step).
    prompts = ["What is the capital of France?"]
    plain = eagle_jax.generate(kept, prompts, max_new_tokens=12)
    spec = eagle_jax.generate(kept, prompts, resolve_draft("default", kept), tree="3,4,8", max_new_tokens=12)
    assert spec.token_ids == plain.token_ids and "Paris" in plain.texts[0]
    assert spec.stats["tau"] > 1.3 and plain.stats["weight_bytes"] == size


def test_the_hlo_check_finds_every_full_precision_weight_copy(tmp_path):
    """The README's `benchmarks/quantized_hlo.py` on one layer of SmolLM2's shapes: full precision writes no
    copy of a weight; a quantized step on XLA:CPU writes one f32 copy of each quantized matrix (the 7 of the
    layer and the embedding), the copies the README's table reports. On a GPU or TPU, the check under test
    is that the dequantization fuses into the dots: no copy."""
    import jax

    from doc_commands import doc_command, run

    out = tmp_path / "hlo.json"
    run(doc_command("python benchmarks/quantized_hlo.py"), "--layers", "1", "--tokens", "1", "--reps", "1",
        "--schemes", "none,int8,int4", "--json", str(out))
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["none"]["copies"] == 0 and rows["none"]["copy_bytes"] == 0
    matrices = 576 * (576 * 2 + 192 * 2 + 1536 * 3) + 49152 * 576
    for scheme in ("int8", "int4"):
        assert rows[scheme]["weight_bytes"] < 0.3 * rows["none"]["weight_bytes"]
        if jax.default_backend() == "cpu":
            assert rows[scheme]["copies"] == 8, rows[scheme]["copy_lines"]
            assert rows[scheme]["copy_bytes"] == 4 * matrices
            assert all("convert" in line for line in rows[scheme]["copy_lines"])
        else:
            assert rows[scheme]["copies"] == 0, rows[scheme]["copy_lines"]
