"""eagle-jax: EAGLE speculative decoding in pure JAX."""

from eagle_jax.config import ModelConfig, RopeConfig
from eagle_jax.loader import LoadError, Target, load_target
from eagle_jax.engine import GenerationResult, generate

__all__ = ["ModelConfig", "RopeConfig", "LoadError", "Target", "load_target", "generate", "GenerationResult"]
__version__ = "0.1.0"
