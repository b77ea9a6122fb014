"""`python -m eagle_jax.serve`: settings, presets, the real SmolLM2 server, and the load-test script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_jax.serve import ConfigError, ServeConfig, create_app, load_preset
from eagle_jax.serve.__main__ import build_config, build_parser, main
from eagle_jax.tree import TreeConfig
from builders import run_main, tiny_target

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_preset_is_a_valid_config():
    cfg = ServeConfig(**load_preset(ROOT / "serve" / "smollm2-135m-instruct.toml"))
    assert cfg.model == "smollm2-135m-instruct" and cfg.draft == "auto" and cfg.host == "127.0.0.1"
    assert cfg.speculation_mode() == ("auto", None) and None in cfg.candidate_trees()


def test_flags_override_the_preset_and_bad_presets_name_the_key(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('port = 9000\nmax_batch = 8\nspeculation = "fixed:4,4,16"\ncandidates = ["off", "3,1,4"]\n')
    cfg = build_config(build_parser().parse_args(["--preset", str(preset), "--port", "9001", "--reprofile"]))
    assert (cfg.port, cfg.max_batch, cfg.reprofile, cfg.candidates) == (9001, 8, True, ("off", "3,1,4"))
    assert cfg.speculation_mode() == ("fixed", TreeConfig(4, 4, 16))
    defaults = build_config(build_parser().parse_args([]))
    assert defaults == ServeConfig() and defaults.host == "127.0.0.1" and defaults.api_key is None

    for text, words in [("max_batches = 3", "unknown key 'max_batches'"), ('port = "x"', "port must be of type int"),
                        ("speculation = \"fixed:4,4\"", "speculation"), ("candidates = [1]", "candidates"),
                        ("max_batch = 0", "max_batch must be >= 1"), ("port = [", "invalid TOML")]:
        preset.write_text(text + "\n")
        with pytest.raises(ConfigError, match=words):
            build_config(build_parser().parse_args(["--preset", str(preset)]))


def test_cli_reports_config_errors_with_exit_code_2(tmp_path, capsys):
    preset = tmp_path / "bad.toml"
    preset.write_text("colour = 'blue'\n")
    assert main(["--preset", str(preset)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "colour" in err
    assert main(["--speculation", "sometimes"]) == 2
    assert "speculation must be" in capsys.readouterr().err
    out = run_main(main, "--help")
    assert out.returncode == 0
    for flag in ("--preset", "--model", "--draft", "--host", "--port", "--api-key", "--max-batch", "--max-model-len",
                 "--speculation", "--reprofile"):
        assert flag in out.stdout


def test_settings_the_model_cannot_serve_are_errors():
    tiny = tiny_target()
    with pytest.raises(ConfigError, match="needs a draft head"):
        create_app(tiny, None, ServeConfig(speculation="fixed:4,4,16", warmup=False))
    with pytest.raises(ConfigError, match="context length"):
        create_app(tiny, None, ServeConfig(max_model_len=100_000, warmup=False))
    with pytest.raises(ConfigError, match="kv_cache_tokens must be >= 0"):
        ServeConfig(kv_cache_tokens=-1)


def test_the_kv_budget_defaults_to_eight_full_rows_of_blocks_or_shapes_contiguous_batch_buckets():
    tiny = tiny_target()
    sched = lambda **kw: create_app(tiny, None, ServeConfig(  # noqa: E731
        max_model_len=200, speculation="off", warmup=False, **kw)).state.api.scheduler
    lengths = lambda **kw: {b: n for b, (n, _) in sched(**kw).lengths.items()}  # noqa: E731
    # Paged (the default): 8 rows of 256 slots in blocks of 16, and any bucket's rows may be 200 long.
    assert sched().pages == (128, 16) and lengths() == {b: 200 for b in (1, 2, 4, 8, 16, 32)}
    assert sched(kv_cache_tokens=0).pages == (32 * 16, 16)  # no budget: max_batch full rows
    assert sched(block_size=32, kv_cache_tokens=1000).pages == (31, 32)
    # Contiguous: 256 a row up to bucket 8, 128 at 16, 128 (the least, room for 64 tokens) at 32.
    assert lengths(block_size=0) == {1: 200, 2: 200, 4: 200, 8: 200, 16: 127, 32: 127}
    assert sched(block_size=0).pages is None
    assert lengths(block_size=0, kv_cache_tokens=0) == {b: 200 for b in (1, 2, 4, 8, 16, 32)}  # no budget
    assert lengths(block_size=0, kv_cache_tokens=4096, max_batch=16) == {1: 200, 2: 200, 4: 200, 8: 200, 16: 200}
    cfg = build_config(build_parser().parse_args(["--kv-cache-tokens", "1024", "--block-size", "0"]))
    assert cfg.kv_cache_tokens == 1024 and cfg.block_size == 0
    with pytest.raises(ConfigError, match="block_size must be >= 0"):
        ServeConfig(block_size=-1)


@pytest.mark.slow
def test_load_test_script_runs_every_mode_in_smoke_mode(tmp_path):
    out = tmp_path / "serve_load.json"
    from doc_commands import argv, doc_command

    # serve/README's measurement command, shrunk by --smoke (a tiny model, concurrency 1 and 2).
    run = subprocess.run(argv(doc_command("python benchmarks/serve_load.py"), "--smoke", "--json", str(out)),
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    got = {(r["mode"], r["concurrency"]): r for r in report["results"]}
    assert set(got) == {(m, c) for m in ("plain", "fixed", "auto") for c in (1, 2)}
    for r in got.values():
        assert r["tokens"] == r["requests"] * 8 and r["tokens_per_s"] > 0  # ignore_eos: exactly max_tokens each
        assert r["rounds"] == 2 and r["requests"] == 2 * 2  # the rounds alternate between the modes; both count
    assert set(got["fixed", 1]["steps"]) == {"3,1,4"} and set(got["plain", 2]["steps"]) == {"off"}
    assert set(report["auto_ratios"]) == {"1", "2"}
    assert "auto" in run.stdout and "vs plain" in run.stdout


def _serve(tmp_path, name, *extra):
    """A `python -m eagle_jax.serve` subprocess on a tiny model (background preparation on); returns
    (process, base url)."""
    import os

    from builders import write_tiny_chat_model

    model = tmp_path / "tiny-model"
    if not model.exists():
        write_tiny_chat_model(model)
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # cache even the tiny programs
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "eagle_jax.serve", "--model", str(model), "--draft", "random",
                             "--port", "0", "--json", "--max-batch", "2", "--max-model-len", "64", "--candidates", "off",
                             "3,1,4", "--compile-cache", str(tmp_path / "xla"), "--profile-dir",
                             str(tmp_path / "profiles"), "--profile-reps", "2", *extra],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=env)
    for line in proc.stdout:
        if line.startswith("{"):
            return proc, json.loads(line)["url"]
    proc.wait(10)
    raise AssertionError((tmp_path / f"{name}.log").read_text()[-3000:])


def _get(url):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _until_prepared(url, timeout=300):
    """The /ready answers seen until preparation completes (each as (status code, body))."""
    import time

    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        code, body = _get(url + "/ready")
        seen.append((code, json.loads(body)))
        if code == 200 and seen[-1][1]["preparation"]["complete"]:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"preparation did not complete: {seen[-1]}")


def _compiles(url):
    from eagle_jax.serve.metrics import parse

    m = parse(_get(url + "/metrics")[1])
    return {s: m[f'eagle_xla_programs_total{{source="{s}"}}'] for s in ("compiled", "cache")}


@pytest.mark.slow  # two server processes
def test_readiness_reports_progress_and_a_second_start_compiles_nothing(tmp_path):
    proc, url = _serve(tmp_path, "first")
    try:
        seen = _until_prepared(url)
        first = _compiles(url)
    finally:
        proc.terminate()
        proc.wait(30)
    codes = {c for c, _ in seen}
    assert codes <= {200, 503} and seen[-1][1]["status"] == "ready"
    progress = [b["preparation"]["programs_done"] for _, b in seen]
    total = seen[-1][1]["preparation"]["programs_total"]
    assert progress == sorted(progress) and progress[-1] == total and total >= 6  # steps, rows, prefills, trees
    assert seen[-1][1]["preparation"]["speculation"] == {"1": ["3,1,4"], "2": ["3,1,4"]}
    assert seen[-1][1]["longest_request_by_batch_bucket"] == {"1": 64, "2": 64}
    for code, body in seen:  # 503 exactly while nothing can be served yet
        assert (code == 200) == body["preparation"]["servable"] and body["status"] in ("starting", "preparing", "ready")
    assert first["compiled"] >= total

    proc, url = _serve(tmp_path, "second")
    try:
        _until_prepared(url)
        second = _compiles(url)
        code, body = _get(url + "/harness")
        assert code == 200 and json.loads(body)["preparation"]["complete"]
    finally:
        proc.terminate()
        proc.wait(30)
    assert second["compiled"] == 0 and second["cache"] >= total, (first, second)
