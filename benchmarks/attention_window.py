"""What a plain decode step costs with the attention window (`generate(..., attention_window=True)`)
against attention over the whole preallocated cache, for rows filled to several lengths.

    python benchmarks/attention_window.py [--batch-size 32] [--cache-len 1024] [--lengths 64 200 400 900]
        [--json results/attention_window.json]

The data pipeline answers campaign prompts in batches of 32 with up to 512 new tokens (cache 1024):
without a window every step pays for 1024 slots from the first token on. Both variants run in one
process, alternating, so the ratio is fair on a shared machine. Prints a table and writes JSON.
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

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eagle_jax  # noqa: E402
from eagle_jax import steps  # noqa: E402
from eagle_jax.engine import engine_for  # noqa: E402
from eagle_jax.rows import attention_window  # noqa: E402
from eagle_jax.sampling import SamplingParams  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--cache-len", type=int, default=1024)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 200, 400, 900])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default="results/attention_window.json")
    args = ap.parse_args(argv)

    target = eagle_jax.load_target(args.model, tokenizer=False)
    eng = engine_for(target)
    b = args.batch_size
    params = SamplingParams.make(b)
    active = np.ones((b,), bool)
    state = steps.empty_state(target, None, b, args.cache_len)
    rows = []
    for length in args.lengths:
        window = attention_window(length + 1, args.cache_len)
        times = {None: [], window: []}

        def one(s, w):
            s = s.replace(cache=s.cache.replace(lengths=jnp.full((b,), length, jnp.int32)))
            t0 = time.perf_counter()
            s, _, count = eng.run_step(s, params, active, None, window=w)
            count.block_until_ready()
            return s, time.perf_counter() - t0

        for w in times:  # compile and warm both
            state, _ = one(state, w)
            state, _ = one(state, w)
        for _ in range(args.reps):  # alternate, so load from elsewhere hits both alike
            for w in times:
                state, sec = one(state, w)
                times[w].append(sec)
        full, win = (float(np.median(times[w])) for w in (None, window))
        rows.append({"batch_size": b, "cache_len": args.cache_len, "length": length, "window": window or args.cache_len,
                     "full_ms": full * 1e3, "window_ms": win * 1e3, "speedup": full / win})
    print(f"plain decode step, batch {b}, cache {args.cache_len} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus)")
    print(f"{'row length':>10} {'window':>7} {'whole cache ms':>15} {'window ms':>10} {'speedup':>8}")
    for r in rows:
        print(f"{r['length']:>10} {r['window']:>7} {r['full_ms']:>15.1f} {r['window_ms']:>10.1f} {r['speedup']:>7.2f}x")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
                               "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
