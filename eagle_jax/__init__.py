"""eagle-jax: EAGLE speculative decoding in pure JAX."""

from eagle_jax.config import ModelConfig, RopeConfig
from eagle_jax.loader import LoadError, Target, load_target
from eagle_jax.engine import GenerationResult, generate
from eagle_jax.draft import DraftConfig, DraftLoadError, load_draft, random_head, save_draft
from eagle_jax.tree import TreeConfig

__all__ = ["ModelConfig", "RopeConfig", "LoadError", "Target", "load_target", "generate", "GenerationResult",
           "DraftConfig", "DraftLoadError", "load_draft", "random_head", "save_draft", "TreeConfig"]
__version__ = "0.1.0"
