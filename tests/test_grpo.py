"""GRPO advantages and loss against hand-computed small cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.rl.grpo import (GRPOConfig, LossDenominators, denominators, group_advantages,
                             grpo_loss, k3_kl)

REWARDS = np.array([1, 0, 0, 1, 1, 1, 1, 0], np.float32)


@pytest.mark.parametrize("mode,expected", [
    # group 1: mean .5, unbiased std sqrt(1/3); group 2: mean .75, unbiased std .5
    ("grpo", [0.5 * math.sqrt(3), -0.5 * math.sqrt(3), -0.5 * math.sqrt(3), 0.5 * math.sqrt(3),
              0.5, 0.5, 0.5, -1.5]),
    ("drgrpo", [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]),
    # r_i - mean of the other three
    ("loo", [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0]),
])
def test_group_advantages_match_hand_computed_values(mode, expected):
  adv = group_advantages(REWARDS, 4, mode, eps=0.0 if mode == "grpo" else 1e-6)
  np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)


def test_identical_rewards_in_a_group_give_zero_advantage_without_nan():
  for mode in ("grpo", "drgrpo", "loo"):
    adv = group_advantages(jnp.ones(8), 4, mode)
    assert np.all(np.asarray(adv) == 0.0)


def test_group_advantages_reject_a_batch_that_is_not_whole_groups():
  with pytest.raises(ValueError, match="group_size=3"):
    group_advantages(jnp.ones(8), 3)


def _case():
  # 2 sequences x 3 tokens; seq 0 has 3 completion tokens, seq 1 only 2
  ratio = np.array([[1.5, 1.1, 0.5], [0.5, 1.5, 1.0]], np.float32)
  old = np.log(np.full((2, 3), 0.4, np.float32))
  lp = old + np.log(ratio)
  adv = np.array([2.0, -1.0], np.float32)
  mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
  return lp, old, adv, mask


def test_clipped_surrogate_clips_both_sides_and_counts_clipped_tokens():
  lp, old, adv, mask = _case()
  cfg = GRPOConfig(clip_low=0.2, clip_high=0.28, group_size=2)
  loss, m = grpo_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg)
  # A=2: ratio 1.5 clips high -> -2*1.28; 1.1 unclipped -> -2.2; 0.5 (A>0, pessimistic) -> -1.0
  # A=-1: ratio 0.5 clips low -> +0.8; ratio 1.5 unclipped (A<0) -> +1.5; third token masked
  per_token = [-2 * 1.28, -2.2, -1.0, 0.8, 1.5]
  np.testing.assert_allclose(loss, sum(per_token) / 5, rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac"], 2 / 5, rtol=1e-6)
  np.testing.assert_allclose(m["clip_high_frac"], 1 / 5, rtol=1e-6)
  np.testing.assert_allclose(m["clip_low_frac"], 1 / 5, rtol=1e-6)
  # clipped tokens carry no gradient; unclipped ones carry -A * ratio
  g = jax.grad(lambda x: grpo_loss(x, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                   cfg)[0])(jnp.asarray(lp))
  expected = np.array([[0.0, -2 * 1.1, -2 * 0.5], [0.0, 1.5, 0.0]]) / 5
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)


def test_seq_mean_token_mean_averages_each_sequence_first():
  lp, old, adv, mask = _case()
  cfg = GRPOConfig(clip_low=0.2, clip_high=0.28, group_size=2, loss_agg="seq-mean-token-mean")
  loss, _ = grpo_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg)
  seq0 = (-2 * 1.28 - 2.2 - 1.0) / 3
  seq1 = (0.8 + 1.5) / 2
  np.testing.assert_allclose(loss, (seq0 + seq1) / 2, rtol=1e-5)


def test_k3_kl_matches_closed_form_and_enters_the_loss_with_beta():
  lp = jnp.log(jnp.array([[0.5, 0.2]]))
  ref = jnp.log(jnp.array([[0.25, 0.2]]))
  kl = k3_kl(lp, ref)
  np.testing.assert_allclose(kl, [[0.5 + math.log(2) - 1, 0.0]], atol=1e-6)
  cfg = GRPOConfig(beta=0.1, group_size=2)
  mask = jnp.ones((1, 2))
  zero_adv = jnp.zeros((1,))
  loss, m = grpo_loss(lp, lp, zero_adv, mask, cfg, ref_logprobs=ref)
  np.testing.assert_allclose(loss, 0.1 * (0.5 + math.log(2) - 1) / 2, rtol=1e-5)
  np.testing.assert_allclose(m["kl"], (0.5 + math.log(2) - 1) / 2, rtol=1e-5)
  with pytest.raises(ValueError, match="ref_logprobs"):
    grpo_loss(lp, lp, zero_adv, mask, cfg)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_losses_with_full_batch_denominators_sum_to_the_full_loss(agg):
  lp, old, adv, mask = _case()
  cfg = GRPOConfig(group_size=2, loss_agg=agg)
  full, _ = grpo_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), cfg)
  denom = denominators(jnp.asarray(mask))
  assert isinstance(denom, LossDenominators)
  parts = [grpo_loss(jnp.asarray(lp[i:i + 1]), jnp.asarray(old[i:i + 1]), jnp.asarray(adv[i:i + 1]),
                     jnp.asarray(mask[i:i + 1]), cfg, denom=denom)[0] for i in range(2)]
  np.testing.assert_allclose(sum(parts), full, rtol=1e-6)
