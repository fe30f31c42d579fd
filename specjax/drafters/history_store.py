"""The host side of history drafting: each prompt's most recent completions, within fixed caps.

`HistoryStore` keeps on the host, per prompt (found by a hash of its tokens,
`specjax.drafters.token_hash`, which the device computes too), its latest completions, for every prompt of a
dataset up to `max_prompts` (least-recently-recorded eviction beyond that). Memory is taken as
prompts are recorded: per prompt `per_prompt` x `width` int32 tokens. Before a rollout it hands
the device a `HistoryTable` of the rollout's own prompts only (static shape: one slot per row),
which the drafter (`specjax.drafters.history.HistoryDrafter`) reads, so the device's memory and
the per-step lookup do not grow with the dataset. The store is saved with a run (`to_json` /
`load_json`), and a malformed or out-of-bounds saved store is refused with the field it breaks.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.config_tree import check
from specjax.drafters.token_hash import prompt_key
from specjax.errors import UserError

if TYPE_CHECKING:
  from specjax.drafters.corpus import CorpusStore


@struct.dataclass
class HistoryTable:
  """What the device sees of a `HistoryStore`: M prompt slots of H entries of W tokens. An entry
  holds the last `tail` tokens of its prompt, then the completion (cut at W)."""

  keys: jax.Array  # uint32[M] prompt hash
  prompt_lengths: jax.Array  # int32[M]; -1: an empty slot
  tokens: jax.Array  # int32[M, H, W]
  lengths: jax.Array  # int32[M, H] tokens held per entry (0: empty)
  tail: int = struct.field(pytree_node=False, default=3)


class _Entries:
  """One prompt's entries: tokens int32[H, W], lengths int32[H], the next one to overwrite."""

  __slots__ = ("tokens", "lengths", "next")

  def __init__(self, per_prompt: int, width: int):
    self.tokens = np.zeros((per_prompt, width), np.int32)
    self.lengths = np.zeros((per_prompt,), np.int32)
    self.next = 0


class HistoryStore:
  """Per prompt (keyed by its token ids), the `per_prompt` most recent completions, for at most
  `max_prompts` prompts (the least recently recorded prompt is evicted first). Host memory grows
  with the prompts recorded, up to max_prompts x per_prompt x width x 4 bytes (`nbytes`); the
  device sees only a rollout's prompts (`table`). `tail` prompt tokens precede each completion,
  so a row's first drafts can match its prompt's end."""

  def __init__(self, max_prompts: int, per_prompt: int, width: int, tail: int,
               corpus: CorpusStore | None = None):
    """`corpus`: a cross-prompt table (`specjax.drafters.corpus`) fed the same rollouts (each
    row's last corpus.max_n prompt tokens, then its completion) and saved with the store."""
    self.corpus = corpus
    check(max_prompts >= 1, "HistoryStore.max_prompts", f"must be >= 1, got {max_prompts}")
    check(per_prompt >= 1, "HistoryStore.per_prompt", f"must be >= 1, got {per_prompt}")
    check(tail >= 1, "HistoryStore.tail", f"must be >= 1, got {tail}")
    check(width > tail, "HistoryStore.width", f"must be > tail = {tail}, got {width}")
    self.max_prompts, self.per_prompt, self.width, self.tail = max_prompts, per_prompt, width, tail
    self._clear()

  def _clear(self) -> None:
    # (prompt key, prompt length) -> its entries, least recently recorded first
    self._held: collections.OrderedDict[tuple[int, int], _Entries] = collections.OrderedDict()
    self.recorded = 0  # completions recorded over the store's life

  @property
  def prompts(self) -> int:
    return len(self._held)

  @property
  def nbytes(self) -> int:
    """Bytes of token storage held (the entries of every prompt held)."""
    return self.prompts * self.per_prompt * (self.width + 1) * 4

  def record(self, prompts, prompt_lengths, completions, lengths) -> None:
    """Rows of a rollout: prompts int[N, P] (right-padded), prompt_lengths int[N], completions
    int[N, C], lengths int[N]. Rows keep their order: the last of a prompt's rows is its most
    recent entry."""
    prompts, completions = np.asarray(prompts), np.asarray(completions)
    prompt_lengths, lengths = np.asarray(prompt_lengths), np.asarray(lengths)
    for p, pl, c, cl in zip(prompts, prompt_lengths, completions, lengths):
      ids = p[:int(pl)]
      name = (prompt_key(ids), int(pl))
      held = self._held.pop(name, None)
      if held is None:
        if len(self._held) >= self.max_prompts:  # evict the least recently recorded prompt
          self._held.popitem(last=False)
        held = _Entries(self.per_prompt, self.width)
      self._held[name] = held
      entry = np.concatenate([ids[-self.tail:], c[:int(cl)]])[:self.width]
      e = held.next
      held.tokens[e] = 0
      held.tokens[e, :len(entry)] = entry
      held.lengths[e] = len(entry)
      held.next = (e + 1) % self.per_prompt
      self.recorded += 1
    if self.corpus is not None:
      self.corpus.record(np.concatenate([p[:int(pl)][-self.corpus.max_n:], c[:int(cl)]])
                         for p, pl, c, cl in zip(prompts, prompt_lengths, completions, lengths))

  def table(self, prompts=None, prompt_lengths=None) -> HistoryTable:
    """The device's view. With a rollout's prompts (int[N, P] right-padded, int[N] lengths): one
    slot per row, holding that row's prompt's entries (an empty slot where the store has none),
    so its shape is the rollout's whatever the store holds. Without: every prompt held, least
    recently recorded first (at least one slot)."""
    if prompts is None:
      names = list(self._held) or [None]
    else:
      prompts, prompt_lengths = np.asarray(prompts), np.asarray(prompt_lengths)
      names = [(prompt_key(p[:int(n)]), int(n)) for p, n in zip(prompts, prompt_lengths)]
    m = len(names)
    keys = np.zeros((m,), np.uint32)
    plens = np.full((m,), -1, np.int32)
    tokens = np.zeros((m, self.per_prompt, self.width), np.int32)
    lengths = np.zeros((m, self.per_prompt), np.int32)
    for i, name in enumerate(names):
      held = self._held.get(name) if name is not None else None
      if held is not None:
        keys[i], plens[i] = name
        tokens[i], lengths[i] = held.tokens, held.lengths
    return HistoryTable(keys=jnp.asarray(keys), prompt_lengths=jnp.asarray(plens),
                        tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths), tail=self.tail)

  def to_json(self) -> dict:
    """What the store holds, as plain JSON (a checkpoint's): its shape and each prompt's entries,
    least recently recorded first."""
    prompts = []
    for (key, plen), held in self._held.items():
      prompts.append({"key": key, "prompt_length": plen, "next": held.next,
                      "entries": [held.tokens[e, :held.lengths[e]].tolist()
                                  for e in range(self.per_prompt)]})
    out = {"shape": [self.max_prompts, self.per_prompt, self.width], "tail": self.tail,
           "recorded": self.recorded, "prompts": prompts}
    if self.corpus is not None:
      out["corpus"] = self.corpus.to_json()
    return out

  def load_json(self, data: dict | None) -> None:
    """Restore `to_json`'s output (None: nothing saved; the store stays as it is). A history of
    another shape, or a malformed one (a field missing or of the wrong type, more prompts or
    entries than the store holds), raises `UserError` naming what is wrong; the store is then
    unchanged."""
    if data is None:
      return
    shape = [self.max_prompts, self.per_prompt, self.width]
    problem = _malformed_history(data)
    if problem is None and (list(data["shape"]) != shape or data["tail"] != self.tail):
      raise UserError(f"HistoryStore: the saved history has shape {data['shape']} and tail "
                      f"{data['tail']}, this run's {shape} and {self.tail} (DraftConfig."
                      f"history_prompts, history_per_prompt, history_tokens, ngram_max)")
    if problem is None:
      problem = _history_out_of_bounds(data["prompts"], *shape)
    if problem is not None:
      raise UserError(f"HistoryStore: the saved drafting history is malformed ({problem}); "
                      f"resume from another checkpoint, or start the run afresh")
    if self.corpus is not None:  # (checked and restored first: on an error nothing changed)
      self.corpus.load_json(data.get("corpus"))
    self._clear()
    for p in data["prompts"]:
      held = _Entries(self.per_prompt, self.width)
      held.next = p["next"]
      for e, entry in enumerate(p["entries"]):
        held.tokens[e, :len(entry)] = entry
        held.lengths[e] = len(entry)
      self._held[(p["key"], p["prompt_length"])] = held
    self.recorded = data["recorded"]


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _malformed_history(data) -> str | None:
  """What makes `data` other than `HistoryStore.to_json`'s layout, or None."""
  if not isinstance(data, dict):
    return f"a {type(data).__name__}, not an object"
  fields = {"shape": (list, "a list"), "tail": (int, "an int"), "recorded": (int, "an int"),
            "prompts": (list, "a list")}
  for name, (kind, said) in fields.items():
    if name not in data:
      return f"no '{name}'"
    if not isinstance(data[name], kind) or isinstance(data[name], bool):
      return f"'{name}' is {data[name]!r:.40}, not {said}"
  if len(data["shape"]) != 3 or not all(_is_int(n) for n in data["shape"]):
    return f"'shape' is {data['shape']!r:.40}, not three ints"
  for i, p in enumerate(data["prompts"]):
    if not isinstance(p, dict):
      return f"prompts[{i}] is {p!r:.40}, not an object"
    for name in ("key", "prompt_length", "next", "entries"):
      if name not in p:
        return f"prompts[{i}] has no '{name}'"
      listed = name == "entries"
      if not (isinstance(p[name], list) if listed else _is_int(p[name])):
        return f"prompts[{i}].{name} is {p[name]!r:.40}, not {'a list' if listed else 'an int'}"
    for e, entry in enumerate(p["entries"]):
      if not isinstance(entry, list) or not all(_is_int(t) for t in entry):
        return f"prompts[{i}].entries[{e}] is not a list of token ids"
  return None


def _history_out_of_bounds(prompts: list, max_prompts: int, per_prompt: int,
                           width: int) -> str | None:
  """What of a well-formed history does not fit a store of this shape, or None."""
  if len(prompts) > max_prompts:
    return f"{len(prompts)} prompts, for {max_prompts}"
  seen = set()
  for i, p in enumerate(prompts):
    if not 0 <= p["key"] < 2**32 or not 0 <= p["prompt_length"] < 2**31:
      return f"prompts[{i}] has key {p['key']} and prompt_length {p['prompt_length']}"
    if (p["key"], p["prompt_length"]) in seen:
      return f"prompts[{i}] repeats an earlier prompt's key and prompt_length"
    seen.add((p["key"], p["prompt_length"]))
    if not 0 <= p["next"] < per_prompt or len(p["entries"]) > per_prompt:
      return (f"prompts[{i}] has next {p['next']} and {len(p['entries'])} entries, for "
              f"{per_prompt} per prompt")
    for e, entry in enumerate(p["entries"]):
      if len(entry) > width or not all(0 <= t < 2**31 for t in entry):
        return f"prompts[{i}].entries[{e}] has {len(entry)} tokens (at most {width}) or a bad id"
  return None
