"""`python -m eagle_jax.train --recipe train/<name>.toml`: data -> features -> train -> export.

Stages, each resumable: (1) prompts from the recipe's sources (eval sets refused), (2) the target's
answers written to token shards, (3) training with orbax checkpoints (kill it and rerun the same
command to resume), (4) export of the head in the official EAGLE / EAGLE-3 layout to <out>/head.
Metrics go to stdout and <out>/metrics.jsonl. On a multi-host TPU slice, set up the usual
environment (or pass --distributed) and run the same command on every host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import tomllib
from pathlib import Path

from eagle_jax.quant import SCHEMES

KNOWN = {
    "target": {"model", "quantize"},
    "head": {"kind", "draft_vocab_size", "init_from_target_layer", "init_from", "seed", "export_dtype"},
    "data": {"dir", "sources", "max_new_tokens", "temperature", "top_p", "batch_size", "shard_size", "seed",
             "holdout", "features", "features_dir", "limit", "continuous"},
    "train": {"out_dir"} | {f.name for f in dataclasses.fields(__import__(
        "eagle_jax.train.trainer", fromlist=["OptimConfig"]).OptimConfig)},
}


class RecipeError(ValueError):
    pass


def load_recipe(path) -> dict:
    path = Path(path)
    try:
        recipe = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe not found") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: invalid TOML ({e})") from None
    for section, fields in recipe.items():
        if section not in KNOWN:
            raise RecipeError(f"{path}: unknown section [{section}] (known: {', '.join(KNOWN)})")
        unknown = set(fields) - KNOWN[section]
        if unknown:
            raise RecipeError(f"{path}: unknown field(s) in [{section}]: {', '.join(sorted(unknown))}")
    for section in ("target", "head", "data", "train"):
        if section not in recipe:
            raise RecipeError(f"{path}: missing section [{section}]")
    return recipe


def build_prompts(target, sources, base: Path, checkpoint_dir: Path | None = None) -> list:
    """Prompts of `sources`; a magpie source saves its progress under `checkpoint_dir` (resumable).

    A prompt is a string, or a list of strings for a conversation: a jsonl source with
    `turns = "all"` keeps every user turn of its lines (the default, "first", keeps the first)."""
    from eagle_jax.train import data

    prompts: list = []
    for i, src in enumerate(sources):
        kind = src.get("kind")
        if kind == "jsonl":
            p = Path(src["path"])
            turns = src.get("turns", "first")
            if turns not in ("first", "all"):
                raise RecipeError(f"data.sources: jsonl source {src['path']}: turns must be \"first\" or \"all\", "
                                  f"got {turns!r}")
            prompts += data.load_jsonl_prompts(p if p.is_absolute() else base / p, turns=turns)
        elif kind == "topics":
            prompts += data.topic_prompts(src["topics"])
        elif kind == "magpie":
            ckpt = None if checkpoint_dir is None else checkpoint_dir / f"magpie-partial-{src.get('seed', 0)}.json"
            if checkpoint_dir is not None:
                checkpoint_dir.mkdir(parents=True, exist_ok=True)
            prompts += data.magpie_prompts(target, int(src.get("n", 64)), seed=int(src.get("seed", 0)),
                                           temperature=float(src.get("temperature", 1.0)),
                                           batch_size=int(src.get("batch_size", 8)), checkpoint=ckpt)
        else:
            raise RecipeError(f"data.sources[{i}]: unknown kind {kind!r} (jsonl, topics, magpie)")
    return prompts


def collect_prompts(target, sources: list, data_dir: Path, base: Path, recipe_name: str) -> list:
    """The recipe's prompts, fixed once built: <data dir>/prompts.json holds them and
    prompt_sources.json the sources that made them (with counts). Sources appended to the recipe
    later are built and appended (more data for a later stage). A recipe that lists only the first
    recorded sources (an earlier stage, rerun after a later one added data) gets only their prompts.
    Changing a recorded source is an error, because answered prompts must not change."""
    from eagle_jax.train import data

    prompts_file, sources_file = data_dir / "prompts.json", data_dir / "prompt_sources.json"
    prompts, recorded = [], []
    if prompts_file.exists():
        prompts = json.loads(prompts_file.read_text())
        if not sources_file.exists():  # made before sources were recorded: fixed as it is
            return prompts
        recorded = json.loads(sources_file.read_text())
        done = [r["source"] for r in recorded]
        if len(sources) < len(done) and sources and list(sources) == done[:len(sources)]:
            return prompts[:sum(r["prompts"] for r in recorded[:len(sources)])]
        if list(sources[:len(done)]) != done:
            raise RecipeError(f"{recipe_name}: data.sources do not start with the sources that made "
                              f"{prompts_file} ({sources_file}: {done}); sources may only be appended")
    new = list(sources[len(recorded):])
    if new or not prompts_file.exists():
        for src in new:
            built = build_prompts(target, [src], base, checkpoint_dir=data_dir)
            data.check_not_eval(built, source=f"{recipe_name} ({src.get('kind')} source)")
            prompts += built
            recorded.append({"source": src, "prompts": len(built)})
        data_dir.mkdir(parents=True, exist_ok=True)
        prompts_file.write_text(json.dumps(prompts))
        sources_file.write_text(json.dumps(recorded, indent=1))
    return prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_jax.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="TOML recipe (see train/*.toml)")
    ap.add_argument("--steps", type=int, help="override train.steps")
    ap.add_argument("--limit", type=int, help="override data.limit: answer (and train on) only the first N prompts")
    ap.add_argument("--max-new-tokens", type=int,
                    help="override data.max_new_tokens (longest answer the target writes; a new data directory)")
    ap.add_argument("--batch-size", type=int, help="override train.batch_size (conversations per step)")
    ap.add_argument("--answer-batch-size", type=int,
                    help="override data.batch_size (prompts the target answers at once; a greedy data directory "
                         "may be continued with another, e.g. a larger one on an accelerator)")
    ap.add_argument("--data-time-limit", type=float, metavar="SECONDS",
                    help="start no new shard of answers after SECONDS; train on what is answered (rerun to go on)")
    ap.add_argument("--train-time-limit", type=float, metavar="SECONDS",
                    help="end training with the first step that ends after SECONDS of training: checkpointed and "
                         "exported as at the last step (rerun to continue)")
    ap.add_argument("--seq-len", type=int, help="override train.seq_len (tokens per conversation, longer ones cut)")
    ap.add_argument("--decay-steps", type=int,
                    help="override train.decay_steps (the warmup + cosine schedule's length; 0: the run's steps)")
    ap.add_argument("--out-dir", help="override train.out_dir (checkpoints, metrics, the exported head)")
    ap.add_argument("--init-from", help="override head.init_from: continue from this exported head directory")
    ap.add_argument("--distributed", action="store_true",
                    help="call jax.distributed.initialize() (multi-host TPU / GPU; auto-detected on TPU pods)")
    ap.add_argument("--data-only", action="store_true",
                    help="stop after the data stage (prompts and the target's answers written)")
    ap.add_argument("--quantize", choices=[*SCHEMES, "none"],
                    help="override target.quantize: the frozen target's matrices weight-only quantized (its answers "
                         "and features then come from the quantized model; use a data directory of its own)")
    ap.add_argument("--json", action="store_true", help="print the final summary as JSON")
    args = ap.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.limit is not None:
        recipe["data"]["limit"] = args.limit
    if args.answer_batch_size is not None:
        recipe["data"]["batch_size"] = args.answer_batch_size
    for flag in ("steps", "batch_size", "seq_len", "answer_batch_size", "data_time_limit", "train_time_limit",
                 "decay_steps"):
        value = getattr(args, flag)
        if value is not None and (value < 0 if flag == "decay_steps" else value <= 0):
            print(f"error: --{flag.replace('_', '-')} must be {'0 or more' if flag == 'decay_steps' else 'positive'}, "
                  f"got {value}", file=sys.stderr)
            return 2
    if args.max_new_tokens is not None:
        recipe["data"]["max_new_tokens"] = args.max_new_tokens
    n_new = recipe["data"].get("max_new_tokens", 256)  # checked wherever it came from, before the model loads
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 1:
        print(f"error: {args.recipe}: data.max_new_tokens (or --max-new-tokens) must be a whole number of at "
              f"least 1, got {n_new!r}", file=sys.stderr)
        return 2
    if args.quantize:
        recipe["target"]["quantize"] = None if args.quantize == "none" else args.quantize
    if args.out_dir:
        recipe["train"]["out_dir"] = args.out_dir
    if args.init_from:
        recipe["head"]["init_from"] = str(Path(args.init_from).resolve())

    import jax
    import os

    if args.distributed or os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("COORDINATOR_ADDRESS"):
        jax.distributed.initialize()
    import eagle_jax
    from eagle_jax.train import data
    from eagle_jax.train.trainer import Checkpointer, OptimConfig, Trainer, export, init_head

    base = Path(args.recipe).resolve().parent.parent  # recipes live in <repo>/train/
    out = Path(recipe["train"].get("out_dir", "runs/default"))
    out.mkdir(parents=True, exist_ok=True)
    target = eagle_jax.load_target(recipe["target"]["model"], quantize=recipe["target"].get("quantize"))
    d = recipe["data"]
    data_dir = Path(d.get("dir", out / "data"))
    try:
        prompts = collect_prompts(target, d.get("sources", []), data_dir, base, str(args.recipe))
    except (RecipeError, data.EvalContaminationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[data] {len(prompts)} prompts", flush=True)
    settings = data.GenerationSettings(
        max_new_tokens=int(d.get("max_new_tokens", 256)), temperature=float(d.get("temperature", 0.0)),
        top_p=float(d.get("top_p", 1.0)), batch_size=int(d.get("batch_size", 8)),
        shard_size=int(d.get("shard_size", 64)), seed=int(d.get("seed", 0)))
    t0 = time.perf_counter()
    # This run answers and uses its own prompts, or only the first `limit` of them (raise it later to
    # extend); the directory may hold more prompts and answers (a later stage's).
    n_use = len(prompts) if d.get("limit") is None else min(int(d["limit"]), len(prompts))
    stored = json.loads((data_dir / "prompts.json").read_text()) if (data_dir / "prompts.json").exists() else prompts
    data.generate_dataset(target, stored, data_dir, settings, limit=n_use,
                          progress=lambda n: print(f"[data] +{n} answers", flush=True),
                          deadline=None if args.data_time_limit is None else time.monotonic() + args.data_time_limit,
                          continuous=bool(d.get("continuous", False)))
    rows = data.read_dataset(data_dir)[:n_use]
    n_hold = max(1, int(len(rows) * float(d.get("holdout", 0.1))))
    train_rows, eval_rows = rows[:-n_hold], rows[-n_hold:]
    print(f"[data] {len(train_rows)} train / {len(eval_rows)} held-out conversations, "
          f"{sum(int(m.sum()) for _, m in train_rows)} answer tokens ({time.perf_counter() - t0:.0f}s)", flush=True)
    if args.data_only:
        return 0

    h = recipe["head"]
    init_from = None
    if h.get("init_from"):
        init_from = Path(h["init_from"])
        init_from = init_from if init_from.is_absolute() else base / init_from
    try:
        head = init_head(target, h.get("kind", "eagle3"), h.get("draft_vocab_size"), train_rows,
                         init_from=init_from, init_from_target_layer=bool(h.get("init_from_target_layer")),
                         seed=int(h.get("seed", 0)))
    except ValueError as e:
        print(f"error: {args.recipe}: head.init_from: {e}", file=sys.stderr)
        return 2
    if init_from is not None:
        print(f"[head] initialised from {init_from}", flush=True)
    tcfg = {k: v for k, v in recipe["train"].items() if k != "out_dir"}
    for name in ("steps", "batch_size", "seq_len", "decay_steps"):
        if getattr(args, name) is not None:
            tcfg[name] = getattr(args, name)
    ocfg = OptimConfig(**tcfg)
    if ocfg.group_by_length:
        from eagle_jax.train.features import group_by_length

        train_rows = group_by_length(train_rows, ocfg.batch_size, ocfg.seed)
    trainer = Trainer(target, head, ocfg)
    ckpt = Checkpointer(out / "checkpoints", keep=ocfg.keep_checkpoints)
    if ckpt.restore_latest(trainer):
        print(f"[train] resumed at step {trainer.step} (data position {trainer.data_pos})", flush=True)
    feat_dir = None
    if d.get("features", "online") == "offline":  # computed on first use, then read back
        feat_dir = Path(d.get("features_dir", out / "features"))
        print(f"[features] offline features in {feat_dir}", flush=True)
    log = open(out / "metrics.jsonl", "a")

    def on_log(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()
        acc = " ".join(f"{a:.3f}" for a in rec["acc"])
        extra = f" eval_acc {' '.join(f'{a:.3f}' for a in rec['eval_acc'])}" if "eval_acc" in rec else ""
        rate = "" if rec["tokens_per_s"] is None else f" {rec['tokens_per_s']:.0f} tok/s"
        print(f"[train] step {rec['step']} loss {rec['loss']:.4f} acc {acc}{extra}{rate}", flush=True)

    deadline = None if args.train_time_limit is None else time.monotonic() + args.train_time_limit
    hist = trainer.train(train_rows, eval_rows=eval_rows, checkpointer=ckpt, on_log=on_log, features_dir=feat_dir,
                         deadline=deadline)
    ckpt.wait()
    head_dir = export(trainer, out / "head", dtype=h.get("export_dtype", "float32"))
    # The last step of this run evaluated already; a rerun of a finished run (no steps) evaluates here.
    final = hist[-1] if hist else None
    eval_acc = final["eval_acc"] if final and "eval_acc" in final else trainer.evaluate(eval_rows)
    summary = {"steps": trainer.step, "head": str(head_dir), "final": final, "eval_acc": eval_acc}
    print(f"[export] {head_dir}", flush=True)
    if args.json:
        print(json.dumps(summary))
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
