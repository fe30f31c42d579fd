"""A deliberately BROKEN verifier, the control of the distribution tests: each such test must
fail with it in place of `segment.verify` (monkeypatched), so a test that cannot fail is caught."""

import jax
import jax.numpy as jnp

from specjax.sampling.processing import process_logits
from specjax.sampling.rejection import verify


def verify_without_residual(key, target_logits, draft_tokens, draft_probs, **setting):
  """The same acceptance as `verify`, but after a rejection it samples the target's p instead of
  normalize(max(0, p - q)): biased wherever drafts are rejected."""
  k_verify, k_fresh = jax.random.split(key)
  res = verify(k_verify, target_logits, draft_tokens, draft_probs, **setting)
  fresh = jax.random.categorical(k_fresh, process_logits(target_logits, **setting), axis=-1)
  k = draft_tokens.shape[1]
  rejected_at = ((jnp.arange(k + 1) == res.num_accepted[:, None])
                 & (res.num_accepted < k)[:, None])
  return res.replace(tokens=jnp.where(rejected_at, fresh, res.tokens))
