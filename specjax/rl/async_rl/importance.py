"""Truncated importance sampling for the off-policy batches of async RL: per-token weights
min(pi_old / pi_sampler, cap) that `TrainBatch.pg_weights` applies to the policy-gradient term.

pi_old is the trainer's policy when the batch is trained (the anchor of the PPO ratio), pi_sampler
the possibly older policy that generated the batch (its logprobs as the sampler reported them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tis_weights(old_logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array,
                cap: float) -> jax.Array:
  """min(exp(old - sampler), cap) on the masked tokens, 0 elsewhere."""
  w = jnp.minimum(jnp.exp(old_logprobs - sampler_logprobs), cap)
  return jnp.where(mask > 0, w, 0.0)


def weight_metrics(is_weights: jax.Array, mask: jax.Array, cap: float) -> dict[str, jax.Array]:
  n = jnp.maximum(mask.sum(), 1.0)
  on = mask > 0
  return {"is/weight_mean": jnp.sum(is_weights * mask) / n,
          "is/weight_min": jnp.min(jnp.where(on, is_weights, jnp.inf)),
          "is/truncated_frac": jnp.sum((is_weights >= cap) & on) / n}
