"""Weight-only quantization of a target: int8 and fp8 (e4m3) per output channel, int4 in groups, and a
GGUF file's own blocks kept as they are.

A quantized matrix is a `QuantizedWeight` (a pytree: it lives inside the model's `nnx.Param`s and goes
through jit, sharding and `nnx.split` like an array) of a dense [..., K, N] matrix (K the contracted axis)
stored in G groups of K / G consecutive rows:
  values  int8 [..., K, N] (int8), float8_e4m3fn [..., K, N] (fp8), or uint8 [..., K / 2, N] (int4: two
          4-bit codes 0..15 a byte, row 2i in the low nibble and 2i + 1 in the high one);
  scale   [..., G, 1, N] and bias [..., G, 1, N] or None: w = value * scale + bias in each group.
`quantize` makes int8 / fp8 symmetric per output column (G = 1, no bias) and int4 asymmetric in groups of
32 rows (bias = the group's minimum; scale and bias in float16, as llama.cpp's Q4_1 stores them).
`from_blocks` keeps a GGUF tensor's blocks (`eagle_jax.gguf_blocks`): Q4_0 / Q4_1 / Q4_K as int4 and Q8_0 /
Q5_* / Q6_K as int8, in their groups of 32 or 16 with the file's scales and minimums, so the quantized
target holds what the file holds. `quantize_model` quantizes 2-D matrices (a MoE layer's stacked experts
stay in full precision for now).

`matmul(x, w)` is the one product every layer uses: x @ w for an array, and for a quantized matrix the
dequantization is written inside the product (the codes are converted as the dot's operand and each
group's partial sum scaled, plus bias * the group's sum of x), so no full-precision copy of the matrix is
kept between steps. Whether the compiler materialises the converted operand inside a step is its choice:
`benchmarks/quantized.py` measures it on this machine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SCHEMES = ("int8", "fp8", "int4", "gguf")
INT4_GROUP = 32  # int4 rows per scale, the size of llama.cpp's 4-bit blocks
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# Matrices a quantized target stores quantized: attention and MLP (the embedding and lm_head with
# `embeddings=True`). Norms, biases and the MoE router stay in full precision.
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class QuantizeError(ValueError):
    """A quantization scheme or group size that does not apply; the message names the tensor."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    values: jax.Array
    scale: jax.Array
    bias: jax.Array | None = None
    scheme: str = dataclasses.field(default="int8", metadata=dict(static=True))  # int8, fp8 or int4 (values)
    shape: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))  # the dense matrix's

    @property
    def dtype(self):
        """The dense matrix's dtype: the scale's, or float32 where scales are stored in float16 (int4, GGUF)."""
        return jnp.dtype(jnp.float32) if self.scale.dtype == jnp.float16 else self.scale.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def groups(self) -> int:
        return int(self.scale.shape[-3])

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (self.values, self.scale, self.bias)
                   if a is not None)

    def __getitem__(self, index):  # `param[...]` (how the model reads its parameters) gives the matrix itself
        if index is Ellipsis:
            return self
        raise TypeError("a quantized matrix can only be read whole (param[...])")

    @property
    def T(self):  # noqa: N802 - mirrors ndarray.T for the tied lm_head
        raise TypeError("a quantized matrix cannot be transposed; quantize the lm_head separately")


def _pack4(codes):
    """Codes [..., K, N] in 0..15 -> bytes [..., K / 2, N] (row 2i low nibble, 2i + 1 high)."""
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)


def quantize(w, scheme: str, group: int | None = None, name: str = "weight") -> QuantizedWeight:
    """The quantized form of w [..., K, N] (K the contracted axis); `name` goes into errors. group: rows per
    scale (int4: default 32; int8 / fp8: default None, one scale per output column)."""
    if scheme not in ("int8", "fp8", "int4"):
        raise QuantizeError(f"quantize scheme must be one of int8, fp8, int4, got {scheme!r}")
    w = jnp.asarray(w)
    k = w.shape[-2]
    group = (INT4_GROUP if scheme == "int4" else k) if group is None else group
    if k % group or (scheme == "int4" and group % 2):
        raise QuantizeError(f"{scheme} groups of {group} rows do not divide {name}'s {k} rows (shape "
                            f"{tuple(w.shape)}); pick a group size that divides {k}")
    g = w.astype(jnp.float32).reshape(w.shape[:-2] + (k // group, group, w.shape[-1]))  # [..., G, group, N]
    if scheme in ("int8", "fp8"):
        amax = jnp.max(jnp.abs(g), axis=-2, keepdims=True)
        top = 127.0 if scheme == "int8" else FP8_MAX
        scale = jnp.where(amax > 0, amax / top, 1.0).astype(w.dtype)
        q = g / scale.astype(jnp.float32)
        values = (jnp.clip(jnp.round(q), -127, 127).astype(jnp.int8) if scheme == "int8"
                  else q.astype(jnp.float8_e4m3fn))
        return QuantizedWeight(values.reshape(w.shape), scale, None, scheme, tuple(w.shape))
    lo, hi = jnp.min(g, axis=-2, keepdims=True), jnp.max(g, axis=-2, keepdims=True)
    scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(jnp.float16)
    bias = lo.astype(jnp.float16)  # rounded first, so the codes are chosen against what is stored
    codes = jnp.round((g - bias.astype(jnp.float32)) / scale.astype(jnp.float32))
    codes = jnp.clip(codes, 0, 15).astype(jnp.uint8).reshape(w.shape)
    return QuantizedWeight(_pack4(codes), scale, bias, "int4", tuple(w.shape))


def from_blocks(blocks, name: str = "weight") -> QuantizedWeight:
    """A GGUF tensor's `gguf_blocks.Blocks` (rows N of K values, as the file holds a [N, K] matrix) as the
    quantized [K, N] matrix the model multiplies by: the file's codes, scales and minimums, moved only."""
    n, k = blocks.codes.shape
    groups = blocks.scale.shape[1]
    scale = jnp.asarray(blocks.scale.T.reshape(groups, 1, n))
    bias = None if blocks.bias is None else jnp.asarray(blocks.bias.T.reshape(groups, 1, n))
    codes = np.ascontiguousarray(blocks.codes.T)  # [K, N]
    if blocks.bits == 4:
        if codes.min(initial=0) < 0 or codes.max(initial=0) > 15:
            raise QuantizeError(f"{name}: 4-bit codes outside 0..15")
        return QuantizedWeight(jnp.asarray(_pack4(codes.astype(np.uint8))), scale, bias, "int4", (k, n))
    return QuantizedWeight(jnp.asarray(codes.astype(np.int8)), scale, bias, "int8", (k, n))


def codes(q: QuantizedWeight):
    """The codes [..., K, N] of q: its values, or an int4 matrix's unpacked (as int8)."""
    if q.scheme != "int4":
        return q.values
    both = jnp.stack([q.values & 0xF, q.values >> 4], axis=-2)  # [..., K / 2, 2, N]
    return both.reshape(q.shape).astype(jnp.int8)


def dequantize(q, dtype=None):
    """The dense matrix of q (an array is returned as it is)."""
    if not isinstance(q, QuantizedWeight):
        return q
    dtype = dtype or q.dtype
    k, n = q.shape[-2:]
    c = codes(q).astype(jnp.float32).reshape(q.shape[:-2] + (q.groups, k // q.groups, n))
    w = c * q.scale.astype(jnp.float32)
    if q.bias is not None:
        w = w + q.bias.astype(jnp.float32)
    return w.reshape(q.shape).astype(dtype)


def matmul(x, w):
    """x [..., K] @ w [K, N]: a plain product for an array, the dequantizing product for a quantized one."""
    if not isinstance(w, QuantizedWeight):
        return x @ w
    if w.ndim != 2:
        raise ValueError(f"matmul takes a 2-D quantized matrix, got shape {w.shape}")
    k, n = w.shape
    groups = w.groups
    scale = w.scale[:, 0].astype(x.dtype)  # [G, N]
    if groups == 1:
        out = (x @ codes(w).astype(x.dtype)) * scale[0]
        if w.bias is not None:
            out = out + jnp.sum(x, axis=-1, keepdims=True) * w.bias[0, 0].astype(x.dtype)
        return out
    xg = x.reshape(x.shape[:-1] + (groups, k // groups))  # [..., G, group]
    partial = jnp.einsum("...gk,gkn->...gn", xg, codes(w).astype(x.dtype).reshape(groups, k // groups, n))
    out = partial * scale  # each group's x . codes, scaled
    if w.bias is not None:  # plus bias times the group's sum of x
        out = out + jnp.sum(xg, axis=-1)[..., None] * w.bias[:, 0].astype(x.dtype)
    return jnp.sum(out, axis=-2)


def take_columns(q, ids, dtype):
    """Columns `ids` (any shape) of a quantized [K, N] matrix, dequantized: [*ids.shape, K]. A quantized
    tied embedding is stored transposed ([H, V], the lm_head's form), so a lookup takes its columns."""
    k = q.shape[0]
    flat = ids.reshape(-1)
    taken = jnp.take(q.values, flat, axis=1)  # [K (or K / 2), T]
    if q.scheme == "int4":
        taken = jnp.stack([taken & 0xF, taken >> 4], axis=1).reshape(k, -1)
    groups = q.groups
    cols = taken.astype(jnp.float32).reshape(groups, k // groups, -1)
    cols = cols * jnp.take(q.scale[:, 0], flat, axis=1).astype(jnp.float32)[:, None]
    if q.bias is not None:
        cols = cols + jnp.take(q.bias[:, 0], flat, axis=1).astype(jnp.float32)[:, None]
    return cols.reshape(k, -1).T.reshape(ids.shape + (k,)).astype(dtype)


def weight_bytes(tree) -> int:
    """Bytes of every array in tree (an nnx state, a model's parameters), quantized matrices at their size."""
    leaves = jax.tree_util.tree_leaves(tree)
    return int(sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in leaves if hasattr(a, "dtype")))


def quantize_model(model, scheme: str | None, group: int | None = None, embeddings: bool = True):
    """Quantizes the target's attention and MLP matrices in place (`MATRICES`; 2-D ones) and, with
    embeddings, its embedding (stored transposed, [H, V], so the tied lm_head is a plain quantized
    matrix) and lm_head; returns the model. scheme None leaves it as it is; group None is the scheme's
    default (`quantize`)."""
    if scheme is None:
        return model
    if scheme == "gguf":
        raise QuantizeError("quantize 'gguf' keeps a GGUF file's blocks as it loads: pass it to load_target "
                            "with a .gguf file or a built-in model")
    if scheme not in SCHEMES:
        raise QuantizeError(f"quantize must be one of {SCHEMES} or None, got {scheme!r}")
    if model.mesh is not None:
        raise QuantizeError("a quantized target cannot be sharded over a mesh yet: load it on one device")
    if model.quantization is not None:
        raise QuantizeError(f"the target is already quantized ({model.quantization[0]})")
    for i, layer in enumerate(model.layers):
        for name in MATRICES:
            param = getattr(layer, name, None)
            if param is None or param[...].ndim != 2:
                continue
            param.set_value(quantize(param[...], scheme, group, name=f"layers.{i}.{name}"))
    if embeddings:
        model.embed.set_value(quantize(model.embed[...].T, scheme, group, name="embed (transposed)"))
        if not model.cfg.tie_embeddings:
            model.lm_head.set_value(quantize(model.lm_head[...], scheme, group, name="lm_head"))
    model.quantization = (scheme, group, embeddings)
    return model


def add_quantize_args(parser) -> None:
    """--quantize on a CLI (generate, bench, serve)."""
    parser.add_argument("--quantize", choices=[*SCHEMES, "none"], default=None,
                        help="store the target's attention, MLP, embedding and lm_head matrices weight-only "
                             "quantized: int8 or fp8 (e4m3) per output channel, int4 in groups of 32 rows, or "
                             "gguf: a GGUF file's own blocks as they are (4-bit ones as int4, the others as "
                             "int8; default: none, full precision)")


def scheme_from_arg(value: str | None) -> str | None:
    return None if value in (None, "none") else value
