"""The engine's scheduler: which of the caller's rows hold the slots. A batch longer than the slots
is a queue: rows wait, are prefilled in whole prompt groups, and are admitted into free slots
once a segment returns with `refill` slots free; the refill threshold follows measured costs and
the rate at which rows finish (`adaptive.RefillPolicy`), and each segment is told when to
return (`stop_at_live`, `stop_at_paused`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import UserError
from specjax.sampling.adaptive import RefillPolicy
from specjax.sampling.cost_table import CostTable
from specjax.sampling.engine import batch as batch_programs
from specjax.sampling.engine.batch import Batch, Summary
from specjax.sampling.engine.kv import DenseKV, PagedKVManager
from specjax.sampling.engine.programs import Programs


class Scheduler:
  """The caller's rows that wait for a slot: those not yet prefilled, in order, and the rows of
  one prefill (whole prompt groups, `prefill_rows`, padded past the queue's end) that found no
  free slot yet, held prefilled on the device. A refill moves up to `refill` of them into free
  slots at a time; a group's samples may take slots in different refills, each prefill done
  once. The KV manager places each admitted row (a paged run: on pages of a replica)."""

  def __init__(self, programs: Programs, kv: DenseKV | PagedKVManager, rows: np.ndarray,
               prompts, prompt_lengths, key, group: int, slots: int, refill: int,
               prefill_rows: int, dp: int):
    self.programs, self.kv, self.rows = programs, kv, rows
    self.prompts, self.prompt_lengths, self.key = prompts, prompt_lengths, key
    self.group, self.slots, self.prefill_rows = group, slots, prefill_rows
    self.refill = refill  # free slots that make a segment return, while rows wait
    self.refills = RefillPolicy(slots, dp, refill)
    # (its state, the caller's rows, -1 for padding; which of them still wait)
    self.pending: tuple | None = None
    self.prefills = 0

  def waiting(self) -> int:
    return len(self.rows) + (0 if self.pending is None else int(self.pending[2].sum()))

  def _prefill_next(self) -> None:
    rows = self.rows[:self.prefill_rows]
    self.rows = self.rows[len(rows):]
    ids = np.concatenate([rows, np.full(self.prefill_rows - len(rows), -1)]).astype(np.int32)
    take = np.where(ids >= 0, ids, rows[-1])
    self.prefills += 1
    inputs = batch_programs.admission_inputs(self.prompts, self.prompt_lengths, self.key,
                                             jnp.asarray(take), self.prefills)
    self.pending = (self.programs.prefill(*inputs, self.group), ids, ids >= 0)

  def admit(self, batch: Batch, free: np.ndarray) -> np.ndarray | None:
    """Up to `refill` waiting rows into the `free` slots, in queue order: the slots they took, or
    None when a paged run has pages for none of them."""
    if self.pending is None:
      self._prefill_next()
    new, ids, wait = self.pending
    into = np.zeros(self.prefill_rows, np.int32)
    row_ids = np.full(self.prefill_rows, -1, np.int32)
    free, taken = list(free), []
    for i in np.flatnonzero(wait):
      if len(taken) == self.refill or not free:
        break
      slot = self.kv.place(self.prefills, int(i), int(ids[i]), free)
      if slot is None:  # no pages: the rest wait too (queue order)
        break
      free.remove(slot)
      into[i], row_ids[i], wait[i] = slot, ids[i], False
      taken.append(slot)
    if not taken:
      return None
    if not wait.any():
      self.pending = None
    batch.apply(lambda state: self.kv.admit(state, new, into, row_ids))
    return np.asarray(taken)

  def refill_slots(self, batch: Batch, summary: Summary) -> tuple[Summary, bool]:
    """Admit waiting rows while `refill` slots are free: (the summary after, whether waiting
    rows found free slots but no pages)."""
    live, no_pages = int(summary.live.sum()), False
    while self.waiting() and self.slots - live >= self.refill:
      batch.harvest()
      # one read of the free slots per refill, not per admission
      free = batch.free_slots()
      admitted = False
      while self.waiting() and len(free) >= self.refill:
        taken = self.admit(batch, free)
        if taken is None:  # no pages: wait for rows to finish
          no_pages = True
          break
        admitted = True
        free, live = free[~np.isin(free, taken)], live + len(taken)
      # (an admitted row can be done at once: its first token ended it)
      summary = batch.summary()
      live = int(summary.live.sum())
      if not admitted:
        break
    return summary, no_pages

  def check_stalled(self) -> None:
    """Every row is done and rows wait: the pages of rows that ended at their first token come
    back at the next visit; with every page free, a prompt group must fit."""
    kv = self.kv
    if not kv.paged or kv.pages_in_use == 0:
      engine, pages = self.programs.engine, getattr(kv, "pages", None)
      dp = 1 if pages is None else len(pages.replicas)
      num_pages = 0 if pages is None else pages.num_pages // dp
      raise UserError(
          f"EngineConfig.paging.kv_cache_gb={engine.paging.kv_cache_gb}: the pool's {num_pages} "
          f"pages"
          f"{' per data-parallel replica' if dp > 1 else ''} cannot hold the first pages of one "
          f"prompt group ({self.group} rows); raise kv_cache_gb or lower page_ahead")

  def stop_at_live(self, live: int, bucket: int, buckets: list[int], compact: bool,
                   no_pages: bool) -> int:
    """Live rows at which the next segment returns: rows wait: once `refill` slots are free (or,
    short of pages, once a row ends); else once the rows fit a smaller bucket."""
    if self.waiting():
      return live - 1 if no_pages else self.slots - self.refill
    smaller = [b for b in buckets if b < bucket]
    # (on a mesh, paged: the live rows may fit a smaller bucket, but not each replica's)
    return min(smaller[0], live - 1) if compact and smaller else 0

  def stop_at_paused(self, live: int) -> int:
    """(paged) a segment also returns once a refill's worth more rows wait for pages."""
    return self.kv.paused + max(self.refill if self.waiting() else live // 8, 1)

  def compile_jobs(self, batch: Batch) -> tuple:
    """The harvest and admission programs, compiled with the others when rows wait (compiled,
    not run: a harvest and an admission take the state they update)."""
    if not self.waiting():
      return ()
    rows = self.prefill_rows

    def compile_admission():
      new = self.programs.prefill(self.prompts[:rows], self.prompt_lengths[:rows], self.key,
                                  self.group)
      return self.kv.compile_admission(batch.state, new, rows)

    return (lambda: batch_programs.harvest.lower(batch.results, batch.state).compile(),
            compile_admission)

  def measure_refill_costs(self, batch: Batch, costs: CostTable) -> None:
    """(fixed seconds per refill, prefill seconds per row) of this queue, measured as a step cost
    is (`CostTable.step_cost`, kept under K = -1): a timed run of m prefills of `prefill_rows`
    rows, an admission of none of them (every row id -1: the state is left as it was) and the
    summary's round trip; the slope over m is a prefill's cost, the rest the refill's fixed
    cost. (A refill's harvest, a scatter like the admission, is not timed.)"""
    p, rows = self.programs, self.prefill_rows
    key_cost = (costs.program_id(("refill", p.graphdef, p.drafter, p.cfg, p.cache_size, p.mesh,
                                  self.slots, self.kv.paged)), rows, -1)
    none = np.full((rows,), -1, np.int32)

    def run(m: int) -> int:
      for _ in range(m):
        new = p.prefill(self.prompts[:rows], self.prompt_lengths[:rows], self.key, self.group)
      batch.apply(lambda state: self.kv.admit(state, new, np.arange(rows, dtype=np.int32), none))
      jax.device_get(batch_programs.summarize(batch.state))
      return m

    per_prefill = costs.step_cost(key_cost, run, 1, p.engine.calibration.repeats)
    self.refills.costs = (costs.fixed_cost(key_cost), per_prefill / rows)

  def observe(self, live_before: int, summary: Summary, iters: int) -> None:
    """A full-bucket segment ran while rows wait (no row joins during one)."""
    self.refills.observe(live_before - int(summary.live.sum()), iters)

  def update_refill(self, step_s: float, segment_s: float) -> None:
    if self.refills.costs is not None:  # (K's step cost is measured by now)
      self.refill = self.refills.threshold(step_s, segment_s)
