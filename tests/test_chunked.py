"""Chunked head statistics (logprobs, entropy, soft cross-entropy) equal the full-logits ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.chunked import (
  logprob_and_entropy,
  soft_cross_entropy,
  token_logprobs,
)

B, S, D, V, N = 2, 23, 16, 40, 12


@pytest.fixture(scope="module")
def inputs():
  ks = jax.random.split(jax.random.key(0), 7)
  return {
      "hidden": jax.random.normal(ks[0], (B, S, D)),
      "weight": 0.3 * jax.random.normal(ks[1], (D, V)),
      "targets": jax.random.randint(ks[2], (B, S), 0, V),
      "student_hidden": jax.random.normal(ks[3], (B, S, D)),
      "student_weight": 0.3 * jax.random.normal(ks[4], (D, N)),
      "ids": jax.random.permutation(ks[5], V)[:N],
      "w": jax.random.normal(ks[6], (3, B, S))}


@pytest.mark.parametrize("chunk,temperature", [(5, 1.0), (8, 0.7), (0, 1.0)])
def test_chunked_logprobs_and_entropy_equal_full_logits_with_gradients(inputs, chunk, temperature):
  h, wt, y, w = inputs["hidden"], inputs["weight"], inputs["targets"], inputs["w"]

  def full(h, wt):
    return logprob_and_entropy(jnp.einsum("bsd,dv->bsv", h, wt), y, temperature)

  def chunked(h, wt):
    return token_logprobs(h, wt, y, temperature=temperature, chunk=chunk)

  def objective(fn):
    def f(h, wt):
      lp, ent = fn(h, wt)
      return jnp.sum(lp * w[0]) + jnp.sum(ent * w[1])
    return f

  got, want = jax.jit(chunked)(h, wt), full(h, wt)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-5)
  got_g = jax.jit(jax.grad(objective(chunked), (0, 1)))(h, wt)
  want_g = jax.grad(objective(full), (0, 1))(h, wt)
  for g, r in zip(got_g, want_g):
    np.testing.assert_allclose(g, r, atol=1e-5)


def test_chunked_soft_cross_entropy_equals_full_logits_with_gradients(inputs):
  hs, ws = inputs["student_hidden"], inputs["student_weight"]
  ht, wt, ids, w = inputs["hidden"], inputs["weight"], inputs["ids"], inputs["w"]

  def full(hs, ws, ht):
    teacher = jnp.einsum("bsd,dv->bsv", ht, wt)
    tlogp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher)[..., ids], -1)
    slogp = jax.nn.log_softmax(jnp.einsum("bsd,dn->bsn", hs, ws), -1)
    ce = -jnp.sum(jnp.exp(tlogp) * slogp, -1)
    agree = (jnp.argmax(slogp, -1) == jnp.argmax(tlogp, -1)).astype(jnp.float32)
    return ce, agree, jnp.argmax(teacher, -1)

  chunked = lambda hs, ws, ht: soft_cross_entropy(hs, ws, ht, wt, ids, chunk=6)
  got, want = jax.jit(chunked)(hs, ws, ht), full(hs, ws, ht)
  np.testing.assert_allclose(got[0], want[0], atol=1e-5)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[2], want[2])
  objective = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * w[2])
  got_g = jax.jit(jax.grad(objective(chunked), (0, 1, 2)))(hs, ws, ht)
  want_g = jax.grad(objective(full), (0, 1, 2))(hs, ws, ht)
  for g, r in zip(got_g, want_g):
    np.testing.assert_allclose(g, r, atol=1e-5)
  assert not np.any(got_g[2])  # the teacher never learns


def test_chunked_logprobs_never_hold_full_vocabulary_logits():
  # compiled temp memory of the chunked backward stays far below one [B, S, V] float32 array
  b, s, d, v = 1, 512, 8, 4096
  h = jnp.zeros((b, s, d))
  wt = jnp.zeros((d, v))
  y = jnp.zeros((b, s), jnp.int32)
  grad = jax.grad(lambda h, wt: jnp.sum(token_logprobs(h, wt, y, chunk=64)[0]), (0, 1))
  mem = jax.jit(grad).lower(h, wt).compile().memory_analysis()
  assert mem.temp_size_in_bytes < b * s * v * 4 / 2
