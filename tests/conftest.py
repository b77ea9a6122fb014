"""Test-wide set-up: one persistent XLA compilation cache for this process and every subprocess it starts,
session-scoped fixtures so the real SmolLM2-135M-Instruct target is loaded once per run, and a guard
that frees compiled code before a long-lived worker runs out of memory mappings.

Builders (tiny random models, prompts, GGUF writers) live in `builders.py`; test modules import from
there, never from each other.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Before anything imports jax: the environment reaches the CLI and server subprocesses too, so a
# command test reuses what the in-process tests (or an earlier command) compiled.
XLA_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".test-cache" / "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Under pytest-xdist each worker gets its share of the cores for OpenMP (torch's reference models): two
# workers of two threads each on two cores made the transformers comparisons 1.7x slower than one each.
# XLA's own thread pool is not OpenMP and is left alone.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402

import builders  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Real-model tests are `slow` wherever they sit: a test that asks for the SmolLM2 fixtures is marked,
    so `-m "not slow"` is the quick loop without relying on each module remembering the marker. Under
    pytest-xdist (`-n 2 --dist loadgroup`, as CI runs) those tests share one worker, so the model is
    still loaded once."""
    for item in items:
        if {"smollm2", "shipped_head"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("smollm2"))


@pytest.fixture(autouse=True)
def _release_compiled_code():
    """Frees compiled executables when this worker nears the kernel's limit on memory mappings
    (`builders.release_compiled_code`)."""
    yield
    builders.release_compiled_code()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (f32 on CPU), loaded once for the whole run."""
    import eagle_jax

    return eagle_jax.load_target("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def shipped_head(smollm2):
    """The shipped EAGLE-3 head for SmolLM2-135M-Instruct."""
    from eagle_jax.loader import resolve_draft

    return resolve_draft("default", smollm2)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """Directory of a tiny random Llama with a character tokenizer and chat template (for CLI tests)."""
    return str(builders.write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "tiny-chat"))


@pytest.fixture(scope="session")
def xla_cache() -> str:
    """The compilation cache directory this run shares; pass it to servers as --compile-cache."""
    return XLA_CACHE


@pytest.fixture
def tiny_hf():
    """Factory: tiny_hf(arch='llama', seed=0, **config_overrides) -> torch model."""
    return builders.make_tiny_hf


@pytest.fixture
def gguf_writer():
    """write_llama_gguf(model, path, *, vocab_size_key=True)."""
    return builders.write_llama_gguf


@pytest.fixture
def tiny_llama_dir(tmp_path):
    """A saved tiny random Llama: (torch model, directory with config.json + model.safetensors)."""
    model = builders.make_tiny_hf("llama")
    directory = tmp_path / "tiny-llama"
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture
def tiny_llama_gguf(tmp_path):
    """A tiny random Llama written as F32 GGUF: (torch model, path to the .gguf file)."""
    model = builders.make_tiny_hf("llama")
    path = tmp_path / "tiny-llama.gguf"
    builders.write_llama_gguf(model, path)
    return model, path
