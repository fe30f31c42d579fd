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


def _accept_chain(key: jax.Array, logp: jax.Array, draft_tokens: jax.Array,
                  draft_probs: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The chain's rejection sampling: (num_accepted int32[B], the distribution the token at
  position n = num_accepted is drawn from [B, V] (unnormalised), the processed target there
  p_n [B, V]). `logp` [B, >= K+1, V] are processed target logprobs at the chain's positions. The
  draw is the residual max(p - q, 0) after a rejection (n < K), else p (the bonus token). One
  uniform per draft."""
  batch, k = draft_tokens.shape
  vocab = logp.shape[-1]
  rows = jnp.arange(batch)
  p_draft = jnp.exp(jnp.take_along_axis(logp[:, :k], draft_tokens[..., None], axis=-1)[..., 0])
  u = jax.random.uniform(key, (batch, k), jnp.float32)
  if draft_probs is None:
    accept = u < p_draft  # min(1, p(x) / 1)
  else:
    q = draft_probs.astype(jnp.float32)
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    # u < p/q without the division; p >= q accepts outright (exact when q == p), but never a
    # token the processed target excludes
    accept = (u * q_draft < p_draft) | ((p_draft >= q_draft) & (p_draft > 0))
  n = _leading_true(accept)
  rejected = n < k
  p_n = jnp.exp(logp[rows, n])  # [B, V]
  n_draft = jnp.minimum(n, k - 1)
  if draft_probs is None:
    q_n = (jnp.arange(vocab)[None, :] == draft_tokens[rows, n_draft][:, None]).astype(jnp.float32)
  else:
    q_n = q[rows, n_draft]
  q_n = jnp.where(rejected[:, None], q_n, 0.0)
  residual = jnp.maximum(p_n - q_n, 0.0)
  # an all-zero residual means p == q at that position (a rejection there has probability ~0);
  # falling back to p keeps the draw well defined
  residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
  return n, residual, p_n


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
  k = draft_tokens.shape[1]

  if temperature == 0:
    raw = target_logits.astype(jnp.float32)
    argmax = jnp.argmax(raw, axis=-1).astype(jnp.int32)  # [B, K+1]
    num_accepted = _leading_true(draft_tokens == argmax[:, :k])
    last = jnp.take_along_axis(argmax, num_accepted[:, None], axis=1)[:, 0]
    return _emit(draft_tokens, num_accepted, last, jax.nn.log_softmax(raw, axis=-1))

  key_accept, key_resample = jax.random.split(key)
  logp = process_logits(target_logits, temperature=temperature, top_k=top_k, top_p=top_p)
  num_accepted, residual, _ = _accept_chain(key_accept, logp, draft_tokens, draft_probs)
  last = jax.random.categorical(key_resample, jnp.log(residual), axis=-1).astype(jnp.int32)
  return _emit(draft_tokens, num_accepted, last, logp)


def verify_tree(key: jax.Array, target_logits: jax.Array, draft_tokens: jax.Array,
                draft_probs: jax.Array | None, alternatives: jax.Array, *, temperature: float,
                top_k: int | None = None,
                top_p: float | None = None) -> tuple[VerifyResult, jax.Array]:
  """Verify a draft tree (`specjax.models.tree.DraftTree`): the chain `draft_tokens[B, K]` (drawn
  from `draft_probs`, or deterministic when None) and at each of the first D <= K depths i the
  alternatives `alternatives[B, D, W-1]` (any tokens that depend on the drafter's output only,
  e.g. its next most likely ones), scored by `target_logits[B, 1 + K + D * (W-1), V]` at the
  tree's nodes (`DraftTree(K, W, D)`).

  The chain is verified as by `verify`. Where its draft at depth i <= D is rejected, the
  alternatives at depth i are tried in turn against what the target still owes: the residual r
  of that position; alternative x is accepted with probability r(x), and on a rejection r loses
  x and is renormalised. Once every alternative is rejected the token is drawn from what is left;
  an accepted alternative is followed by a token drawn from the target at its node. Every token is
  thus distributed exactly as sampling the processed target one token at a time, and more are
  accepted than by the chain alone. Greedy (`temperature == 0`): an alternative is accepted when
  it is the target's argmax.

  Returns (result, path): `result` as `verify`'s (an accepted alternative counts as an accepted
  draft), `path` int32[B, K+1] the node whose input token sits at each committed position from
  the root on (the chain's own index, or the accepted alternative's): the caller keeps the
  caches' entries of those nodes.
  """
  batch, k = draft_tokens.shape
  if alternatives.ndim != 3 or alternatives.shape[0] != batch or \
      not 1 <= alternatives.shape[1] <= k:
    raise ValueError(f"alternatives must be [B, D, W-1] with B = {batch}, 1 <= D <= K = {k}, got "
                     f"shape {alternatives.shape}")
  depth, alts = alternatives.shape[1:]
  nodes = 1 + k + depth * alts
  if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, nodes):
    raise ValueError(f"target_logits must be [B, 1 + K + D * (W-1), V] = [{batch}, {nodes}, V] "
                     f"for K = {k}, D = {depth} and W = {alts + 1}, got shape "
                     f"{target_logits.shape}")
  chain_logits = target_logits[:, :k + 1]
  _check_inputs(chain_logits, draft_tokens, draft_probs, temperature, top_k, top_p)
  draft_tokens = draft_tokens.astype(jnp.int32)
  alternatives = alternatives.astype(jnp.int32)
  rows = jnp.arange(batch)

  def alternative_node(n, j):  # node index of alternative j at depth n + 1 (clamped to D)
    return 1 + k + jnp.minimum(n, depth - 1) * alts + j

  if temperature == 0:
    raw = target_logits.astype(jnp.float32)
    argmax = jnp.argmax(raw, axis=-1).astype(jnp.int32)  # [B, nodes]
    n = _leading_true(draft_tokens == argmax[:, :k])
    want = jnp.take_along_axis(argmax, n[:, None], axis=1)[:, 0]  # the target's token at n
    cands = alternatives[rows, jnp.minimum(n, depth - 1)]  # [B, W-1]
    hit = (cands == want[:, None]) & (n < depth)[:, None]
    taken = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), -1)
    logp_all = jax.nn.log_softmax(raw, axis=-1)
    bonus = argmax[rows, alternative_node(n, jnp.maximum(taken, 0))]
    return _tree_emit(draft_tokens, n, taken, want, bonus, logp_all, k, alts, alternatives)

  # (the chain draws its uniforms as `verify` does: the same key decides the same chain)
  key_accept, key_rest = jax.random.split(key)
  key_alts, key_last, key_bonus = jax.random.split(key_rest, 3)
  logp = process_logits(target_logits, temperature=temperature, top_k=top_k, top_p=top_p)
  n, residual, p_n = _accept_chain(key_accept, logp, draft_tokens, draft_probs)
  rejected = n < depth  # rejected at a depth that has alternatives
  # the alternatives at depth n + 1, each against what the residual still owes
  cands = alternatives[rows, jnp.minimum(n, depth - 1)]  # [B, W-1]
  u_alt = jax.random.uniform(key_alts, (batch, max(alts, 1)), jnp.float32)
  taken = jnp.full((batch,), -1, jnp.int32)
  for j in range(alts):
    x = cands[:, j]
    mass = residual[rows, x]
    total = jnp.sum(residual, axis=-1)
    take = rejected & (taken < 0) & (u_alt[:, j] * total < mass) & (mass > 0)
    taken = jnp.where(take, j, taken)
    # (rows accepted whole or rejected deeper keep their draw: the bonus from p, the residual)
    residual = residual.at[rows, x].set(jnp.where(rejected, 0.0, mass))
  # rows that took no alternative draw from what is left (every alternative's mass removed after
  # a rejection); an all-zero remainder only where an alternative was taken, whose draw is not
  # used
  left = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
  last = jax.random.categorical(key_last, jnp.log(left), axis=-1).astype(jnp.int32)
  bonus_logp = logp[rows, alternative_node(n, jnp.maximum(taken, 0))]  # [B, V]
  bonus = jax.random.categorical(key_bonus, bonus_logp, axis=-1).astype(jnp.int32)
  return _tree_emit(draft_tokens, n, taken, last, bonus, logp, k, alts, alternatives)


def _tree_emit(draft_tokens, n, taken, last, bonus, logp_all, k: int, alts: int,
               alternatives) -> tuple[VerifyResult, jax.Array]:
  """The emitted tokens of a tree verify: the chain's first n drafts, then either alternative
  `taken` (>= 0) at depth n + 1 followed by `bonus`, or `last`; and the path of nodes."""
  batch = draft_tokens.shape[0]
  rows = jnp.arange(batch)
  took = taken >= 0
  at = jnp.minimum(n, alternatives.shape[1] - 1)  # (an alternative is taken only at n < D)
  alt_node = 1 + k + at * alts + jnp.maximum(taken, 0)
  alt_tok = alternatives[rows, at, jnp.maximum(taken, 0)] if alts else last
  pos = jnp.arange(k + 1)[None, :]
  nn = n[:, None]
  path = jnp.where(took[:, None] & (pos == nn + 1), alt_node[:, None], pos).astype(jnp.int32)
  drafts = jnp.concatenate([draft_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  at_n = jnp.where(took, alt_tok, last)
  tokens = jnp.where(pos < nn, drafts, jnp.where(pos == nn, at_n[:, None], 0))
  tokens = jnp.where(took[:, None] & (pos == nn + 1), bonus[:, None], tokens).astype(jnp.int32)
  num_accepted = (n + took).astype(jnp.int32)
  # each emitted token is scored by the node before it on the path
  node_logp = jnp.take_along_axis(logp_all, path[..., None], axis=1)  # [B, K+1, V]
  lp = jnp.take_along_axis(node_logp, tokens[..., None], axis=-1)[..., 0]
  lp = jnp.where(pos <= num_accepted[:, None], lp, 0.0).astype(jnp.float32)
  return VerifyResult(tokens=tokens, num_accepted=num_accepted, logprobs=lp), path
