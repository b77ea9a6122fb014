"""How many short requests `python -m eagle_jax.serve` holds at once for a fixed KV cache memory budget.

    python benchmarks/serve_kv_capacity.py [--max-model-len 2048] [--kv-rows 8] [--requests 64] [--json PATH]

The budget is `--kv-rows` requests of max_model_len (their KV slots: 8 x 2048 by default). Three
servers (SmolLM2-135M-Instruct, plain decoding, `--no-warmup`: programs compile when first needed), one
after the other, each getting `--requests` concurrent completions of a `--prompt-tokens`-token prompt and
`--max-tokens` tokens (EOS ignored; prompts join four to a prefill, so admission outpaces completion and
what limits the running requests is the KV cache):
* contiguous: every row holds max_model_len slots, so the budget is `--kv-rows` rows (`--block-size 0
  --kv-cache-tokens 0 --max-batch KV_ROWS`);
* contiguous, per-bucket budget: batch buckets of b rows hold budget / b slots a row (`--block-size 0
  --kv-cache-tokens BUDGET`): short requests fit many rows, a long one forces a small bucket;
* paged: one pool of the budget's slots in blocks of 16, each request taking the blocks it needs
  (`--kv-cache-tokens BUDGET`, the default layout).
For each: the most requests running at once (the server's /metrics, polled), tokens/s over the whole
load, and the peak resident memory of the server. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle_jax.serve.requests import cache_length  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def complete(url, prompt: list[int], max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def run_server(name: str, flags: list[str], args, log_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "eagle_jax.serve", "--port", str(port), "--speculation", "off", "--no-warmup",
            "--max-model-len", str(args.max_model_len), "--prefill-chunk", str(args.prefill_chunk), *flags]
    log = open(log_dir / f"{name.replace(' ', '_').replace(',', '')}.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                metrics(url)
                break
            except (OSError, ValueError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: the server did not start; log: {log.name}")
                time.sleep(0.5)
        prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(args.prompt_tokens)] for i in range(args.requests)]
        peak, stop = {"running": 0, "blocks_used": 0}, threading.Event()

        def poll():
            while not stop.is_set():
                try:
                    m = metrics(url)
                    peak["running"] = max(peak["running"], int(m.get("eagle_requests_running", 0)))
                    peak["blocks_used"] = max(peak["blocks_used"], int(m.get("eagle_kv_blocks_used", 0)))
                except (OSError, ValueError):
                    pass
                stop.wait(0.1)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
            tokens = sum(pool.map(lambda p: complete(url, p, args.max_tokens), prompts))
        wall = time.monotonic() - t0
        stop.set()
        watcher.join()
        status = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status") if ":" in line)
        return {"flags": flags, "peak_running": peak["running"], "peak_blocks_used": peak["blocks_used"],
                "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-rows", type=int, default=8, help="the budget, in requests of max_model_len")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=128,
                    help="prompts up to this long join four to a prefill (longer ones alone, in chunks)")
    ap.add_argument("--json", default="results/serve_kv_capacity.json")
    args = ap.parse_args(argv)
    budget = args.kv_rows * cache_length(args.max_model_len, [])
    layouts = {
        "contiguous": ["--block-size", "0", "--kv-cache-tokens", "0", "--max-batch", str(args.kv_rows)],
        "contiguous, per-bucket budget": ["--block-size", "0", "--kv-cache-tokens", str(budget),
                                          "--max-batch", str(args.max_batch)],
        "paged": ["--kv-cache-tokens", str(budget), "--max-batch", str(args.max_batch)],
    }
    log_dir = Path(tempfile.mkdtemp(prefix="kv_capacity_"))
    res = {name: run_server(name, flags, args, log_dir) for name, flags in layouts.items()}

    base = res["contiguous"]["peak_running"]
    print(f"\nSmolLM2-135M-Instruct, plain decoding, KV budget {budget} slots ({args.kv_rows} rows of max_model_len "
          f"{args.max_model_len}), {args.requests} requests of {args.prompt_tokens} + {args.max_tokens} tokens "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)")
    print(f"{'layout':<32} {'most running':>12} {'x contiguous':>13} {'tok/s':>8} {'peak RSS GB':>12}")
    for name, r in res.items():
        print(f"{name:<32} {r['peak_running']:12d} {r['peak_running'] / max(base, 1):13.1f} {r['tokens_per_s']:8.1f} "
              f"{r['peak_rss_bytes'] / 1e9:12.2f}")
    report = {"benchmark": "serve_kv_capacity", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
              "budget_slots": budget, "args": vars(args), "results": res, "logs": str(log_dir)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
