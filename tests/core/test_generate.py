"""`python -m eagle_jax.generate` as a user runs it."""

import json
import subprocess
import sys

import pytest

import eagle_jax
from eagle_jax.generate import main
from builders import run_main


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "eagle_jax.generate", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # a fresh interpreter: `python -m` must not warn that the module was already imported
def test_help_documents_every_flag():
    out = _run("--help")
    assert out.returncode == 0
    for flag in ("--model", "--prompt", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                 "--stop", "--no-chat", "--json", "--draft", "--tree", "--candidates"):
        assert flag in out.stdout
    assert "RuntimeWarning" not in out.stderr


def test_missing_model_is_a_clear_error_not_a_traceback(tmp_path):
    out = run_main(main, "--model", tmp_path / "nope.gguf", "--prompt", "hi")
    assert out.returncode == 2
    assert "nope.gguf" in out.stderr and "Traceback" not in out.stderr


def test_module_stays_callable_after_importing_the_cli_module():
    import eagle_jax.generate  # noqa: F401  (binds the submodule; the API must keep working)

    assert callable(eagle_jax.generate)


@pytest.fixture(scope="module")
def tiny_chat(tiny_chat_model):
    """The tiny chat model as the library loads it: the reference the CLI's output must equal."""
    return eagle_jax.load_target(tiny_chat_model)


# The CLI on a tiny random chat model: its flags, output and speculation paths are the point here. The
# documented commands on the real SmolLM2 target are test_docs.py's test_generate_commands.
@pytest.mark.slow
def test_json_output_equals_the_library_result(tiny_chat_model, tiny_chat):
    out = _run("--model", tiny_chat_model, "--prompt", "Name three colors.", "--max-new-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    ref = eagle_jax.generate(tiny_chat, "Name three colors.", max_new_tokens=12)
    assert data["token_ids"] == ref.token_ids and len(ref.token_ids[0]) > 0
    assert data["texts"] == ref.texts
    assert data["stats"]["generated_tokens"] == len(ref.token_ids[0])
    assert data["model"] == "tiny-chat"


@pytest.mark.slow
def test_random_draft_from_the_cli_keeps_the_greedy_text(tmp_path, tiny_chat_model, tiny_chat, monkeypatch):
    # The CLI's main in this process (its subprocess path is test_json_output_equals_the_library_result's).
    plain = eagle_jax.generate(tiny_chat, "Name three colors.", max_new_tokens=12)
    args = ("--model", tiny_chat_model, "--prompt", "Name three colors.", "--max-new-tokens", "12", "--json",
            "--draft", "random")
    out = run_main(main, *args, "--tree", "3,2,6")
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)
    assert spec["token_ids"] == plain.token_ids and spec["texts"] == plain.texts
    assert sum(spec["stats"]["accept_histogram"]) == len(spec["stats"]["accepted_per_step"])
    # --tree auto: the harness measures this device's step costs (into EAGLE_JAX_CACHE) and picks per step,
    # here between plain steps and the tree above (--candidates; the default ones are the engine tests').
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    out = run_main(main, *args, "--tree", "auto", "--candidates", "3,2,6")
    assert out.returncode == 0, out.stderr
    auto = json.loads(out.stdout)
    assert auto["token_ids"] == plain.token_ids
    assert auto["stats"]["tree"] == "auto" and auto["stats"]["profile"] == "measured"
    assert set(auto["stats"]["choices"]) <= {"off", "3,2,6"}
    assert sum(auto["stats"]["choices"].values()) == auto["stats"]["steps"] - 1  # every step after the prefill
    assert list((tmp_path / "harness").glob("*.json"))  # the profile is cached for the next run


def test_bad_tree_flags_are_a_clear_error():
    out = run_main(main, "--model", "smollm2-135m-instruct", "--prompt", "hi", "--draft", "random", "--tree", "2,2,50")
    assert out.returncode == 2 and "tree_tokens" in out.stderr and "Traceback" not in out.stderr
    out = run_main(main, "--model", "smollm2-135m-instruct", "--prompt", "hi", "--draft", "random", "--tree", "d2k2n5")
    assert out.returncode == 2 and "DEPTH,TOPK,TOKENS" in out.stderr and "Traceback" not in out.stderr
    out = run_main(main, "--model", "smollm2-135m-instruct", "--prompt", "hi", "--draft", "random", "--tree", "3,4,8",
               "--candidates", "2,2,4")
    assert out.returncode == 2 and "--tree auto" in out.stderr and "Traceback" not in out.stderr
    out = run_main(main, "--model", "smollm2-135m-instruct", "--prompt", "hi", "--draft", "random", "--tree", "auto",
               "--candidates", "2,2,50")
    assert out.returncode == 2 and "tree_tokens" in out.stderr and "Traceback" not in out.stderr
