"""specjax: lossless speculative decoding inside RL rollouts, in JAX/Flax."""

__version__ = "0.1.0"
