"""Chooses the draft tree for a head on this machine: measured step cost x measured acceptance.

    python benchmarks/choose_tree.py [--draft default] [--prompts held-out.jsonl] [--json PATH]

For every candidate TreeConfig (depth x top-k x N) it measures, in one run:
  * the cost of one jitted speculative step (draft + verify + accept + draft refresh) at batch 1,
    relative to one plain decode step at the same context length, and
  * tau (tokens per step incl. the bonus token) of greedy decoding on development prompts that are
    not evaluation prompts (by default: the last prompts of the shipped head's prompt list, which lie
    in the trainer's held-out split, the last 3% of conversations, so the head never trained on them),
and ranks the trees by the estimated speedup tau / cost. Prints a table, writes JSON. The README's
bench tree for this CPU (3,4,8) was chosen this way; `--tree auto` (the harness) makes the same
trade-off per step at run time, from costs it measures where it runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

import eagle_jax  # noqa: E402
from eagle_jax.loader import resolve_draft  # noqa: E402
from eagle_jax.tree import TreeConfig  # noqa: E402
from spec_step_overhead import step_costs  # noqa: E402

GRID = [(1, 1, 2), (1, 2, 3), (1, 4, 5), (2, 1, 3), (2, 2, 4), (2, 4, 6), (3, 1, 4), (3, 2, 5), (3, 4, 6),
        (3, 4, 8), (4, 4, 8), (4, 4, 12), (4, 4, 16), (5, 4, 16), (6, 4, 24), (6, 10, 60)]


def dev_prompts(path, n):
    """The last n prompts of a JSON list or a JSONL file ('prompt' per line); evaluation prompts refused."""
    from eagle_jax.train.data import check_not_eval, load_jsonl_prompts

    path = Path(path)
    prompts = json.loads(path.read_text()) if path.suffix == ".json" else load_jsonl_prompts(path)
    prompts = [p if isinstance(p, str) else p[0] for p in prompts[-n:]]  # a conversation: its first turn
    check_not_eval(prompts, source=str(path))
    return prompts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--prompts", default="train/data/smollm2-135m-instruct-eagle3/prompts.json",
                    help="JSON list or JSONL ('prompt') of development prompts; the last --n are used")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--grid", default=None, help="semicolon-separated D,K,N triples (default: built-in grid)")
    ap.add_argument("--json", default="results/choose_tree.json")
    args = ap.parse_args(argv)

    target = eagle_jax.load_target(args.model)
    head = resolve_draft(args.draft, target)
    prompts = dev_prompts(args.prompts, args.n)
    grid = GRID if args.grid is None else [tuple(int(x) for x in t.split(",")) for t in args.grid.split(";")]
    trees = {TreeConfig(d, k, n).name: TreeConfig(d, k, n) for d, k, n in grid}

    costs = step_costs(target, head, 1, trees)
    plain_s = costs["plain_decode"]
    plain = eagle_jax.generate(target, prompts, max_new_tokens=args.max_new_tokens)
    rows = []
    for name, tree in trees.items():
        r = eagle_jax.generate(target, prompts, draft=head, tree=tree, max_new_tokens=args.max_new_tokens)
        cost = costs[name] / plain_s
        rows.append({"tree": name, "depth": tree.depth, "topk": tree.topk, "tree_tokens": tree.tree_tokens,
                     "step_ms": costs[name] * 1e3, "cost_vs_plain_step": cost, "tau": r.stats["tau"],
                     "est_speedup": r.stats["tau"] / cost, "identical": r.token_ids == plain.token_ids})
        print(f"{name:<10} cost {cost:5.2f}x  tau {r.stats['tau']:5.2f}  est {r.stats['tau'] / cost:5.2f}x",
              flush=True)
    rows.sort(key=lambda r: -r["est_speedup"])
    print(f"\n{args.model} + {args.draft}, batch 1, {len(prompts)} dev prompts x {args.max_new_tokens} tokens, "
          f"plain step {plain_s * 1e3:.1f} ms ({jax.default_backend()})")
    print(f"{'tree':<10} {'step ms':>8} {'cost':>6} {'tau':>6} {'est speedup':>12}  identical")
    for r in rows:
        print(f"{r['tree']:<10} {r['step_ms']:8.1f} {r['cost_vs_plain_step']:6.2f} {r['tau']:6.2f} "
              f"{r['est_speedup']:12.2f}  {r['identical']}")
    out = {"benchmark": "choose_tree", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                       "backend": jax.default_backend()},
           "model": args.model, "draft": args.draft, "prompts": {"file": str(args.prompts), "last": len(prompts),
                                                              "max_new_tokens": args.max_new_tokens},
           "plain_step_ms": plain_s * 1e3, "results": rows,
           "best": rows[0]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
