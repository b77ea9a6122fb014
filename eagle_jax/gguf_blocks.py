"""GGUF's quantized blocks read as integer codes with per-group scales (and minimums), not as floats.

Every llama.cpp block type we keep stores a row of K values in groups of g consecutive values, each
value w = code * scale + bias with one (scale, bias) per group:

  type   codes     group  scale          bias              file layout of one block
  Q8_0   -127..127   32   d              -                 d:f16, 32 x int8
  Q4_0   0..15       32   d              -8 d              d:f16, 16 bytes of nibbles
  Q4_1   0..15       32   d              m                 d:f16, m:f16, 16 bytes of nibbles
  Q5_0   0..31       32   d              -16 d             d:f16, 4 bytes of fifth bits, 16 bytes of nibbles
  Q5_1   0..31       32   d              m                 d, m:f16, fifth bits, nibbles
  Q4_K   0..15       32   d * sc_j       -dmin * m_j       256 values: d, dmin:f16, 12 bytes of 6-bit sc/m, 128 bytes of nibbles
  Q5_K   0..31       32   d * sc_j       -dmin * m_j       as Q4_K plus 32 bytes of fifth bits
  Q6_K   -32..31     16   d * sc_j       -                 256 values: 128 bytes low nibbles, 64 bytes high pairs, 16 x int8 sc, d:f16

`decode(raw, kind, k)` turns a tensor's raw bytes [rows, bytes per row] into `Blocks`: codes [rows, K]
(int8), scale [rows, K / g] and bias [rows, K / g] or None, in float16 where the file's values are
float16 products that stay exact in it (d, m, and -8 d / -16 d) and float32 where they are not
(d * sc). `gguf.quants.dequantize` of the same bytes equals codes * scale + bias (tested); this module
only re-arranges bits, so a quantized load keeps exactly what the file holds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Block types kept quantized, with (values per block, bytes per block); 4-bit codes become int4 matrices,
# wider ones int8.
LAYOUT = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


@dataclasses.dataclass
class Blocks:
    """One tensor's codes [rows, K] (int8), scale and bias [rows, K / group] (bias may be None), rows first
    as in the file. `bits` is 4 where every code is 0..15."""

    codes: np.ndarray
    scale: np.ndarray
    bias: np.ndarray | None
    bits: int

    @property
    def shape(self):
        return self.codes.shape

    def rows(self, order) -> "Blocks":
        """The same tensor with its rows taken in `order` (an index array over rows)."""
        return Blocks(self.codes[order], self.scale[order], None if self.bias is None else self.bias[order], self.bits)


def _f16(raw, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block: [blocks] (as float16)."""
    return np.ascontiguousarray(raw[:, start:start + 2]).view(np.float16)[:, 0]


def _nibbles(qs) -> np.ndarray:
    """Bytes [blocks, 16] -> codes [blocks, 32]: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _fifth_bits(qh, count: int) -> np.ndarray:
    """Bit i of a little-endian bit field [blocks, count / 8] as [blocks, count] (0 or 1)."""
    return np.unpackbits(qh, axis=1, bitorder="little")[:, :count]


def _k_scales(packed) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums of a Q4_K / Q5_K super-block from its 12 bytes: [blocks, 8] each.
    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 minimums 0-3; bytes 8-11 hold the low 4 bits of scales
    4-7 (low nibble) and minimums 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-3 / 4-7."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0xF) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode_blocks(raw: np.ndarray, kind: str):
    """raw [blocks, bytes per block] -> (codes [blocks, n], scale [blocks, groups], bias or None)."""
    n = raw.shape[0]
    if kind == "Q8_0":
        return raw[:, 2:].view(np.int8), _f16(raw, 0)[:, None], None
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(raw, 0)[:, None]
        if kind == "Q4_0":
            return _nibbles(raw[:, 2:]), d, (d * np.float16(-8))
        return _nibbles(raw[:, 4:]), d, _f16(raw, 2)[:, None]
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        codes = _nibbles(raw[:, at + 4:]) | (_fifth_bits(raw[:, at:at + 4], 32) << 4)
        d = _f16(raw, 0)[:, None]
        return codes, d, (d * np.float16(-16)) if kind == "Q5_0" else _f16(raw, 2)[:, None]
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw, 0).astype(np.float32)[:, None], _f16(raw, 2).astype(np.float32)[:, None]
        sc, mn = _k_scales(raw[:, 4:16])
        qs = raw[:, 16:144] if kind == "Q4_K" else raw[:, 48:176]
        # Four chunks of 64 values: 32 bytes each, low nibbles the chunk's first 32 values, high its last 32.
        chunks = qs.reshape(n, 4, 32)
        codes = np.stack([chunks & 0xF, chunks >> 4], axis=2).reshape(n, 256)
        if kind == "Q5_K":  # fifth bit of value 32 j + l: bit j of byte l of the 32-byte field
            high = np.unpackbits(raw[:, 16:48][:, None, :], axis=1, count=8, bitorder="little")  # [n, 8, 32]
            codes = codes | (high.reshape(n, 256) << 4)
        return codes, d * sc, -(dmin * mn)
    if kind == "Q6_K":
        ql, qh = raw[:, 0:128].reshape(n, 2, 64), raw[:, 128:192].reshape(n, 2, 32)
        sc = raw[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(raw, 208).astype(np.float32)[:, None]
        # Each half of 128 values: value 32 j + l (j = 0..3, l = 0..31) takes its low 4 bits from ql byte l
        # (j = 0, 2) or 32 + l (j = 1, 3), low nibble for j < 2 and high for j >= 2, and its top 2 bits from
        # bits 2 j, 2 j + 1 of qh byte l.
        low = np.stack([ql[:, :, 0:32] & 0xF, ql[:, :, 32:64] & 0xF, ql[:, :, 0:32] >> 4, ql[:, :, 32:64] >> 4], axis=2)
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # [n, 2, 4, 32]
        codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 256)
        return codes, d * sc, None
    raise ValueError(f"block type {kind} is not kept quantized")


def decode(raw: np.ndarray, kind: str, k: int) -> Blocks:
    """A tensor's raw bytes [rows, bytes per row] (as `gguf` reads a quantized tensor) as Blocks of K = k
    values a row."""
    per_block, size = LAYOUT[kind]
    rows = raw.shape[0]
    if k % per_block or raw.shape[-1] != k // per_block * size:
        raise ValueError(f"{kind} rows of {k} values need {k // per_block * size} bytes, got {raw.shape[-1]}")
    codes, scale, bias = _decode_blocks(np.ascontiguousarray(raw, np.uint8).reshape(-1, size), kind)
    shaped = lambda a: None if a is None else np.ascontiguousarray(a).reshape(rows, -1)
    return Blocks(shaped(codes.astype(np.int8)), shaped(scale), shaped(bias), 4 if kind in FOUR_BIT else 8)
