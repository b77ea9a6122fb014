"""Tree-masked attention over a KV cache: the entry point and its pure-jnp reference.

Shapes (one letter per axis):
  B batch rows, N new (tree) tokens per row, S cache slots, K kv heads, G query heads per kv head,
  D head dim.

Every row has a prefix of `lengths[b]` committed tokens in cache slots [0, length); the tree's keys
and values are already written at slots [length, length + M). Query n sees the whole prefix and the
tree keys m with `tree_mask[b, n, m]` ([B, N, M]; M = N when the queries are the tree itself, as in
verification). Slots at or past `length + M` are never read: they may hold anything, NaN included.

Sliding-window attention: `key_starts` [B, N] int32 (optional) gives each query the first prefix slot it
sees: query n reads prefix slots [key_starts[b, n], length) only. The caller folds the window into the
tree mask for the tree's own keys. None: every query sees the whole prefix.

A causal mask makes this ordinary prefill / decode attention (N = 1 is a decode step), so the engine
runs all of its attention through this one function.

Implementations (same signature, same numbers up to rounding):
  "reference"  pure jnp, below: the definition every other implementation is tested against.
  "cpu"        pure jnp arranged for XLA:CPU (pallas_kernels/cpu.py): with few queries per row a loop
               over rows reads each row's keys and values once, where they lie, as far as the row
               reaches; more than cpu.MAX_QUERY_ROWS query rows per row go to the reference.
  "tpu"        Pallas Mosaic kernel (pallas_kernels/tpu.py).
  "gpu"        Pallas Triton kernel (pallas_kernels/gpu.py).
`tree_attention` picks by `jax.default_backend()`: TPU -> "tpu", GPU -> "gpu", CPU -> "cpu", anything
else -> "reference" (Pallas runs on CPU only in interpret mode, which is for tests: it is slow). Head
shapes a compiled kernel does not take (see `_kernel_takes`) fall back to the reference.
`use_implementation(...)` overrides that choice for everything traced inside it, e.g. to run the
whole engine through an interpreted kernel in a test.

`paged_tree_attention` (pallas_kernels/paged.py) is the same attention over a paged cache (a block
pool read through a block table), dispatched the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.layout import slot_visibility

IMPLEMENTATIONS = ("reference", "cpu", "tpu", "gpu")


def tree_attention_reference(q, k_cache, v_cache, lengths, tree_mask, *, key_starts=None,
                             block_sizes: BlockSizes | None = None, interpret=False):
    """Pure-jnp tree attention. q [B,N,Hq,D]; caches [B,S,K,D]; lengths [B]; tree_mask [B,N,M] bool;
    key_starts [B,N] int32 or None (see the module docstring)."""
    del block_sizes, interpret  # same signature as the kernels
    b, n, hq, d = q.shape
    s, k = k_cache.shape[1], k_cache.shape[2]
    g = hq // k
    qg = q.reshape(b, n, k, g, d)
    # Tree keys M equal N except for draft expansion (queries = one frontier).
    visible, live = slot_visibility(lengths, tree_mask, jnp.arange(s, dtype=jnp.int32), key_starts)  # [B,N,S], [B,S]
    # Slots past the tree may hold garbage (NaN). Scores of hidden slots are replaced below; their
    # values must be zeroed too, or 0-weight * NaN would leak into the output.
    v_live = jnp.where(live[:, :, None, None], v_cache, 0)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum(
        "BNKGD,BSKD->BKGNS", qg, k_cache, preferred_element_type=jnp.float32
    ) * scale
    scores = jnp.where(visible[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKGNS,BSKD->BNKGD", probs.astype(v_cache.dtype), v_live,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, n, hq, d).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class _Choice:
    implementation: str
    interpret: object = False
    block_sizes: BlockSizes | None = None


_forced: contextvars.ContextVar[_Choice | None] = contextvars.ContextVar("tree_attention_implementation",
                                                                         default=None)


def _check_implementation(name):
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"tree attention implementation must be one of {IMPLEMENTATIONS}, got {name!r}")


def default_implementation() -> str:
    """The kernel for the default backend: "tpu", "gpu", "cpu" or (anything else) "reference"."""
    return {"tpu": "tpu", "gpu": "gpu", "cpu": "cpu"}.get(jax.default_backend(), "reference")


def _kernel_takes(implementation: str, q, k_cache) -> bool:
    """Whether the backend's compiled kernel handles these head shapes (else the default falls back).

    GPU: Triton tensors are powers of two, so the head dim must be one. TPU: the kernel slices each
    KV head's lanes out of a [block_kv, Hkv * D] slab; only lane-tile-aligned slices (D a multiple of
    128, or a single KV head) are used by default until other head dims are validated on hardware.
    """
    d, kv_heads = q.shape[-1], k_cache.shape[2]
    if implementation == "gpu":
        return d & (d - 1) == 0 and d >= 16
    return d % 128 == 0 or kv_heads == 1


@contextlib.contextmanager
def use_implementation(implementation: str, *, interpret=False, block_sizes: BlockSizes | None = None):
    """Routes every `tree_attention` / `paged_tree_attention` call traced inside the block to
    `implementation`.

    The choice is read at trace time: a function jitted and traced before (same shapes) keeps the
    implementation it was traced with, so call `jax.clear_caches()` around the block when the same
    jitted functions run both ways. interpret: passed to the kernel (True, or for "tpu" also a
    `pltpu.InterpretParams()`); block_sizes: the kernel's tiles (None: its defaults).
    """
    _check_implementation(implementation)
    token = _forced.set(_Choice(implementation, interpret, block_sizes))
    try:
        yield
    finally:
        _forced.reset(token)


def resolve_implementation(implementation: str | None, interpret, block_sizes: BlockSizes | None, q, k_cache):
    """(implementation, interpret, block_sizes) for one call: an explicit `implementation` wins over
    `use_implementation`, which wins over the backend default (with its head-shape fallback). k_cache is
    anything [*, *, Hkv, D], a contiguous cache or a block pool."""
    forced = _forced.get()
    if implementation is None and forced is not None:
        implementation = forced.implementation
        interpret = interpret or forced.interpret
        block_sizes = forced.block_sizes if block_sizes is None else block_sizes
    if implementation is None:
        implementation = default_implementation()
        if implementation in ("tpu", "gpu") and not interpret and not _kernel_takes(implementation, q, k_cache):
            implementation = "reference"
    _check_implementation(implementation)
    return implementation, interpret, block_sizes


def tree_attention(q, k_cache, v_cache, lengths, tree_mask, *, key_starts=None, window: int | None = None,
                   interpret=False, implementation: str | None = None, block_sizes: BlockSizes | None = None):
    """Tree attention through the best implementation for the backend (see the module docstring).

    q [B, N, Hq, D]; caches [B, S, Hkv, D] with the tree's keys at [length, length + M); lengths [B]
    int32; tree_mask [B, N, M] bool; key_starts [B, N] int32 or None (a sliding window: the first prefix
    slot each query sees); window (static int or None): only slots [0, window) are read, the caller
    guaranteeing lengths + M <= window (the CPU implementation reads them in place; the others get the
    window sliced off). Returns [B, N, Hq, D] in q's dtype.

    interpret: run the chosen kernel in Pallas interpret mode (tests); ignored by the reference.
    An explicit `implementation` wins over `use_implementation`, which wins over the backend default.
    """
    implementation, interpret, block_sizes = resolve_implementation(implementation, interpret, block_sizes, q,
                                                                    k_cache)
    if implementation == "cpu":
        from pallas_kernels.cpu import MAX_QUERY_ROWS, tree_attention_rows

        if q.shape[1] * q.shape[2] <= MAX_QUERY_ROWS:  # (more query rows: the reference, below)
            return tree_attention_rows(q, k_cache, v_cache, lengths, tree_mask, key_starts=key_starts, window=window)
    if window is not None:
        k_cache, v_cache = k_cache[:, :window], v_cache[:, :window]
    if implementation == "tpu":
        from pallas_kernels.tpu import tree_attention_tpu  # kernel modules load only when used

        return tree_attention_tpu(q, k_cache, v_cache, lengths, tree_mask, key_starts=key_starts,
                                  block_sizes=block_sizes, interpret=interpret)
    if implementation == "gpu":
        from pallas_kernels.gpu import tree_attention_gpu

        return tree_attention_gpu(q, k_cache, v_cache, lengths, tree_mask, key_starts=key_starts,
                                  block_sizes=block_sizes, interpret=interpret)
    return tree_attention_reference(q, k_cache, v_cache, lengths, tree_mask, key_starts=key_starts)
