"""Start-up of `python -m eagle_jax.serve` as a user meets it: time to listen, to the first answer to the
README's curl request, to full speculation at batch bucket 1 and to the end of the background preparation,
answering the request every 2 s throughout (every answer must be the same greedy text), then a load of
--clients concurrent clients (greedy, as the README's request), then (unless --no-mixed) the same load with
every other client sampling, twice: once while the trees' general (sampling) programs compile in the
background, once after. Resident memory (VmRSS, VmHWM) is sampled every second. Runs the server twice
on the same caches: a first start (empty caches, unless --keep-cache) and a second start. Prints a table and
writes JSON.

    python benchmarks/serve_startup.py                      # the README's main command, default settings
    python benchmarks/serve_startup.py --smoke              # a tiny random model: checks the script only

Run it alone: the machine's other load changes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BODY = {"messages": [{"role": "user", "content": "Write a haiku about speculative decoding."}],
        "max_tokens": 64, "temperature": 0}


def _vmhwm(pid: int) -> int:
    st = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
    return int(st["VmHWM"].split()[0]) * 1024


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (OSError, ValueError):
        return None, None


def _post(url, body, timeout=600):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def one_start(args, cache: Path, tag: str) -> dict:
    port = args.port
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "eagle_jax.serve", "--port", str(port), "--compile-cache", str(cache / "xla"),
            "--profile-dir", str(cache / "harness"), *args.serve_args]
    log = open(cache / f"{tag}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    mem, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                st = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status") if ":" in line)
                mem.append((time.monotonic() - t0, int(st["VmRSS"].split()[0]) * 1024, int(st["VmHWM"].split()[0]) * 1024))
            except (OSError, KeyError, ValueError):
                pass
            stop.wait(1.0)

    threading.Thread(target=sample, daemon=True).start()
    ev, body, answer = {}, dict(BODY, **({"model": args.model_name} if args.model_name else {})), None
    elapsed = lambda: round(time.monotonic() - t0, 1)
    try:
        while time.monotonic() - t0 < args.limit and proc.poll() is None:
            if "listening_s" not in ev and _get(url + "/health")[0] is not None:
                ev["listening_s"] = elapsed()
            try:
                answer = _post(url, body)["choices"][0]["message"]["content"]
                ev["first_answer_s"] = elapsed()
                break
            except urllib.error.HTTPError as e:  # the server answered, but not with an answer: say why
                ev["first_answer_error"] = f"{e.code}: {e.read()[:200].decode(errors='replace')}"
                time.sleep(0.5)
            except (OSError, ValueError):
                time.sleep(0.5)
        if answer is None:
            raise RuntimeError(f"{tag} start: no answer within {args.limit:.0f} s "
                               f"({ev.get('first_answer_error', 'no response')}); log: {log.name}")
        ev["rss_at_first_answer"] = max((m[1] for m in mem), default=0)
        answers = []
        while time.monotonic() - t0 < args.limit and proc.poll() is None:
            ts = time.monotonic()
            try:
                same = _post(url, body)["choices"][0]["message"]["content"] == answer
                answers.append((elapsed(), round(time.monotonic() - ts, 2), same))
            except (OSError, ValueError) as e:
                answers.append((elapsed(), None, str(e)[:80]))
            _, ready = _get(url + "/ready")
            _, harness = _get(url + "/harness")
            if ready and ready["preparation"].get("complete") and "prepared_s" not in ev:
                ev["prepared_s"] = elapsed()
            costs = (harness or {}).get("profile", {}).get("step_seconds", {}).get("1", {})
            cands = (harness or {}).get("candidates", [])
            if "bucket1_speculating_s" not in ev and all(c in costs for c in cands):
                ev["bucket1_speculating_s"] = elapsed()
            if "prepared_s" in ev and "bucket1_speculating_s" in ev:
                break
            time.sleep(2)
        ev["answers_during"] = len(answers)
        ev["answers_same"] = sum(a[2] is True for a in answers)
        ev["slowest_answer_s"] = max((a[1] for a in answers if a[1] is not None), default=None)
        ts = time.monotonic()

        def client(i, mixed=False):
            b = dict(body, messages=[{"role": "user", "content": f"Tell me fact number {i} about rivers."}])
            if mixed and i % 2:
                b.update(temperature=0.8, seed=i)
            t = time.monotonic()
            _post(url, b)
            return time.monotonic() - t

        with ThreadPoolExecutor(args.clients) as ex:
            latencies = list(ex.map(client, range(2 * args.clients)))
        ev["load_s"] = round(time.monotonic() - ts, 1)
        ev["load_slowest_s"] = round(max(latencies), 1)
        ev["vmhwm_greedy"] = _vmhwm(proc.pid)
        if args.mixed:
            for phase in ("mixed_load_s", "mixed_load_again_s"):
                ts = time.monotonic()
                with ThreadPoolExecutor(args.clients) as ex:
                    list(ex.map(lambda i: client(i, mixed=True), range(2 * args.clients)))
                ev[phase] = round(time.monotonic() - ts, 1)
                while time.monotonic() - t0 < args.limit:  # the general tree programs asked for, compiled
                    _, ready = _get(url + "/ready")
                    prep = (ready or {}).get("preparation", {})
                    if not prep.get("pending", 1) and prep.get("compiling") is None:
                        break
                    time.sleep(1)
                ev["sampled_speculation"] = prep.get("sampled_speculation")
        _, harness = _get(url + "/harness")
        ev["choices"] = (harness or {}).get("choices")
        from eagle_jax.serve.metrics import parse

        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            m = parse(r.read().decode())
        ev["xla_programs"] = {s: m.get(f'eagle_xla_programs_total{{source="{s}"}}') for s in ("compiled", "cache")}
    finally:
        stop.set()
        time.sleep(1.1)
        proc.terminate()
        proc.wait(60)
    ev["peak_rss"] = max((m[1] for m in mem), default=0)
    ev["vmhwm"] = max((m[2] for m in mem), default=0)
    return {"events": ev, "answers": answers, "memory": mem[::5]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--limit", type=float, default=1200, help="seconds per start, at most")
    ap.add_argument("--cache", help="cache folder (default: a new temporary one, removed afterwards)")
    ap.add_argument("--keep-cache", action="store_true", help="do not empty --cache before the first start")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model (checks the script, not the numbers)")
    ap.add_argument("--no-mixed", dest="mixed", action="store_false",
                    help="skip the loads where every other client samples")
    ap.add_argument("--json", default="serve_startup.json")
    args, rest = ap.parse_known_args(argv)
    args.serve_args, args.model_name = rest, "smollm2-135m-instruct"
    tmp = tempfile.mkdtemp(prefix="eagle-startup-")
    cache = Path(args.cache or tmp)
    if args.cache and not args.keep_cache:
        shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from serve_load import write_tiny_model

        model = write_tiny_model(cache / "tiny")
        args.serve_args = ["--model", str(model), "--draft", "random", "--max-batch", "2", "--max-model-len", "128",
                           "--candidates", "off", "3,1,4", *args.serve_args]
        args.model_name, args.clients, BODY["max_tokens"] = None, 2, 8
    try:
        runs = {tag: one_start(args, cache, tag) for tag in ("first", "second")}
    finally:
        if not args.cache:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = [("listening", "listening_s", "s"), ("first answer", "first_answer_s", "s"),
            ("bucket 1 speculating", "bucket1_speculating_s", "s"), ("preparation complete", "prepared_s", "s"),
            ("answers during preparation (same / all)", None, ""), ("RSS at first answer", "rss_at_first_answer", "GB"),
            (f"peak RSS (VmHWM) through {args.clients} greedy clients", "vmhwm_greedy", "GB"),
            *([(f"peak RSS (VmHWM) through {args.clients} mixed clients", "vmhwm", "GB"),
               ("mixed load, then again (programs in)", None, "")] if args.mixed else []),
            ("XLA programs compiled / from cache", None, "")]
    print(f"{'':44s} {'first start':>16s} {'second start':>16s}")
    for label, key, unit in rows:
        cells = []
        for tag in ("first", "second"):
            e = runs[tag]["events"]
            if label.startswith("answers"):
                cells.append(f"{e.get('answers_same')} / {e.get('answers_during')}")
            elif label.startswith("mixed"):
                cells.append(f"{e.get('mixed_load_s', '-')} / {e.get('mixed_load_again_s', '-')} s")
            elif label.startswith("XLA"):
                x = e.get("xla_programs") or {}
                cells.append(f"{x.get('compiled')} / {x.get('cache')}")
            elif unit == "GB":
                cells.append(f"{e.get(key, 0) / 1e9:.2f} GB")
            else:
                cells.append(f"{e[key]:.1f} s" if key in e else "-")
        print(f"{label:44s} {cells[0]:>16s} {cells[1]:>16s}")
    report = {"host": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "serve_args": args.serve_args, "runs": runs}
    Path(args.json).write_text(json.dumps(report, indent=1))
    ok = all(r["events"].get("first_answer_s") is not None for r in runs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
