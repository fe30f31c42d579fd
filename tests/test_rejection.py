"""Tests of the lossless verifier (specjax.sampling.rejection.verify)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling.rejection import verify


def test_first_emitted_token_follows_the_target_distribution_quick():
  batch, k, vocab = 50_000, 2, 6
  k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
  logits = jnp.broadcast_to(2 * jax.random.normal(k1, (vocab,)), (batch, k + 1, vocab))
  q_logits = 2 * jax.random.normal(k2, (vocab,))
  drafts = jax.random.categorical(k3, q_logits, shape=(batch, k))
  probs = jnp.broadcast_to(jax.nn.softmax(q_logits), (batch, k, vocab))
  res = jax.jit(functools.partial(verify, temperature=1.0))(k4, logits, drafts, probs)
  freq = np.bincount(np.asarray(res.tokens[:, 0]), minlength=vocab) / batch
  np.testing.assert_allclose(freq, jax.nn.softmax(logits[0, 0]), atol=0.01)
