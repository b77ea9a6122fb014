"""Weight-only quantization (`eagle_jax.quant`): the schemes' error bounds, the dequantizing product, the
quantized embedding lookup, a quantized target's size, and speculation that stays lossless with respect
to the quantized target."""

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
from builders import TINY, tiny_target
from eagle_jax import quant
from eagle_jax.draft import random_head

RNG = np.random.default_rng(0)
W = RNG.normal(size=(128, 96)).astype(np.float32) * 0.05
X = RNG.normal(size=(3, 5, 128)).astype(np.float32)


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_dequantized_weights_are_within_the_schemes_error_bound(scheme):
    q = quant.quantize(W, scheme, group=32)
    err = np.abs(np.asarray(quant.dequantize(q)) - W)
    if scheme == "int8":  # half a step of amax / 127 per column
        bound = np.abs(W).max(axis=0) / 127 / 2
    elif scheme == "fp8":  # e4m3: 3 mantissa bits, relative 2^-4 (and the subnormal step near 0)
        bound = np.abs(W) * 2.0 ** -4 + np.abs(W).max(axis=0) / 448 * 2.0 ** -9
    else:  # half a step of (max - min) / 15 per group of 32 rows
        g = W.reshape(4, 32, 96)
        bound = np.repeat((g.max(axis=1) - g.min(axis=1)) / 15 / 2, 32, axis=0)
    assert np.all(err <= bound * 1.001 + 1e-7)
    assert err.max() > 0  # it did quantize


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_the_dequantizing_product_and_lookup_equal_the_dequantized_matrix(scheme):
    q = quant.quantize(W, scheme, group=32)
    dense = np.asarray(quant.dequantize(q))
    np.testing.assert_allclose(np.asarray(quant.matmul(jnp.asarray(X), q)), X @ dense, rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([[3, 95], [0, 3]])
    np.testing.assert_array_equal(np.asarray(quant.take_columns(q, ids, jnp.float32)), dense.T[np.asarray(ids)])


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
