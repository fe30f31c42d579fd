"""GRPO: group advantages (GRPO, Dr.GRPO, leave-one-out), the clipped policy-gradient loss and
their config (`GRPOConfig`, beside the registries it validates against).

Token arrays are [B, T], one entry per token (the train step aligns them with the sequence);
`mask` is 1 on the completion tokens the loss covers. Explicit denominators make the losses of
micro-batches sum to exactly the full-batch loss (gradient accumulation).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config_tree import check, one_of
from specjax.models.chunked import logprob_and_entropy


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
  """Advantages [N/G, G] of group-centred rewards (`centered` = r - group mean)."""

  fn: Callable[[jax.Array, int, float], jax.Array]  # (centered [N/G, G], group_size, eps)
  min_group_size: int = 2


ADVANTAGES: dict[str, AdvantageEstimator] = {}


def register_advantage(name: str, min_group_size: int = 2):
  """Decorator: register `fn(centered, group_size, eps)` as the estimator `GRPOConfig.adv_mode`
  names `name`."""
  def add(fn):
    ADVANTAGES[name] = AdvantageEstimator(fn, min_group_size)
    return fn
  return add


@register_advantage("grpo")
def _grpo(centered: jax.Array, group_size: int, eps: float) -> jax.Array:
  """(r - mean) / (std + eps) with the unbiased std (ddof=1), as in TRL / verl."""
  std = jnp.sqrt(jnp.sum(centered**2, axis=1, keepdims=True) / max(group_size - 1, 1))
  return centered / (std + eps)


@register_advantage("drgrpo", min_group_size=1)
def _drgrpo(centered: jax.Array, group_size: int, eps: float) -> jax.Array:
  """r - mean (Dr.GRPO drops the std scaling)."""
  return centered


@register_advantage("loo")
def _loo(centered: jax.Array, group_size: int, eps: float) -> jax.Array:
  """r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean) (RLOO baseline)."""
  return centered * (group_size / max(group_size - 1, 1))


def group_advantages(rewards: jax.Array, group_size: int, mode: str = "grpo",
                     eps: float = 1e-6) -> jax.Array:
  """float32[N] advantages of rewards[N] laid out as N / G consecutive groups of G samples, by
  the estimator registered as `mode` (`ADVANTAGES`: grpo, drgrpo, loo)."""
  r = jnp.asarray(rewards, jnp.float32)
  if r.shape[0] % group_size:
    raise ValueError(f"group_advantages: {r.shape[0]} rewards are not a multiple of "
                     f"group_size={group_size}")
  if mode not in ADVANTAGES:
    raise ValueError(f"group_advantages: mode must be one of {list(ADVANTAGES)}, got {mode!r}")
  g = r.reshape(-1, group_size)
  centered = g - g.mean(axis=1, keepdims=True)
  return ADVANTAGES[mode].fn(centered, group_size, eps).reshape(-1)


# token-mean: over all completion tokens; seq-mean-token-mean: per sequence over its own length,
# then over sequences; seq-mean-token-sum-norm (Dr.GRPO): per-sequence sums over a constant length
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")



@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """The GRPO loss and its advantages; `adv_mode` and `loss_agg` name the entries of
  `ADVANTAGES` and `LOSS_AGGS` above."""

  group_size: int = 8  # G samples per prompt
  clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher)
  clip_high: float = 0.28
  beta: float = 0.0  # k3 KL coefficient to the frozen reference; 0 skips the reference forward
  adv_mode: str = "grpo"  # grpo: (r - mean) / (std + eps); drgrpo: r - mean; loo: leave-one-out
  loss_agg: str = "token-mean"
  adv_eps: float = 1e-6

  def __post_init__(self):
    w = "GRPOConfig"
    check(self.group_size >= 1, f"{w}.group_size", f"must be >= 1, got {self.group_size}")
    one_of(self.adv_mode, ADVANTAGES, f"{w}.adv_mode")
    need = ADVANTAGES[self.adv_mode].min_group_size
    check(self.group_size >= need, f"{w}.group_size",
          f"adv_mode={self.adv_mode!r} needs group_size >= {need}, got {self.group_size}")
    check(0 <= self.clip_low < 1, f"{w}.clip_low", f"must be in [0, 1), got {self.clip_low}")
    check(self.clip_high >= 0, f"{w}.clip_high", f"must be >= 0, got {self.clip_high}")
    check(self.beta >= 0, f"{w}.beta", f"must be >= 0, got {self.beta}")
    check(self.adv_eps > 0, f"{w}.adv_eps", f"must be > 0, got {self.adv_eps}")
    one_of(self.loss_agg, LOSS_AGGS, f"{w}.loss_agg")

@struct.dataclass
class LossDenominators:
  tokens: jax.Array  # float32 scalar: completion tokens in the full batch
  seqs: jax.Array  # float32 scalar: sequences in the full batch
  # float32 scalar: Dr.GRPO's constant length (the largest completion, e.g. max_new_tokens)
  norm_len: jax.Array | None = None
  # float32 scalar: completion tokens the token-mean metrics average over (None: `tokens`); the
  # tokens of the sequences a packed step trains on when it leaves some out
  metric_tokens: jax.Array | None = None

  @property
  def metric_denominator(self) -> jax.Array:
    return self.tokens if self.metric_tokens is None else self.metric_tokens


def denominators(mask: jax.Array, norm_len: int | None = None) -> LossDenominators:
  """Full-batch denominators of `mask` [B, T]; `norm_len` None -> T (the padded width)."""
  return LossDenominators(tokens=jnp.maximum(mask.sum(), 1.0).astype(jnp.float32),
                          seqs=jnp.asarray(mask.shape[0], jnp.float32),
                          norm_len=jnp.asarray(norm_len or mask.shape[1], jnp.float32))


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """Schulman's k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref - pi >= 0."""
  d = ref_logprobs - logprobs
  return jnp.exp(d) - d - 1.0


def aggregate(per_token: jax.Array, mask: jax.Array, agg: str,
              denom: LossDenominators, seq_lengths: jax.Array | None = None) -> jax.Array:
  """Sum of this (micro-)batch's share of the full-batch mean under `agg`. `seq_lengths` [B, T]
  (packed rows, several sequences per row): each token's own sequence's completion length."""
  if agg == "token-mean":
    return jnp.sum(per_token * mask) / denom.tokens
  if agg == "seq-mean-token-mean":
    if seq_lengths is not None:
      return jnp.sum(per_token * mask / jnp.maximum(seq_lengths, 1.0)) / denom.seqs
    per_seq = jnp.sum(per_token * mask, axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
    return jnp.sum(per_seq) / denom.seqs
  if agg == "seq-mean-token-sum-norm":  # Dr.GRPO: one constant length for every sequence
    norm_len = per_token.shape[1] if denom.norm_len is None else denom.norm_len
    return jnp.sum(per_token * mask) / (denom.seqs * norm_len)
  raise ValueError(f"aggregate: loss_agg must be one of {LOSS_AGGS}, got {agg!r}")


def grpo_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
              mask: jax.Array, cfg: GRPOConfig, ref_logprobs: jax.Array | None = None,
              denom: LossDenominators | None = None,
              pg_weights: jax.Array | None = None,
              seq_lengths: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Clipped surrogate with separate low/high clip + beta * k3 KL. Arrays [B, T], advantages [B]
  (one per row) or [B, T] (one per token: packed rows; `seq_lengths` as in `aggregate`).

  `pg_weights` [B, T] (e.g. truncated importance-sampling weights) scales each token's
  policy-gradient term, as a constant; the KL term and all metrics stay unweighted.
  Returns (loss, metrics); metrics are token means over `mask` in this (micro-)batch, scaled like
  the loss so that they too sum over micro-batches.
  """
  mask = mask.astype(jnp.float32)
  denom = denominators(mask) if denom is None else denom
  adv = advantages.astype(jnp.float32)
  adv = adv[:, None] if adv.ndim == 1 else adv
  log_ratio = logprobs - old_logprobs
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  pg = jnp.maximum(-adv * ratio, -adv * clipped)
  per_token = pg if pg_weights is None else pg * jax.lax.stop_gradient(pg_weights)
  # the clipped branch binds (and has zero gradient) exactly where these hold
  clip_low_hit = (ratio < 1.0 - cfg.clip_low) & (adv < 0)
  clip_high_hit = (ratio > 1.0 + cfg.clip_high) & (adv > 0)
  kl = jnp.zeros_like(logprobs)
  if cfg.beta > 0:
    if ref_logprobs is None:
      raise ValueError("grpo_loss: beta > 0 needs ref_logprobs")
    kl = k3_kl(logprobs, ref_logprobs)
    per_token = per_token + cfg.beta * kl
  loss = aggregate(per_token, mask, cfg.loss_agg, denom, seq_lengths)
  tok = lambda x: jnp.sum(x.astype(jnp.float32) * mask) / denom.metric_denominator
  metrics = {
      "pg_loss": aggregate(pg, mask, cfg.loss_agg, denom, seq_lengths),
      "kl": tok(kl),
      "clip_frac": tok(clip_low_hit | clip_high_hit),
      "clip_low_frac": tok(clip_low_hit),
      "clip_high_frac": tok(clip_high_hit),
      "ratio_mean": tok(ratio),
      "approx_kl_old": tok(0.5 * log_ratio**2),
  }
  return loss, metrics


def token_logprobs(logits: jax.Array, targets: jax.Array,
                   temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(logprob of targets [B, T], entropy [B, T]) under softmax(logits / temperature)."""
  return logprob_and_entropy(logits, targets, temperature)
