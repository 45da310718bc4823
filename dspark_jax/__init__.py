"""dspark-jax: DSpark confidence-scheduled speculative decoding in JAX/Flax NNX."""

__version__ = "0.1.0"
