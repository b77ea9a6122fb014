"""How long a running stream stalls while `python -m eagle_jax.serve` admits a long prompt.

Starts the server (default settings unless flags follow; pass --compile-cache/--profile-dir to reuse
caches), waits until its background preparation is complete, then for each prompt length: opens one
streaming chat request (ignore_eos, --max-tokens), and once it streams, sends a non-streaming request
whose prompt is that many tokens (token ids, through /v1/completions). Records the stream's gaps between
chunks before, during and after the long prompt's admission and the long request's time to its answer.
Prints a table and writes JSON. Goal (serve README): the longest gap while a 1000-token prompt is admitted
is at most 1 s.

    python benchmarks/long_prompt_gap.py --lengths 1000 500 --json results/long_prompt_gap.json
    python benchmarks/long_prompt_gap.py --smoke      # a tiny random model: checks the script only

Run it alone: the machine's other load changes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _json(url, body=None, timeout=600):
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def stream(url, model, max_tokens, arrivals, started):
    """One streaming chat request; the arrival time of every chunk goes to `arrivals`."""
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    if model:
        body["model"] = model
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                arrivals.append(time.monotonic())
                started.set()


def measure(url, model, n_tokens, args) -> dict:
    arrivals, started = [], threading.Event()
    th = threading.Thread(target=stream, args=(url, model, args.max_tokens, arrivals, started), daemon=True)
    th.start()
    started.wait(120)
    time.sleep(args.lead)
    body = {"prompt": [(17 * i + 101) % args.vocab + 1 for i in range(n_tokens)], "max_tokens": 4, "temperature": 0}
    if model:
        body["model"] = model
    t0 = time.monotonic()
    _json(url + "/v1/completions", body)
    t1 = time.monotonic()
    th.join(600)
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    before = [g for t, g in gaps if t < t0]
    during = [g for t, g in gaps if t0 <= t <= t1 + 0.5]
    return {"prompt_tokens": n_tokens, "long_request_s": round(t1 - t0, 2),
            "gap_before_median_s": round(sorted(before)[len(before) // 2], 3) if before else None,
            "gap_before_max_s": round(max(before), 3) if before else None,
            "gap_during_max_s": round(max(during), 3) if during else None, "chunks": len(arrivals)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 500])
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens of the running stream")
    ap.add_argument("--lead", type=float, default=2.0, help="seconds of streaming before the long prompt")
    ap.add_argument("--limit", type=float, default=1200, help="seconds to wait for the preparation")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default="long_prompt_gap.json")
    args, serve_args = ap.parse_known_args(argv)
    model, args.vocab = "smollm2-135m-instruct", 40000
    tmp = tempfile.mkdtemp(prefix="eagle-gap-")
    if args.smoke:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from serve_load import write_tiny_model

        path = write_tiny_model(Path(tmp) / "tiny")
        serve_args = ["--model", str(path), "--draft", "random", "--max-batch", "2", "--max-model-len", "256",
                      "--candidates", "off", "3,1,4", "--prefill-chunk", "32", *serve_args]
        model, args.vocab, args.max_tokens, args.lengths, args.lead = None, 50, 150, [100], 0.2
    url = f"http://127.0.0.1:{args.port}"
    log = open(Path(tmp) / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "eagle_jax.serve", "--port", str(args.port), *serve_args],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > args.limit:
                raise RuntimeError(f"the server did not finish preparing (log: {log.name})")
            try:
                if _json(url + "/ready", timeout=5)["preparation"].get("complete"):
                    break
            except OSError:
                pass
            time.sleep(1)
        rows = [measure(url, model, n, args) for n in args.lengths]
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"{'prompt tokens':>14s} {'long request':>13s} {'gap before (median / max)':>27s} {'longest gap during':>19s}")
    sec = lambda x: "-" if x is None else f"{x:.3f}s"  # noqa: E731
    for r in rows:
        print(f"{r['prompt_tokens']:14d} {r['long_request_s']:12.2f}s "
              f"{sec(r['gap_before_median_s']) + ' / ' + sec(r['gap_before_max_s']):>27s} {sec(r['gap_during_max_s']):>19s}")
    Path(args.json).write_text(json.dumps({"host": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "serve_args": serve_args,
                                           "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
