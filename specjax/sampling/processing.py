"""Logit processing shared by the AR sampler and the verifier: temperature, top-k, top-p.

`process_logits` turns raw logits into the log-probabilities of the distribution actually sampled
from; `temperature == 0` is handled by callers as greedy (argmax of the raw logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def process_logits(logits: jax.Array, *, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> jax.Array:
  """float32 log-probs [..., V] after temperature, top-k then top-p (nucleus) filtering.

  Filtered-out tokens get -inf. Ties at the top-k boundary keep every tied token; top-p keeps the
  smallest prefix of the sorted distribution whose mass reaches `top_p` (always >= 1 token).
  """
  x = logits.astype(jnp.float32)
  if temperature > 0:
    x = x / temperature
  if top_k is not None and 0 < top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, top_k)[0][..., -1:]
    x = jnp.where(x < kth, NEG_INF, x)
  if top_p is not None and top_p < 1.0:
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    sorted_p = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = mass_before < top_p
    # smallest kept logit is the threshold; everything below it goes
    threshold = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < threshold, NEG_INF, x)
  return jax.nn.log_softmax(x, axis=-1)


def sample_token(key: jax.Array, logits: jax.Array, *, temperature: float,
                 top_k: int | None = None, top_p: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Sample from processed logits [..., V]; returns (token int32[...], logprob float32[...]).

  The logprob is under the processed distribution (greedy: under temperature-1 softmax of the
  raw logits, i.e. the policy's own logprob of the argmax).
  """
  if temperature == 0:
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  else:
    lp = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    tok = jax.random.categorical(key, lp, axis=-1).astype(jnp.int32)
  return tok, jnp.take_along_axis(lp, tok[..., None], axis=-1)[..., 0]
