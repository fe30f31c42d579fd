"""The engine's batch: the device state of one rollout's slots, the caller's finished rows, and
every program that takes (donates) the state, so that the engine holds its KV memory once.

A program that takes the state gives back the one to use (`Batch.apply`); the batch keeps that
one and nothing else. After compaction the rows step in a smaller bucket state gathered from the
full-size state, which the batch keeps for the write-back (its rows only: a paged state's pool
moves with the bucket state, whose first segment takes it).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.sampling.engine import paged_state
from specjax.sampling.metrics import AcceptanceCounts
from specjax.sampling.segment import EngineState, map_rows, release_pages, take_rows


@struct.dataclass
class Results:
  """What the engine keeps of each of the caller's rows once it is done (the slots move on)."""

  tokens: jax.Array  # int32[B, N + Kmax + 1]
  logprobs: jax.Array  # float32[B, N + Kmax + 1]
  lengths: jax.Array  # int32[B]
  counts: AcceptanceCounts  # per row


class Summary(NamedTuple):
  """What the host reads of a state between segments (one round trip)."""

  live: np.ndarray  # bool[b]
  seq_lengths: np.ndarray  # int32[b]: committed tokens of live rows, 0 for the others
  tokens: int  # completion tokens of the caller's rows in the state
  drafts: int  # drafts verified so far (pooled over rows)
  accepted: np.ndarray  # accepted drafts per position (pooled)
  row_ids: np.ndarray  # int32[b]: the caller's row in each slot, -1 for none
  homes: np.ndarray  # int32[b]: each row's slot in the full-size state


take_jit = jax.jit(take_rows)


@jax.jit
def summarize(state: EngineState):
  live = ~state.done
  counts = state.counts.pooled()
  return (live, jnp.where(live, state.seq.lengths, 0),
          jnp.sum(jnp.where(state.row_ids >= 0, state.lengths, 0)),
          counts.num_drafts, counts.accepted_per_position, state.row_ids, state.slots)


@functools.partial(jax.jit, donate_argnames=("out",))
def write_back(out: EngineState, state: EngineState) -> EngineState:
  """Rows of a bucket state back into the full-size state at their slots (padding dropped)."""
  idx = jnp.where(state.row_ids >= 0, state.slots, out.done.shape[0])
  return map_rows(lambda o, s: o.at[idx].set(s, mode="drop"), out, state)


@functools.partial(jax.jit, donate_argnames=("results", "state"))
def harvest(results: Results, state: EngineState) -> tuple[Results, EngineState]:
  """Finished rows of a full-size state into the caller's rows of `results`; their slots are
  then free (row id -1)."""
  take = state.done & (state.row_ids >= 0)
  idx = jnp.where(take, state.row_ids, results.lengths.shape[0])
  mine = Results(tokens=state.tokens, logprobs=state.logprobs, lengths=state.lengths,
                 counts=state.counts)
  results = jax.tree.map(lambda r, x: r.at[idx].set(x, mode="drop"), results, mine)
  return results, release_pages(state.replace(row_ids=jnp.where(take, -1, state.row_ids)), take)


@jax.jit
def admission_inputs(prompts, prompt_lengths, key, rows, n):
  """The prompts and lengths of the caller's `rows` and the key of the queue's `n`-th prefill, in
  one dispatch (indexing and folding op by op cost a millisecond or more per refill)."""
  return prompts[rows], prompt_lengths[rows], jax.random.fold_in(key, n)


@functools.partial(jax.jit, donate_argnames=("state",))
def admit(state: EngineState, new: EngineState, slots: jax.Array,
          row_ids: jax.Array) -> EngineState:
  """Prefilled rows `new` into the free `slots` of a full-size state as the caller's `row_ids`
  (-1: a padding row past the end of the queue, dropped)."""
  idx = jnp.where(row_ids >= 0, slots, state.done.shape[0])
  new = new.replace(row_ids=row_ids, slots=slots)
  return jax.tree.map(lambda o, s: o.at[idx].set(s, mode="drop"), state, new)


def _rows_only(*states: EngineState) -> tuple[EngineState, ...]:
  """The states as compaction's programs take them: a paged state without its page buffers."""
  return tuple(paged_state.without_buffers(s) for s in states)


def gather(state: EngineState, idx: jax.Array, pad: jax.Array) -> EngineState:
  """Compaction's gather of rows `idx` into a bucket state. A paged state's pool is not copied:
  the bucket state holds the same page buffers, which its first segment takes (the full-size
  state keeps its rows, for the write-back)."""
  return paged_state.with_buffers(take_jit(*_rows_only(state), idx, pad), state)


def compile_write_back(full: EngineState, state: EngineState):
  """The write-back of bucket `state` into `full`, compiled, not run (it would take `full`)."""
  return write_back.lower(*_rows_only(full, state)).compile()


class Batch:
  """The rows a rollout steps: `state` (the full-size state of every slot, or after compaction a
  bucket state of the live rows), and `results`, the caller's finished rows. Every program that
  takes the state goes through `apply` or `run`, which keep the state it returns."""

  def __init__(self, state: EngineState, results: Results):
    self.state, self.results = state, results
    self.slots = self.bucket = state.done.shape[0]
    self._full: EngineState | None = None  # compacted: the full-size state (rows only valid)

  @classmethod
  def start(cls, state: EngineState, batch: int) -> Batch:
    """The first rows' state (prefilled) and empty results for the caller's `batch` rows."""
    width = state.tokens.shape[1]
    return cls(state, Results(tokens=jnp.zeros((batch, width), jnp.int32),
                              logprobs=jnp.zeros((batch, width), jnp.float32),
                              lengths=jnp.zeros((batch,), jnp.int32),
                              counts=AcceptanceCounts.zeros(state.counts.draft_len, batch)))

  def apply(self, program: Callable[[EngineState], EngineState]) -> None:
    """`program` takes the state and returns the one to keep."""
    self.state = program(self.state)

  def run(self, program: Callable[[EngineState], tuple]):
    """`program` takes the state and returns (the state to keep, a result): the result."""
    self.state, result = program(self.state)
    return result

  def summary(self) -> Summary:
    return Summary(*jax.device_get(summarize(self.state)))

  def harvest(self) -> None:
    """Finished rows into `results`; their slots are free after it (a full-size state)."""
    self.results, self.state = harvest(self.results, self.state)

  def free_slots(self) -> np.ndarray:
    return np.flatnonzero(np.asarray(jax.device_get(self.state.row_ids)) < 0)

  def compact(self, idx: np.ndarray, pad: np.ndarray, bucket: int) -> None:
    """Gather rows `idx` of the full-size state (brought up to date first) into a state of
    `bucket` rows, `pad` marking padding: one gather program per bucket, whichever bucket the
    rows come from."""
    full = self.full_size()
    self.state, self._full, self.bucket = gather(full, jnp.asarray(idx), jnp.asarray(pad)), \
        full, bucket

  def full_size(self) -> EngineState:
    """The full-size state with a bucket's rows written back (it takes the full-size state the
    batch kept; a paged pool moves back with the rows, uncopied). The batch keeps stepping its
    bucket state."""
    if self._full is None:
      return self.state
    full = paged_state.with_buffers(write_back(*_rows_only(self._full, self.state)), self.state)
    self._full = None
    return full

  def finish(self) -> Results:
    """The caller's rows: every row harvested from the full-size state. Ends the batch."""
    results, _ = harvest(self.results, self.full_size())
    return results

  @contextlib.contextmanager
  def borrowed(self, state: EngineState):
    """`state` (a throw-away bucket state) as the batch's state for the block, with the page
    buffers of the batch's own, which dry runs take and give back; then the batch's state again,
    with the buffers as the block left them."""
    own, self.state = self.state, paged_state.with_buffers(state, self.state)
    try:
      yield self
    finally:
      self.state = paged_state.with_buffers(own, self.state)
