"""Does the compiler keep quantized weights narrow? Full-precision weight copies in a compiled target step.

    python benchmarks/quantized_hlo.py [--layers 30] [--tokens 1 8] [--json results/quantized_hlo.json]

A target of SmolLM2-135M's shapes (random weights: needs no model file, so it runs as is on a GPU or TPU
machine) is quantized with each scheme (`--schemes`, default none,int8,fp8,int4) and one forward of N
tokens against a 256-slot cache (N = 1: a plain decode step; N = 8: a tree verify) is compiled for this
machine's backend. In the optimised HLO, every instruction outside a fused computation whose result is a
floating-point array with a weight's element count is a full-precision copy of that weight written to memory
and read back in every step: what weight-only quantization is meant to avoid. For each scheme and N the
script prints those copies (count and MB), the step's time and its ratio to full precision, and writes JSON
with the copies' HLO lines. `--dump DIR` also writes each optimised HLO module.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FLOATS = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2}
NOT_COPIES = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant"}  # views or inputs, not writes
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(f64|f32|bf16|f16)\[([\d,]*)\]")


def weight_like(dims, shapes) -> bool:
    """Whether an array of `dims` holds as many elements as a [K, N] matrix of `shapes` laid out along K and N
    (leading or trailing group axes merged, size-1 axes ignored): the matrix, its transpose or its groups."""
    dims = [d for d in dims if d != 1]
    n = 1
    for d in dims:
        n *= d
    return len(dims) >= 2 and any(n == k * m and (dims[0] in (k, m) or dims[-1] in (k, m)) for k, m in shapes)


def full_precision_copies(hlo_text: str, shapes) -> list[str]:
    """The instructions of an optimised HLO module that write a floating-point copy of a [K, N] weight of
    `shapes` to memory (`weight_like`): those outside fused computations (a fusion's inner instructions live
    in registers), skipping parameters and views. Returns their HLO lines."""
    fused = set(re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", hlo_text))
    shapes, found, inside = set(shapes), [], None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("{")[0].split("(")[0]:
            inside = header.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if m is None or inside in fused or m.group(2) in NOT_COPIES:
            continue
        if any(weight_like([int(d) for d in filter(None, dims.split(","))], shapes)
               for _, dims in _ARRAY.findall(m.group(1))):
            found.append(line.strip())
    return found


def copy_bytes(lines) -> int:
    """Bytes the copies of `full_precision_copies` write (the largest weight-sized array of each line)."""
    total = 0
    for line in lines:
        shapes = [(FLOATS[t], [int(d) for d in filter(None, dims.split(","))])
                  for t, dims in _ARRAY.findall(_INSTRUCTION.match(line).group(1))]
        total += max(width * functools.reduce(lambda a, b: a * b, dims, 1) for width, dims in shapes)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="tokens per forward (1: decode)")
    ap.add_argument("--schemes", default="none,int8,fp8,int4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dump", default=None, help="directory for each optimised HLO module")
    ap.add_argument("--json", default="results/quantized_hlo.json")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from eagle_jax import quant
    from eagle_jax.config import ModelConfig
    from eagle_jax.model import random_model

    cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=args.layers, num_heads=9, num_kv_heads=3, head_dim=64, tie_embeddings=True,
                      max_position=2048)

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def forward(graphdef, state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache).logits

    rows = []
    for scheme in args.schemes.split(","):
        model = random_model(cfg, seed=0)
        shapes = {tuple(v.shape) for v in jax.tree_util.tree_leaves(nnx.state(model)) if v.ndim == 2}
        quant.quantize_model(model, quant.scheme_from_arg(scheme))
        graphdef, state = nnx.split(model)
        for n in args.tokens:
            tokens = jnp.zeros((1, n), jnp.int32)
            cache = model.init_cache(1, 256).replace(lengths=jnp.full((1,), 64, jnp.int32))
            compiled = forward.lower(graphdef, state, tokens, cache).compile()
            text = compiled.as_text()
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                (Path(args.dump) / f"{scheme}-{n}.hlo.txt").write_text(text)
            copies = full_precision_copies(text, shapes)
            compiled(state, tokens, cache).block_until_ready()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                compiled(state, tokens, cache).block_until_ready()
                times.append(time.perf_counter() - t0)
            rows.append({"scheme": scheme, "tokens": n, "weight_bytes": quant.weight_bytes(state),
                         "copies": len(copies), "copy_bytes": copy_bytes(copies), "step_ms": float(np.median(times)) * 1e3,
                         "copy_lines": copies[:40]})
            print(f"{scheme} N={n}: {len(copies)} copies, {rows[-1]['step_ms']:.2f} ms", flush=True)
    base = {r["tokens"]: r["step_ms"] for r in rows if r["scheme"] == "none"}
    device = jax.devices()[0]
    print(f"\nFull-precision weight copies in a compiled forward, {args.layers} layers of SmolLM2-135M's shapes, "
          f"cache 256 ({jax.default_backend()}: {device.device_kind}, "
          f"{platform.processor() or platform.machine()}, jax {jax.__version__})")
    print(f"{'scheme':>6} {'N':>3} {'weight MB':>10} {'copies':>7} {'copy MB':>8} {'step ms':>8} {'x f32':>6}")
    for r in rows:
        ratio = f"{r['step_ms'] / base[r['tokens']]:.2f}" if r["tokens"] in base else "-"
        print(f"{r['scheme']:>6} {r['tokens']:>3} {r['weight_bytes'] / 1e6:>10.1f} {r['copies']:>7} "
              f"{r['copy_bytes'] / 1e6:>8.1f} {r['step_ms']:>8.2f} {ratio:>6}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "quantized_hlo", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                               "host": platform.node(), "backend": jax.default_backend(),
                               "device": device.device_kind, "jax": jax.__version__, "settings": vars(args),
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
