"""What the sync and async loops share between a scored rollout and the train step: the rollout's
metrics, and the train batch (old and reference logprobs of the trainer's policy, sampler mismatch).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.rl.rollout import acceptance_summary, engine_summary, segment_events
from specjax.rl.tasks import RewardBatch
from specjax.rl.train_step import TrainBatch, Trainer, TrainState
from specjax.sampling import Rollout


SEGMENT_LOG = "engine/segment_log"


def rollout_metrics(rollout: Rollout, rewards: RewardBatch, group_size: int, data_position: int,
                    prompts_cut: int) -> dict[str, Any]:
  """Host-side metrics of one step's rollouts: rewards, lengths, data position (after the step's
  prompts), generated tokens, forward steps and the acceptance numbers of a speculative rollout."""
  r = rewards.rewards.reshape(-1, group_size)
  comp_len = np.asarray(jax.device_get(rollout.lengths))
  return {
      "reward/mean": float(r.mean()), "reward/std": float(r.std()),
      "reward/accuracy": float(rewards.correct.mean()), "reward/errors": len(rewards.errors),
      "reward/zero_std_groups": float(np.mean(r.std(axis=1) == 0)),
      "response/length_mean": float(comp_len.mean()), "response/length_max": int(comp_len.max()),
      "response/truncated": float(1.0 - np.asarray(jax.device_get(rollout.eos)).mean()),
      "data/position": data_position, "data/prompts_cut": prompts_cut,
      "gen/tokens": int(comp_len.sum()),
      "gen/forward_steps": int(rollout.num_steps) if rollout.num_steps is not None else -1,
      **acceptance_summary(rollout),
      **engine_summary(rollout),
      SEGMENT_LOG: segment_events(rollout),  # logged as events by the loop, not as a metric
  }


def build_train_batch(trainer: Trainer, state: TrainState, ref_params: Any, tokens: jax.Array,
                      mask: jax.Array, sampler_logprobs: jax.Array,
                      advantages: jax.Array, *,
                      on_policy: bool = False) -> tuple[TrainBatch, dict[str, jax.Array]]:
  """(train batch, mismatch metrics): old logprobs of the trainer's current policy, reference
  logprobs (zeros without a reference), and how far the old logprobs are from the sampler's.
  `on_policy` (one optimizer step on rollouts of the current policy): no old-logprob forward;
  the train step uses its own logprobs as the old ones and reports the mismatch itself."""
  ref = trainer.logprobs(ref_params, tokens) * mask if ref_params is not None \
      else jnp.zeros(tokens.shape, jnp.float32)
  if on_policy:
    batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=advantages, old_logprobs=None,
                       ref_logprobs=ref, sampler_logprobs=sampler_logprobs * mask)
    return batch, {}
  old = trainer.logprobs(trainer.forward_params(state.params), tokens) * mask
  delta = jnp.abs(old - sampler_logprobs) * mask
  mismatch = {"mismatch/mean_abs": jnp.sum(delta) / jnp.maximum(mask.sum(), 1.0),
              "mismatch/max_abs": jnp.max(delta)}
  batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=advantages, old_logprobs=old,
                     ref_logprobs=ref)
  return batch, mismatch
