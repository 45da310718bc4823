"""Target LMs (Qwen3 / Qwen2 / Llama 3, Gemma 4), KV cache, Hugging Face checkpoint loading."""

from dspark_jax.models.transformer import (
    ForwardOut,
    KVCache,
    Transformer,
    forward,
    forward_jit,
    graphdef,
    init_cache,
    init_params,
    param_count,
)

__all__ = [
    "ForwardOut",
    "KVCache",
    "Transformer",
    "forward",
    "forward_jit",
    "graphdef",
    "init_cache",
    "init_params",
    "param_count",
]
