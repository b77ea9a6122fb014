"""What a plain decode step costs as rows and max_model_len grow: contiguous vs paged KV caches.

    python benchmarks/paged_kv.py [--context 100] [--batch-sizes 1 32] [--json results/paged_kv.json]

SmolLM2-135M-Instruct f32, every row holding `--context` committed tokens, one plain step (the engine's
`run_step`, all-greedy program) under four cache layouts, in one run:
* contiguous, cache 256: every row holds 256 slots, attention reads all of them;
* contiguous, cache 2048: every row holds 2048 slots (max_model_len 2048), attention reads all of them;
* contiguous, cache 2048, window: attention reads the power-of-two window that holds the rows (128);
* paged, width 2048 (with and without a window): rows hold only the 16-slot blocks their context (+ 20
  slots of room) needs, in one pool; attention walks the rows' blocks through the block table, 128
  slots at a time, as far as the longest row reaches (`pallas_kernels.chunked`): no window needed.
For each: ms a step, tokens/s (rows / step time), and the KV memory the layout holds. Then the figures
the paged cache is for: throughput at the largest batch over batch 1, the step at max_model_len 2048
over one at 256 for the same contexts, and how many such rows a fixed KV budget (the contiguous
2048-slot rows of the largest batch) holds paged. Best of three medians, layouts interleaved.
Prints a table and writes JSON.
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eagle_jax  # noqa: E402
from eagle_jax import steps  # noqa: E402
from eagle_jax.engine import Engine  # noqa: E402
from eagle_jax.paging import blocks_for  # noqa: E402
from eagle_jax.rows import attention_window  # noqa: E402
from eagle_jax.sampling import SamplingParams  # noqa: E402

BLOCK = 16
ROOM = 20  # slots a row holds past its context (what it may still generate in this benchmark)


def kv_bytes(cache) -> int:
    return sum(a.size * a.dtype.itemsize for a in (*cache.k, *cache.v))


def layouts(eng: Engine, batch: int, context: int):
    """name -> (state, window)."""
    t = eng.target
    win = attention_window(context + 1, 2048)
    return {
        "contiguous 256": (steps.empty_state(t, None, batch, 256), None),
        "contiguous 2048": (steps.empty_state(t, None, batch, 2048), None),
        "contiguous 2048, window": (steps.empty_state(t, None, batch, 2048), win),
        "paged 2048, window": (eng.paged_state([context + ROOM] * batch, batch, 2048, 0, BLOCK), win),
        "paged 2048": (eng.paged_state([context + ROOM] * batch, batch, 2048, 0, BLOCK), None),
    }


def time_layouts(eng: Engine, batch: int, context: int, reps: int = 7, rounds: int = 3) -> dict:
    params = SamplingParams.make(batch)
    active = jnp.ones((batch,), bool)
    boxes = layouts(eng, batch, context)
    out = {k: {"ms": [], "kv_bytes": kv_bytes(s.cache), "window": w} for k, (s, w) in boxes.items()}

    def once(name):
        s, w = boxes[name]
        s = s.replace(cache=s.cache.replace(lengths=jnp.full((batch,), context, jnp.int32)))
        s, _, count = eng.run_step(s, params, active, None, window=w, sampling=False)
        count.block_until_ready()
        boxes[name] = (s, w)

    for name in boxes:
        once(name)  # compile
    for _ in range(rounds):
        for name in boxes:
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                once(name)
                ts.append(time.perf_counter() - t0)
            out[name]["ms"].append(float(np.median(ts)) * 1e3)
    for v in out.values():
        v["ms"] = min(v["ms"])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", default="results/paged_kv.json")
    args = ap.parse_args(argv)
    eng = Engine(eagle_jax.load_target("smollm2-135m-instruct"))
    res = {b: time_layouts(eng, b, args.context) for b in args.batch_sizes}

    lo, hi = min(args.batch_sizes), max(args.batch_sizes)
    print(f"\nSmolLM2-135M-Instruct f32, plain step, rows of {args.context} committed tokens "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)")
    print(f"{'layout':<26} {'rows':>5} {'window':>7} {'ms/step':>9} {'tok/s':>8} {'KV MB':>8}")
    for b, rows in res.items():
        for name, r in rows.items():
            print(f"{name:<26} {b:5d} {str(r['window'] or 'all'):>7} {r['ms']:9.1f} {b / r['ms'] * 1e3:8.1f} "
                  f"{r['kv_bytes'] / 2**20:8.1f}")
    paged, base = "paged 2048", "contiguous 256"
    speedup = (hi / res[hi][paged]["ms"]) / (lo / res[lo][paged]["ms"])
    vs256 = res[hi][paged]["ms"] / res[hi][base]["ms"]
    budget = res[hi]["contiguous 2048"]["kv_bytes"]
    per_row = res[hi][paged]["kv_bytes"] / hi  # the pool holds exactly its rows' blocks
    fits = int(budget // per_row)
    summary = {"throughput_ratio": speedup, "step_2048_over_256": vs256,
               "rows_per_budget_paged": fits, "rows_per_budget_contiguous": hi,
               "blocks_per_row": blocks_for(args.context + ROOM, BLOCK)}
    print(f"\npaged: {hi} rows give {speedup:.1f}x the tokens/s of {lo}; a step at max_model_len 2048 "
          f"costs {vs256:.2f}x one at 256")
    print(f"a KV budget of {budget / 2**20:.0f} MB ({hi} contiguous rows of 2048 slots) holds {fits} paged rows "
          f"of {args.context} + {ROOM} tokens ({fits / hi:.1f}x)")
    report = {"benchmark": "paged_kv", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                          "jax": jax.__version__, "backend": jax.default_backend()},
              "context": args.context, "block_size": BLOCK, "results": {str(b): r for b, r in res.items()},
              "summary": summary}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
