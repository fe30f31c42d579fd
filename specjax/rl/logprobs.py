"""Training-side logprobs: the logprob and entropy of each token of a full-sequence forward,
aligned with the sequence (position j: token j given tokens < j), as the GRPO loss reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import chunked
from specjax.rl.grpo import token_logprobs


def sequence_logprobs(logits: jax.Array, tokens: jax.Array,
                      temperature: float) -> tuple[jax.Array, jax.Array]:
  """(logprob [B, S] of token j at position j, 0 at j = 0; entropy [B, S] of the same
  distribution) from logits [B, S, V] of a full-sequence forward."""
  lp, ent = token_logprobs(logits[:, :-1], tokens[:, 1:], temperature)
  return _pad_first(lp), _pad_first(ent)


def _pad_first(x: jax.Array) -> jax.Array:
  return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)


def policy_logprobs(model, out, tokens: jax.Array,
                    temperature: float) -> tuple[jax.Array, jax.Array]:
  """`sequence_logprobs` of a forward `out` of `model`; with ModelConfig.logits_chunk the logits
  are formed from the hidden states a chunk of positions at a time (out.logits is None then)."""
  if out.logits is not None:
    return sequence_logprobs(out.logits, tokens, temperature)
  h = model.final_norm(out.hidden)[:, :-1]
  lp, ent = chunked.token_logprobs(h, model.head_weight(), tokens[:, 1:], temperature=temperature,
                                   chunk=model.cfg.logits_chunk)
  return _pad_first(lp), _pad_first(ent)
