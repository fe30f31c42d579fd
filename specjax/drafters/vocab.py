"""Reduced draft vocabulary of the EAGLE-3 head: the N most frequent target tokens of the rollouts.

`d2t[i]` is the target id of draft id i (ascending, so N == V is the identity); `t2d[v]` says whether
target token v is in the draft vocabulary. Draft logits go back to the full vocabulary by scatter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

DEFAULT_MAX_DRAFT_VOCAB = 32000


@struct.dataclass
class VocabMaps:
  d2t: jax.Array  # int32[N] target id of each draft id, ascending
  t2d: jax.Array  # bool[V] target token is in the draft vocabulary

  @property
  def draft_vocab(self) -> int:
    return self.d2t.shape[0]

  @property
  def vocab_size(self) -> int:
    return self.t2d.shape[0]


def identity_maps(vocab_size: int) -> VocabMaps:
  return VocabMaps(d2t=jnp.arange(vocab_size, dtype=jnp.int32),
                   t2d=jnp.ones((vocab_size,), jnp.bool_))


def token_counts(tokens, vocab_size: int, mask=None) -> np.ndarray:
  """Frequency of every target id in `tokens` (any shape), counting only where `mask` is set."""
  tokens = np.asarray(tokens).reshape(-1)
  if mask is not None:
    tokens = tokens[np.asarray(mask).reshape(-1).astype(bool)]
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ValueError(f"token_counts: token ids must lie in [0, {vocab_size}), got "
                     f"[{tokens.min()}, {tokens.max()}]")
  return np.bincount(tokens, minlength=vocab_size).astype(np.int64)


def build_vocab_maps(counts, vocab_size: int, draft_vocab: int | None = None, *,
                     always_include=()) -> VocabMaps:
  """Top-`draft_vocab` tokens by frequency `counts[V]` (ties: lower id first) -> VocabMaps.

  `always_include` (e.g. EOS ids) is kept whatever its frequency. `draft_vocab` None ->
  min(V, 32000); N == V gives the identity maps.
  """
  n = min(vocab_size, DEFAULT_MAX_DRAFT_VOCAB) if draft_vocab is None else int(draft_vocab)
  if not 1 <= n <= vocab_size:
    raise ValueError(f"build_vocab_maps: draft_vocab must lie in [1, {vocab_size}], got {n}")
  counts = np.asarray(counts, np.float64).copy()
  if counts.shape != (vocab_size,):
    raise ValueError(f"build_vocab_maps: counts must have shape ({vocab_size},), got {counts.shape}")
  if len(set(always_include)) > n:
    raise ValueError(f"build_vocab_maps: always_include has {len(set(always_include))} ids, more "
                     f"than draft_vocab={n}")
  if n == vocab_size:
    return identity_maps(vocab_size)
  counts[list(always_include)] = np.inf
  order = np.lexsort((np.arange(vocab_size), -counts))  # frequency desc, then id asc
  d2t = np.sort(order[:n]).astype(np.int32)
  t2d = np.zeros((vocab_size,), bool)
  t2d[d2t] = True
  return VocabMaps(d2t=jnp.asarray(d2t), t2d=jnp.asarray(t2d))


def build_vocab_maps_from_tokens(tokens, vocab_size: int, draft_vocab: int | None = None, *,
                                 mask=None, always_include=()) -> VocabMaps:
  """`build_vocab_maps` over the frequencies of `tokens` (any shape) where `mask` is set."""
  return build_vocab_maps(token_counts(tokens, vocab_size, mask), vocab_size, draft_vocab,
                          always_include=always_include)


def draft_to_target_logits(draft_logits: jax.Array, maps: VocabMaps,
                           fill: float = -jnp.inf) -> jax.Array:
  """[..., N] draft logits -> [..., V] with `fill` outside the draft vocabulary."""
  out = jnp.full(draft_logits.shape[:-1] + (maps.vocab_size,), fill, draft_logits.dtype)
  return out.at[..., maps.d2t].set(draft_logits)


def draft_to_target_probs(draft_probs: jax.Array, maps: VocabMaps) -> jax.Array:
  """[..., N] probabilities -> [..., V], zero outside the draft vocabulary."""
  return draft_to_target_logits(draft_probs, maps, fill=0.0)


def target_to_draft(values: jax.Array, maps: VocabMaps) -> jax.Array:
  """Restrict [..., V] values (logits, probs) to the draft vocabulary: [..., N]."""
  return jnp.take(values, maps.d2t, axis=-1)
