"""Roofline cost of one forward pass of a model-parallel replica, and of a speculative step.

time = ||(FLOPs / achieved FLOP/s, bytes / achieved bandwidth)||_p + collectives + launch
overhead: a roofline whose knee is rounded by the p-norm.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.config_tree import refuse
from specjax.sim.catalog import HardwareSpec, ModelSpec

DRAFT_VOCAB = 32000  # EAGLE-3 reduced draft vocabulary
LOGIT_BYTES = 12.0  # fp32 logits written, read by softmax, read by the sampler
# Compute and memory traffic overlap imperfectly near the ridge point: the roofline is the
# p-norm of the two times (p -> inf is the hard max; at p = 6 the knee costs 12% more).
ROOFLINE_P = 6.0


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of peak and fixed costs of one hardware + software stack (fitted by
  `specjax.sim.calibrate.fit_efficiency`)."""

  bw: float = 0.8  # fraction of HBM bandwidth reached streaming weights and KV cache
  flops: float = 0.5  # fraction of peak FLOP/s in decode / verify matmuls
  step_overhead_s: float = 1e-3  # per target forward: scheduler, launch, sampler bookkeeping
  draft_overhead_s: float = 3e-4  # per draft forward (a small model / head)
  mfu: float = 0.3  # model FLOPs utilisation of logprob and train
  comm: float = 0.7  # fraction of link bandwidth reached by collectives
  host_ngram_s_per_token: float = 2e-9  # CPU n-gram lookup time per context token scanned
  prepare_overhead_s: float = 5.0  # colocated: engine wake/sleep, train-state offload per step
  other_s: float = 2.0  # data loading + reward per step
  # Fields that matter for small models on CPUs (zero / neutral on the GPU entries):
  attn_flops: float | None = None  # fraction of peak in attention (None: same as `flops`)
  kv_bw: float | None = None  # fraction of bandwidth reading / writing the KV cache (None: `bw`)
  layer_overhead_s: float = 0.0  # per layer per forward: op dispatch inside the program
  logit_s: float = 0.0  # per logit element (row x position x vocab): softmax, sampling, verify
  overlap_p: float = ROOFLINE_P  # roofline knee; 1 = compute and memory traffic add up
  segment_overhead_s: float = 0.0  # specjax engine: host work per segment (sync, compaction)

  def __post_init__(self):
    for f in ("attn_flops", "kv_bw"):
      v = getattr(self, f)
      if v is not None and not 0 < v <= 1:
        refuse(f"Efficiency.{f}: must be None or in (0, 1], got {v}")
    if self.overlap_p < 1:
      refuse(f"Efficiency.overlap_p: must be >= 1, got {self.overlap_p}")
    for f in ("bw", "flops", "mfu", "comm"):
      v = getattr(self, f)
      if not 0 < v <= 1:
        refuse(f"Efficiency.{f}: must be in (0, 1], got {v}")
    for f in ("step_overhead_s", "draft_overhead_s", "host_ngram_s_per_token",
              "prepare_overhead_s", "other_s", "layer_overhead_s", "logit_s",
              "segment_overhead_s"):
      if getattr(self, f) < 0:
        refuse(f"Efficiency.{f}: must be >= 0, got {getattr(self, f)}")

  def replace(self, **kw) -> "Efficiency":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class Net:
  """What a forward pass reads and computes: a target model, an EAGLE-3 head, an MTP layer."""

  dense_params: float  # read and multiplied by every token (attention, dense MLP, heads)
  kv_bytes_per_token: float
  attn_pair_flops: float  # per (query token, context token) pair
  vocab: int  # logits materialised per token
  hidden: int
  layers: int  # layers that end in a collective under model parallelism
  expert_params: float = 0.0  # one expert of one layer
  moe_layers: int = 0
  num_experts: int = 0
  experts_per_token: int = 0
  bytes_per_param: int = 2

  def flops_per_token(self) -> float:
    return 2.0 * (self.dense_params + self.moe_layers * self.experts_per_token * self.expert_params)

  def weight_bytes(self, tokens) -> np.ndarray:
    """Bytes of weights read by one forward over `tokens` tokens: each touched expert once."""
    dense = self.dense_params * self.bytes_per_param
    if not self.moe_layers:
      return np.full_like(np.asarray(tokens, float), dense)
    miss = (1.0 - self.experts_per_token / self.num_experts) ** np.asarray(tokens, float)
    touched = self.num_experts * (1.0 - miss)
    return dense + self.moe_layers * touched * self.expert_params * self.bytes_per_param


def target_net(m: ModelSpec) -> Net:
  router = m.hidden * m.num_experts if m.is_moe else 0
  dense_mlp = 0 if m.is_moe else m.mlp_params
  return Net(dense_params=m.layers * (m.attn_params + dense_mlp + router) + m.embed_params,
             kv_bytes_per_token=m.kv_bytes_per_token, attn_pair_flops=m.attn_flops_per_pair,
             vocab=m.vocab, hidden=m.hidden, layers=m.layers, expert_params=m.expert_params,
             moe_layers=m.layers if m.is_moe else 0, num_experts=m.num_experts,
             experts_per_token=m.experts_per_token, bytes_per_param=m.bytes_per_param)


def eagle3_net(m: ModelSpec, draft_vocab: int = DRAFT_VOCAB) -> Net:
  """EAGLE-3 head: fc 3d->d, one layer whose q/k/v read 2d, dense SwiGLU, draft-vocab LM head."""
  d, hd = m.hidden, m.head_dim
  attn = 2 * d * hd * (m.heads + 2 * m.kv_heads) + m.heads * hd * d
  params = 3 * d * d + attn + 3 * d * m.intermediate + draft_vocab * d
  return Net(dense_params=params, kv_bytes_per_token=2 * m.kv_heads * hd * m.kv_bytes,
             attn_pair_flops=4 * m.heads * hd, vocab=draft_vocab, hidden=d, layers=1,
             bytes_per_param=m.bytes_per_param)


def mtp_net(m: ModelSpec) -> Net:
  """Native MTP module: 2d->d projection, one target-shaped layer, the shared full LM head."""
  t = target_net(m)
  one_layer = (t.dense_params - m.embed_params) / m.layers
  return dataclasses.replace(t, dense_params=2 * m.hidden * m.hidden + one_layer + m.embed_params,
                             kv_bytes_per_token=m.kv_bytes_per_token / m.layers,
                             attn_pair_flops=m.attn_flops_per_pair / m.layers, layers=1,
                             moe_layers=1 if m.is_moe else 0)


def auto_model_parallel(m: ModelSpec, hw: HardwareSpec, weight_fraction: float = 0.5) -> int:
  """Smallest power-of-two replica whose weight shard takes at most `weight_fraction` of HBM."""
  mp = 1
  while m.weight_bytes / mp > weight_fraction * hw.hbm_bytes:
    mp *= 2
  return mp


def collective_time(net: Net, hw: HardwareSpec, eff: Efficiency, mp: int, tokens) -> np.ndarray:
  """Per forward, alpha-beta model: tensor parallelism all-reduces the attention and the MLP
  outputs of every layer; MoE layers instead dispatch + combine tokens to experts (all-to-all)."""
  tokens = np.asarray(tokens, float)
  if mp == 1:
    return np.zeros_like(tokens)
  link = (hw.nvlink_bw / 2 if mp <= hw.domain else hw.net_bw) * eff.comm
  act = tokens * net.hidden * 2.0
  all_reduce = 2.0 * (mp - 1) / mp * act / link
  latency = hw.link_latency_s * (1 + math.log2(mp))
  if net.moe_layers:
    all_to_all = (mp - 1) / mp * act * net.experts_per_token / mp / link
    per_layer = all_reduce + 2 * all_to_all + 3 * latency
  else:
    per_layer = 2 * (all_reduce + latency)
  return net.layers * per_layer


def forward_time(net: Net, hw: HardwareSpec, eff: Efficiency, mp: int, tokens, kv_tokens,
                 queries_per_row: float, overhead_s: float, logit_tokens=None) -> np.ndarray:
  """One forward of a replica of `mp` GPUs over `tokens` new tokens whose rows attend to
  `kv_tokens` cached positions in total (each query of a row sees that row's context).
  Logits are materialised for `logit_tokens` tokens (default: all of them)."""
  tokens = np.asarray(tokens, float)
  kv_tokens = np.asarray(kv_tokens, float)
  logit_tokens = tokens if logit_tokens is None else np.asarray(logit_tokens, float)
  attn = net.attn_pair_flops * queries_per_row * kv_tokens
  nbytes = net.weight_bytes(tokens) + LOGIT_BYTES * net.vocab * logit_tokens
  kv_bytes = net.kv_bytes_per_token * (kv_tokens + tokens)
  compute = (net.flops_per_token() * tokens / (mp * hw.flops * eff.flops)
             + attn / (mp * hw.flops * (eff.attn_flops or eff.flops)))
  memory = (nbytes / (mp * hw.hbm_bw * eff.bw)
            + kv_bytes / (mp * hw.hbm_bw * (eff.kv_bw or eff.bw)))
  p = eff.overlap_p
  roof = (compute**p + memory**p) ** (1.0 / p)
  fixed = overhead_s + net.layers * eff.layer_overhead_s + eff.logit_s * net.vocab * logit_tokens
  busy = np.where(tokens > 0, roof + fixed, 0.0)
  return busy + np.where(tokens > 0, collective_time(net, hw, eff, mp, tokens), 0.0)


def ar_step_time(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, mp: int, rows,
                 kv_tokens) -> np.ndarray:
  """One autoregressive decode step: `rows` live rows, `kv_tokens` cached positions in total."""
  return forward_time(target_net(model), hw, eff, mp, rows, kv_tokens, 1.0, eff.step_overhead_s)


def spec_step_time(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, mp: int, rows, kv_tokens,
                   draft_len: int, acceptance_length: float, drafter,
                   draft_model: ModelSpec | None = None) -> np.ndarray:
  """One speculative step: the drafter's work (`drafter.vllm_draft_time`), then the target
  verifies K+1 tokens per row at once (same weights and KV read as one AR step, K+1 times the
  FLOPs and logits)."""
  rows = np.asarray(rows, float)
  kv_tokens = np.asarray(kv_tokens, float)
  k = draft_len
  verify = forward_time(target_net(model), hw, eff, mp, rows * (k + 1), kv_tokens, k + 1,
                        eff.step_overhead_s)
  if k == 0:
    return verify
  return verify + drafter.vllm_draft_time(model, hw, eff, mp, rows, kv_tokens, k,
                                          acceptance_length, draft_model)
