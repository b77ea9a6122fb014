"""A decode step of the real target with the CPU's attention (`pallas_kernels.cpu`) against the reference's.

    python benchmarks/cpu_attention.py [--batch-size 64] [--cache-len 1024] [--lengths 100 300 600 900]
        [--tree 3,4,8] [--mixed] [--reps 5] [--json results/cpu_attention.json]

For each row length, one step program per implementation is compiled (the step reads the attention
window that holds the rows, as `generate(..., attention_window=True)` does), and the two run alternately
in one process, so the ratio is fair on a shared machine. Without --tree the step is plain decoding (the
data pipeline's answers: batch 64, up to 1024 slots); with --tree it drafts and verifies that tree with
the shipped draft head (the bench's batch-1 speculative step). Prints a table and writes JSON.
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
from eagle_jax.engine import engine_for  # noqa: E402
from eagle_jax.loader import resolve_draft  # noqa: E402
from eagle_jax.rows import attention_window  # noqa: E402
from eagle_jax.sampling import SamplingParams  # noqa: E402
from eagle_jax.tree import TreeConfig  # noqa: E402
from pallas_kernels import use_implementation  # noqa: E402

IMPLEMENTATIONS = ("reference", "cpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default=None, help="draft head directory for --tree (default: the model's shipped head)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--cache-len", type=int, default=1024)
    ap.add_argument("--lengths", type=int, nargs="+", default=[100, 300, 600, 900])
    ap.add_argument("--tree", default=None, help="a speculative step of this D,K,N tree instead of a plain one")
    ap.add_argument("--mixed", action="store_true",
                    help="rows spread evenly over 1..length (as in continuous batching) instead of all at length")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="results/cpu_attention.json")
    args = ap.parse_args(argv)
    if jax.default_backend() != "cpu":
        ap.error(f"this compares XLA:CPU attention; the backend is {jax.default_backend()}")

    target = eagle_jax.load_target(args.model, tokenizer=False)
    tree = TreeConfig.parse(args.tree) if args.tree else None
    head = resolve_draft(args.head or "default", target) if tree is not None else None
    eng = engine_for(target, head)
    b, n_new = args.batch_size, tree.tree_tokens if tree is not None else 1
    draft_len = args.cache_len + (steps.draft_extra([tree]) if tree is not None else 0)
    params = SamplingParams.make(b)
    active = np.ones((b,), bool)
    abstract = eng.abstract(jax.eval_shape(lambda: eng.empty_state(b, args.cache_len, draft_len)))
    p_abs, a_abs = eng.abstract((params, jax.ShapeDtypeStruct((b,), jnp.bool_)))
    rows = []
    for length in args.lengths:
        window = attention_window(length + n_new + (tree.depth if tree is not None else 0), args.cache_len)
        programs = {}
        for impl in IMPLEMENTATIONS:
            with use_implementation(impl):
                programs[impl] = steps.compile_step(eng.graphdef, eng.state, eng.head_graphdef, eng.head_state,
                                                    abstract, p_abs, a_abs, tree, window, False, fresh=True)
        times = {impl: [] for impl in IMPLEMENTATIONS}
        emitted = {}

        def one(impl):
            s = eng.empty_state(b, args.cache_len, draft_len)
            lens = np.ceil(length * np.arange(1, b + 1) / b) if args.mixed else np.full((b,), length)
            s = s.replace(cache=s.cache.replace(lengths=jnp.asarray(lens, jnp.int32)))
            jax.block_until_ready(s)
            t0 = time.perf_counter()
            _, out, count = programs[impl](eng.state, eng.head_state, s, params, jnp.asarray(active))
            count.block_until_ready()
            emitted[impl] = np.asarray(out)
            return time.perf_counter() - t0

        for impl in IMPLEMENTATIONS:  # warm both
            one(impl)
        for _ in range(args.reps):  # alternate, so load from elsewhere hits both alike
            for impl in IMPLEMENTATIONS:
                times[impl].append(one(impl))
        ref, cpu = (float(np.median(times[i])) for i in IMPLEMENTATIONS)
        rows.append({"batch_size": b, "cache_len": args.cache_len, "length": length, "window": window or args.cache_len,
                     "tree": args.tree, "mixed": args.mixed, "reference_ms": ref * 1e3, "cpu_ms": cpu * 1e3, "speedup": ref / cpu,
                     "same_tokens": bool(np.array_equal(emitted["reference"], emitted["cpu"]))})
    kind = f"{args.tree} tree" if tree is not None else "plain"
    kind += ", rows spread over 1..length" if args.mixed else ""
    print(f"{kind} decode step, batch {b}, cache {args.cache_len} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, jax {jax.__version__})")
    print(f"{'row length':>10} {'window':>7} {'reference ms':>13} {'cpu ms':>8} {'speedup':>8} {'same tokens':>12}")
    for r in rows:
        print(f"{r['length']:>10} {r['window']:>7} {r['reference_ms']:>13.1f} {r['cpu_ms']:>8.1f} "
              f"{r['speedup']:>7.2f}x {str(r['same_tokens']):>12}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
                               "host": platform.processor() or platform.machine(), "results": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
