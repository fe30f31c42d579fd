"""Cross-prompt drafting: what followed a context anywhere in earlier rollouts, of any prompt.

A dataset visited once per epoch rarely shows a prompt again within a run, but the text its
answers are made of recurs across prompts: a chat template's opening, a task's phrasing, the
steps of a worked solution. `CorpusStore` (host) keeps, for the n-grams of every earlier rollout
(its prompt's last tokens, then its completion; n from `min_n` to `max_n`), the `width` tokens that
followed the n-gram's latest occurrence, in a hashed table of `slots` entries of fixed shape (a
newer occurrence, or another n-gram whose hash lands on the slot, replaces what the slot held).
Before a rollout the table goes to the device (`CorpusTable`); at every draft step
`corpus_lookup` hashes each row's last n tokens (longest first) and drafts the continuation held
there. The table depends only on earlier rollouts, so drafts from it keep the target's
distribution through the verifier whatever it holds (a stale or colliding entry costs
acceptance, never correctness). Memory: slots x (width + 2) x 4 bytes on the host and the device
whatever the run's length; each draft step reads max_n - min_n + 1 slots per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.config_tree import check
from specjax.drafters.token_hash import prompt_keys, window_keys
from specjax.errors import UserError
from specjax.sampling.drafter import Sequences


@struct.dataclass
class CorpusTable:
  """The device's copy of a `CorpusStore`: per slot the hash of the n-gram it holds (`prompt_key`
  of its tokens), the tokens that followed it and how many of them there are (0: empty)."""

  keys: jax.Array  # uint32[S]
  tokens: jax.Array  # int32[S, W]
  lengths: jax.Array  # int32[S]
  min_n: int = struct.field(pytree_node=False, default=2)
  max_n: int = struct.field(pytree_node=False, default=8)


class CorpusStore:
  """The continuations of every n-gram (min_n <= n <= max_n) of the rollouts recorded, latest
  occurrence first, in `slots` hashed entries of `width` tokens (see the module's docstring)."""

  def __init__(self, slots: int, width: int, min_n: int, max_n: int):
    check(slots >= 1 and not slots & (slots - 1), "CorpusStore.slots",
          f"must be a power of two, got {slots}")
    check(width >= 1, "CorpusStore.width", f"must be >= 1, got {width}")
    check(1 <= min_n <= max_n, "CorpusStore.min_n",
          f"must be in [1, max_n={max_n}], got {min_n}")
    self.slots, self.width, self.min_n, self.max_n = slots, width, min_n, max_n
    self._clear()

  def _clear(self) -> None:
    self._keys = np.zeros((self.slots,), np.uint32)
    self._tokens = np.zeros((self.slots, self.width), np.int32)
    self._lengths = np.zeros((self.slots,), np.int32)
    self._table: CorpusTable | None = None

  @property
  def filled(self) -> int:
    return int(np.count_nonzero(self._lengths))

  @property
  def nbytes(self) -> int:
    return self._keys.nbytes + self._tokens.nbytes + self._lengths.nbytes

  def record(self, sequences) -> None:
    """Token sequences of a rollout (1-D int arrays, e.g. a prompt's last max_n tokens then the
    completion), in order: a later occurrence of an n-gram replaces an earlier one."""
    keys, conts, lens = [], [], []
    for seq in sequences:
      s = np.asarray(seq, np.int32)
      padded = np.concatenate([s, np.zeros((self.width,), np.int32)])
      follow = np.lib.stride_tricks.sliding_window_view(padded, self.width)  # [L + 1, W]
      for n in range(self.min_n, self.max_n + 1):
        if len(s) <= n:
          break
        # the windows s[t - n : t] for t in n .. L - 1: each followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(s[:-1], n)
        keys.append(window_keys(windows))
        conts.append(follow[n:len(s)])
        lens.append(np.minimum(self.width, len(s) - np.arange(n, len(s))))
    if not keys:
      return
    keys = np.concatenate(keys)
    slot = (keys & np.uint32(self.slots - 1)).astype(np.int64)
    # the last occurrence of each slot wins (np.unique's first index in the reversed order)
    _, first = np.unique(slot[::-1], return_index=True)
    keep = len(slot) - 1 - first
    self._keys[slot[keep]] = keys[keep]
    self._tokens[slot[keep]] = np.concatenate(conts)[keep]
    self._lengths[slot[keep]] = np.concatenate(lens)[keep]
    self._table = None

  def table(self) -> CorpusTable:
    """The device copy (made once per change)."""
    if self._table is None:
      self._table = CorpusTable(keys=jnp.asarray(self._keys), tokens=jnp.asarray(self._tokens),
                                lengths=jnp.asarray(self._lengths), min_n=self.min_n,
                                max_n=self.max_n)
    return self._table

  def to_json(self) -> dict:
    """The filled slots, as plain JSON (a checkpoint's)."""
    filled = np.flatnonzero(self._lengths)
    return {"shape": [self.slots, self.width, self.min_n, self.max_n],
            "slots": filled.tolist(), "keys": self._keys[filled].tolist(),
            "entries": [self._tokens[i, :self._lengths[i]].tolist() for i in filled]}

  def load_json(self, data: dict) -> None:
    """Restore `to_json`'s output; another shape or a malformed one raises `UserError` naming
    what is wrong, and the store is then unchanged."""
    shape = [self.slots, self.width, self.min_n, self.max_n]
    problem = _malformed_corpus(data, shape)
    if problem is not None:
      raise UserError(f"CorpusStore: the saved cross-prompt table is malformed or of another "
                      f"shape ({problem}; DraftConfig.corpus_slots, corpus_min_match, "
                      f"corpus_ngram_max, draft_len); resume from another checkpoint, or start "
                      f"the run afresh")
    self._clear()
    for slot, key, entry in zip(data["slots"], data["keys"], data["entries"]):
      self._keys[slot] = key
      self._tokens[slot, :len(entry)] = entry
      self._lengths[slot] = len(entry)


def _malformed_corpus(data, shape: list[int]) -> str | None:
  if not isinstance(data, dict):
    return f"a {type(data).__name__}, not an object"
  for name in ("shape", "slots", "keys", "entries"):
    if not isinstance(data.get(name), list):
      return f"'{name}' is missing or not a list"
  if data["shape"] != shape:
    return f"shape {data['shape']}, this run's {shape}"
  if not len(data["slots"]) == len(data["keys"]) == len(data["entries"]):
    return "'slots', 'keys' and 'entries' differ in length"
  for i, (slot, key, entry) in enumerate(zip(data["slots"], data["keys"], data["entries"])):
    ints = isinstance(entry, list) and all(isinstance(t, int) and 0 <= t < 2**31 for t in entry)
    if not (isinstance(slot, int) and 0 <= slot < shape[0] and isinstance(key, int)
            and 0 <= key < 2**32 and ints and 1 <= len(entry) <= shape[1]):
      return f"entry {i} (slot {slot!r:.20}, key {key!r:.20}) is out of bounds or not token ids"
  return None


def corpus_lookup(seq: Sequences, table: CorpusTable,
                  draft_len: int) -> tuple[jax.Array, jax.Array]:
  """(int32[B, K] drafts, int32[B] match length, 0 where none): the continuation the table holds
  for the row's last n tokens (n = max_n down to min_n, the longest held first), clamped at its
  last token."""
  tokens, lengths = seq.tokens, seq.lengths
  batch = tokens.shape[0]
  slots, width = table.tokens.shape
  i = jnp.minimum(jnp.arange(draft_len), width - 1)[None, :]
  drafts = jnp.zeros((batch, draft_len), jnp.int32)
  matched = jnp.zeros((batch,), jnp.int32)
  for n in range(table.min_n, table.max_n + 1):  # a longer context's entry replaces a shorter's
    idx = jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0)
    keys = prompt_keys(jnp.take_along_axis(tokens, idx, axis=1), jnp.full((batch,), n))
    slot = (keys & jnp.uint32(slots - 1)).astype(jnp.int32)
    held = jnp.take(table.lengths, slot)
    found = (jnp.take(table.keys, slot) == keys) & (held > 0) & (lengths >= n)
    cont = jnp.take(table.tokens, slot, axis=0)  # [B, W]
    cont = jnp.take_along_axis(cont, jnp.minimum(i, held[:, None] - 1), axis=1)
    drafts = jnp.where(found[:, None], cont, drafts)
    matched = jnp.where(found, n, matched)
  return drafts, matched
