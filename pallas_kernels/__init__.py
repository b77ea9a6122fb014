"""Pallas kernels for eagle-jax (importable on its own; no dependency on eagle_jax).

`tree_attention` is the one entry point for a contiguous cache: tree-masked attention over a KV cache,
dispatched by backend to a TPU (Mosaic) kernel, a GPU (Triton) kernel or the pure-jnp reference.
`paged_tree_attention` is the same over a paged cache (a block pool read through a block table).
"""

from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.paged import gather_blocks, paged_tree_attention, paged_tree_attention_reference
from pallas_kernels.tree_attention import (
    IMPLEMENTATIONS,
    default_implementation,
    tree_attention,
    tree_attention_reference,
    use_implementation,
)

__all__ = ["BlockSizes", "IMPLEMENTATIONS", "default_implementation", "gather_blocks", "paged_tree_attention",
           "paged_tree_attention_reference", "tree_attention", "tree_attention_reference", "use_implementation"]
