"""History drafting: the completions earlier rollouts gave the same prompt, as a lookup corpus.

RL revisits its prompts epoch after epoch, and as the policy converges its answers to a prompt
repeat. `HistoryStore` (host, `specjax.drafters.history_store`) keeps, per prompt, its most
recent completions within fixed caps; before a rollout it hands the device a `HistoryTable` of
static shape. `HistoryDrafter` loads
each row's entries when the row is prefilled (the prompt's hash, computed on the device, finds
them), and drafts the continuation of the row's last n tokens in them, the occurrence nearest the
row's own position first. Where the history has no match the drafter falls back to its `inner`
drafter (an EAGLE-3 head, a draft model) or, without one, to n-gram lookup in the row itself.

With a cross-prompt table (`HistoryParams.corpus`, `specjax.drafters.corpus`: what followed a
context in any prompt's earlier rollouts) a row whose last tokens match there longer than in its
own prompt's history drafts that continuation instead: a dataset visited once per epoch rarely
shows a prompt again within a run, but its answers' text recurs across prompts.

Drafts from the history are deterministic (a one-hot draft distribution), or with `sampled`
drawn from the entries' votes for what follows the row's context (a draft distribution q, accepted
with probability min(1, p(x) / q(x)) and corrected by the verifier's residual). Either way the
draft and q depend only on committed tokens, the drafts before it and the table, so the output
keeps the target's distribution whatever the history holds (a hash collision or a stale answer
costs acceptance, never correctness).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config_tree import check
from specjax.drafters.corpus import CorpusTable, corpus_lookup
from specjax.drafters.eagle3 import Eagle3Method
from specjax.drafters.history_store import HistoryTable
from specjax.drafters.methods import DraftMethodBase, register_method
from specjax.drafters.ngram import _windows_match, lookup
from specjax.drafters.token_hash import prompt_keys
from specjax.sampling.drafter import Drafter, Sequences, TargetStep

@struct.dataclass
class HistoryParams:
  table: HistoryTable
  inner: Any = None  # the inner drafter's params
  corpus: CorpusTable | None = None  # the cross-prompt table, if the store keeps one


@struct.dataclass
class HistoryState:
  tokens: jax.Array  # int32[B, H, W] the row's prompt's entries
  lengths: jax.Array  # int32[B, H]
  inner: Any = ()


def history_lookup(seq: Sequences, hist: jax.Array, hist_len: jax.Array, draft_len: int, n: int,
                   min_n: int, tail: int) -> tuple[jax.Array, jax.Array]:
  """(int32[B, K] drafts, int32[B] match length, 0 where none): the continuation of the row's
  last n' tokens (n' = n down to min_n, longest first) in its history entries hist [B, H, W].
  Among occurrences: nearest to the row's own position (an entry is aligned with the row: both
  start `tail` tokens before the completion), then the longest continuation, then the entry of
  highest index. A continuation is clamped at its entry's last token."""
  tokens, lengths = seq.tokens, seq.lengths
  batch = tokens.shape[0]
  _, h, w = hist.shape
  k = draft_len
  drafts = jnp.zeros((batch, k), jnp.int32)
  matched = jnp.zeros((batch,), jnp.int32)
  t = jnp.arange(w)[None, None, :]
  entry = jnp.arange(h)[None, :, None]
  i = jnp.arange(k)[None, :]
  for m in range(min_n, n + 1):
    idx = jnp.maximum(lengths[:, None] - m + jnp.arange(m)[None, :], 0)
    suffix = jnp.take_along_axis(tokens, idx, axis=1)
    match = _windows_match(hist, hist_len, suffix) & (lengths >= m)[:, None, None]
    aligned = (tail + lengths - seq.prompt_lengths - m)[:, None, None]
    avail = jnp.minimum(k, hist_len[..., None] - t - m)
    score = jnp.where(match, -jnp.abs(t - aligned) * ((k + 1) * h) + avail * h + entry, -2**30)
    flat = jnp.argmax(score.reshape(batch, -1), axis=1)
    found = jnp.any(match.reshape(batch, -1), axis=1)
    e, start = flat // w, flat % w
    e_len = jnp.take_along_axis(hist_len, e[:, None], axis=1)
    pos = jnp.minimum(start[:, None] + m + i, e_len - 1)
    cont = hist[jnp.arange(batch)[:, None], e[:, None], pos]
    drafts = jnp.where(found[:, None], cont, drafts)
    matched = jnp.where(found, m, matched)
  return drafts, matched


def history_sample(seq: Sequences, hist: jax.Array, hist_len: jax.Array, fallback: jax.Array,
                   n: int, min_n: int, tail: int, vocab: int,
                   key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(int32[B, K] drafts, float32[B, K, vocab] q): draft i drawn from q_i, the votes of the row's
  history entries hist [B, H, W] for the token that follows the context's last n' tokens (n' = n
  down to min_n, the longest that some entry continues); an entry votes with its occurrence
  nearest the row's own position (entries and rows are aligned as in `history_lookup`). The
  context is the row's committed tokens, then drafts 0 .. i - 1. Where no entry continues it,
  q_i is one-hot on `fallback[:, i]` (e.g. `history_lookup`'s drafts). q_i depends only on the
  committed tokens, the drafts before i and the table, so the verifier's residual keeps the
  target's distribution (`rejection.verify`)."""
  tokens, lengths = seq.tokens, seq.lengths
  batch, k = fallback.shape
  _, h, w = hist.shape
  idx = jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0)
  ctx = jnp.concatenate([jnp.take_along_axis(tokens, idx, axis=1),
                         jnp.zeros((batch, k), jnp.int32)], axis=1)  # last n committed, drafts
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, h))
  entries = jnp.broadcast_to(jnp.arange(h)[None, :], (batch, h))
  t = jnp.arange(w)[None, None, :]

  def draft(ctx, xs):
    i, step_key = xs
    counts = jnp.zeros((batch, vocab), jnp.float32)
    for m in range(min_n, n + 1):  # a longer context's votes replace a shorter one's
      suffix = jax.lax.dynamic_slice_in_dim(ctx, n + i - m, m, axis=1)
      match = _windows_match(hist, hist_len, suffix) & (lengths + i >= m)[:, None, None]
      aligned = (tail + lengths + i - seq.prompt_lengths - m)[:, None, None]
      start = jnp.argmax(jnp.where(match, -jnp.abs(t - aligned), -2**30), axis=2)  # [B, H]
      votes = jnp.any(match, axis=2).astype(jnp.float32)
      nxt = hist[rows, entries, jnp.minimum(start + m, w - 1)]
      c = jnp.zeros((batch, vocab), jnp.float32).at[rows, nxt].add(votes)
      counts = jnp.where(jnp.sum(c, axis=1, keepdims=True) > 0, c, counts)
    total = jnp.sum(counts, axis=1, keepdims=True)
    fixed = jax.nn.one_hot(jax.lax.dynamic_index_in_dim(fallback, i, axis=1, keepdims=False),
                           vocab, dtype=jnp.float32)
    q = jnp.where(total > 0, counts / jnp.maximum(total, 1.0), fixed)
    x = jax.random.categorical(step_key, jnp.log(q), axis=-1).astype(jnp.int32)
    ctx = jax.lax.dynamic_update_slice_in_dim(ctx, x[:, None], n + i, axis=1)
    return ctx, (x, q)

  _, (drafts, q) = jax.lax.scan(draft, ctx, (jnp.arange(k), jax.random.split(key, k)))
  return jnp.swapaxes(drafts, 0, 1), jnp.swapaxes(q, 0, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryDrafter(Drafter):
  """Drafts from the row's prompt's earlier completions (`HistoryParams.table`), where its last
  `min_match`+ tokens occur there; elsewhere from `inner` (None: n-gram lookup in the row's own
  context, `n` down to `min_n` tokens). Params: `HistoryParams(table, inner params)`.

  `sampled` (at a temperature > 0; needs `vocab_size`): each history draft is drawn from the
  entries' votes for what follows its context (`history_sample`), a draft distribution q that
  the verifier's residual corrects, so where earlier completions disagree the draft covers them
  in proportion; else the occurrence nearest the row's position (q one-hot)."""

  n: int = 3
  min_n: int = 1
  min_match: int = 1  # history drafts need a match of at least this many tokens
  inner: Drafter | None = None
  sampled: bool = False

  def __post_init__(self):
    name = type(self).__name__
    check(self.draft_len >= 1, f"{name}.draft_len", f"must be >= 1, got {self.draft_len}")
    check(1 <= self.min_n <= self.n, f"{name}.min_n",
          f"must be in [1, n={self.n}], got {self.min_n}")
    check(self.min_n <= self.min_match <= self.n, f"{name}.min_match",
          f"must be in [min_n={self.min_n}, n={self.n}], got {self.min_match}")
    check(not self.sampled or self.vocab_size, f"{name}.vocab_size",
          "sampled history drafts need the vocabulary size (their draft distribution's width)")

  def _inner(self) -> Drafter | None:
    if self.inner is None:
      return None  # the engine sets K and the temperature on this drafter: the inner one follows
    return dataclasses.replace(self.inner, draft_len=self.draft_len, temperature=self.temperature)

  @property
  def stateful(self) -> bool:
    return self.inner is not None and self.inner.stateful

  @property
  def row_local(self) -> bool:
    return self.inner is None or self.inner.row_local

  def page_layout(self, params: HistoryParams):
    # the inner drafter's KV cache (an EAGLE-3 head's, a draft model's), if it keeps one, is the
    # state's one cache: a paged engine keeps it on the target's pages as the inner drafter's own
    return None if self.inner is None else self._inner().page_layout(params.inner)

  def init(self, params: HistoryParams, batch: int, cache_size: int) -> HistoryState:
    _, h, w = params.table.tokens.shape
    inner = self._inner()
    return HistoryState(tokens=jnp.zeros((batch, h, w), jnp.int32),
                        lengths=jnp.zeros((batch, h), jnp.int32),
                        inner=() if inner is None else inner.init(params.inner, batch, cache_size))

  def observe(self, params: HistoryParams, state: HistoryState, step: TargetStep) -> HistoryState:
    inner = self._inner()
    if inner is not None:
      state = state.replace(inner=inner.observe(params.inner, state.inner, step))
    if step.out.logits is not None:  # a decode or verify step: the entries stay
      return state
    # the prefill (prompt logits are not computed): load each row's prompt's entries
    table = params.table
    keys = prompt_keys(step.input_tokens, step.num_new)
    hit = (table.keys[None, :] == keys[:, None]) & (table.prompt_lengths[None, :] ==
                                                   step.num_new[:, None])
    slot = jnp.argmax(hit, axis=1)
    found = jnp.any(hit, axis=1)
    return state.replace(tokens=jnp.take(table.tokens, slot, axis=0),
                         lengths=jnp.where(found[:, None], jnp.take(table.lengths, slot, axis=0),
                                           0))

  def propose(self, params: HistoryParams, state: HistoryState, seq: Sequences, key: jax.Array):
    hist, matched = history_lookup(seq, state.tokens, state.lengths, self.draft_len, self.n,
                                   self.min_n, params.table.tail)
    use = matched >= self.min_match
    q = None
    if self.sampled and self.temperature > 0:  # (greedy: the nearest occurrence's tokens)
      key, sample_key = jax.random.split(key)
      hist, q = history_sample(seq, state.tokens, state.lengths, hist, self.n, self.min_n,
                               params.table.tail, self.vocab_size, sample_key)
    if params.corpus is not None:
      # any prompt's earlier rollouts: where their context matches longer than the prompt's own
      # history (or that has none), their continuation (deterministic: q one-hot)
      found, found_len = corpus_lookup(seq, params.corpus, self.draft_len)
      cross = (found_len > jnp.where(use, matched, 0)) & (found_len > 0)
      hist = jnp.where(cross[:, None], found, hist)
      if q is not None:
        q = jnp.where(cross[:, None, None], jax.nn.one_hot(found, q.shape[-1], dtype=q.dtype), q)
      use = use | cross
    inner = self._inner()
    if inner is None:
      other, probs, inner_state = lookup(seq, self.draft_len, self.n, self.min_n, 1), None, ()
    else:
      run_inner = lambda: inner.propose(params.inner, state.inner, seq, key)
      # every row drafts from its history: the inner drafter is not run (a head's K chained
      # forwards saved). Its state stays as observed: a stateful drafter keeps it current through
      # `observe` alone, as over the engine's plain AR steps; a stateless one has none to keep.
      shapes = jax.eval_shape(run_inner)
      skip = lambda: (hist, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1]),
                      state.inner)
      other, probs, inner_state = jax.lax.cond(jnp.all(use), skip, run_inner)
    drafts = jnp.where(use[:, None], hist, other)
    if q is not None:  # sampled history drafts: q, and the other rows' own (one-hot if none)
      other_q = jax.nn.one_hot(other, q.shape[-1], dtype=q.dtype) if probs is None else probs
      probs = jnp.where(use[:, None, None], q, other_q.astype(q.dtype))
    elif probs is not None:  # a history draft is deterministic: its draft distribution is one-hot
      one_hot = jax.nn.one_hot(hist, probs.shape[-1], dtype=probs.dtype)
      probs = jnp.where(use[:, None, None], one_hot, probs)
    return drafts, probs, state.replace(inner=inner_state)


def history_drafter(draft_cfg, **kwargs) -> HistoryDrafter:
  """The history drafter of an RL `DraftConfig` (K, n-gram range, history_min_match capped to
  it)."""
  d = draft_cfg
  return HistoryDrafter(draft_len=d.draft_len, n=d.ngram_max, min_n=d.ngram_min,
                        min_match=max(d.ngram_min, min(d.history_min_match, d.ngram_max)),
                        sampled=d.history_sampled, **kwargs)


@dataclasses.dataclass(frozen=True)
class HistoryMethod(DraftMethodBase):
  """`history`: drafts from each prompt's earlier completions (`HistoryStore`, kept by the RL
  sampler), n-gram lookup in the row itself where the history has nothing; nothing to train."""

  name: ClassVar[str] = "history"

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft, group_size):
    return history_drafter(draft_cfg, vocab_size=policy_cfg.vocab_size), None


@dataclasses.dataclass(frozen=True)
class Eagle3HistoryMethod(Eagle3Method):
  """`eagle3-history`: the history drafter where the prompt's earlier completions match the row,
  the EAGLE-3 head everywhere else (trained, adapted online and saved as `eagle3`'s)."""

  name: ClassVar[str] = "eagle3-history"

  def build_drafter(self, draft_cfg, *, policy_graphdef, policy_cfg, draft, group_size):
    head, fixed = super().build_drafter(draft_cfg, policy_graphdef=policy_graphdef,
                                        policy_cfg=policy_cfg, draft=draft,
                                        group_size=group_size)
    return history_drafter(draft_cfg, vocab_size=head.vocab_size, inner=head), fixed

  def train_graphdef(self, drafter):
    return super().train_graphdef(drafter.inner)


register_method(HistoryMethod())
register_method(Eagle3HistoryMethod())
