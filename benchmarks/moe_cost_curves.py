"""Verify cost against tree size for a MoE target and a dense target of the same active size, and the
tree the harness chooses for each.

    python benchmarks/moe_cost_curves.py [--layers 12] [--context 128] [--json results/moe_cost_curves.json]

Two random targets of SmolLM2's width (hidden 576, 9 heads / 3 kv heads, vocabulary 49152), `--layers`
layers each: a dense one with an MLP of 1536 and a MoE one with 8 experts of 768, top 2 (the same
active MLP width: 2 x 768). For each, in one process:
* verify: one target forward over N tree tokens against a cache of `--context` tokens, N = 1..64,
  relative to N = 1 (a plain decode step);
* the harness's cost profile (`eagle_jax.profiles.measure_profile`: whole engine steps with an untrained
  EAGLE-3 head) for a plain step and the default candidate trees, batch 1;
* the harness's choice (`eagle_jax.harness.Harness`) given the same acceptance for both targets: statistics
  fed with steps whose rows accept each tree level with probability `--accept` (chains `--accept-chain`),
  so only the costs differ between the two choices.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def feed(harness, trees, accept: float, accept_chain: float, steps: int = 400, seed: int = 0):
    """Observations of `steps` steps per tree: each level is accepted with the width's probability."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for tree in trees:
        p = accept_chain if tree.topk == 1 else accept
        for _ in range(steps):
            depth = 0
            while depth < tree.depth and rng.random() < p:
                depth += 1
            harness.observe(tree, [depth + 1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--accept", type=float, default=0.75, help="per-level acceptance of top-k > 1 trees")
    ap.add_argument("--accept-chain", type=float, default=0.6, help="per-level acceptance of chains")
    ap.add_argument("--json", default="results/moe_cost_curves.json")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cost_curves import median_time
    from eagle_jax.config import ModelConfig
    from eagle_jax.draft import random_head
    from eagle_jax.harness import DEFAULT_CANDIDATES, Harness, candidate_trees
    from eagle_jax.loader import Target
    from eagle_jax.model import random_model
    from eagle_jax.profiles import Profile, measure_profile
    from eagle_jax.tree import tree_name

    dense_cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_layers=args.layers, num_heads=9, num_kv_heads=3, head_dim=64, tie_embeddings=True,
                            max_position=2048)
    moe_cfg = dataclasses.replace(dense_cfg, arch="mixtral", num_experts=8, experts_per_token=2, expert_size=768)

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def verify(graphdef, state, tokens, cache):
        n = tokens.shape[1]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (tokens.shape[0], n, n))
        return nnx.merge(graphdef, state)(tokens, cache, tree_mask=mask, logits_at=None).logits

    trees = candidate_trees(DEFAULT_CANDIDATES)
    report = {}
    for label, cfg in (("dense", dense_cfg), ("moe", moe_cfg)):
        target = Target(model=random_model(cfg, seed=0), tokenizer=None, name=label, source="random")
        g, st = nnx.split(target.model)
        cache = target.model.init_cache(1, 256).replace(lengths=jnp.full((1,), args.context, jnp.int32))
        curve = {}
        for n in (1, 2, 4, 8, 16, 32, 64):
            toks = jnp.zeros((1, n), jnp.int32)
            curve[n] = median_time(lambda: verify(g, st, toks, cache).block_until_ready(), reps=9)
        head = random_head(cfg, "eagle3", seed=1)
        seconds = measure_profile(target, head, [1], [None] + trees, cache_len=256, draft_len=256, reps=5,
                                  context=args.context, sampling=False)
        harness = Harness([None] + trees, Profile(key=label, seconds=seconds, meta={}, source="measured"), ucb=0.0)
        feed(harness, trees, args.accept, args.accept_chain)
        choice = harness.choose(1, 1, 1)
        report[label] = {"verify_seconds": curve, "step_seconds": seconds[1], "choice": choice.name,
                         "expected_tokens": {tree_name(t): harness.stats.expected_tokens(t) for t in [None] + trees},
                         "params": sum(x.size for x in jax.tree_util.tree_leaves(st))}
    print(f"Verify cost of N tree tokens relative to a plain step (N=1), {args.layers} layers, context "
          f"{args.context} ({platform.processor() or platform.machine()}, jax {jax.__version__})")
    print(f"{'N':>4} " + " ".join(f"{lab + ' ms':>10} {lab + ' x':>8}" for lab in report))
    for n in report["dense"]["verify_seconds"]:
        print(f"{n:>4} " + " ".join(f"{r['verify_seconds'][n] * 1e3:>10.2f} "
                                    f"{r['verify_seconds'][n] / r['verify_seconds'][1]:>8.2f}" for r in report.values()))
    print("\nWhole engine steps (batch 1) and the harness's choice at the same acceptance "
          f"(trees {args.accept}, chains {args.accept_chain} per level)")
    names = list(report["dense"]["step_seconds"])
    print(f"{'candidate':>10} {'tokens':>7} " + " ".join(f"{lab + ' ms':>9} {lab + ' tok/s':>10}" for lab in report))
    for name in names:
        tokens = report["dense"]["expected_tokens"][name]
        print(f"{name:>10} {tokens:>7.2f} " + " ".join(
            f"{r['step_seconds'][name] * 1e3:>9.2f} {tokens / r['step_seconds'][name]:>10.1f}" for r in report.values()))
    print("harness chose: " + ", ".join(f"{lab} -> {r['choice']}" for lab, r in report.items()))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "moe_cost_curves", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                               "host": platform.node(), "jax": jax.__version__, "settings": vars(args),
                               "results": report}, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
