"""Step time against the tensor-parallel degree, on a mesh of fake CPU devices.

    python benchmarks/tensor_parallel.py [--devices 8] [--tokens 32] [--json results/tensor_parallel.json]

Two targets, every degree in one process of `--devices` fake CPU devices (XLA_FLAGS is set here, before
JAX starts):
* SmolLM2-135M-Instruct (9 heads, 3 kv heads, MLP 1536) at degree 1 and 3, the degrees its shape admits;
* a random 8-layer Llama of SmolLM2's width and vocabulary with 8 heads and 8 kv heads at degree 1, 2, 4
  and 8 (8 layers keep its compiles short).
For each: ms a plain step and ms a 3,4,8 speculative step (with an untrained EAGLE-3 head of the target's
shape; `generate` over one prompt with ignore_eos, wall time / target forwards, the best of three runs,
the first of which compiles),
and whether the greedy tokens equal degree 1's.

On CPU the fake devices share the machine's cores and every collective is a memory copy, so the table
shows that the sharded programs run and what their overhead is, not a speed-up: a sharded step costs
more here. On GPUs or TPUs each shard has its own chip and memory bandwidth. Prints a table, writes JSON.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per run (default: %(default)s)")
    p.add_argument("--json", default="results/tensor_parallel.json")
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    import dataclasses

    import jax

    import eagle_jax
    from eagle_jax.draft import random_head
    from eagle_jax.loader import Target
    from eagle_jax.model import random_model
    from eagle_jax.sharding import shard_target

    real = eagle_jax.load_target("smollm2-135m-instruct")
    cfg8 = dataclasses.replace(real.cfg, num_heads=8, num_kv_heads=8, head_dim=64, hidden_size=512,
                               intermediate_size=1536, num_layers=8)
    wide = Target(model=random_model(cfg8, seed=0), tokenizer=None, name="random-8-heads", source="random")
    prompt = real.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                                add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if not isinstance(prompt, list) else prompt
    rows = []
    for tgt, degrees in ((real, (1, 3)), (wide, (1, 2, 4, 8))):
        head = random_head(tgt.cfg, "eagle3", seed=1)
        base = {}
        for tp in degrees:
            if tp > args.devices:
                continue
            shard_target(tgt, tp, 1)
            row = {"model": tgt.name, "tensor_parallel": tp}
            for label, draft, tree in (("plain", None, None), ("d3k4n8", head, "3,4,8")):
                best, ids = None, None
                for _ in range(3):  # the first run compiles
                    r = eagle_jax.generate(tgt, [prompt], draft, tree=tree, max_new_tokens=args.tokens, ignore_eos=True)
                    ms = 1000 * r.stats["wall_s"] / r.stats["steps"]
                    best = ms if best is None or ms < best else best
                    ids = r.token_ids
                base.setdefault(label, ids)
                row[f"{label}_ms"] = round(best, 2)
                row[f"{label}_same_as_tp1"] = ids == base[label]
            rows.append(row)
            print(f"{row['model']:<24} TP {tp}: plain {row['plain_ms']:7.1f} ms  d3k4n8 {row['d3k4n8_ms']:7.1f} ms  "
                  f"same tokens {row['plain_same_as_tp1'] and row['d3k4n8_same_as_tp1']}", flush=True)
    print(f"\nstep time vs tensor-parallel degree, {args.devices} fake CPU devices on {os.cpu_count()} cores "
          "(correctness, not speed: see the docstring)")
    print(f"{'model':<24} {'TP':>3} {'plain ms':>9} {'d3k4n8 ms':>10} {'x TP1 plain':>12} {'same tokens':>12}")
    for r in rows:
        one = next(x for x in rows if x["model"] == r["model"] and x["tensor_parallel"] == 1)
        print(f"{r['model']:<24} {r['tensor_parallel']:>3} {r['plain_ms']:9.1f} {r['d3k4n8_ms']:10.1f} "
              f"{r['plain_ms'] / one['plain_ms']:12.2f} {str(r['plain_same_as_tp1'] and r['d3k4n8_same_as_tp1']):>12}")
    out = {"benchmark": "tensor_parallel", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                       "backend": jax.default_backend(), "devices": len(jax.devices())},
           "new_tokens": args.tokens, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
