"""Filling parameters from checkpoint tensors by a declarative table: one loader for targets and heads.

A table lists (tensor name in the file, parameter key, transpose). `fill` reads every tensor a parameter
needs, checks its shape against the parameter's, and checks that every tensor in the file was used and
every parameter was filled; each error names the file, the tensor and both shapes.
"""

from __future__ import annotations

import re
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np


def fill(entries: Iterable[tuple[str, Hashable, bool]], shapes: dict, tensor_names: Sequence[str],
         read: Callable[[str], np.ndarray], shape_of: Callable[[str], tuple[int, ...]], *, source: str, error,
         kind: str, ignored: Sequence[re.Pattern | str] = (), optional: Callable[[str, Hashable], bool] = None,
         transform: Callable[[str, np.ndarray], np.ndarray] | None = None, describe=lambda key: str(key),
         context: str = "") -> dict:
    """Parameter key -> array, for every entry whose key is in `shapes` (parameter key -> shape).

    An entry's transpose is False, True (reverse every axis) or "last2" (swap the last two: a stack of
    matrices stored transposed). A `read` (or `transform`) may return a value that is not an ndarray: a
    parameter it has already put in the model's form (a quantized matrix), stored as it is.

    Entries whose key the model does not have are skipped (an architecture without biases; a tied
    lm_head), and their tensors count as used when `optional(name, key)` says the file may carry them.
    `ignored` tensors (names or regex patterns) may be in the file unused. Errors are `error(message)`
    naming `source`; `kind` names the model in the leftover-tensor message and `context` is appended to
    shape errors (e.g. the config's sizes).
    """
    available = set(tensor_names)
    consumed: set[str] = set()
    arrays: dict = {}
    for name, key, transpose in entries:
        if key not in shapes:
            if optional is not None and optional(name, key) and name in available:
                consumed.add(name)
            continue
        expected = tuple(shapes[key])
        if name not in available:
            raise error(f"{source}: missing tensor {name!r} (needed for {describe(key)}, shape {expected})")
        got = tuple(shape_of(name))
        if transpose == "last2":  # stacked matrices, each transposed
            want = expected[:-2] + expected[:-3:-1]
        else:
            want = tuple(reversed(expected)) if transpose else expected
        if got != want:
            raise error(f"{source}: tensor {name!r} has shape {got}, but {describe(key)} needs {want}{context}")
        arr = read(name)
        if transform is not None:
            arr = transform(name, arr)
        if not isinstance(arr, np.ndarray):
            arrays[key] = arr
        else:
            arrays[key] = np.swapaxes(arr, -1, -2) if transpose == "last2" else (arr.T if transpose else arr)
        consumed.add(name)
    patterns = [re.compile(re.escape(p) + "$") if isinstance(p, str) else p for p in ignored]
    leftovers = sorted(n for n in available - consumed if not any(p.match(n) for p in patterns))
    if leftovers:
        shown = ", ".join(leftovers[:8]) + (" ..." if len(leftovers) > 8 else "")
        raise error(f"{source}: {len(leftovers)} tensor(s) not used by {kind}: {shown}")
    missing = sorted(describe(k) for k in shapes if k not in arrays)
    if missing:
        raise error(f"{source}: parameters not filled by any tensor: {', '.join(missing)}")
    return arrays
