"""Hardware and model catalogs of the simulator: published specs, extendable from a YAML file.

Units are SI throughout: FLOP/s, bytes, bytes/s, seconds. No jax here: the simulator is numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from specjax.config_tree import refuse
from specjax.errors import UserError


def _check(cls: str, cond: bool, field: str, msg: str) -> None:
  if not cond:
    refuse(f"{cls}.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
  """One accelerator. Bandwidths are per GPU; `nvlink_bw` is the marketed bidirectional figure
  (collectives use half of it per direction); `net_bw` is the scale-out NIC bandwidth per GPU."""

  name: str
  flops: float  # dense bf16 FLOP/s
  hbm_bw: float  # bytes/s
  hbm_bytes: float  # usable HBM capacity
  nvlink_bw: float  # bytes/s, bidirectional
  net_bw: float  # bytes/s per GPU, one direction (InfiniBand / RoCE)
  domain: int  # GPUs in one NVLink domain
  link_latency_s: float = 5e-6  # per collective hop

  def __post_init__(self):
    for f in ("flops", "hbm_bw", "hbm_bytes", "nvlink_bw", "net_bw"):
      _check("HardwareSpec", getattr(self, f) > 0, f, f"must be > 0, got {getattr(self, f)}")
    _check("HardwareSpec", self.domain >= 1, "domain", f"must be >= 1, got {self.domain}")
    _check("HardwareSpec", self.link_latency_s >= 0, "link_latency_s", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A Qwen3 / Llama-style decoder as in its Hugging Face config.json. MoE models set
  `num_experts`, `experts_per_token` and `expert_intermediate` (every layer is MoE)."""

  name: str
  hidden: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  intermediate: int  # dense MLP width (the EAGLE-3 head's MLP width for MoE models too)
  vocab: int
  tie_embeddings: bool = False
  num_experts: int = 0
  experts_per_token: int = 0
  expert_intermediate: int = 0
  bytes_per_param: int = 2  # bf16 weights
  kv_bytes: int = 2  # bf16 KV cache

  def __post_init__(self):
    for f in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
              "bytes_per_param", "kv_bytes"):
      _check("ModelSpec", getattr(self, f) >= 1, f, f"must be >= 1, got {getattr(self, f)}")
    _check("ModelSpec", self.heads % self.kv_heads == 0, "kv_heads",
           f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
    if self.num_experts:
      _check("ModelSpec", 1 <= self.experts_per_token <= self.num_experts, "experts_per_token",
             f"must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}")
      _check("ModelSpec", self.expert_intermediate >= 1, "expert_intermediate",
             f"must be >= 1 for an MoE model, got {self.expert_intermediate}")

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def attn_params(self) -> int:  # one layer: q, k, v, o
    return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

  @property
  def expert_params(self) -> int:  # one expert of one layer (SwiGLU)
    return 3 * self.hidden * self.expert_intermediate

  @property
  def mlp_params(self) -> int:  # one layer, all experts
    if self.is_moe:
      return self.num_experts * self.expert_params + self.hidden * self.num_experts
    return 3 * self.hidden * self.intermediate

  @property
  def active_mlp_params(self) -> int:  # one layer, per token
    if self.is_moe:
      return self.experts_per_token * self.expert_params + self.hidden * self.num_experts
    return self.mlp_params

  @property
  def embed_params(self) -> int:
    return self.vocab * self.hidden

  @property
  def num_params(self) -> int:
    head = 0 if self.tie_embeddings else self.embed_params
    return self.embed_params + head + self.layers * (self.attn_params + self.mlp_params)

  @property
  def active_params(self) -> int:
    """Parameters touched per token in matmuls (LM head included, embedding lookup excluded)."""
    return self.embed_params + self.layers * (self.attn_params + self.active_mlp_params)

  @property
  def weight_bytes(self) -> float:
    return float(self.num_params * self.bytes_per_param)

  @property
  def kv_bytes_per_token(self) -> float:
    return float(2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes)

  @property
  def attn_flops_per_pair(self) -> float:
    """FLOPs of one (query token, context token) pair: QK^T and PV over all layers and heads."""
    return float(4 * self.layers * self.heads * self.head_dim)


def _gb(x: float) -> float:
  return x * 1e9


def _tb(x: float) -> float:
  return x * 1e12


HARDWARE: dict[str, HardwareSpec] = {h.name: h for h in (
    HardwareSpec("h100", flops=989e12, hbm_bw=_tb(3.35), hbm_bytes=_gb(80), nvlink_bw=_gb(900),
                 net_bw=_gb(50), domain=8),
    HardwareSpec("h200", flops=989e12, hbm_bw=_tb(4.8), hbm_bytes=_gb(141), nvlink_bw=_gb(900),
                 net_bw=_gb(50), domain=8),
    HardwareSpec("b200", flops=2250e12, hbm_bw=_tb(8.0), hbm_bytes=_gb(180), nvlink_bw=_gb(1800),
                 net_bw=_gb(50), domain=8),
    HardwareSpec("gb200", flops=2500e12, hbm_bw=_tb(8.0), hbm_bytes=_gb(186),
                 nvlink_bw=_gb(1800), net_bw=_gb(50), domain=72),
    # The 2-core x86_64 CPU specjax's own measurements ran on: nominal peaks the fitted
    # fractions are relative to (2 cores x 2.5 GHz x 2 FMA x 8 fp32 lanes x 2 FLOPs; one DDR4
    # channel); domain 1: no model parallelism.
    HardwareSpec("cpu", flops=160e9, hbm_bw=_gb(20), hbm_bytes=_gb(16), nvlink_bw=_gb(1),
                 net_bw=_gb(1), domain=1, link_latency_s=0.0),
)}

_QWEN_VOCAB = 151936
_LLAMA_VOCAB = 128256

MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, _QWEN_VOCAB, tie_embeddings=True),
    ModelSpec("qwen3-1.7b", 2048, 28, 16, 8, 128, 6144, _QWEN_VOCAB, tie_embeddings=True),
    ModelSpec("qwen3-4b", 2560, 36, 32, 8, 128, 9728, _QWEN_VOCAB, tie_embeddings=True),
    ModelSpec("qwen3-8b", 4096, 36, 32, 8, 128, 12288, _QWEN_VOCAB),
    ModelSpec("qwen3-14b", 5120, 40, 40, 8, 128, 17408, _QWEN_VOCAB),
    ModelSpec("qwen3-32b", 5120, 64, 64, 8, 128, 25600, _QWEN_VOCAB),
    ModelSpec("qwen3-30b-a3b", 2048, 48, 32, 4, 128, 6144, _QWEN_VOCAB, num_experts=128,
              experts_per_token=8, expert_intermediate=768),
    ModelSpec("qwen3-235b-a22b", 4096, 94, 64, 4, 128, 12288, _QWEN_VOCAB, num_experts=128,
              experts_per_token=8, expert_intermediate=1536),
    ModelSpec("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, _LLAMA_VOCAB),
    ModelSpec("llama-3.1-70b", 8192, 80, 64, 8, 128, 28672, _LLAMA_VOCAB),
)}


class UnknownName(UserError, KeyError):
  """A hardware, model or workload name the catalog lacks: a KeyError of the lookup, and a user's
  mistake (one line from the command line)."""

  def __str__(self) -> str:  # the message as given, not KeyError's quoted repr
    return str(self.args[0]) if self.args else ""


def _lookup(table: dict[str, Any], name: str, kind: str):
  key = name.lower()
  if key not in table:
    raise UnknownName(f"unknown {kind} {name!r}; known: {sorted(table)} (add more with --catalog)")
  return table[key]


def get_hardware(name: str) -> HardwareSpec:
  return _lookup(HARDWARE, name, "hardware")


def get_model(name: str) -> ModelSpec:
  return _lookup(MODELS, name, "model")


def load_catalog(path: str) -> tuple[list[str], list[str]]:
  """Registers the `hardware:` and `models:` entries of a YAML file (name -> fields of
  HardwareSpec / ModelSpec; numbers may be written 3.35e12). Returns the names added."""
  with open(path) as f:
    data = yaml.safe_load(f) or {}
  unknown = set(data) - {"hardware", "models"}
  if unknown:
    refuse(f"{path}: unknown top-level keys {sorted(unknown)}; use hardware: / models:")
  hw_names, model_names = [], []
  for name, fields in (data.get("hardware") or {}).items():
    spec = HardwareSpec(name=name.lower(), **{k: float(v) if k != "domain" else int(v)
                                              for k, v in fields.items()})
    HARDWARE[spec.name] = spec
    hw_names.append(spec.name)
  for name, fields in (data.get("models") or {}).items():
    spec = ModelSpec(name=name.lower(), **fields)
    MODELS[spec.name] = spec
    model_names.append(spec.name)
  return hw_names, model_names
