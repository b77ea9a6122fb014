"""Load test of `python -m eagle_jax.serve`: throughput and latency vs concurrent streaming clients.

For each mode (plain = `--speculation off`, fixed = `--speculation fixed:D,K,N`, auto = the harness) it
starts a server subprocess; the servers run side by side. Per concurrency level C it warms every server up
(compiles every shape the measurement needs), then drives them in turn, `--rounds` times in rotating order,
with C concurrent streaming chat clients (the real `openai` client), each request generating exactly
--max-tokens tokens (ignore_eos), and records tokens/s, request latency and time to first token over all
rounds (so a slow spell of a shared machine hits every mode alike). Prints a table with auto's ratio to
plain and to the best non-auto mode at each concurrency (goals: >= 1.0 and >= 0.95), and writes JSON (with
each server's /metrics at the end: the harness's choices per tree shape and tau).

    python benchmarks/serve_load.py --draft default                     # the real measurement (slow)
    python benchmarks/serve_load.py --smoke                             # a tiny random model, a minute

`--smoke` builds a tiny random Llama with a character tokenizer in a temporary directory and runs every
mode at concurrency 1 and 2: it checks the pipeline, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a cat watching the rain.",
    "Give me three tips for learning a new programming language.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a bicycle works to a ten-year-old.",
    "Summarise the plot of a detective story in a paragraph.",
    "Why do leaves change colour in autumn?",
    "List five healthy breakfast ideas and say why each is good.",
    "How does a refrigerator keep food cold?",
    "Write a friendly email inviting a colleague to lunch.",
    "What are the main causes of ocean tides?",
    "Explain what a hash table is and when to use one.",
    "Give advice to someone starting to run for exercise.",
    "Describe the water cycle step by step.",
    "What makes a good team meeting?",
    "Write a limerick about a forgetful robot.",
]


# --- tiny model for --smoke --------------------------------------------------------------------------

def write_tiny_model(directory: Path, seed: int = 0, heads: int = 4, kv_heads: int = 2) -> Path:
    """A tiny random Llama as a Hugging Face directory (config.json, model.safetensors, a 97-token
    character tokenizer with a chat template); heads / kv_heads: attention heads of head size 48 / heads."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127) if chr(c) not in "`~"]
    # 6 layers: an EAGLE-3 head (--draft random) needs distinct low / middle / high layers to tap.
    vocab, hidden, inter, layers, kv = len(specials) + len(chars), 48, 96, 6, kv_heads
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 0}))
    rng = np.random.default_rng(seed)
    w = lambda *shape, scale=0.15: (rng.standard_normal(shape) * scale).astype(np.float32)
    hd = hidden // heads
    tensors = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0), "model.norm.weight": np.ones(hidden, np.float32),
               "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv * hd, hidden),
            p + "self_attn.v_proj.weight": w(kv * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter)})
    save_file(tensors, str(directory / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[2], bos_token=specials[0], unk_token=specials[0],
                            chat_template=template).save_pretrained(str(directory))
    return directory


# --- server process --------------------------------------------------------------------------------

class Server:
    def __init__(self, args, mode: str, log_path: Path):
        spec = {"plain": "off", "fixed": f"fixed:{args.fixed_tree}", "auto": "auto"}[mode]
        self.cmd = [sys.executable, "-m", "eagle_jax.serve", "--model", args.model, "--draft", args.draft,
                    "--speculation", spec, "--host", "127.0.0.1", "--port", "0", "--json",
                    "--max-batch", str(args.max_batch), "--max-model-len", str(args.max_model_len),
                    "--max-queue", str(max(256, 4 * max(args.concurrency))), "--log-level", "warning",
                    *args.server_arg]
        self.log_path = log_path
        self.proc = None
        self.url = None

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "ready":
                self.url = msg["url"]
                break
        if self.url is None:
            self.proc.wait(10)
            raise RuntimeError(f"server exited ({self.proc.returncode}) before it was ready; see {self.log_path}:\n"
                               + Path(self.log_path).read_text()[-3000:])
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def metrics(self) -> dict:
        from eagle_jax.serve.metrics import parse

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse(r.read().decode())


# --- clients ---------------------------------------------------------------------------------------

async def one_request(client, model, prompt, max_tokens):
    t0 = time.perf_counter()
    first, tokens, text = None, 0, []
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"latency_s": time.perf_counter() - t0, "ttft_s": first, "tokens": tokens}


async def drive(url, model, prompts, concurrency, n_requests, max_tokens):
    """n_requests requests from `concurrency` clients, each sending its next request when one ends."""
    import openai

    queue = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(prompts[i % len(prompts)])
    results = []

    async def worker(client):
        while not queue.empty():
            prompt = queue.get_nowait()
            results.append(await one_request(client, model, prompt, max_tokens))

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def summarise(concurrency, results, wall):
    """Throughput and latency of `results` (requests of one or more rounds) that took `wall` seconds."""
    lat = sorted(r["latency_s"] for r in results)
    ttft = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
            "latency_mean_s": statistics.mean(lat), "latency_p50_s": pct(lat, 0.5), "latency_p90_s": pct(lat, 0.9),
            "ttft_mean_s": statistics.mean(ttft) if ttft else None, "ttft_p90_s": pct(ttft, 0.9),
            "per_request_tokens_per_s": statistics.mean(r["tokens"] / r["latency_s"] for r in results)}


def step_summary(before: dict, after: dict) -> dict:
    """Steps, rows and tokens per tree shape between two /metrics scrapes (what the harness chose)."""
    out = {}
    for key, value in after.items():
        if key.startswith("eagle_steps_total{"):
            name = key[len('eagle_steps_total{config="'):-2]
            d = lambda m: after.get(f'{m}{{config="{name}"}}', 0) - before.get(f'{m}{{config="{name}"}}', 0)
            steps, rows, toks = d("eagle_steps_total"), d("eagle_step_rows_total"), d("eagle_step_tokens_total")
            if steps:
                out[name] = {"steps": steps, "rows_per_step": rows / steps, "tau": toks / rows if rows else None}
    return out


def merge_steps(parts: list[dict]) -> dict:
    """step_summary of several rounds added up."""
    out = {}
    for part in parts:
        for name, v in part.items():
            o = out.setdefault(name, {"steps": 0.0, "rows": 0.0, "tokens": 0.0})
            o["steps"] += v["steps"]
            o["rows"] += v["steps"] * v["rows_per_step"]
            o["tokens"] += (v["tau"] or 0.0) * v["steps"] * v["rows_per_step"]
    return {name: {"steps": o["steps"], "rows_per_step": o["rows"] / o["steps"],
                   "tau": o["tokens"] / o["rows"] if o["rows"] else None} for name, o in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="default", help="draft head for the fixed and auto modes (default: %(default)s)")
    ap.add_argument("--modes", nargs="+", default=["plain", "fixed", "auto"], choices=["plain", "fixed", "auto"])
    ap.add_argument("--fixed-tree", default=None, help="D,K,N of the fixed mode (default: TreeConfig(), the default tree)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per concurrency level (default: 2 x concurrency, at least 8)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measurement rounds per concurrency level, alternating between the modes")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--dataset", default=None, help="mt_bench, humaneval or a JSONL file (default: built-in prompts)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for the server (repeat; e.g. --server-arg=--reprofile)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, concurrency 1 2, a few short requests")
    ap.add_argument("--json", default="results/serve_load.json")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    if args.fixed_tree is None:
        from eagle_jax.tree import TreeConfig

        d = TreeConfig()
        args.fixed_tree = f"{d.depth},{d.topk},{d.tree_tokens}"
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="serve_load_smoke_")
        if args.model == "smollm2-135m-instruct":
            args.model = str(write_tiny_model(Path(tmp.name) / "tiny-llama"))
        if args.draft == "default":
            args.draft = "random"
        args.concurrency, args.max_tokens, args.max_model_len, args.max_batch = [1, 2], 8, 128, 2
        args.requests = args.requests or 2
        args.fixed_tree = "3,1,4"
        # A compilation cache shared by the three servers (shapes compiled by one are loaded by the next):
        # the caller's JAX_COMPILATION_CACHE_DIR when it has one (the test suite's), else a temporary one.
        cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path(tmp.name) / "xla")
        # Contiguous rows: the smoke run checks this script, and the paged server's extra programs (row
        # surgery on the pools) would only add compile time; tests/serve covers the paged server.
        args.server_arg = ["--candidates", "off", "3,1,4", "--profile-reps", "2", "--no-warmup", "--block-size", "0",
                           "--compile-cache", cache,
                           "--profile-dir", str(Path(tmp.name) / "profiles")] + args.server_arg
    prompts = PROMPTS
    if args.dataset:
        from eagle_jax.bench import load_dataset

        prompts = load_dataset(args.dataset)
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    rows, metrics = [], {}
    with contextlib.ExitStack() as stack:
        # Every mode's server runs side by side (started one at a time, so each measures its cost profile on
        # an otherwise idle machine), and the measurement rounds alternate between them: a slow spell of
        # this shared machine then hits every mode alike instead of whichever mode it ran at the time.
        servers, models = {}, {}
        # auto first: measuring its cost profile (every candidate at every batch bucket) takes by far the
        # most memory, so it starts while nothing else holds any.
        for mode in sorted(args.modes, key=lambda m: m != "auto"):
            t0 = time.perf_counter()
            server = stack.enter_context(Server(args, mode, out_path.with_name(f"{out_path.stem}_{mode}.log")))
            server.startup_s = time.perf_counter() - t0
            print(f"[{mode}] server ready in {server.startup_s:.0f} s at {server.url}", flush=True)
            with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as resp:
                models[mode] = json.loads(resp.read())["data"][0]["id"]
            servers[mode] = server
        servers = {mode: servers[mode] for mode in args.modes}  # measured in the order given
        for c in args.concurrency:
            n = args.requests or max(2 * c, 8)
            for mode, server in servers.items():  # warm-up: compiles every shape this level needs
                asyncio.run(drive(server.url, models[mode], prompts, c, n, min(8, args.max_tokens)))
            done = {mode: ([], 0.0, []) for mode in servers}
            for k in range(args.rounds):
                order = list(servers)[k % len(servers):] + list(servers)[:k % len(servers)]
                for mode in order:
                    before = servers[mode].metrics()
                    results, wall = asyncio.run(drive(servers[mode].url, models[mode], prompts, c, n, args.max_tokens))
                    res, total, steps = done[mode]
                    done[mode] = (res + results, total + wall,
                                  steps + [step_summary(before, servers[mode].metrics())])
                    rate = sum(x["tokens"] for x in results) / wall
                    print(f"[{mode}] concurrency {c:>3} round {k + 1}: {rate:8.1f} tok/s", flush=True)
            for mode, (results, wall, steps) in done.items():
                r = summarise(c, results, wall)
                r.update(mode=mode, rounds=args.rounds, steps=merge_steps(steps), startup_s=servers[mode].startup_s)
                rows.append(r)
                print(f"[{mode}] concurrency {c:>3}: {r['tokens_per_s']:8.1f} tok/s, latency {r['latency_mean_s']:6.2f} s, "
                      f"TTFT {r['ttft_mean_s'] or 0:5.2f} s, steps {r['steps']}", flush=True)
        metrics = {mode: server.metrics() for mode, server in servers.items()}

    def get(mode, c):
        return next((r for r in rows if r["mode"] == mode and r["concurrency"] == c), None)

    print(f"\n{'mode':<6} {'conc':>4} {'tok/s':>9} {'req/s':>7} {'lat mean':>9} {'lat p90':>8} {'TTFT':>7} "
          f"{'vs plain':>9} {'vs best':>8}")
    ratios = {}
    for c in args.concurrency:
        best_other = max((get(m, c)["tokens_per_s"] for m in args.modes if m != "auto" and get(m, c)), default=None)
        for mode in args.modes:
            r = get(mode, c)
            plain = get("plain", c)
            vs_plain = r["tokens_per_s"] / plain["tokens_per_s"] if plain else None
            vs_best = r["tokens_per_s"] / best_other if best_other and mode == "auto" else None
            if mode == "auto":
                ratios[c] = {"auto_vs_plain": vs_plain, "auto_vs_best_fixed": vs_best,
                             "goal_met": (vs_plain is None or vs_plain >= 1.0) and (vs_best is None or vs_best >= 0.95)}
            fmt = lambda x, w: f"{x:{w}.2f}" if x is not None else " " * (w - 1) + "-"
            print(f"{mode:<6} {c:>4} {r['tokens_per_s']:9.1f} {r['requests_per_s']:7.2f} {r['latency_mean_s']:9.2f} "
                  f"{r['latency_p90_s']:8.2f} {fmt(r['ttft_mean_s'], 7)} {fmt(vs_plain, 9)} {fmt(vs_best, 8)}")
    report = {"benchmark": "serve_load", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": version("jax")},
              "settings": {k: v for k, v in vars(args).items()}, "results": rows, "auto_ratios": ratios,
              "server_metrics": metrics}
    out_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out_path}")
    if tmp is not None:
        tmp.cleanup()
    return report


if __name__ == "__main__":
    main()
