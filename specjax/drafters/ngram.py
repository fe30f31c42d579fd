"""Model-free drafters: n-gram prompt lookup over a row's own context, and its group-aware variant
that also searches the sibling rollouts of the same GRPO prompt group. In-jit, ragged rows.

Proposals are deterministic (`draft_probs=None`): the verifier accepts a draft with probability
p(x), so the output distribution is the target's whatever the lookup proposes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.config_tree import check
from specjax.sampling.drafter import Drafter, Sequences
from specjax.drafters.methods import DraftMethodBase, register_method


def _windows_match(ctx: jax.Array, ctx_len: jax.Array, suffix: jax.Array) -> jax.Array:
  """bool[B, R, S]: ctx[b, r, t : t+m] == suffix[b] and token t+m is committed (t+m < ctx_len).

  ctx int32[B, R, S], ctx_len int32[B, R], suffix int32[B, m]. For a row's own context the bound
  also excludes the suffix itself (it ends at the last committed token)."""
  s, m = ctx.shape[-1], suffix.shape[-1]
  t = jnp.arange(s)
  ok = (t[None, None, :] + m) < ctx_len[..., None]
  padded = jnp.pad(ctx, ((0, 0), (0, 0), (0, m)))
  for i in range(m):  # m <= n, a handful of static shifts
    ok &= padded[..., i:i + s] == suffix[:, i, None, None]
  return ok


def lookup(seq: Sequences, draft_len: int, n: int, min_n: int, group_size: int) -> jax.Array:
  """int32[B, K] drafts: the continuation of the best earlier occurrence of the row's last n' tokens
  (n' = n down to min_n, longest first), else the last token repeated.

  Candidates come from the row itself and the other rows b' with b' // G == b // G. Preference:
  the row's own most recent occurrence; else the sibling occurrence with the longest committed
  continuation (capped at K), latest first. An own-row continuation that runs into the present is
  extended periodically (the match says the text repeats with period p); a sibling's is clamped at
  the sibling's last committed token.
  """
  tokens, lengths = seq.tokens, seq.lengths
  batch, width = tokens.shape
  g, k = group_size, draft_len
  if batch % g:
    raise ValueError(f"batch {batch} is not a multiple of group_size {g}")
  rows = jnp.arange(batch)
  ctx = jnp.repeat(tokens.reshape(batch // g, g, width), g, axis=0)  # [B, G, S]
  ctx_len = jnp.repeat(lengths.reshape(batch // g, g), g, axis=0)  # [B, G]
  own = (jnp.arange(g)[None, :] == (rows % g)[:, None])[..., None]  # [B, G, 1]
  last = jnp.take_along_axis(tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)
  drafts = jnp.broadcast_to(last, (batch, k)).astype(jnp.int32)
  i = jnp.arange(k)[None, :]
  t = jnp.arange(width)[None, None, :]
  for m in range(min_n, n + 1):  # longer n-grams overwrite shorter ones where they match
    idx = jnp.maximum(lengths[:, None] - m + jnp.arange(m)[None, :], 0)
    suffix = jnp.take_along_axis(tokens, idx, axis=1)
    match = _windows_match(ctx, ctx_len, suffix)
    avail = jnp.where(own, k, jnp.minimum(k, ctx_len[..., None] - t - m))
    score = jnp.where(match, own * ((k + 1) * width) + avail * width + t, -1)
    flat = jnp.argmax(score.reshape(batch, -1), axis=1)
    found = jnp.max(score.reshape(batch, -1), axis=1) >= 0
    r, start = flat // width, flat % width
    is_own = r == rows % g
    period = jnp.maximum(lengths - m - start, 1)
    sib_len = jnp.take_along_axis(ctx_len, r[:, None], axis=1)
    pos = jnp.where(is_own[:, None], start[:, None] + m + i % period[:, None],
                    jnp.minimum(start[:, None] + m + i, sib_len - 1))
    src = (rows - rows % g + r)[:, None]
    cont = tokens[src, pos]
    drafts = jnp.where(found[:, None], cont, drafts)
  return drafts


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramDrafter(Drafter):
  """Prompt lookup: continue the most recent earlier occurrence of the last `n` tokens in the
  row's own prompt + completion, backing off to shorter n-grams down to `min_n`."""

  n: int = 3
  min_n: int = 1

  def __post_init__(self):
    name = type(self).__name__
    check(self.draft_len >= 1, f"{name}.draft_len", f"must be >= 1, got {self.draft_len}")
    check(self.n >= 1, f"{name}.n", f"must be >= 1, got {self.n}")
    check(1 <= self.min_n <= self.n, f"{name}.min_n",
          f"must be in [1, n={self.n}], got {self.min_n}")

  @property
  def group(self) -> int:
    return 1

  @property
  def stateful(self) -> bool:
    return False  # reads the committed tokens only

  def propose(self, params, state, seq: Sequences, key: jax.Array):
    return lookup(seq, self.draft_len, self.n, self.min_n, self.group), None, state


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupNgramDrafter(NgramDrafter):
  """N-gram lookup that also searches the G sibling rollouts of the row's prompt group (rows
  b' // G == b // G; GRPO samples G answers per prompt and siblings share phrases)."""

  group_size: int

  def __post_init__(self):
    super().__post_init__()
    check(self.group_size >= 1, f"{type(self).__name__}.group_size",
          f"must be >= 1, got {self.group_size}")

  @property
  def group(self) -> int:
    return self.group_size

  @property
  def row_local(self) -> bool:
    return False  # reads the sibling rows b' // G == b // G: rows stay where they are


@dataclasses.dataclass(frozen=True)
class NgramMethod(DraftMethodBase):
  """`ngram`: prompt lookup in the row's own context; nothing to train, no params."""

  name: ClassVar[str] = "ngram"

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft, group_size):
    d = draft_cfg
    return NgramDrafter(draft_len=d.draft_len, n=d.ngram_max, min_n=d.ngram_min), ()


@dataclasses.dataclass(frozen=True)
class GroupNgramMethod(DraftMethodBase):
  """`group-ngram`: n-gram lookup that also searches the row's GRPO group (G siblings)."""

  name: ClassVar[str] = "group-ngram"

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft, group_size):
    d = draft_cfg
    return GroupNgramDrafter(draft_len=d.draft_len, n=d.ngram_max, min_n=d.ngram_min,
                             group_size=group_size), ()


register_method(NgramMethod())
register_method(GroupNgramMethod())
