"""Tile sizes of the tree-attention kernels, checked when they are made.

`block_q` counts query *rows*: a kernel folds the G query heads that share a KV head into the row
axis (row = n * G + g), so one KV block load serves all G heads. `block_kv` counts cache slots per
KV block; the tree keys are tiled by `min(block_kv, tree size rounded up)`.

Both are powers of two of at least 16: Triton needs power-of-two tensors and dot operands of at
least 16 per side, and TPU needs second-minor block dims that are multiples of 8 (16 for bf16).
"""

from __future__ import annotations

import dataclasses


def _is_power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_q: query rows per block; block_kv: cache slots per KV block.

    GPU (Triton) kernel only: kv_splits cuts the cache prefix into that many chunks run by parallel
    programs and merged afterwards (flash decoding; None: enough programs to fill the GPU's SMs);
    num_warps / num_stages (None: Triton's defaults).
    """

    block_q: int
    block_kv: int
    kv_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        def check(name, ok, what, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
                raise ValueError(f"BlockSizes.{name} must be {'None or ' if optional else ''}{what}, got {value!r}")

        check("block_q", lambda v: _is_power_of_two(v) and v >= 16, "a power of two >= 16")
        check("block_kv", lambda v: _is_power_of_two(v) and v >= 16, "a power of two >= 16")
        check("kv_splits", lambda v: v >= 1, "a positive int", optional=True)
        check("num_warps", _is_power_of_two, "a power of two", optional=True)
        check("num_stages", lambda v: v >= 1, "a positive int", optional=True)

    @classmethod
    def tpu_default(cls) -> "BlockSizes":
        # 256 rows cover N = 64 with G = 4 in one block (the cache is read once per row block);
        # [256, Hkv * D] cache slabs keep DMAs large. Llama-3-8B shapes (Hkv 8, D 128, bf16) need
        # ~10 MiB of VMEM, under the 16 MiB default scoped limit.
        return cls(block_q=256, block_kv=256)

    @classmethod
    def gpu_default(cls) -> "BlockSizes":
        # Register-resident tiles: [64, D] queries against [64, D] keys per loop step.
        return cls(block_q=64, block_kv=64, kv_splits=None, num_warps=4, num_stages=2)
