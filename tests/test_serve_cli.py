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
from test_decoding import tiny_target

ROOT = Path(__file__).resolve().parents[1]


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
    out = subprocess.run([sys.executable, "-m", "eagle_jax.serve", "--help"], capture_output=True, text=True, cwd=ROOT)
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


def _start_server(args, log):
    proc = subprocess.Popen([sys.executable, "-m", "eagle_jax.serve", "--port", "0", "--json", *args],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    for line in proc.stdout:
        if line.startswith("{"):
            return proc, json.loads(line)
    proc.wait(10)
    log.seek(0)
    raise AssertionError(f"server exited with {proc.returncode}:\n{log.read()[-3000:]}")


@pytest.mark.slow
def test_real_smollm2_server_with_a_random_head_answers_the_openai_client_like_plain_greedy(tmp_path):
    openai = pytest.importorskip("openai")
    import eagle_jax

    with open(tmp_path / "server.log", "w+") as log:
        proc, ready = _start_server(["--draft", "random", "--max-batch", "1", "--max-model-len", "256",
                                     "--candidates", "off", "3,1,4", "--profile-dir", str(tmp_path / "profiles"),
                                     "--profile-reps", "2", "--compile-cache", "", "--no-warmup", "--api-key", "k1"], log)
        try:
            assert ready["model"] == "smollm2-135m-instruct" and ready["auth"] and ready["speculation"] == "auto"
            target = eagle_jax.load_target("smollm2-135m-instruct")
            messages = [{"role": "user", "content": "Name three primary colours."}]
            want = eagle_jax.generate(target, [messages], max_new_tokens=24)
            client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="k1", max_retries=0, timeout=300)
            r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=24,
                                               temperature=0)
            assert r.choices[0].message.content == want.texts[0]
            assert r.usage.completion_tokens == len(want.token_ids[0])
            streamed = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                                      max_tokens=24, temperature=0, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in streamed) == want.texts[0]
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=ready["url"] + "/v1", api_key="nope", max_retries=0).models.list()
            assert list((tmp_path / "profiles").glob("*.json"))  # the harness profiled this machine
        finally:
            proc.terminate()
            proc.wait(30)


def test_load_test_script_runs_every_mode_in_smoke_mode(tmp_path):
    out = tmp_path / "serve_load.json"
    run = subprocess.run([sys.executable, "benchmarks/serve_load.py", "--smoke", "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    got = {(r["mode"], r["concurrency"]): r for r in report["results"]}
    assert set(got) == {(m, c) for m in ("plain", "fixed", "auto") for c in (1, 2)}
    for r in got.values():
        assert r["tokens"] == r["requests"] * 8 and r["tokens_per_s"] > 0  # ignore_eos: exactly max_tokens each
    assert set(got["fixed", 1]["steps"]) == {"d3k1n4"} and set(got["plain", 2]["steps"]) == {"off"}
    assert set(report["auto_ratios"]) == {"1", "2"}
    assert "auto" in run.stdout and "vs plain" in run.stdout
