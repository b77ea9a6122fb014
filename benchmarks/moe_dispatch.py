"""The MoE MLP's two dispatches against the token count: where "grouped" (ragged_dot) overtakes "dense".

    python benchmarks/moe_dispatch.py [--hidden 576] [--expert-size 768] [--experts 8] [--top-k 2]
                                      [--json results/moe_dispatch.json]

For each token count N (a decode step, trees, prompts) it times one jitted MoE MLP (`eagle_jax.moe`) with
each dispatch, the median of repeated runs after a compile, in one process, and checks that both give the
same output. `moe.dispatch_for` switches at GROUPED_ABOVE_PAIRS_PER_EXPERT pairs per expert; the table
shows whether that holds on this machine. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--expert-size", type=int, default=768)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", default="1,4,8,16,32,64,128,512")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default="results/moe_dispatch.json")
    args = p.parse_args(argv)
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from eagle_jax import moe

    rng = np.random.default_rng(0)
    e, h, f = args.experts, args.hidden, args.expert_size
    weights = [jnp.asarray(rng.normal(scale=0.05, size=s), jnp.float32)
               for s in ((h, e), (e, h, f), (e, h, f), (e, f, h))]
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
        row = {"tokens": n, "pairs_per_expert": n * args.top_k / e, "auto": moe.dispatch_for(n, args.top_k, e)}
        outs = {}
        for name in moe.DISPATCHES:
            fn = jax.jit(functools.partial(moe.moe_mlp, top_k=args.top_k, norm_topk=True, dispatch=name))
            outs[name] = np.asarray(fn(x, *weights))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn(x, *weights).block_until_ready()
                times.append(time.perf_counter() - t0)
            row[f"{name}_ms"] = 1e3 * statistics.median(times)
        row["max_abs_diff"] = float(max(np.abs(outs[name] - outs["dense"]).max() for name in moe.DISPATCHES))
        row["faster"] = min(moe.DISPATCHES, key=lambda name: row[f"{name}_ms"])
        rows.append(row)
    print(f"MoE MLP, hidden {h}, {e} experts of {f}, top {args.top_k} ({platform.processor() or platform.machine()})")
    print(f"{'tokens':>7} {'pairs/expert':>13} {'gather ms':>10} {'dense ms':>9} {'grouped ms':>11} {'faster':>8} "
          f"{'auto':>8} {'max diff':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['pairs_per_expert']:>13.1f} {r['gather_ms']:>10.3f} {r['dense_ms']:>9.3f} "
              f"{r['grouped_ms']:>11.3f} {r['faster']:>8} {r['auto']:>8} {r['max_abs_diff']:>9.1e}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                               "jax": jax.__version__, "config": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
