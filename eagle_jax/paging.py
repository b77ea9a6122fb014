"""The host side of a paged KV cache: the pool's free blocks, and the block table each step reads.

A paged cache (`eagle_jax.kv_cache`, `table` set) keeps every layer's keys and values in one pool of
fixed-size blocks shared by all rows. Which blocks a row holds is decided here, on the host: a request
takes the blocks its prompt, its token budget and the speculative tree's slack need (`blocks_for`)
from the free list, and gives them back when it ends. The table row of a slot nobody holds is -1
(`block_table`), so a step's writes for it are dropped: a row can never write into blocks that have
gone to another.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np

NO_BLOCK = -1  # a table entry that holds no block


def blocks_for(slots: int, block_size: int) -> int:
    """Blocks that hold `slots` slots."""
    return -(-max(int(slots), 0) // block_size)


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class BlockPool:
    """Free list of a pool of `num_blocks` blocks of `block_size` slots. Blocks freed last are handed
    out first (their memory is warm), and a block is never handed out twice without being released."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self._free = collections.deque(range(self.num_blocks - 1, -1, -1))
        self._held = np.zeros(self.num_blocks, bool)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_take(self, n: int) -> bool:
        return n <= len(self._free)

    def take(self, n: int) -> list[int]:
        """n blocks off the free list; OutOfBlocks (and nothing taken) when fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks wanted, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.pop() for _ in range(n)]
        self._held[out] = True
        return out

    def release(self, blocks: Iterable[int]) -> None:
        blocks = [int(b) for b in blocks]
        bad = [b for b in blocks if not (0 <= b < self.num_blocks) or not self._held[b]]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"releasing blocks not held (or twice): {sorted(set(bad)) or blocks}")
        self._held[blocks] = False
        self._free.extend(blocks)


def block_table(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[len(rows), width] int32 table: row i's blocks in slot order, then NO_BLOCK."""
    table = np.full((len(rows), width), NO_BLOCK, np.int32)
    for i, blocks in enumerate(rows):
        if len(blocks) > width:
            raise ValueError(f"row {i} holds {len(blocks)} blocks; the table has room for {width}")
        table[i, : len(blocks)] = blocks
    return table
