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

KNOWN = {
    "target": {"model"},
    "head": {"kind", "draft_vocab_size", "init_from_target_layer", "init_from", "seed", "export_dtype"},
    "data": {"dir", "sources", "max_new_tokens", "temperature", "top_p", "batch_size", "shard_size", "seed",
             "holdout", "features", "features_dir", "limit"},
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


def build_prompts(target, sources, base: Path) -> list[str]:
    from eagle_jax.train import data

    prompts: list[str] = []
    for i, src in enumerate(sources):
        kind = src.get("kind")
        if kind == "jsonl":
            p = Path(src["path"])
            prompts += data.load_jsonl_prompts(p if p.is_absolute() else base / p)
        elif kind == "topics":
            prompts += data.topic_prompts(src["topics"])
        elif kind == "magpie":
            prompts += data.magpie_prompts(target, int(src.get("n", 64)), seed=int(src.get("seed", 0)),
                                           temperature=float(src.get("temperature", 1.0)),
                                           batch_size=int(src.get("batch_size", 8)))
        else:
            raise RecipeError(f"data.sources[{i}]: unknown kind {kind!r} (jsonl, topics, magpie)")
    return prompts


def collect_prompts(target, sources: list, data_dir: Path, base: Path, recipe_name: str) -> list[str]:
    """The recipe's prompts, fixed once built: <data dir>/prompts.json holds them and
    prompt_sources.json the sources that made them (with counts). Sources appended to the recipe
    later are built and appended (more data for a later stage); changing or removing a recorded
    source is an error, because answered prompts must not change."""
    from eagle_jax.train import data

    prompts_file, sources_file = data_dir / "prompts.json", data_dir / "prompt_sources.json"
    prompts, recorded = [], []
    if prompts_file.exists():
        prompts = json.loads(prompts_file.read_text())
        if not sources_file.exists():  # made before sources were recorded: fixed as it is
            return prompts
        recorded = json.loads(sources_file.read_text())
        done = [r["source"] for r in recorded]
        if list(sources[:len(done)]) != done:
            raise RecipeError(f"{recipe_name}: data.sources do not start with the sources that made "
                              f"{prompts_file} ({sources_file}: {done}); sources may only be appended")
    new = list(sources[len(recorded):])
    if new or not prompts_file.exists():
        for src in new:
            built = build_prompts(target, [src], base)
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
    ap.add_argument("--distributed", action="store_true",
                    help="call jax.distributed.initialize() (multi-host TPU / GPU; auto-detected on TPU pods)")
    ap.add_argument("--json", action="store_true", help="print the final summary as JSON")
    args = ap.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import jax
    import os

    if args.distributed or os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("COORDINATOR_ADDRESS"):
        jax.distributed.initialize()
    import numpy as np

    import eagle_jax
    from eagle_jax.draft import DraftConfig, DraftHead
    from eagle_jax.train import data
    from eagle_jax.train.features import build_draft_vocab, write_offline
    from eagle_jax.train.trainer import Checkpointer, OptimConfig, Trainer, export
    from flax import nnx

    base = Path(args.recipe).resolve().parent.parent  # recipes live in <repo>/train/
    out = Path(recipe["train"].get("out_dir", "runs/default"))
    out.mkdir(parents=True, exist_ok=True)
    target = eagle_jax.load_target(recipe["target"]["model"])
    d = recipe["data"]
    data_dir = Path(d.get("dir", out / "data"))
    try:
        prompts = collect_prompts(target, d.get("sources", []), data_dir, base, str(args.recipe))
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[data] {len(prompts)} prompts", flush=True)
    settings = data.GenerationSettings(
        max_new_tokens=int(d.get("max_new_tokens", 256)), temperature=float(d.get("temperature", 0.0)),
        top_p=float(d.get("top_p", 1.0)), batch_size=int(d.get("batch_size", 8)),
        shard_size=int(d.get("shard_size", 64)), seed=int(d.get("seed", 0)))
    t0 = time.perf_counter()
    limit = d.get("limit")  # answer only the first `limit` prompts (whole shards); raise it later to extend
    data.generate_dataset(target, prompts, data_dir, settings, limit=None if limit is None else int(limit),
                          progress=lambda n: print(f"[data] +{n} answers", flush=True))
    rows = data.read_dataset(data_dir)
    n_hold = max(1, int(len(rows) * float(d.get("holdout", 0.1))))
    train_rows, eval_rows = rows[:-n_hold], rows[-n_hold:]
    print(f"[data] {len(train_rows)} train / {len(eval_rows)} held-out conversations, "
          f"{sum(int(m.sum()) for _, m in train_rows)} answer tokens ({time.perf_counter() - t0:.0f}s)", flush=True)

    h = recipe["head"]
    kind = h.get("kind", "eagle3")
    cfg = DraftConfig.for_target(target.cfg, kind, h.get("draft_vocab_size"))
    head = DraftHead(cfg, rngs=nnx.Rngs(int(h.get("seed", 0))), dtype=target.model.dtype)
    if h.get("init_from"):  # continue from an exported head (its weights and draft vocabulary)
        from eagle_jax.draft import load_draft

        p = Path(h["init_from"])
        head = load_draft(p if p.is_absolute() else base / p, target.cfg, dtype=target.model.dtype)
        if (head.cfg.kind, head.cfg.draft_vocab_size, head.cfg.aux_layers) != (kind, cfg.draft_vocab_size,
                                                                                cfg.aux_layers):
            print(f"error: {args.recipe}: head.init_from {h['init_from']} is a {head.cfg.kind} head with draft "
                  f"vocabulary {head.cfg.draft_vocab_size}; the recipe asks for {kind} / {cfg.draft_vocab_size}",
                  file=sys.stderr)
            return 2
        print(f"[head] initialised from {p}", flush=True)
    elif kind == "eagle3":
        d2t, _ = build_draft_vocab(train_rows, cfg.vocab_size, cfg.draft_vocab_size, always=target.eos_token_ids)
        head.d2t[...] = np.asarray(d2t, np.int32)
    if h.get("init_from_target_layer") and not h.get("init_from"):
        top = target.model.layers[target.cfg.num_layers - 1]
        for name in ("wo", "w_gate", "w_up", "w_down"):
            getattr(head, name)[...] = getattr(top, name)[...]
        head.post_norm[...] = top.mlp_norm[...]
        if kind == "eagle3":  # the draft lm_head starts as the target's rows for the draft vocabulary
            keep = np.arange(cfg.draft_vocab_size) + np.asarray(head.d2t[...])
            head.lm_head[...] = np.asarray(target.model.lm_head_weight())[:, keep]
            head.norm[...] = target.model.final_norm[...]
    tcfg = {k: v for k, v in recipe["train"].items() if k != "out_dir"}
    if args.steps:
        tcfg["steps"] = args.steps
    ocfg = OptimConfig(**tcfg)
    if ocfg.group_by_length:
        from eagle_jax.train.features import group_by_length

        train_rows = group_by_length(train_rows, ocfg.batch_size, ocfg.seed)
    trainer = Trainer(target, head, ocfg)
    ckpt = Checkpointer(out / "checkpoints", keep=ocfg.keep_checkpoints)
    if ckpt.restore_latest(trainer):
        print(f"[train] resumed at step {trainer.step} (data position {trainer.data_pos})", flush=True)
    feat_dir = None
    if d.get("features", "online") == "offline":
        feat_dir = Path(d.get("features_dir", out / "features"))
        write_offline(trainer.extractor, train_rows, ocfg.batch_size, ocfg.seq_len, feat_dir, ocfg.seq_bucket)
        print(f"[features] offline features in {feat_dir}", flush=True)
    log = open(out / "metrics.jsonl", "a")

    def on_log(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()
        acc = " ".join(f"{a:.3f}" for a in rec["acc"])
        extra = f" eval_acc {' '.join(f'{a:.3f}' for a in rec['eval_acc'])}" if "eval_acc" in rec else ""
        print(f"[train] step {rec['step']} loss {rec['loss']:.4f} acc {acc}{extra} "
              f"{rec['tokens_per_s']:.0f} tok/s", flush=True)

    hist = trainer.train(train_rows, eval_rows=eval_rows, checkpointer=ckpt, on_log=on_log, features_dir=feat_dir)
    ckpt.wait()
    head_dir = export(trainer, out / "head", dtype=h.get("export_dtype", "float32"))
    summary = {"steps": trainer.step, "head": str(head_dir), "final": hist[-1] if hist else None,
               "eval_acc": trainer.evaluate(eval_rows)}
    print(f"[export] {head_dir}", flush=True)
    if args.json:
        print(json.dumps(summary))
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
