"""Where a speculative step's time goes, against a plain step and this machine's memory bandwidth.

    python benchmarks/step_breakdown.py [--context 128] [--cache-len 256] [--json results/step_breakdown.json]

With the shipped SmolLM2-135M-Instruct EAGLE-3 head at batch 1 (f32), in one run (ratios only mean
something within a run on a shared machine):
* whole steps as the engine runs them (`profiles.stepper`, all-greedy programs): plain, n1 (verify the
  root alone and refresh the draft), d3k1n4 and d3k4n8;
* their parts, each as its own jitted program: the verify forward over N tree tokens (with and without
  the lm_head), one draft level (k frontier nodes, their draft-vocabulary top-k), the whole drafted tree,
  and the draft refresh over the accepted pairs (separate programs do not overlap or fuse as a step's
  parts do, so they do not add up to the step exactly);
* the floor: the bytes a plain step must read (weights + the KV it attends over) at this machine's
  streaming bandwidth (numpy copy and a one-row matrix-vector product), and one matmul of the target's
  MLP shape at 1..16 rows through XLA and through numpy (OpenBLAS).
Every figure is the best of three medians, the kinds interleaved. Prints a table and writes JSON.
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
from eagle_jax import profiles, steps  # noqa: E402
from eagle_jax.compiling import param_count  # noqa: E402
from eagle_jax.loader import default_head_path  # noqa: E402
from eagle_jax.tree import TreeConfig  # noqa: E402

TREES = {"plain": None, "n1": TreeConfig(3, 1, 1), "d3k1n4": TreeConfig(3, 1, 4), "d3k4n8": TreeConfig(3, 4, 8)}


def best_median(fns: dict, reps: int = 11, rounds: int = 3) -> dict:
    """name -> seconds: the smallest of `rounds` medians of `reps` calls, rounds interleaved across names."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                jax.block_until_ready(fn())
                ts.append(time.perf_counter() - t)
            out[k].append(float(np.median(ts)))
    return {k: min(v) for k, v in out.items()}


def whole_steps(target, head, cache_len, context):
    trees = [t for t in TREES.values() if t is not None]
    state, run = profiles.stepper(target, head, list(TREES.values()), 1, cache_len,
                                  cache_len + steps.draft_extra(trees), context, sampling=False)
    box = [state]

    def once(tree):
        def f():
            box[0] = run(box[0], tree)
            return box[0].root
        return f

    return best_median({name: once(tree) for name, tree in TREES.items()})


def parts(target, head, cache_len, context):
    g, st = nnx.split(target.model)
    hg, hs = nnx.split(head)
    s = steps.empty_state(target, head, 1, cache_len, cache_len + 64)
    ctx = jnp.full((1,), context, jnp.int32)
    s = s.replace(cache=s.cache.replace(lengths=ctx), draft_cache=s.draft_cache.replace(lengths=ctx))
    layers = steps.capture_layers(head.cfg)

    @functools.partial(jax.jit, static_argnames=("logits",))
    def verify(st, s, tokens, logits):
        n = tokens.shape[1]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (1, n, n))
        out = nnx.merge(g, st)(tokens, s.cache, tree_mask=mask, capture_layers=layers,
                               logits_at=None if logits else False)
        return out.logits if logits else out.hidden

    @functools.partial(jax.jit, static_argnames=("tree",))
    def draft(st, hs, s, tree):
        return steps.draft_tree(nnx.merge(g, st), nnx.merge(hg, hs), s, tree).tokens

    @jax.jit
    def level(st, hs, s, inp, tok):
        hd = nnx.merge(hg, hs)
        k = tok.shape[1]
        h, _ = hd(nnx.merge(g, st), inp, tok, s.draft_cache, fuse=False,
                  positions=jnp.broadcast_to(s.draft_cache.lengths[:, None], (1, k)), tree_mask=jnp.ones((1, k, k), bool))
        return jax.lax.top_k(hd.logprobs(nnx.merge(g, st), h), k)[1]

    @jax.jit
    def refresh(st, hs, s, feats, tok):
        return nnx.merge(hg, hs)(nnx.merge(g, st), feats, tok, s.draft_cache, fuse=True)[0]

    fns = {}
    for n in (1, 2, 4, 8, 16):
        tok = jnp.zeros((1, n), jnp.int32)
        fns[f"verify N={n}"] = functools.partial(verify, st, s, tok, True)
        fns[f"verify N={n}, no lm_head"] = functools.partial(verify, st, s, tok, False)
    H, F = head.cfg.hidden_size, head.cfg.feature_size
    for k in (1, 4):
        fns[f"draft level k={k}"] = functools.partial(level, st, hs, s, jnp.zeros((1, k, H)), jnp.zeros((1, k), jnp.int32))
    for name in ("d3k1n4", "d3k4n8"):
        fns[f"draft tree {name}"] = functools.partial(draft, st, hs, s, TREES[name])
    for n in sorted({t.depth + 1 for t in TREES.values() if t is not None}):
        fns[f"draft refresh {n} pairs"] = functools.partial(refresh, st, hs, s, jnp.zeros((1, n, F)),
                                                            jnp.zeros((1, n), jnp.int32))
    return best_median(fns)


def bandwidth(hidden: int, inter: int):
    """(copy GB/s (numpy, 512 MB), bytes of the 20 weights, seconds of a chain of 20 [M, hidden] @ [hidden,
    inter] products at M rows through XLA and numpy (70 MB of weights: M=1 streams them))."""
    src = np.ones(1 << 27, np.float32)
    dst = np.empty_like(src)
    t = best_median({"copy": functools.partial(np.copyto, dst, src)})["copy"]
    copy_gbs = 2 * src.nbytes / t / 1e9
    src = dst = None
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((hidden, inter), np.float32) for _ in range(20)]
    jws = [jnp.asarray(w) for w in ws]

    @jax.jit
    def chain(x, ws):
        return sum(x @ w for w in ws)

    fns = {}
    for m in (1, 2, 4, 8, 16):
        x = rng.standard_normal((m, hidden), np.float32)
        fns[f"xla M={m}"] = functools.partial(chain, jnp.asarray(x), jws)
        fns[f"numpy M={m}"] = functools.partial(lambda x: sum(x @ w for w in ws), x)
    mm = best_median(fns)
    weight_bytes = sum(w.nbytes for w in ws)
    return copy_gbs, weight_bytes, mm


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--cache-len", type=int, default=256)
    ap.add_argument("--json", default="results/step_breakdown.json")
    args = ap.parse_args(argv)
    target = eagle_jax.load_target("smollm2-135m-instruct")
    head = eagle_jax.load_draft(default_head_path(target), target.cfg)
    whole = whole_steps(target, head, args.cache_len, args.context)
    part = parts(target, head, args.cache_len, args.context)
    copy_gbs, w_bytes, mm = bandwidth(target.cfg.hidden_size, target.cfg.intermediate_size)
    plain = whole["plain"]
    cfg = target.cfg
    kv_bytes = 2 * cfg.num_layers * args.context * cfg.num_kv_heads * cfg.head_dim * 4
    step_bytes = param_count(nnx.split(target.model)[1]) * 4 + kv_bytes
    gemv_gbs = w_bytes / mm["xla M=1"] / 1e9

    print(f"\nSmolLM2-135M-Instruct f32 + shipped EAGLE-3 head, batch 1, context {args.context}, "
          f"cache {args.cache_len} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)")
    print(f"{'whole step':<28} {'ms':>8} {'x plain':>8}")
    for k, v in whole.items():
        print(f"{k:<28} {v * 1e3:8.1f} {v / plain:8.2f}")
    print(f"{'part':<28} {'ms':>8} {'x plain':>8}")
    for k, v in part.items():
        print(f"{k:<28} {v * 1e3:8.1f} {v / plain:8.2f}")
    read_gbs = w_bytes / mm["numpy M=1"] / 1e9
    floor = step_bytes / (max(read_gbs, copy_gbs) * 1e9)
    print(f"\nplain step reads {step_bytes / 1e6:.0f} MB: {floor * 1e3:.1f} ms at {max(read_gbs, copy_gbs):.1f} GB/s "
          f"(numpy one-row product {read_gbs:.1f} GB/s, copy {copy_gbs:.1f} GB/s); measured {plain * 1e3:.1f} ms, "
          f"{plain / floor:.1f}x the floor (XLA's one-row product streams {gemv_gbs:.1f} GB/s)")
    print(f"{'[M,576]@[576,1536] x20':<28} {'XLA ms':>8} {'numpy ms':>9} {'XLA x M=1':>10}")
    for m in (1, 2, 4, 8, 16):
        print(f"{'M=' + str(m):<28} {mm[f'xla M={m}'] * 1e3:8.2f} {mm[f'numpy M={m}'] * 1e3:9.2f} "
              f"{mm[f'xla M={m}'] / mm['xla M=1']:10.2f}")
    report = {"benchmark": "step_breakdown", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                          "jax": jax.__version__, "backend": jax.default_backend()},
              "context": args.context, "cache_len": args.cache_len, "whole_step_s": whole, "part_s": part,
              "ratio_vs_plain": {k: v / plain for k, v in {**whole, **part}.items()},
              "bandwidth": {"copy_gb_s": copy_gbs, "numpy_gemv_gb_s": read_gbs, "xla_gemv_gb_s": gemv_gbs, "plain_step_bytes": step_bytes,
                            "plain_floor_s": floor},
              "matmul_s": mm}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
