"""Pallas kernels for eagle-jax (importable on its own; no dependency on eagle_jax).

`tree_attention` is the one entry point: tree-masked attention over a KV cache, dispatched by backend.
"""

from pallas_kernels.tree_attention import tree_attention, tree_attention_reference

__all__ = ["tree_attention", "tree_attention_reference"]
