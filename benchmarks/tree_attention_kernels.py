"""Tree-attention kernels vs the XLA reference: time, speedup and achieved memory bandwidth.

On a TPU or GPU, times the backend's Pallas kernel and `tree_attention_reference` (both jitted) at
Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128, bf16) for every combination of
cache 1k / 4k / 16k slots, tree size N 1 / 16 / 64 and batch 1 / 8 / 32. Every row's prefix fills
the cache (length = cache - N), and the tree is a random ancestor mask.

Bytes moved = K and V of the prefix and the tree (what attention must read) + q + out; GB/s divides
that by the median time. At N = 1 attention is purely bandwidth-bound, so the table also gives the
fraction of the device's peak bandwidth (known devices, or --peak-gbps).

--smoke runs tiny shapes on any backend (CPU included), with the kernels in interpret mode: it
checks that the script, the kernels and the JSON work, not speed.

    python benchmarks/tree_attention_kernels.py [--smoke] [--json OUT] [--peak-gbps GBPS] [--iters 20]
        [--caches 1024,4096,16384] [--ns 1,16,64] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import BlockSizes, default_implementation, tree_attention_reference  # noqa: E402
from pallas_kernels.gpu import tree_attention_gpu  # noqa: E402
from pallas_kernels.tpu import tree_attention_tpu  # noqa: E402

KERNELS = {"reference": tree_attention_reference, "tpu": tree_attention_tpu, "gpu": tree_attention_gpu}

# HBM bandwidth in GB/s by device_kind substring (vendor data sheets); --peak-gbps overrides.
PEAK_GBPS = {
    "H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0,
    "TPU v6 lite": 1640.0, "TPU v5 lite": 819.0, "TPU v5p": 2765.0, "TPU v5": 2765.0, "TPU v4": 1228.0,
}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    cache: int  # cache slots S
    n: int  # tree tokens
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str

    def bytes_moved(self) -> int:
        item = jnp.dtype(self.dtype).itemsize
        kv = 2 * self.batch * self.cache * self.kv_heads * self.head_dim  # prefix + tree = the whole cache here
        q_and_out = 2 * self.batch * self.n * self.q_heads * self.head_dim
        return (kv + q_and_out) * item


def full_shapes(caches=(1024, 4096, 16384), ns=(1, 16, 64), batches=(1, 8, 32)):
    return [Shape(b, s, n, 32, 8, 128, "bfloat16") for s, n, b in itertools.product(caches, ns, batches)]


def smoke_shapes():
    return [Shape(b, s, n, 4, 2, 64, "float32") for s, n, b in ((48, 1, 1), (64, 5, 2))]


def make_inputs(shape: Shape, seed: int = 0):
    """Device-side random inputs; a random tree (node i's parent is a random earlier node)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    dt = jnp.dtype(shape.dtype)
    q = jax.random.normal(keys[0], (shape.batch, shape.n, shape.q_heads, shape.head_dim), dt)
    k = jax.random.normal(keys[1], (shape.batch, shape.cache, shape.kv_heads, shape.head_dim), dt)
    v = jax.random.normal(keys[2], (shape.batch, shape.cache, shape.kv_heads, shape.head_dim), dt)
    lengths = jnp.full((shape.batch,), shape.cache - shape.n, jnp.int32)
    rng = np.random.default_rng(seed)
    mask = np.eye(shape.n, dtype=bool)
    for i in range(1, shape.n):
        mask[i] |= mask[rng.integers(0, i)]
    return q, k, v, lengths, jnp.asarray(np.broadcast_to(mask, (shape.batch, shape.n, shape.n)))


def time_ms(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_gbps(device_kind: str, override: float | None) -> float | None:
    if override:
        return override
    for key, value in PEAK_GBPS.items():
        if key.lower() in device_kind.lower():
            return value
    return None


def run(shapes, implementations, *, interpret, block_sizes, iters, peak):
    results = []
    for shape in shapes:
        args = make_inputs(shape)
        ref_fn = jax.jit(tree_attention_reference)
        ref_out = np.asarray(ref_fn(*args), np.float32)
        ref_ms = None
        for name in implementations:
            if name == "reference":
                fn = ref_fn
            else:
                fn = jax.jit(functools.partial(KERNELS[name], block_sizes=block_sizes, interpret=interpret))
            ms = time_ms(fn, args, iters)
            if name == "reference":
                ref_ms = ms
            err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - ref_out)))
            gbps = shape.bytes_moved() / (ms * 1e-3) / 1e9
            results.append(dict(dataclasses.asdict(shape), implementation=name,
                                interpret=bool(interpret) and name != "reference", ms=ms,
                                speedup=(ref_ms / ms) if ref_ms else None, gb_per_s=gbps,
                                roofline=(gbps / peak) if peak and shape.n == 1 else None, max_abs_err=err))
        del args
    return results


def print_table(results):
    head = (f"{'batch':>5} {'cache':>6} {'N':>3}  {'impl':<9} {'ms':>9} {'speedup':>8} {'GB/s':>8} {'of peak':>8} "
            f"{'max err':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        roof = f"{100 * r['roofline']:.0f}%" if r["roofline"] else "-"
        print(f"{r['batch']:>5} {r['cache']:>6} {r['n']:>3}  {r['implementation']:<9} {r['ms']:>9.3f} {speedup:>8} "
              f"{r['gb_per_s']:>8.1f} {roof:>8} {r['max_abs_err']:>8.1e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels in interpret mode (runs on CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth, GB/s")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement (median)")
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    parser.add_argument("--caches", type=ints, default=(1024, 4096, 16384), help="cache slots, e.g. 1024,4096")
    parser.add_argument("--ns", type=ints, default=(1, 16, 64), help="tree sizes N, e.g. 1,16")
    parser.add_argument("--batches", type=ints, default=(1, 8, 32), help="batch sizes, e.g. 1,8")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    if args.smoke:
        shapes, implementations = smoke_shapes(), ["reference", "tpu", "gpu"]
        interpret, block_sizes, iters = True, BlockSizes(block_q=16, block_kv=16), args.iters or 2
    else:
        kernel = default_implementation()
        if kernel == "reference":
            parser.error(f"no Pallas kernel for the {backend} backend; use --smoke (interpret mode) on CPU")
        shapes, implementations = full_shapes(args.caches, args.ns, args.batches), ["reference", kernel]
        interpret, block_sizes, iters = False, None, args.iters or 20
    peak = peak_gbps(device_kind, args.peak_gbps)

    title = f"# tree attention kernels on {device_kind} ({backend}), jax {jax.__version__}"
    title += f", peak {peak:.0f} GB/s" if peak else ""
    print(title + (" [smoke: interpret mode, not a timing]" if args.smoke else ""))
    results = run(shapes, implementations, interpret=interpret, block_sizes=block_sizes, iters=iters, peak=peak)
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            device=device_kind, backend=backend, jax=jax.__version__, python=platform.python_version(),
            smoke=args.smoke, iters=iters, peak_gbps=peak, results=results), indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
