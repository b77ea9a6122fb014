"""`python -m eagle_jax.bench`: datasets, the JSON report, errors."""

import json
import os
import subprocess
import sys

import pytest

from eagle_jax.bench import load_dataset, main
from builders import run_main

REQUIRED = {"dataset", "batch_size", "temperature", "prompts", "plain_tokens_per_s", "spec_tokens_per_s", "speedup",
            "tau", "accept_histogram", "greedy_identical"}


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "eagle_jax.bench", "--no-progress", *args], capture_output=True,
                          text=True, timeout=900, env=env)


def test_builtin_datasets_and_jsonl(tmp_path):
    mt, he = load_dataset("mt_bench"), load_dataset("humaneval")
    assert len(mt) == 80 and len(he) == 164
    assert he[0].startswith("\n\ndef has_close_elements") or "def " in he[0]
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"turns": ["b", "c"]}\n')
    assert load_dataset(str(f)) == ["a", "b"]
    f.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:1"):
        load_dataset(str(f))


def test_errors_are_clear(tmp_path):
    out = run_main(main, "--no-progress", "--dataset", str(tmp_path / "none.jsonl"))
    assert out.returncode == 2 and "none.jsonl" in out.stderr and "Traceback" not in out.stderr
    out = run_main(main, "--no-progress", "--tree", "2,2,50")
    assert out.returncode == 2 and "tree_tokens" in out.stderr
    out = run_main(main, "--no-progress", "--tree", "3,4,8", "--candidates", "2,2,4")
    assert out.returncode == 2 and "--candidates" in out.stderr and "--tree auto" in out.stderr
    out = run_main(main, "--no-progress", "--tree", "auto", "--candidates", "off")
    assert out.returncode == 2 and "no draft tree" in out.stderr


@pytest.mark.slow
def test_bench_reports_every_combination_and_checks_greedy_identity(tmp_path, tiny_chat_model):
    """On a tiny random chat model with an untrained head: the combinations, the report and the plot are
    the point (the README's bench command on the real target is test_docs.py's)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Name a fruit."}\n{"prompt": "Say hi."}\n{"prompt": "Count to three."}\n')
    out_json = tmp_path / "bench.json"
    # Two fixed trees; the real-model `--tree auto` run is the README bench command's test (test_docs.py).
    # On a mesh of two fake devices (the target split two ways): greedy identity is checked on it.
    out = _run("--model", tiny_chat_model, "--draft", "random", "--dataset", str(f), "--max-new-tokens", "8",
               "--batch-size", "1", "2", "--temperature", "0", "0.8", "--tree", "2,2,4", "3,1,3",
               "--json", str(out_json), "--plot", str(tmp_path / "b.png"), "--tensor-parallel", "2",
               env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2"))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["mesh"] == {"data": 1, "model": 2}
    assert report["trees"] == ["2,2,4", "3,1,3"]
    assert len(report["results"]) == 8  # batch sizes x temperatures x trees
    assert [r["tree"] for r in report["results"]] == ["2,2,4", "3,1,3"] * 4
    for a, b in zip(report["results"][::2], report["results"][1::2]):  # both against the same plain runs
        assert a["plain_tokens_per_s"] == b["plain_tokens_per_s"] and a["batch_size"] == b["batch_size"]
        assert "choices" not in a and "choices" not in b
    assert (tmp_path / "b.png").stat().st_size > 10_000
    for r in report["results"]:
        assert REQUIRED <= set(r)
        assert r["prompts"] == 3 and r["plain_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["plain_tokens_per_s"])
        assert r["greedy_identical"] is (True if r["temperature"] == 0 else None)
        assert r["tau"] >= 1.0 and sum(r["accept_histogram"]) > 0
    assert "speedup" in out.stdout and str(out_json) in out.stdout


@pytest.mark.slow  # heavy on a cold cache: CI runs it, the quick loop does not
def test_run_bench_with_the_auto_tree_reports_the_harness_choices(tmp_path, monkeypatch):
    from eagle_jax.bench import run_bench
    from builders import PROMPTS, oracle_pair

    import eagle_jax.engine as engine
    from eagle_jax import harness, steps
    from eagle_jax.rows import batch_shapes
    from builders import write_profile as _profile

    tgt, head = oracle_pair()

    # A cost profile where every tree is cheap (measuring one is test_engine_spec's job), in the cache
    # directory the bench's engine reads: the harness speculates, and each step's choice is counted.
    # Two candidates instead of the default ones: the same harness, fewer steps to compile.
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    candidates = ["3,1,4", "3,4,8"]
    trees = harness.candidate_trees(candidates)
    (tmp_path / "harness").mkdir()
    for prompt in PROMPTS[:2]:
        _, _, s_len = batch_shapes(tgt.cfg.max_position, [prompt], 12, slack=steps.tree_slack(trees))
        _profile(tmp_path / "harness", tgt, head, 1, s_len, None, lambda t: 0.01, candidates)
    monkeypatch.setattr(engine, "encode_prompts", lambda tok, prompts, chat: [list(p) for p in prompts])
    r = run_bench(tgt, head, PROMPTS[:2], batch_size=1, temperature=0.0, max_new_tokens=12, tree="auto", seed=0,
                  candidates=candidates)
    assert r["greedy_identical"] is True and sum(r["choices"].values()) > 0
    assert set(r["choices"]) <= set(candidates)  # trees only: a plain step costs as much as a tree here
    assert sum(r["accept_histogram"]) == sum(r["choices"].values())  # batch 1: one count per chosen step
    assert r["tau"] > 2  # the oracle head's drafts are accepted
