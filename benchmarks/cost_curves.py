"""Verify and draft cost curves on this machine: the numbers a tree configuration is chosen from.

    python benchmarks/cost_curves.py [--batch-sizes 1 8] [--json results/cost_curves.json]

* verify: one target forward over N tree tokens against a cache holding `--context` tokens, for
  N in 1..64, relative to N = 1 (a plain decode step);
* draft: one draft-head step over k frontier nodes including its top-k over the vocabulary, for
  EAGLE-1 (the target's full-vocabulary lm_head) and EAGLE-3 heads with several draft vocabularies.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import eagle_jax  # noqa: E402


def median_time(fn, reps=15):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _verify(graphdef, state, tokens, cache):
    model = nnx.merge(graphdef, state)
    n = tokens.shape[1]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (tokens.shape[0], n, n))
    return model(tokens, cache, tree_mask=mask, logits_at=None).logits


@functools.partial(jax.jit, static_argnames=("graphdef", "head_graphdef", "k"))
def _draft(graphdef, state, head_graphdef, head_state, feats, tokens, cache, k):
    target = nnx.merge(graphdef, state)
    head = nnx.merge(head_graphdef, head_state)
    b = tokens.shape[0]
    h, _ = head(target, feats, tokens, cache, fuse=False,
                positions=jnp.broadcast_to(cache.lengths[:, None], (b, k)), tree_mask=jnp.ones((b, k, k), bool))
    return jax.lax.top_k(head.logprobs(target, h), k)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--json", default="results/cost_curves.json")
    args = ap.parse_args(argv)
    target = eagle_jax.load_target("smollm2-135m-instruct")
    g, st = nnx.split(target.model)
    H = target.cfg.hidden_size
    out = {"verify": {}, "draft": {}}
    for b in args.batch_sizes:
        cache = target.model.init_cache(b, 256).replace(lengths=jnp.full((b,), args.context, jnp.int32))
        row = {}
        for n in (1, 2, 4, 8, 16, 32, 64):
            toks = jnp.zeros((b, n), jnp.int32)
            row[n] = median_time(lambda: _verify(g, st, toks, cache).block_until_ready())
        out["verify"][b] = row
        heads = {"eagle1 (V=49152)": eagle_jax.random_head(target.cfg, "eagle1")}
        for vd in (4096, 8192, 16384, 32000):
            heads[f"eagle3 (Vd={vd})"] = eagle_jax.random_head(target.cfg, "eagle3", draft_vocab_size=vd)
        drow = {}
        for name, head in heads.items():
            hg, hs = nnx.split(head)
            for k in (1, 4, 8):
                dcache = head.init_cache(b, 256).replace(lengths=jnp.full((b,), args.context, jnp.int32))
                feats = jnp.zeros((b, k, H), jnp.float32)
                toks = jnp.zeros((b, k), jnp.int32)
                drow[f"{name} k={k}"] = median_time(
                    lambda: _draft(g, st, hg, hs, feats, toks, dcache, k)[0].block_until_ready())
        out["draft"][b] = drow

    for b in args.batch_sizes:
        base = out["verify"][b][1]
        print(f"\nbatch {b}: verify cost of N tree tokens (context {args.context}); N=1 is a plain decode step")
        print("  " + "  ".join(f"N={n}: {t * 1e3:6.1f} ms ({t / base:4.2f}x)" for n, t in out["verify"][b].items()))
        print(f"batch {b}: one draft step (k frontier nodes + top-k), relative to N=1 verify")
        for name, t in out["draft"][b].items():
            print(f"  {name:<26} {t * 1e3:6.2f} ms  {t / base:5.3f}x")
    report = {"benchmark": "cost_curves", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                          "backend": jax.default_backend()},
              "context": args.context, "seconds": out}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
