"""The Drafter protocol: how any drafter (n-gram, draft model, EAGLE-3, MTP) plugs into the loop.

A drafter is a frozen dataclass (hashable: a static argument of `jit`) whose methods are pure
functions of pytrees. The speculative loop calls, all under one `jit`:

  state = drafter.init(params, batch, cache_size)
  state = drafter.observe(params, state, step)      # after the prefill, and after every verify
  tokens, probs, state = drafter.propose(params, state, seq, key)   # [B, K], [B, K, V] | None

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
from flax import struct

from specjax.models.decoder import DecoderOutput


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
