"""The Drafter protocol: how any drafter (n-gram, draft model, EAGLE-3, MTP) plugs into the loop.

A drafter is a frozen dataclass (hashable: a static argument of `jit`) whose methods are pure
functions of pytrees. The speculative loop calls, all under one `jit`:

  state = drafter.init(params, batch, cache_size)
  state = drafter.observe(params, state, step)      # after the prefill, and after every verify
  tokens, probs, state = drafter.propose(params, state, seq, key)   # [B, K], [B, K, V] | None
  (tree_width > 1: tokens, probs, alternatives, state = drafter.propose_tree(...), [B, K, W-1])

`observe` receives what the *target* just did (`TargetStep`): it ran on `input_tokens[b, :T]` at
positions `start[b] ..`, and of those T positions the first `num_new[b]` are now committed; the
token that follows input position t is `next_tokens[b, t]`. After the prefill, T is the padded
prompt length, `num_new` the prompt lengths and `next_tokens` the prompt shifted left with the
first sampled token at the end of each row. After a verify step, `input_tokens` is
[last committed, draft_1 .. draft_K], `num_new = num_accepted + 1` and `next_tokens` the emitted
tokens. An EAGLE-3 head pairs `target.aux_hidden[b, t]` with `next_tokens[b, t]`; a draft model
feeds `input_tokens`; an n-gram drafter ignores both and reads `seq`.

Rows that are finished keep being stepped (static shapes); their proposals are ignored. Every
array of a drafter's state has the rows on its leading axis: the engine gathers rows of it when it
compacts the live batch, and sets `KVCache.window` on every cache in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.decoder import DecoderOutput
from specjax.models.tree import DraftTree


@struct.dataclass
class TargetStep:
  input_tokens: jax.Array  # int32[B, T]
  next_tokens: jax.Array  # int32[B, T]
  start: jax.Array  # int32[B] position of input_tokens[:, 0]
  num_new: jax.Array  # int32[B] committed positions among the T
  out: DecoderOutput  # target forward on input_tokens (logits, hidden, aux_hidden)


@struct.dataclass
class Sequences:
  """Committed tokens of every row: prompt followed by generated tokens."""

  tokens: jax.Array  # int32[B, S]
  lengths: jax.Array  # int32[B]
  prompt_lengths: jax.Array  # int32[B]


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base class; subclasses override the three methods. `vocab_size` None means "any" (the
  loop checks it against the target's). `temperature` is the proposal temperature; the loop sets
  it to the sampling temperature (0 means greedy, deterministic proposals)."""

  draft_len: int
  vocab_size: int | None = None
  temperature: float = 1.0
  # candidates a verify scores per depth: 1 a chain; more a draft tree (`propose_tree`,
  # `specjax.models.tree.DraftTree`) for drafters that rank their candidates (`drafts_trees`)
  tree_width: int = 1
  # the first depths of the chain that carry the tree's alternatives (0: every depth)
  tree_depth: int = 0
  # a tree's chain of the drafter's most likely tokens (deterministic drafts, accepted with the
  # target's p(x)) instead of samples from its distribution: with the alternatives, each depth
  # then offers its W best candidates, where a sampled chain's rejection leaves the residual to
  # tokens the drafter underrates
  tree_argmax: bool = False

  @property
  def drafts_trees(self) -> bool:
    """The drafter implements `propose_tree`, so `tree_width` may exceed 1."""
    return False

  @property
  def tree(self) -> DraftTree:
    """The shape a verify scores: `DraftTree(draft_len, tree_width, tree_depth)` (a chain at
    width 1)."""
    return DraftTree(self.draft_len, self.tree_width, self.tree_depth)

  @property
  def write_span(self) -> int:
    """Cache positions a verify writes past a row's last committed token: the tree's drafted
    nodes (K for a chain)."""
    return self.draft_len if self.tree_width == 1 else self.tree.nodes - 1

  @property
  def stateful(self) -> bool:
    """The drafter keeps state that must observe every committed token (EAGLE-3, MTP): the
    engine then lets it observe plain AR steps too, so drafting can resume after them."""
    return True

  @property
  def row_local(self) -> bool:
    """A row's drafts depend only on that row (not on its neighbours in the batch), so rows may
    be regrouped into smaller buckets (live-batch compaction)."""
    return True

  def page_layout(self, params: Any) -> tuple[int, int, int, Any] | None:
    """(layers, kv heads, head dim, dtype) of the drafter's KV cache when its state holds one
    `KVCache` over the committed tokens (`init` makes it), which a paged engine then keeps on
    the target's pages: a pool of its own, the target's page table, so its memory grows with
    each row's tokens too. It must write only positions the target's next step writes or
    below. None (the default): the state stays as `init` makes it."""
    return None

  def init(self, params: Any, batch: int, cache_size: int) -> Any:
    return ()

  def observe(self, params: Any, state: Any, step: TargetStep) -> Any:
    return state

  def propose(self, params: Any, state: Any, seq: Sequences,
              key: jax.Array) -> tuple[jax.Array, jax.Array | None, Any]:
    raise NotImplementedError

  def propose_tree(self, params: Any, state: Any, seq: Sequences, key: jax.Array
                   ) -> tuple[jax.Array, jax.Array | None, jax.Array, Any]:
    """`propose`'s chain and, at each depth, `tree_width - 1` alternatives to its draft there
    (int32[B, K, tree_width - 1]: candidates from the same proposal as that draft, e.g. its next
    most likely tokens, never depending on the verifier's randomness), which a tree verify tries
    where the chain's draft is rejected (`rejection.verify_tree`)."""
    raise NotImplementedError(f"{type(self).__name__} drafts chains only (tree_width 1)")


def top_alternatives(logits: jax.Array, drawn: jax.Array, width: int,
                     ids: jax.Array | None = None) -> jax.Array:
  """int32[B, width - 1]: a proposal's most likely tokens (`logits` [B, N]) other than the drawn
  ones (`drawn` [B], in the ids `ids` maps the N logits to; None: the logits' own), most likely
  first: the alternatives of a draft tree (`Drafter.propose_tree`)."""
  top = jax.lax.top_k(logits, width)[1].astype(jnp.int32)  # [B, W]
  if ids is not None:
    top = jnp.take(ids, top)
  order = jnp.argsort(top == drawn[:, None], axis=1, stable=True)[:, :width - 1]
  return jnp.take_along_axis(top, order, axis=1)
