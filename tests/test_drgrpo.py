"""Dr.GRPO's loss: per-sequence token sums over one constant length, not each sequence's own."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax.rl.grpo import GRPOConfig, denominators, grpo_loss

CFG = GRPOConfig(group_size=2, adv_mode="drgrpo", loss_agg="seq-mean-token-sum-norm")


def test_drgrpo_loss_divides_by_a_constant_length_not_the_sequence_length():
  mask = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]], jnp.float32)  # lengths 4 and 1
  lp = jnp.full((2, 6), -1.0)
  adv = jnp.asarray([1.0, 1.0])
  denom = denominators(mask, norm_len=8)
  old = jnp.full((2, 6), -1.0)
  grads = jax.grad(lambda lp: grpo_loss(lp, old, adv, mask, CFG, denom=denom)[0])(lp)
  # every completion token gets -A / (B * L) whatever its sequence's length: 1 / (2 * 8)
  np.testing.assert_allclose(grads, -mask / 16.0, rtol=1e-6)
  loss, _ = grpo_loss(lp, lp, adv, mask, CFG, denom=denom)
  np.testing.assert_allclose(loss, -5.0 / 16.0, rtol=1e-6)


def test_drgrpo_loss_of_micro_batches_sums_to_the_full_batch_loss():
  rng = np.random.default_rng(0)
  mask = jnp.asarray(rng.random((4, 7)) < 0.6, jnp.float32)
  lp = jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)
  old = lp + 0.1 * jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=4), jnp.float32)
  denom = denominators(mask, norm_len=7)
  full, _ = grpo_loss(lp, old, adv, mask, CFG, denom=denom)
  parts = sum(grpo_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], CFG,
                        denom=denom)[0] for i in (0, 2))
  np.testing.assert_allclose(parts, full, rtol=1e-6)
