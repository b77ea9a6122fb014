"""Answer tokens/s of the data pipeline: static batches against continuous batching, in one process.

    python benchmarks/data_answering.py [--prompts train/prompts/campaign-prompts-2.jsonl] [--start 12000]
        [--count 64] [--max-new-tokens 256] [--batch-size 32] [--json results/data_answering.json]

Answers the same conversations (every turn of each JSONL line, as the campaign does) twice into
temporary directories: with `generate_dataset`'s static batches (a batch runs until its longest answer
ends; later turns of a shard's conversations follow as a smaller batch) and with `continuous=True` (the
server's engine loop keeps `--batch-size` rows busy, later turns queued as soon as the earlier answer
ends). Each mode first answers `--warmup` other conversations, so the timed runs do not pay for
compiling the shapes they share, and the time JAX spends compiling during the timed runs (what a long
job pays once) is reported apart. Prints answer tokens/s of both with and without it, their ratios and
whether the shards are equal; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import jax  # noqa: E402

import eagle_jax  # noqa: E402
from eagle_jax.train import data  # noqa: E402

MODES = ("static", "continuous")


COMPILING = [0.0]  # seconds JAX spent tracing, lowering and compiling (every thread)


def count_compiles(name: str, seconds: float, **_) -> None:
    if name.startswith("/jax/core/compile/"):
        COMPILING[0] += seconds


def answer(target, prompts, settings, mode: str, out: Path) -> tuple[float, float, int]:
    """(seconds, of which compiling, answer tokens) of answering `prompts` into `out` in this mode."""
    t0, c0 = time.perf_counter(), COMPILING[0]
    data.generate_dataset(target, prompts, out, settings, continuous=mode == "continuous")
    seconds = time.perf_counter() - t0
    return seconds, COMPILING[0] - c0, sum(int(m.sum()) for _, m in data.read_dataset(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="train/prompts/campaign-prompts-2.jsonl")
    ap.add_argument("--start", type=int, default=12000, help="first JSONL line (0-based) of the timed conversations")
    ap.add_argument("--count", type=int, default=64, help="conversations timed")
    ap.add_argument("--warmup", type=int, default=16, help="conversations answered first by each mode (compiles)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--json", default="results/data_answering.json")
    args = ap.parse_args(argv)
    for name in ("count", "warmup", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    prompts = data.load_jsonl_prompts(args.prompts, turns="all")
    timed = prompts[args.start: args.start + args.count]
    warm = prompts[args.start + args.count: args.start + args.count + args.warmup]
    if len(timed) < args.count or not warm:
        ap.error(f"{args.prompts} has {len(prompts)} lines: not enough after --start {args.start}")
    jax.monitoring.register_event_duration_secs_listener(count_compiles)
    target = eagle_jax.load_target(args.model)
    settings = data.GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                       shard_size=args.count)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            answer(target, warm, settings, mode, Path(tmp) / f"warm-{mode}")
            seconds, compiling, tokens = answer(target, timed, settings, mode, Path(tmp) / mode)
            results[mode] = {"seconds": seconds, "compile_seconds": compiling, "answer_tokens": tokens,
                             "tokens_per_s": tokens / seconds, "tokens_per_s_without_compiles": tokens / (seconds - compiling)}
            print(f"[{mode}] {tokens} answer tokens in {seconds:.1f} s ({compiling:.1f} s compiling)", flush=True)
        rows = {mode: data.read_dataset(Path(tmp) / mode) for mode in MODES}
    same = sum(np.array_equal(a[0], b[0]) for a, b in zip(*rows.values()))
    ratio = results["continuous"]["tokens_per_s"] / results["static"]["tokens_per_s"]
    ratio_run = (results["continuous"]["tokens_per_s_without_compiles"]
                 / results["static"]["tokens_per_s_without_compiles"])
    turns = sum(len(data.prompt_turns(p)) for p in timed)
    print(f"\nanswering {len(timed)} conversations ({turns} turns), up to {args.max_new_tokens} new tokens, "
          f"batch {args.batch_size} ({platform.processor() or platform.machine()}, {os.cpu_count()} cpus)")
    print(f"{'mode':<11} {'answer tokens':>13} {'seconds':>8} {'compiling':>9} {'tokens/s':>9} {'without compiles':>17}")
    for mode in MODES:
        r = results[mode]
        print(f"{mode:<11} {r['answer_tokens']:>13} {r['seconds']:>8.1f} {r['compile_seconds']:>9.1f} "
              f"{r['tokens_per_s']:>9.1f} {r['tokens_per_s_without_compiles']:>17.1f}")
    print(f"continuous / static: {ratio:.2f}x ({ratio_run:.2f}x without compiles); identical conversations: "
          f"{same} of {len(timed)}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
                               "conversations": len(timed), "turns": turns, "max_new_tokens": args.max_new_tokens,
                               "batch_size": args.batch_size, "results": results, "ratio": ratio, "ratio_without_compiles": ratio_run,
                               "identical_conversations": int(same)}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
