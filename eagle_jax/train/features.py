"""Training batches: token packing, target features (online or offline), and the EAGLE-3 draft vocabulary.

A batch is fixed-shape [B, T]: each conversation is cut or right-padded to T tokens (`valid` marks
real tokens, `loss_mask` the answer tokens). The target's features for a batch are
  * `hidden` [B, T, H]: the final normed hidden state (EAGLE-1's regression target and the input
    from which the target's next-token distribution is recomputed through its lm_head), and
  * `aux` [B, T, 3H]: the residual stream after the low / middle / high layers (EAGLE-3's input).
Online mode computes them inside the training loop; offline mode writes each batch's features to
disk the first time it is used (`cached_feature_batches`; `write_offline` precomputes them all) and
reads them back afterwards. Both give bit-identical batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.compiling import jit_pair, param_count, quick


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray  # [B, T] int32
    loss_mask: np.ndarray  # [B, T] uint8 (1 on answer tokens)
    valid: np.ndarray  # [B, T] bool
    hidden: np.ndarray | None = None  # [B, T, H]
    aux: np.ndarray | None = None  # [B, T, 3H]


def token_batches(rows: Sequence[tuple[np.ndarray, np.ndarray]], batch_size: int, seq_len: int,
                  start: int = 0, seq_bucket: int = 0) -> Iterator[tuple[int, Batch]]:
    """Deterministic batches in row order from row index `start` (the data position for resuming).

    Yields (next_start, batch). The last partial batch is padded with empty rows (valid = False).
    With seq_bucket > 0 a batch is only as long as its longest row rounded up to a multiple of
    seq_bucket (at most seq_len): less padding, one compiled step per distinct length. Padding is
    masked and attention is causal, so the trimmed batch computes the same losses.
    """
    for b0 in range(start, len(rows), batch_size):
        t = seq_len
        if seq_bucket > 0:
            longest = max(len(r[0]) for r in rows[b0: b0 + batch_size])
            t = min(seq_len, -(-longest // seq_bucket) * seq_bucket)
        tok = np.zeros((batch_size, t), np.int32)
        mask = np.zeros((batch_size, t), np.uint8)
        valid = np.zeros((batch_size, t), bool)
        for j, (ids, m) in enumerate(rows[b0: b0 + batch_size]):
            n = min(len(ids), t)
            tok[j, :n], mask[j, :n], valid[j, :n] = ids[:n], m[:n], True
        yield min(b0 + batch_size, len(rows)), Batch(tok, mask, valid)


def _features(graphdef, state, tokens, aux_layers):
    target = nnx.merge(graphdef, state)
    b, t = tokens.shape
    cache = target.init_cache(b, t)
    out = target(tokens, cache, capture_layers=aux_layers, logits_at=False)
    aux = jnp.concatenate(list(out.captured), axis=-1) if aux_layers else None
    return out.hidden, aux


_FEATURES = jit_pair(_features, static_argnames=("graphdef", "aux_layers"))
# A feature pass (forward only) of a target whose parameters x batch tokens are under this compiles
# without LLVM optimisation (`eagle_jax.compiling`).
QUICK_FEATURES_WORK = 1 << 26


class FeatureExtractor:
    """Runs the frozen target over token batches (online mode). state: the target's parameters as the
    trainer placed them (e.g. its experts split over a mesh); batch_sharding: where the tokens go then."""

    def __init__(self, target, aux_layers: Sequence[int] = (), state=None, batch_sharding=None):
        self.graphdef, self.state = nnx.split(target.model)
        if state is not None:
            self.state = state
        self.batch_sharding = batch_sharding
        self.aux_layers = tuple(aux_layers)
        self.n_params = param_count(self.state)

    def __call__(self, batch: Batch) -> Batch:
        tokens = jnp.asarray(batch.tokens)
        if self.batch_sharding is not None and tokens.shape[0] % self.batch_sharding.mesh.size == 0:
            tokens = jax.device_put(tokens, self.batch_sharding)
        fast = quick(self.n_params * tokens.size, QUICK_FEATURES_WORK, tokens)
        hidden, aux = _FEATURES[fast](self.graphdef, self.state, tokens, self.aux_layers)
        return dataclasses.replace(batch, hidden=np.asarray(hidden),
                                   aux=None if aux is None else np.asarray(aux))


def group_by_length(rows, batch_size: int, seed: int = 0) -> list:
    """Reorders rows so that each batch holds rows of similar length (less padding with seq_bucket),
    then shuffles the order of the batches (deterministic in seed). A permutation of rows."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i][0]), i))
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    np.random.default_rng(seed).shuffle(batches)
    return [rows[i] for b in batches for i in b]


def _index(rows, batch_size: int, seq_len: int, seq_bucket: int) -> dict:
    n = -(-len(rows) // batch_size)
    return {"batches": n, "batch_size": batch_size, "seq_len": seq_len, "seq_bucket": seq_bucket, "rows": len(rows)}


def cached_feature_batches(extractor: FeatureExtractor, rows, batch_size: int, seq_len: int, out_dir,
                           seq_bucket: int = 0, start_batch: int = 0) -> Iterator[Batch]:
    """Batches with the target's features, from batch `start_batch` on: read from out_dir when a batch
    was computed before, else computed by the target and written there (the first epoch pays for the
    target's forward passes, later epochs and resumed runs read them back). The directory is tied to
    the rows and batch shapes; another layout is an error naming the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    want = _index(rows, batch_size, seq_len, seq_bucket)
    index = out / "index.json"
    if index.exists():
        have = json.loads(index.read_text())
        if {k: have.get(k, want[k]) for k in want} != want:
            raise ValueError(f"{out}: offline features were written for {have}, not {want}; use a new features_dir")
    index.write_text(json.dumps(want))
    batches = token_batches(rows, batch_size, seq_len, start=start_batch * batch_size, seq_bucket=seq_bucket)
    for i, (_, batch) in enumerate(batches, start_batch):
        path = out / f"batch-{i:06d}.npz"
        if path.exists():
            yield _read_batch(path)
            continue
        b = extractor(batch)
        arrays = {"tokens": b.tokens, "loss_mask": b.loss_mask, "valid": b.valid, "hidden": b.hidden}
        if b.aux is not None:
            arrays["aux"] = b.aux
        tmp = out / f"batch-{i:06d}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)  # a batch file exists only once complete
        yield b


def write_offline(extractor: FeatureExtractor, rows, batch_size: int, seq_len: int, out_dir,
                  seq_bucket: int = 0) -> int:
    """Precomputes every batch's features to out_dir (resumable: finished batches are kept)."""
    return sum(1 for _ in cached_feature_batches(extractor, rows, batch_size, seq_len, out_dir, seq_bucket))


def read_offline(out_dir, start_batch: int = 0) -> Iterator[Batch]:
    out = Path(out_dir)
    n = json.loads((out / "index.json").read_text())["batches"]
    for i in range(start_batch, n):
        yield _read_batch(out / f"batch-{i:06d}.npz")


def _read_batch(path) -> Batch:
    with np.load(path) as z:
        return Batch(z["tokens"], z["loss_mask"], z["valid"], z["hidden"], z["aux"] if "aux" in z else None)


def build_draft_vocab(rows, vocab_size: int, draft_vocab_size: int, always=()) -> tuple[np.ndarray, np.ndarray]:
    """EAGLE-3's reduced vocabulary: the most frequent answer tokens of the training data.

    Returns (d2t [Vd] int64 offsets: target id = draft id + d2t[draft id], t2d [V] bool). Draft ids
    follow target-id order, so the offsets are non-negative. `always` ids (e.g. EOS) are included.
    Ties in frequency go to the lower token id; unused slots are filled with the lowest unseen ids.
    """
    counts = np.zeros(vocab_size, np.int64)
    for tok, mask in rows:
        np.add.at(counts, np.asarray(tok)[np.asarray(mask) > 0], 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    forced = [int(a) for a in always]
    chosen = forced + [int(i) for i in order if int(i) not in set(forced)]
    keep = np.sort(np.asarray(chosen[:draft_vocab_size], np.int64))
    d2t = keep - np.arange(draft_vocab_size)
    t2d = np.zeros(vocab_size, bool)
    t2d[keep] = True
    return d2t, t2d
