"""The server on a device mesh: the documented multi-device commands in their local form (fake CPU devices,
and two `jax.distributed` processes on localhost), against one device's greedy output."""

from __future__ import annotations

import os
import subprocess

import openai

from builders import write_tiny_chat_model
from doc_commands import argv, doc_command, start_server

QUESTIONS = ["Hello there", "Count: 1 2 3"]


def _answers(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    return [client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=24,
                                           temperature=0).choices[0].message.content for q in QUESTIONS]


def _env(devices: int, **extra) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **extra)


def test_documented_tensor_parallel_commands_serve_one_devices_greedy_text(tmp_path):
    model = write_tiny_chat_model(tmp_path / "tiny8", heads=8, kv_heads=8)  # 8 heads: splits 8 ways
    local = ["--model", str(model), "--draft", "random", "--host", "127.0.0.1", "--max-batch", "4",
             "--log-level", "warning"]
    single_host = doc_command("python -m eagle_jax.serve --model /models/Llama-3.1-70B-Instruct --draft "
                              "/models/EAGLE3-LLaMA3.1-Instruct-70B --speculation fixed:4,4,16 --tensor-parallel 8")
    pod = doc_command("python -m eagle_jax.serve --model /models/Llama-3.1-70B-Instruct --draft "
                      "/models/EAGLE3-LLaMA3.1-Instruct-70B --speculation fixed:4,4,16 --tensor-parallel 16")
    # One device's greedy text, in-process (the server's fixed tree with a random head is lossless, so it is
    # plain decoding's; the server applies the same chat template).
    import eagle_jax

    target = eagle_jax.load_target(str(model))
    results = {"one device": eagle_jax.generate(target, [[{"role": "user", "content": q}] for q in QUESTIONS],
                                                max_new_tokens=24).texts}
    for name, degree, data, devices in (("one host", 8, 1, 8), ("data x model", 2, 2, 4)):
        rows = ["--data-parallel", str(data), "--block-size", "0"] if data > 1 else []
        with open(tmp_path / f"{degree}.log", "w+") as log:
            proc, ready = start_server(single_host, *local, "--tensor-parallel", str(degree), *rows,
                                       log=log, env=_env(devices))
            try:
                assert ready["mesh"] == {"data": data, "model": degree}
                results[name] = _answers(ready["url"])
            finally:
                proc.terminate()
                proc.wait(60)
    # Two processes of 4 devices each, TP 8 across them: process 0 serves, process 1 follows.
    coordinator = dict(JAX_COORDINATOR_ADDRESS="127.0.0.1:" + str(20000 + os.getpid() % 20000), JAX_NUM_PROCESSES="2")
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(2)]
    procs = []
    try:
        follower = subprocess.Popen(argv(pod, *local, "--tensor-parallel", "8", "--port", "0"),
                                    stdout=logs[1], stderr=logs[1], env=_env(4, **coordinator, JAX_PROCESS_ID="1"))
        procs.append(follower)
        leader, ready = start_server(pod, *local, "--tensor-parallel", "8", log=logs[0],
                                     env=_env(4, **coordinator, JAX_PROCESS_ID="0"))
        procs.append(leader)
        assert ready["mesh"] == {"data": 1, "model": 8} and ready["processes"] == 2
        results["two processes"] = _answers(ready["url"])
        leader.terminate()
        leader.wait(60)
        assert follower.wait(60) == 0  # the leader's stop reached it: it left cleanly
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    assert results["one host"] == results["one device"]
    assert results["data x model"] == results["one device"]
    assert results["two processes"] == results["one device"]
    assert all(results["one device"])


def test_parallel_settings_that_cannot_serve_together_are_refused_with_the_reason():
    import pytest

    from eagle_jax.serve.config import ConfigError, ServeConfig

    with pytest.raises(ConfigError, match="block_size 0"):
        ServeConfig(data_parallel=2)  # a paged pool is shared by every row
    with pytest.raises(ConfigError, match="max_batch 5 must be a multiple of data_parallel 2"):
        ServeConfig(data_parallel=2, block_size=0, max_batch=5)
    with pytest.raises(ConfigError, match="speculation 'auto'"):
        ServeConfig(distributed=True)
    with pytest.raises(ConfigError, match="tensor_parallel, data_parallel and expert_parallel must be >= 1"):
        ServeConfig(tensor_parallel=0)
    assert ServeConfig(data_parallel=2, block_size=0, distributed=True, speculation="off").mesh_problem() is None
