"""Losses on full logits shared by every trainer: the base policy's pretraining, the MTP module,
and any drafter that learns next tokens. (Losses computed from hidden states a chunk at a time,
without [B, S, V] logits, are `specjax.models.chunked`.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_cross_entropy(logits, labels, mask) -> tuple[jax.Array, jax.Array]:
  """(mean cross-entropy, mean top-1 accuracy) of `logits` [B, T, V] on `labels` over `mask`."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  count = jnp.maximum(mask.sum(), 1.0)
  acc = (jnp.argmax(logp, -1) == labels).astype(jnp.float32)
  return jnp.sum(nll * mask) / count, jnp.sum(acc * mask) / count
