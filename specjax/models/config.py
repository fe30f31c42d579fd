"""Configuration of the decoder: one frozen dataclass, validated on construction.

Covers the Qwen3 and Llama families (GQA, RoPE with optional Llama-3 scaling, optional q/k norm,
tied or untied LM head) and the optional DeepSeek-V3 style native MTP module.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.config_tree import refuse

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots")


def _check(cond: bool, field: str, msg: str) -> None:
  if not cond:
    refuse(f"ModelConfig.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 64
  hidden_size: int = 64
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_hidden: int = 128
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_eps: float = 1e-6
  qk_norm: bool = True  # Qwen3 normalises q and k per head; Llama does not
  tie_embeddings: bool = True
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  # Layers whose *input* residual stream is exported for EAGLE-3; None -> (2, L//2, L-3).
  aux_layers: tuple[int, ...] | None = None
  mtp: bool = False  # native multi-token-prediction module (DeepSeek-V3 style)
  init_std: float = 0.02
  # Full-sequence (no-cache) forwards, i.e. training and logprob passes: 0 = dense attention
  # (scores [B, H, T, T]); > 0 = memory linear in T, a fused kernel where the backend has one,
  # else query x key blocks of this size (`specjax.models.attention`).
  attention_block: int = 0
  # Rematerialisation of each decoder layer in full-sequence forwards: "none" keeps every
  # activation for the backward pass, "full" keeps only layer inputs, "dots" keeps matmul outputs.
  remat: str = "none"
  # Losses and logprobs of full-sequence forwards: LM-head logits this many positions at a time
  # (`specjax.models.chunked`), never [B, T, V] at once; 0 = all positions in one piece.
  logits_chunk: int = 0

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "mlp_hidden"):
      _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
    _check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
           f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    _check(self.head_dim % 2 == 0, "head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
    _check(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
    _check(self.rms_eps > 0, "rms_eps", f"must be > 0, got {self.rms_eps}")
    _check(self.dtype in DTYPES, "dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
    _check(self.param_dtype in DTYPES, "param_dtype",
           f"must be one of {sorted(DTYPES)}, got {self.param_dtype!r}")
    _check(self.attention_block >= 0, "attention_block",
           f"must be >= 0 (0 = dense), got {self.attention_block}")
    _check(self.logits_chunk >= 0, "logits_chunk", f"must be >= 0 (0 = whole sequence), got "
           f"{self.logits_chunk}")
    _check(self.remat in REMAT_POLICIES, "remat",
           f"must be one of {list(REMAT_POLICIES)}, got {self.remat!r}")
    if self.aux_layers is not None:
      object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
      _check(len(self.aux_layers) >= 1, "aux_layers", "must name at least one layer")
      for i in self.aux_layers:
        _check(0 <= i < self.num_layers, "aux_layers",
               f"layer index {i} outside [0, {self.num_layers})")
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

  @property
  def aux_layer_ids(self) -> tuple[int, ...]:
    if self.aux_layers is not None:
      return self.aux_layers
    n = self.num_layers
    return (min(2, n - 1), n // 2, max(n - 3, 0))

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def params_dtype(self):
    return DTYPES[self.param_dtype]

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, v = self.hidden_size, self.mlp_hidden, self.vocab_size
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else v * d
    return v * d + self.num_layers * layer + d + head
