"""The paged server's KV blocks: one pool for every running request, handed out by need.

With `SchedulerConfig.block_size` set, the running batch's caches are paged (`eagle_jax.kv_cache`): the
target's and the draft's keys and values sit in pools of `kv_cache_tokens / block_size` blocks that the
batch state carries whatever its batch bucket, and each row addresses its own blocks through a block
table. A request is admitted only when the pool has the blocks its prompt, its max_tokens and the
speculative tree's slack need (`need`); it holds them until it ends, so a running request never runs out
and is never preempted, and one that does not fit waits in the queue. Its blocks go back to the free
list when it ends, and its table row is cleared first (`rows.clear_paged_rows`), so no later step
writes into blocks another request holds.

A prefill writes newcomers straight into the shared pools: `prefill_state` gives them a state of their
own rows (their blocks in its table) around the running batch's pools, and the prefill's output pools
become the batch's again (the batch's were donated to it).
"""

from __future__ import annotations

import numpy as np

from eagle_jax.paging import BlockPool, block_table, blocks_for
from eagle_jax.rows import pools, with_pools, without_pools
from eagle_jax.steps import DecodeState, empty_state


class PagedBlocks:
    def __init__(self, target, head, block_size: int, kv_cache_tokens: int, max_batch: int, cache_len: int,
                 draft_len: int, slack: int):
        self.target, self.head = target, head
        self.block_size = block_size
        self.cache_len, self.draft_len = cache_len, draft_len if head is not None else 0
        self.width = blocks_for(max(self.cache_len, self.draft_len), block_size)  # table entries a row has
        # Room for at least one request of max_model_len; 0 (no limit): max_batch of them.
        tokens = kv_cache_tokens or max_batch * self.width * block_size
        self.pool = BlockPool(max(tokens // block_size, self.width), block_size)
        self.pages = (self.pool.num_blocks, block_size)
        self.extra = slack + (self.draft_len - self.cache_len if head is not None else 0)

    def need(self, req) -> int:
        """Blocks a request holds: its prompt, max_tokens and the tree's slack (+ the draft's scratch)."""
        return min(blocks_for(len(req.prompt_ids) + req.max_tokens + 1 + self.extra, self.block_size), self.width)

    def reserve(self, req) -> bool:
        """Takes the request's blocks off the free list; False (nothing taken) when too few are free."""
        if getattr(req, "blocks", None):
            return True
        n = self.need(req)
        if not self.pool.can_take(n):
            return False
        req.blocks = self.pool.take(n)
        return True

    def release(self, req) -> None:
        if getattr(req, "blocks", None):
            self.pool.release(req.blocks)
        req.blocks = None

    def counts(self) -> dict:
        return {"kv_blocks_used": self.pool.used, "kv_blocks_free": self.pool.free,
                "kv_block_size": self.block_size}

    def prefill_state(self, reqs, batch: int, main: DecodeState) -> DecodeState:
        """An empty state of `batch` rows, the first len(reqs) holding those requests' blocks, around the
        running batch's pools (which a prefill into it writes, and donates)."""
        table = block_table([r.blocks for r in reqs] + [[]] * (batch - len(reqs)), self.width)
        return with_pools(self._rows(table), pools(main))

    def _rows(self, table: np.ndarray) -> DecodeState:
        """The per-row part of an empty paged state with this table (pools of no blocks: nothing allocated)."""
        return without_pools(empty_state(self.target, self.head, table.shape[0], 0, 0, pages=(0, self.block_size, table)))
