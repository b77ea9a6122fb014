"""`python -m eagle_jax.bench`: plain vs speculative decoding on benchmark prompts, in one run.

    python -m eagle_jax.bench --draft PATH|random --dataset mt_bench --limit 10 --max-new-tokens 256 \\
        --batch-size 1 --temperature 0 --json results/bench.json [--plot results/bench.png]

For every dataset x batch size x temperature: a warm-up that compiles every shape, then plain and
speculative generation interleaved batch by batch on the same prompts (this machine is shared and
noisy; interleaving keeps the ratio fair). Reports tokens/s of each, the speedup, tau (tokens per
verify step including the bonus token), the accepted-length histogram, wall time, and for greedy
runs whether the outputs were identical. Prints a table and writes JSON (`results`, one entry each).
Every run uses one KV cache length (the longest prompt's need), so each batch size compiles one set
of shapes and the load-aware harness (`--tree auto`) measures one cost profile per batch size.
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

from eagle_jax.datasets import load_dataset
from eagle_jax.harness import DEFAULT_CANDIDATES, candidate_trees
from eagle_jax.quant import add_quantize_args, scheme_from_arg, weight_bytes
from eagle_jax.sharding import add_mesh_args
from eagle_jax.tree import TreeConfig, parse_tree


def tree_label(tree) -> str:
    """"D,K,N" for a TreeConfig, "auto" for the harness."""
    return tree if isinstance(tree, str) else tree.name


def tree_arg(text: str):
    """--tree: "auto" or DEPTH,TOPK,TOKENS."""
    if text == "auto":
        return text
    try:
        return TreeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def candidate_arg(text: str) -> str:
    """--candidates: DEPTH,TOPK,TOKENS or off, checked as the argument is read."""
    try:
        parse_tree(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text



def build_parser():
    p = argparse.ArgumentParser(prog="python -m eagle_jax.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="target model (default: %(default)s)")
    p.add_argument("--draft", default="default",
                   help="draft head directory, 'default' (the head shipped for --model) or 'random' "
                        "(untrained; default: %(default)s)")
    p.add_argument("--dataset", action="append", default=None,
                   help="mt_bench, humaneval or a JSONL path with 'prompt'/'turns'; repeatable (default: mt_bench)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="one or more batch sizes")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one or more temperatures")
    p.add_argument("--tree", type=tree_arg, nargs="+", default=None,
                   help="one or more of DEPTH,TOPK,TOKENS or auto (the load-aware harness picks a tree or plain "
                        "decoding each step from costs measured on this device); every tree is timed against the "
                        "same plain runs (default: the engine default tree)")
    p.add_argument("--candidates", type=candidate_arg, nargs="+", default=None,
                   help="the trees --tree auto chooses from, as DEPTH,TOPK,TOKENS (plain decoding is always one; "
                        "default: " + " ".join(c for c in DEFAULT_CANDIDATES if c != "off") + ")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/bench.json", help="output JSON path (default: %(default)s)")
    p.add_argument("--plot", default=None, help="write a PNG of speedup and tau (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_mesh_args(p)
    add_quantize_args(p)
    return p


def resolve_draft(spec: str, target):
    from eagle_jax.loader import resolve_draft

    if spec in ("none", "auto"):
        raise ValueError(f"--draft {spec}: the benchmark compares against a draft head; "
                         "pass 'default', 'random' or a head directory")
    return resolve_draft(spec, target)


def run_cache_len(target, prompt_sets, max_new_tokens: int, trees, candidates=None) -> int:
    """One KV cache length for a whole run: the longest prompt of any set, its answer and the largest tree's
    slack. Every dataset, batch, plain run and tree then compiles (and the harness profiles) one set of
    shapes per batch size instead of one per cache bucket the batches happen to land in."""
    from eagle_jax import steps
    from eagle_jax.engine import encode_prompts

    all_trees = [x for t in trees for x in (candidate_trees(candidates) if t == "auto" else [t])]
    longest = max(len(ids) for prompts in prompt_sets for ids in encode_prompts(target.tokenizer, prompts, True))
    return longest + max_new_tokens + 1 + steps.tree_slack(all_trees)


def run_bench(target, draft, prompts, *, batch_size, temperature, max_new_tokens, tree, seed, progress=None,
              cache_len=None, candidates=None):
    """Plain vs speculative decoding on `prompts`; `tree` is one tree (returns one result) or a list of
    trees (returns one result per tree, all against the same plain runs). Per batch of prompts the
    plain run and each tree's run follow each other, so machine noise hits all of them alike.
    cache_len: the KV cache length every run uses (default `run_cache_len` of these prompts).
    candidates: the trees "auto" chooses from (default `harness.DEFAULT_CANDIDATES`)."""
    import numpy as np

    import eagle_jax

    trees = list(tree) if isinstance(tree, (list, tuple)) else [tree]
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    if cache_len is None:
        cache_len = run_cache_len(target, [prompts], max_new_tokens, trees, candidates)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, cache_len=cache_len)

    def tree_kw(t):
        return dict(tree=t, candidates=candidates) if t == "auto" and candidates is not None else dict(tree=t)
    # Warm-up: compile every bucket both engines will use (same shapes as the timed run, 2 steps each).
    for b in batches:
        eagle_jax.generate(target, b, max_steps=2, **kw)
        for t in trees:
            eagle_jax.generate(target, b, draft=draft, max_steps=2, **tree_kw(t), **kw)
    plain_t, plain_n = 0.0, 0
    acc = [{"t": 0.0, "n": 0, "counts": [], "identical": True, "choices": {}} for _ in trees]
    start = time.perf_counter()
    for b in batches:
        p = eagle_jax.generate(target, b, **kw)
        plain_t += p.stats["wall_s"]
        plain_n += p.stats["generated_tokens"]
        for t, a in zip(trees, acc):
            s = eagle_jax.generate(target, b, draft=draft, **tree_kw(t), **kw)
            a["t"] += s.stats["wall_s"]
            a["n"] += s.stats["generated_tokens"]
            a["counts"] += s.stats["accepted_per_step"]
            for name, k in s.stats.get("choices", {}).items():  # tree="auto": the harness's choices
                a["choices"][name] = a["choices"].get(name, 0) + k
            a["identical"] &= p.token_ids == s.token_ids
        if progress:
            progress(len(b))
    wall = time.perf_counter() - start
    plain_tps = plain_n / plain_t
    results = []
    for t, a in zip(trees, acc):
        counts = a["counts"]
        depth = t.depth if hasattr(t, "depth") else max(counts, default=1) - 1
        hist = np.bincount(np.asarray(counts, np.int64), minlength=depth + 2)[1:].tolist() if counts else []
        spec_tps = a["n"] / a["t"]
        results.append({
            "batch_size": batch_size,
            "temperature": temperature,
            "tree": tree_label(t),
            "prompts": len(prompts),
            "plain_tokens_per_s": plain_tps,
            "spec_tokens_per_s": spec_tps,
            "speedup": spec_tps / plain_tps,
            "tau": float(np.mean(counts)) if counts else 1.0,
            "accept_histogram": hist,
            "greedy_identical": bool(a["identical"]) if temperature == 0 else None,
            "plain_wall_s": plain_t,
            "spec_wall_s": a["t"],
            "wall_s": wall,
            "cache_len": cache_len,
            "plain_tokens": plain_n,
            "spec_tokens": a["n"],
            **({"choices": a["choices"]} if a["choices"] else {}),
        })
    return results if isinstance(tree, (list, tuple)) else results[0]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from eagle_jax import sharding

    sharding.setup_from_args(args)
    import jax
    from flax import nnx

    import eagle_jax

    datasets = args.dataset or ["mt_bench"]
    try:
        if args.candidates is not None:
            candidate_trees(args.candidates)  # only "off": no tree to choose
            if "auto" not in (args.tree or []):
                raise ValueError("--candidates are the trees --tree auto chooses from: add auto to --tree")
        if "auto" in (args.tree or []) and jax.process_count() > 1:
            raise ValueError("--tree auto measures step costs in each process, which would choose apart: "
                             "give fixed trees with several processes")
        data = {d: load_dataset(d)[: args.limit] for d in datasets}
        target = eagle_jax.load_target(args.model, tensor_parallel=args.tensor_parallel,
                                       data_parallel=args.data_parallel, expert_parallel=args.expert_parallel,
                                       quantize=scheme_from_arg(args.quantize))
        draft = resolve_draft(args.draft, target)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trees = args.tree or [eagle_jax.TreeConfig()]
    total = sum(len(p) for p in data.values()) * len(args.batch_size) * len(args.temperature)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="bench", unit="prompt", file=sys.stderr)
    cache_len = run_cache_len(target, list(data.values()), args.max_new_tokens, trees, args.candidates)
    results = []
    for name, prompts in data.items():
        for bs in args.batch_size:
            for temp in args.temperature:
                rs = run_bench(target, draft, prompts, batch_size=bs, temperature=temp,
                               max_new_tokens=args.max_new_tokens, tree=trees, seed=args.seed,
                               progress=bar.update if bar else None, cache_len=cache_len,
                               candidates=args.candidates)
                results += [{"dataset": name, **r} for r in rs]
    if bar:
        bar.close()
    if not sharding.is_leader():  # every process ran the same steps; process 0 reports
        return 0
    print(f"\n{args.model} + draft {args.draft}, tree {' '.join(map(tree_label, trees))}, "
          f"{args.max_new_tokens} new tokens, {jax.default_backend()}")
    print(f"{'dataset':<12} {'batch':>5} {'temp':>5} {'tree':>7} {'plain tok/s':>12} {'spec tok/s':>11} "
          f"{'speedup':>8} {'tau':>6}  identical")
    for r in results:
        print(f"{r['dataset']:<12} {r['batch_size']:>5} {r['temperature']:>5} {r['tree']:>7} "
              f"{r['plain_tokens_per_s']:12.1f} {r['spec_tokens_per_s']:11.1f} {r['speedup']:8.2f} {r['tau']:6.2f}  "
              f"{r['greedy_identical']}")
    out = {
        "benchmark": "eagle_jax.bench",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": args.model, "draft": args.draft,
        "trees": [tree_label(t) for t in trees],
        "candidates": [t.name for t in candidate_trees(args.candidates)] if "auto" in trees else None,
        "max_new_tokens": args.max_new_tokens,
        "mesh": sharding.mesh_shape(target.model.mesh),
        "quantization": scheme_from_arg(args.quantize),
        "weight_bytes": weight_bytes(nnx.state(target.model)),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                    "backend": jax.default_backend()},
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    if args.plot:
        try:
            plot_report(out, args.plot)
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def plot_report(report: dict, path) -> None:
    """Speedup and tau per result of a bench report (the JSON `main` writes), titled with the model,
    draft, tree, machine and date."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, axes = plt.subplots(1, 2, figsize=(max(9.0, 1.6 * len(results)), 4.2))
    several = len({r.get("tree") for r in results}) > 1
    labels = [f"{r['dataset']}\nB={r['batch_size']} T={r['temperature']:g}" + (f"\n{r['tree']}" if several else "")
              for r in results]
    bars = axes[0].bar(labels, [r["speedup"] for r in results])
    axes[0].bar_label(bars, fmt="%.2f")
    axes[0].axhline(1.0, color="gray", lw=1)
    axes[0].set_ylabel("speedup vs plain decoding")
    bars = axes[1].bar(labels, [r["tau"] for r in results], color="tab:orange")
    axes[1].bar_label(bars, fmt="%.2f")
    axes[1].set_ylabel("tau (tokens / verify step)")
    for ax in axes:
        ax.margins(y=0.12)
    m = report.get("machine", {})
    t = report.get("trees") or report.get("tree") or {}  # "tree": reports written before multi-tree runs
    tree = (f"{t['depth']},{t['topk']},{t['tree_tokens']}" if isinstance(t, dict) and t
            else " ".join(t) if isinstance(t, list) else str(t))
    fig.suptitle(f"{report.get('model')} + draft {report.get('draft')}, tree {tree}, "
                 f"{report.get('max_new_tokens')} new tokens; {m.get('backend', '?')} ({m.get('cpus', '?')} CPUs), "
                 f"jax {m.get('jax', '?')}, {str(report.get('date', ''))[:10]}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
