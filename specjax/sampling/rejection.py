"""The lossless verifier: speculative rejection sampling of K drafted tokens against the target.

Every row emits `num_accepted + 1` tokens distributed exactly as sampling the processed target
one token at a time (DESIGN.md, "Lossless verifier"); all rows at once, static shapes, no loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.sampling.processing import process_logits


@struct.dataclass
class VerifyResult:
  tokens: jax.Array  # int32[B, K+1]; row b emits tokens[b, :num_accepted[b] + 1], the rest is 0
  num_accepted: jax.Array  # int32[B] leading draft tokens accepted, 0..K
  logprobs: jax.Array  # float32[B, K+1] processed-target logprob of each emitted token, else 0

  @property
  def num_emitted(self) -> jax.Array:
    """int32[B] tokens emitted by each row: accepted drafts plus the correction/bonus token."""
    return self.num_accepted + 1

  @property
  def emitted_mask(self) -> jax.Array:
    """bool[B, K+1] True at the emitted positions."""
    return jnp.arange(self.tokens.shape[1]) <= self.num_accepted[:, None]


def _check_inputs(target_logits, draft_tokens, draft_probs, temperature, top_k, top_p) -> None:
  if target_logits.ndim != 3:
    raise ValueError(f"target_logits must be [B, K+1, V], got shape {target_logits.shape}")
  if draft_tokens.ndim != 2:
    raise ValueError(f"draft_tokens must be [B, K], got shape {draft_tokens.shape}")
  batch, positions, vocab = target_logits.shape
  if draft_tokens.shape[0] != batch:
    raise ValueError(f"draft_tokens batch {draft_tokens.shape[0]} != target_logits batch {batch}")
  k = draft_tokens.shape[1]
  if k < 1:
    raise ValueError(f"draft length K must be >= 1, got draft_tokens of shape {draft_tokens.shape}")
  if positions != k + 1:
    raise ValueError(f"target_logits must have K+1 = {k + 1} positions for K = {k} drafts, "
                     f"got {positions}")
  if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
    raise ValueError(f"draft_tokens must be integers, got {draft_tokens.dtype}")
  if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
    raise ValueError(f"draft_probs must be [B, K, V] = {(batch, k, vocab)}, "
                     f"got {draft_probs.shape}")
  if not isinstance(temperature, (int, float)) or temperature < 0:
    raise ValueError(f"temperature must be a static Python float >= 0, got {temperature!r}")
  if top_k is not None and top_k < 1:
    raise ValueError(f"top_k must be None or >= 1, got {top_k}")
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be None or in (0, 1], got {top_p}")


def _emit(draft_tokens: jax.Array, num_accepted: jax.Array, last: jax.Array,
          logprobs_all: jax.Array) -> VerifyResult:
  """Accepted drafts, then `last` at position num_accepted, zeros after; logprobs gathered."""
  batch, k = draft_tokens.shape
  pos = jnp.arange(k + 1)[None, :]
  n = num_accepted[:, None]
  drafts = jnp.concatenate([draft_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  tokens = jnp.where(pos < n, drafts, jnp.where(pos == n, last[:, None], 0)).astype(jnp.int32)
  lp = jnp.take_along_axis(logprobs_all, tokens[..., None], axis=-1)[..., 0]
  lp = jnp.where(pos <= n, lp, 0.0).astype(jnp.float32)
  return VerifyResult(tokens=tokens, num_accepted=num_accepted.astype(jnp.int32), logprobs=lp)


def _leading_true(flags: jax.Array) -> jax.Array:
  """int32[B] length of the all-True prefix of bool[B, K]."""
  return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def verify(key: jax.Array, target_logits: jax.Array, draft_tokens: jax.Array,
           draft_probs: jax.Array | None, *, temperature: float, top_k: int | None = None,
           top_p: float | None = None) -> VerifyResult:
  """Verify `draft_tokens[B, K]` against `target_logits[B, K+1, V]` (position i scores the token
  after the prefix + drafts[:i]).

  `draft_probs[B, K, V]` is the (already processed) proposal distribution the drafts were sampled
  from; None means deterministic proposals (q one-hot on the drafted token). `temperature`,
  `top_k`, `top_p` are static; `temperature == 0` is greedy (draft_probs, top-k, top-p ignored).
  Pure and jittable; one uniform per draft and one categorical draw per row.
  """
  _check_inputs(target_logits, draft_tokens, draft_probs, temperature, top_k, top_p)
  draft_tokens = draft_tokens.astype(jnp.int32)
  batch, k = draft_tokens.shape
  vocab = target_logits.shape[-1]

  if temperature == 0:
    raw = target_logits.astype(jnp.float32)
    argmax = jnp.argmax(raw, axis=-1).astype(jnp.int32)  # [B, K+1]
    num_accepted = _leading_true(draft_tokens == argmax[:, :k])
    last = jnp.take_along_axis(argmax, num_accepted[:, None], axis=1)[:, 0]
    return _emit(draft_tokens, num_accepted, last, jax.nn.log_softmax(raw, axis=-1))

  key_accept, key_resample = jax.random.split(key)
  logp = process_logits(target_logits, temperature=temperature, top_k=top_k, top_p=top_p)
  p_draft = jnp.exp(jnp.take_along_axis(logp[:, :k], draft_tokens[..., None], axis=-1)[..., 0])
  u = jax.random.uniform(key_accept, (batch, k), jnp.float32)
  if draft_probs is None:
    accept = u < p_draft  # min(1, p(x) / 1)
  else:
    q = draft_probs.astype(jnp.float32)
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    # u < p/q without the division; p >= q accepts outright (exact when q == p), but never a
    # token the processed target excludes
    accept = (u * q_draft < p_draft) | ((p_draft >= q_draft) & (p_draft > 0))
  num_accepted = _leading_true(accept)

  # only position n = num_accepted needs a draw: the residual after a rejection (n < K) or the
  # bonus token from p at position K
  rejected = num_accepted < k
  p_n = jnp.exp(jnp.take_along_axis(logp, num_accepted[:, None, None], axis=1)[:, 0])  # [B, V]
  n_draft = jnp.minimum(num_accepted, k - 1)
  if draft_probs is None:
    d_n = jnp.take_along_axis(draft_tokens, n_draft[:, None], axis=1)  # [B, 1]
    q_n = (jnp.arange(vocab)[None, :] == d_n).astype(jnp.float32)
  else:
    q_n = jnp.take_along_axis(q, n_draft[:, None, None], axis=1)[:, 0]
  q_n = jnp.where(rejected[:, None], q_n, 0.0)
  residual = jnp.maximum(p_n - q_n, 0.0)
  # an all-zero residual means p == q at that position (a rejection there has probability ~0);
  # falling back to p keeps the draw well defined
  residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
  last = jax.random.categorical(key_resample, jnp.log(residual), axis=-1).astype(jnp.int32)
  return _emit(draft_tokens, num_accepted, last, logp)
