"""Speculative decoding on SmolLM2-135M-Instruct with an untrained head: tau, tokens/s, step overheads.

Measures, in one run on the same prompts:
  * plain greedy decoding vs speculative decoding with a random EAGLE-3 (and EAGLE-1) head for a few
    tree shapes: tokens/s, tau (tokens per verify step incl. the bonus token), identical output;
  * the cost of one jitted speculative step with tree_tokens=1 (no drafting: verify the root and refresh
    the draft) and with the default tree, against one plain decode step.
Prints a table and writes JSON (default results/spec_step_overhead.json).

    python benchmarks/spec_step_overhead.py [--max-new-tokens 64] [--batch-size 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import eagle_jax  # noqa: E402
from eagle_jax import profiles, steps  # noqa: E402
from eagle_jax.tree import TreeConfig  # noqa: E402

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a cat watching the rain.",
    "Give me three tips for learning a new programming language.",
    "What is the difference between a list and a tuple in Python?",
]


def time_steps(fn, n=20):
    fn()  # compile / warm
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def step_costs(target, head, batch, trees):
    """Median seconds of one plain decode step (no head) and one speculative step per tree, same cache
    length and context: the engine's own `steps.step`, run through the harness's profiling stepper."""
    s_len, ctx = 256, 100
    state, run = profiles.stepper(target, None, [None], batch, s_len, 0, ctx)
    box = [state]

    def timed(run, tree):
        def once():
            box[0] = run(box[0], tree)
        return once

    out = {"plain_decode": time_steps(timed(run, None))}
    for name, tree in trees.items():
        box[0], run_tree = profiles.stepper(target, head, [tree], batch, s_len, s_len + steps.draft_extra([tree]), ctx)
        out[name] = time_steps(timed(run_tree, tree))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--json", default="results/spec_step_overhead.json")
    args = ap.parse_args(argv)

    target = eagle_jax.load_target("smollm2-135m-instruct")
    heads = {"eagle3": eagle_jax.random_head(target.cfg, "eagle3", seed=0),
             "eagle1": eagle_jax.random_head(target.cfg, "eagle1", seed=0)}
    trees = {"chain3": TreeConfig.chain(3), "4,4,16": TreeConfig(4, 4, 16)}
    prompts = PROMPTS[: max(args.batch_size, 1)] if args.batch_size > 1 else PROMPTS
    batch_prompts = [prompts] if args.batch_size > 1 else [[p] for p in prompts]

    def run(draft=None, tree=None):
        ids, counts, wall, toks = [], [], 0.0, 0
        for ps in batch_prompts:
            r = eagle_jax.generate(target, ps, draft=draft, tree=tree, max_new_tokens=args.max_new_tokens,
                                   ignore_eos=True)
            ids += r.token_ids
            counts += r.stats["accepted_per_step"]
            wall += r.stats["wall_s"]
            toks += r.stats["generated_tokens"]
        return {"token_ids": ids, "tokens_per_s": toks / wall,
                "tau": float(np.mean(counts)) if counts else 1.0}

    rows = []
    run()  # warm-up compiles
    base = run()
    rows.append({"config": "plain", "tokens_per_s": base["tokens_per_s"], "tau": 1.0, "identical": True})
    for kind, head in heads.items():
        for tname, tree in trees.items():
            run(head, tree)  # warm-up
            r = run(head, tree)
            rows.append({"config": f"{kind} random {tname}", "tokens_per_s": r["tokens_per_s"], "tau": r["tau"],
                         "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                         "identical": r["token_ids"] == base["token_ids"]})

    costs = step_costs(target, heads["eagle3"], args.batch_size,
                       {"spec_n1": TreeConfig(4, 4, 1), "spec_d4k4n16": TreeConfig(4, 4, 16)})
    plain_s = costs["plain_decode"]

    print(f"\nSmolLM2-135M-Instruct f32, batch {args.batch_size}, {args.max_new_tokens} tokens/prompt, "
          f"{len(PROMPTS)} prompts, random (untrained) heads")
    print(f"{'config':<26} {'tok/s':>8} {'tau':>6} {'speedup':>8}  identical")
    for r in rows:
        print(f"{r['config']:<26} {r['tokens_per_s']:8.1f} {r['tau']:6.2f} {r.get('speedup', 1.0):8.2f}  {r['identical']}")
    print("\none step at context 100 (median of 20):")
    for name, s in costs.items():
        print(f"  {name:<16} {s * 1e3:7.1f} ms  {s / plain_s:5.2f}x plain decode")

    out = {
        "benchmark": "spec_step_overhead",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                    "backend": jax.default_backend()},
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
        "results": rows, "step_seconds": costs,
        "step_ratio_vs_plain": {k: v / plain_s for k, v in costs.items()},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
