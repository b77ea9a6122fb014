"""Weight-only quantization of a target: int8 and fp8 (e4m3) per output channel, int4 in groups.

A quantized matrix is a `QuantizedWeight` (a pytree: it lives inside the model's `nnx.Param`s and goes
through jit, sharding and `nnx.split` like an array) holding:
  int8   values int8 [..., K, N], scale [..., 1, N]: w = values * scale (symmetric, per output column);
  fp8    values float8_e4m3fn [..., K, N], scale [..., 1, N]: w = values * scale (amax maps to 448);
  int4   values uint8 [..., K / 2, N] (two 4-bit codes a byte: row 2i in the low nibble, 2i + 1 in the
         high one), scale and zero [..., K / group, 1, N] in the compute dtype: w = (code - zero) * scale
         per group of `group` rows (asymmetric: codes 0..15 span each group's min..max).
`quantize` keeps leading axes; `quantize_model` quantizes 2-D matrices (a MoE layer's stacked experts
stay in full precision for now).

`matmul(x, w)` is the one product every layer uses: x @ w for an array, and for a quantized matrix the
dequantization is written inside the product (the int8 / fp8 values are converted as the dot's operand
and the scale applied to its output; int4 multiplies group by group and scales each group's partial
sum), so XLA on GPU / TPU fuses the convert into the dot and no full-precision copy of the matrix is
made per step (on GPU / TPU; not yet checked in their compiled HLO). `benchmarks/quantized.py` times one
product per scheme on this machine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SCHEMES = ("int8", "fp8", "int4")
DEFAULT_GROUP = 64  # int4 rows per scale
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
    zero: jax.Array | None = None  # int4 only
    scheme: str = dataclasses.field(default="int8", metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))  # the dense matrix's

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (self.values, self.scale, self.zero)
                   if a is not None)

    def __getitem__(self, index):  # `param[...]` (how the model reads its parameters) gives the matrix itself
        if index is Ellipsis:
            return self
        raise TypeError("a quantized matrix can only be read whole (param[...])")

    @property
    def T(self):  # noqa: N802 - mirrors ndarray.T for the tied lm_head
        raise TypeError("a quantized matrix cannot be transposed; quantize the lm_head separately")


def quantize(w, scheme: str, group: int = DEFAULT_GROUP, name: str = "weight") -> QuantizedWeight:
    """The quantized form of w [..., K, N] (K the contracted axis); `name` goes into errors."""
    if scheme not in SCHEMES:
        raise QuantizeError(f"quantize scheme must be one of {SCHEMES}, got {scheme!r}")
    w = jnp.asarray(w)
    dtype = w.dtype
    wf = w.astype(jnp.float32)
    if scheme in ("int8", "fp8"):
        amax = jnp.max(jnp.abs(wf), axis=-2, keepdims=True)
        top = 127.0 if scheme == "int8" else FP8_MAX
        scale = jnp.where(amax > 0, amax / top, 1.0)
        if scheme == "int8":
            values = jnp.clip(jnp.round(wf / scale), -127, 127).astype(jnp.int8)
        else:
            values = (wf / scale).astype(jnp.float8_e4m3fn)
        return QuantizedWeight(values, scale.astype(dtype), None, scheme, tuple(w.shape))
    k = w.shape[-2]
    if k % group or group % 2:
        raise QuantizeError(f"int4 groups of {group} rows do not divide {name}'s {k} rows (shape {tuple(w.shape)}); "
                            f"pick a group size that divides {k}")
    g = wf.reshape(w.shape[:-2] + (k // group, group, w.shape[-1]))  # [..., G, group, N]
    lo, hi = jnp.min(g, axis=-2, keepdims=True), jnp.max(g, axis=-2, keepdims=True)
    scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0)
    zero = jnp.round(-lo / scale)
    codes = jnp.clip(jnp.round(g / scale) + zero, 0, 15).astype(jnp.uint8).reshape(w.shape)
    packed = codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)  # [..., K / 2, N]
    return QuantizedWeight(packed, scale.astype(dtype), zero.astype(dtype), "int4", tuple(w.shape))


def _int4_codes(q: QuantizedWeight):
    """The 4-bit codes [..., K, N] of an int4 matrix, unpacked (as int8)."""
    low, high = q.values & 0xF, q.values >> 4
    both = jnp.stack([low, high], axis=-2)  # [..., K / 2, 2, N]
    return both.reshape(q.shape).astype(jnp.int8)


def dequantize(q, dtype=None):
    """The dense matrix of q (an array is returned as it is)."""
    if not isinstance(q, QuantizedWeight):
        return q
    dtype = dtype or q.dtype
    if q.scheme != "int4":
        return (q.values.astype(jnp.float32) * q.scale.astype(jnp.float32)).astype(dtype)
    k, n = q.shape[-2:]
    groups = q.scale.shape[-3]
    codes = _int4_codes(q).astype(jnp.float32).reshape(q.shape[:-2] + (groups, k // groups, n))
    w = (codes - q.zero.astype(jnp.float32)) * q.scale.astype(jnp.float32)
    return w.reshape(q.shape).astype(dtype)


def matmul(x, w):
    """x [..., K] @ w [K, N]: a plain product for an array, the dequantizing product for a quantized one."""
    if not isinstance(w, QuantizedWeight):
        return x @ w
    if w.ndim != 2:
        raise ValueError(f"matmul takes a 2-D quantized matrix, got shape {w.shape} (use expert_matmul)")
    if w.scheme != "int4":
        return (x @ w.values.astype(x.dtype)) * w.scale[0].astype(x.dtype)
    k, n = w.shape
    groups = w.scale.shape[0]
    xg = x.reshape(x.shape[:-1] + (groups, k // groups))  # [..., G, group]
    codes = _int4_codes(w).astype(x.dtype).reshape(groups, k // groups, n)
    partial = jnp.einsum("...gk,gkn->...gn", xg, codes)  # per group: x . codes
    # (codes - zero) * scale, summed over the group: scale * (x . codes - zero * sum(x)).
    sums = jnp.sum(xg, axis=-1)[..., None]  # [..., G, 1]
    out = (partial - sums * w.zero[:, 0].astype(x.dtype)) * w.scale[:, 0].astype(x.dtype)
    return jnp.sum(out, axis=-2)


def take_columns(q, ids, dtype):
    """Columns `ids` (any shape) of a quantized [K, N] matrix, dequantized: [*ids.shape, K]. A quantized
    tied embedding is stored transposed ([H, V], the lm_head's form), so a lookup takes its columns."""
    k = q.shape[0]
    flat = ids.reshape(-1)
    if q.scheme != "int4":
        cols = jnp.take(q.values, flat, axis=1).astype(jnp.float32) * jnp.take(q.scale[0], flat)[None].astype(jnp.float32)
    else:
        packed = jnp.take(q.values, flat, axis=1)  # [K / 2, T]
        codes = jnp.stack([packed & 0xF, packed >> 4], axis=1).reshape(k, -1).astype(jnp.float32)
        groups = q.scale.shape[0]
        scale = jnp.take(q.scale[:, 0], flat, axis=1).astype(jnp.float32)[:, None]  # [G, 1, T]
        zero = jnp.take(q.zero[:, 0], flat, axis=1).astype(jnp.float32)[:, None]
        cols = ((codes.reshape(groups, k // groups, -1) - zero) * scale).reshape(k, -1)
    return cols.T.reshape(ids.shape + (k,)).astype(dtype)


def weight_bytes(tree) -> int:
    """Bytes of every array in tree (an nnx state, a model's parameters), quantized matrices at their size."""
    leaves = jax.tree_util.tree_leaves(tree)
    return int(sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in leaves if hasattr(a, "dtype")))


def quantize_model(model, scheme: str | None, group: int = DEFAULT_GROUP, embeddings: bool = True):
    """Quantizes the target's attention and MLP matrices in place (`MATRICES`; 2-D ones) and, with
    embeddings, its embedding (stored transposed, [H, V], so the tied lm_head is a plain quantized
    matrix) and lm_head; returns the model. scheme None leaves it as it is."""
    if scheme is None:
        return model
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
                             "quantized: int8 or fp8 (e4m3) per output channel, int4 in groups of 64 rows "
                             "(default: none, full precision)")


def scheme_from_arg(value: str | None) -> str | None:
    return None if value in (None, "none") else value
