"""Truncated importance sampling for the off-policy batches of async RL: the `Trainer` step with
each token's policy-gradient term weighted by min(pi_old / pi_sampler, cap), a constant."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.rl.grpo import aggregate, denominators, grpo_loss, k3_kl
from specjax.rl.train_step import Trainer, TrainBatch, sequence_logprobs


@struct.dataclass
class WeightedTrainBatch(TrainBatch):
  is_weights: jax.Array  # float32[B, S] per-token weight of the policy-gradient term


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


def weighted_pg_loss(logprobs, old_logprobs, advantages, mask, is_weights, grpo_cfg,
                     ref_logprobs=None, denom=None) -> tuple[jax.Array, dict]:
  """GRPO loss with the clipped policy-gradient term of each token scaled by `is_weights`; the
  KL term and all metrics are those of `grpo_loss` (unweighted)."""
  mask = mask.astype(jnp.float32)
  denom = denominators(mask) if denom is None else denom
  _, metrics = grpo_loss(logprobs, old_logprobs, advantages, mask, grpo_cfg, ref_logprobs, denom)
  adv = advantages.astype(jnp.float32)[:, None]
  ratio = jnp.exp(logprobs - old_logprobs)
  clipped = jnp.clip(ratio, 1.0 - grpo_cfg.clip_low, 1.0 + grpo_cfg.clip_high)
  per_token = jnp.maximum(-adv * ratio, -adv * clipped) * jax.lax.stop_gradient(is_weights)
  if grpo_cfg.beta > 0:
    per_token = per_token + grpo_cfg.beta * k3_kl(logprobs, ref_logprobs)
  return aggregate(per_token, mask, grpo_cfg.loss_agg, denom), metrics


@dataclasses.dataclass(frozen=True, eq=False)
class ISTrainer(Trainer):
  """`Trainer` whose step also takes a `WeightedTrainBatch`; a plain `TrainBatch` runs the
  parent's loss unchanged (bit for bit the synchronous step).

  pi_old is the trainer's policy when the batch is trained (the anchor of the PPO ratio), pi_sampler
  the possibly older policy that generated the batch (its logprobs as the sampler reported them)."""

  def _loss(self, params, batch: TrainBatch, draft_aux, draft_weight, denom):
    if not isinstance(batch, WeightedTrainBatch):
      return super()._loss(params, batch, draft_aux, draft_weight, denom)
    # Mirrors Trainer._loss with `weighted_pg_loss` in place of `grpo_loss`.
    model, out = self._forward(self.forward_params(params), batch.tokens)
    lp, entropy = sequence_logprobs(out.logits, batch.tokens, self.temperature)
    mask = batch.loss_mask.astype(jnp.float32)
    ref = batch.ref_logprobs if self.cfg.grpo.beta > 0 else None
    loss, metrics = weighted_pg_loss(lp, batch.old_logprobs, batch.advantages, mask,
                                     batch.is_weights, self.cfg.grpo, ref, denom)
    sg = jax.lax.stop_gradient
    metrics["entropy"] = jnp.sum(sg(entropy) * mask) / denom.tokens
    if self.online and self.is_mtp:
      from specjax.eagle.mtp import mtp_loss

      frozen = nnx.merge(self.policy_graphdef, sg(params["policy"]), params["draft"])
      draft_loss, dm = mtp_loss(frozen, sg(out.hidden), batch.tokens, mask)
      dm["loss"] = draft_loss
    elif self.online:
      from specjax.eagle.ttt import ttt_loss

      draft_loss, dm = ttt_loss(self.draft_graphdef, params["draft"], sg(model.embed[...]),
                                sg(out.aux_hidden), sg(out.logits), batch.tokens, mask, draft_aux,
                                num_steps=self.cfg.draft.ttt_steps)
    if self.online:
      loss = loss + draft_weight * draft_loss
      metrics.update({f"draft/{k}": v / self._micro for k, v in dm.items()})
    return loss, metrics
