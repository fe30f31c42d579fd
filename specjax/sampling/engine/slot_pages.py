"""The host side of the engine's paged KV memory: which pages of the pool each engine slot
holds, over one `PageAllocator` per data-parallel replica, so a slot holds memory for the tokens
its row has, not for the longest row the run allows.

Between segments the engine asks `SlotPages.visit` what to do: finished rows give their pages
back, live rows near the end of their pages take more (`page_ahead` tokens at a time, so a
segment runs many steps before a row needs the host again), and when rows cannot grow the most
recently admitted rows are swapped out (their pages copied to host memory and freed; the row
keeps its slot, paused, and its pages come back, copied in, once pages are free). A row that
waits for pages commits nothing (`segment.paused_rows`), so no row's distribution changes.
Waiting rows are admitted only while no admitted row waits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.paged import NO_PAGE, PagedKV
from specjax.sampling.engine.paged_state import read_pages, read_pages_program, write_pages, \
    write_pages_program
from specjax.sampling.page_allocator import PADDING_ROW, PageAllocator


def _padded(pages, width: int) -> jax.Array:
  out = np.full((width,), NO_PAGE, np.int32)
  out[:len(pages)] = pages
  return jnp.asarray(out)


class ReplicaPages:
  """The pages of one data-parallel replica's slots (its shard of the pool: global page ids
  `offset` + [0, num_pages)) and its rows swapped out to host memory. The allocator keys rows by
  their engine slot and counts pages from 0; `offset` turns them into the pool's ids."""

  def __init__(self, num_pages: int, page_size: int, cache_size: int, page_ahead: int,
               offset: int = 0):
    self.max_pages = -(-cache_size // page_size)
    self.alloc = PageAllocator(num_pages, page_size, self.max_pages)
    self.offset = offset
    self.page_size, self.cache_size = page_size, cache_size
    self.ahead = max(page_ahead, 1)
    self.swapped: dict[int, tuple] = {}  # slot -> ((k, v) per pool, pages held) on the host
    self.waiting = False  # an admitted row waits for pages: admit no new rows
    self.paused = 0  # live rows without pages for their next step after the last visit
    self.swaps = 0  # rows swapped out so far

  def tokens_for(self, seq_len: int, draft_len: int) -> int:
    """Positions a row of `seq_len` committed tokens takes pages for: its next steps' writes
    (up to seq_len - 1 + `draft_len`: K, or a draft tree's drafted nodes) and `page_ahead`
    more, within the cache size."""
    return min(seq_len + draft_len + self.ahead, self.cache_size)

  def admit(self, slots, seq_lens, draft_len: int, prompt_len: int = 0) -> bool:
    """Take pages for new rows in `slots` (all or none). The slots are free: pages a finished
    row there still holds (it ended after the last visit) come back first.

    `prompt_len` > 0: the rows are the samples of one prompt (a GRPO group, prefilled once), and
    their first `prompt_len` cached positions hold the same keys and values. The first row takes
    pages for them; the others share its full pages (reference counted, never written again: a
    row writes only at positions >= its length) and take a private page for the partly filled
    last one. The prefill's copy into pages writes every row's prompt through its own table, so
    the private page gets its row's copy and the shared pages the group's (identical) values."""
    taken = []
    for slot, n in zip(slots, seq_lens):
      share = taken[0] if taken and prompt_len else None
      if not self.admit_row(slot, int(n), draft_len, share, prompt_len):
        for t in taken:
          self.alloc.release(t)
        return False
      taken.append(int(slot))
    return True

  def admit_row(self, slot: int, seq_len: int, draft_len: int, share_from: int | None = None,
                prefix: int = 0) -> bool:
    """Take pages for a new row in the free `slot` (pages a finished row there still holds come
    back first): its own, or with `share_from` (the slot of a row of the same prompt that holds
    them) the full pages of the first `prefix` positions shared and a private page for a partly
    filled last one, as `admit` gives a group's later samples. False: nothing taken."""
    slot = int(slot)
    if slot in self.alloc:
      self.alloc.release(slot)
    if self.waiting:
      return False
    want = self.tokens_for(seq_len, draft_len)
    if share_from is None or not prefix:
      return self.alloc.admit(slot, want)
    if self.alloc.share_prefix(int(share_from), [slot], prefix) is None:
      return False
    if not self.alloc.grow(slot, want):
      self.alloc.release(slot)
      return False
    return True

  def table(self, homes, row_ids) -> np.ndarray:
    """int32[len(homes), max_pages]: the pages of each bucket row's home slot; NO_PAGE for
    padding and for rows that hold none (finished, free or swapped out)."""
    rows = [int(h) if r >= 0 and int(h) in self.alloc else PADDING_ROW
            for h, r in zip(homes, row_ids)]
    table = self.alloc.page_table(rows, self.max_pages)
    return np.where(table >= 0, table + self.offset, table)

  def visit(self, pools: tuple[PagedKV, ...], live, seq_lens, homes,
            draft_len: int) -> tuple[PagedKV, ...]:
    """Between segments: free the pages of rows no longer live, bring swapped rows back where
    pages allow, give live rows pages for their next steps, and swap out the newest rows when
    the rows that wait for pages would otherwise stall the batch. Returns the pools with the
    copies made (the caller sets the page table from `table`)."""
    live_slots = {int(h): int(n) for h, n, ok in zip(homes, seq_lens, live) if ok}
    # (rows of other replicas are in `live_slots` too; only this replica's are visited)
    for slot in self.alloc.rows:
      if slot not in live_slots:
        self.alloc.release(slot)
    for slot in list(self.swapped):  # oldest swap first
      kv, held = self.swapped[slot]
      if not self.alloc.admit(slot, max(held, self.tokens_for(live_slots[slot], draft_len))):
        break
      pools = write_pages(pools, self._padded(self.alloc.row_pages(slot)), kv)
      del self.swapped[slot]
    short = []  # live rows whose pages cannot hold their next step
    for slot in self.alloc.rows:  # oldest admission first
      n = live_slots[slot]
      room = len(self.alloc.row_pages(slot)) * self.page_size
      if room - n >= draft_len + self.ahead // 2:
        continue
      if not self.alloc.grow(slot, self.tokens_for(n, draft_len)) and \
          not self.alloc.grow(slot, n + draft_len):
        short.append(slot)
    # swap out when at least half the rows holding pages wait (all of them: nothing would move)
    if short and 2 * len(short) >= len(self.alloc.rows):
      pools = self._swap_out(pools, short[0], live_slots[short[0]], draft_len)
    self.waiting = bool(short or self.swapped)
    self.paused = len(short) + len(self.swapped)
    return pools

  def _swap_out(self, pools: tuple[PagedKV, ...], first: int, seq_len: int,
                draft_len: int) -> tuple[PagedKV, ...]:
    """Swap out the newest rows until the oldest waiting row (`first`) can take its pages.

    There is always a victim: `first` just failed to grow to seq_len + draft_len, so it needs
    more pages than are free, and `grow` refuses a length the pool cannot hold, so releasing
    every other row frees enough (all pages but those `first` holds). No victim is a bug in the
    accounting: RuntimeError, nothing changed; so is a row that still cannot grow after the
    swap."""
    need = self.alloc.pages_for(seq_len + draft_len) - len(self.alloc.row_pages(first))
    victims = self.alloc.preempt_candidates(need, keep=(first,))
    if not victims:
      raise RuntimeError(f"paging: no row to swap out for slot {first} (candidates: {victims}), "
                         f"which needs {need} more pages for {seq_len} + {draft_len} tokens; "
                         f"{self._state()}")
    for slot in victims:
      pages = self.alloc.row_pages(slot)
      kv = jax.device_get(read_pages(pools, self._padded(pages)))
      self.swapped[slot] = (kv, len(pages) * self.page_size)
      self.alloc.release(slot)
      self.swaps += 1
    if not (self.alloc.grow(first, self.tokens_for(seq_len, draft_len)) or
            self.alloc.grow(first, seq_len + draft_len)):
      raise RuntimeError(f"paging: slot {first} cannot grow to {seq_len} + {draft_len} tokens "
                         f"after swapping out slots {victims}; {self._state()}")
    return pools

  def _state(self) -> str:
    """The allocator's state, for an internal error."""
    rows = {r: len(self.alloc.row_pages(r)) for r in self.alloc.rows}
    return (f"{self.alloc.free_pages} of {self.alloc.num_pages} pages free, pages held by slot "
            f"(oldest admission first) {rows}, swapped out {sorted(self.swapped)}")

  def _padded(self, pages) -> jax.Array:
    """A row's pages as global ids, padded to a page table row."""
    return _padded([p + self.offset for p in pages], self.max_pages)


class SlotPages:
  """Which pages each slot of the engine holds: one `ReplicaPages` per data-parallel replica,
  which owns the slots [r * slots_per_replica, (r + 1) * slots_per_replica) and pages
  [r * pages_per_replica, (r + 1) * pages_per_replica) of the pool, so a row's pages lie on the
  devices that step it. One device: a single replica holding every slot and page."""

  def __init__(self, num_pages: int, page_size: int, cache_size: int, page_ahead: int,
               slots: int = 1, replicas: int = 1):
    """`num_pages`: per replica."""
    if replicas < 1 or slots % replicas:
      raise ValueError(f"{slots} slots do not split over {replicas} data-parallel replicas")
    self.replicas = [ReplicaPages(num_pages, page_size, cache_size, page_ahead, r * num_pages)
                     for r in range(replicas)]
    self.slots_per_replica = max(slots // replicas, 1)
    self.page_size, self.cache_size = page_size, cache_size
    self.max_pages = self.replicas[0].max_pages

  # -- counters -----------------------------------------------------------------------------------

  @property
  def num_pages(self) -> int:
    """Pages of the whole pool (every replica's)."""
    return sum(r.alloc.num_pages for r in self.replicas)

  @property
  def pages_in_use(self) -> int:
    return sum(r.alloc.pages_in_use for r in self.replicas)

  @property
  def paused(self) -> int:
    return sum(r.paused for r in self.replicas)

  @property
  def swaps(self) -> int:
    return sum(r.swaps for r in self.replicas)

  def replica_of(self, slot: int) -> int:
    return min(int(slot) // self.slots_per_replica, len(self.replicas) - 1)

  def _of(self, slot) -> ReplicaPages:
    return self.replicas[self.replica_of(slot)]

  def __contains__(self, slot) -> bool:
    return int(slot) in self._of(slot).alloc

  def row_pages(self, slot: int) -> tuple[int, ...]:
    """The pages of the row in `slot`, as the pool's (global) ids."""
    rep = self._of(slot)
    return tuple(p + rep.offset for p in rep.alloc.row_pages(int(slot)))

  def refcount(self, page: int) -> int:
    """How many rows hold the pool's page `page` (0: free)."""
    rep = self.replicas[int(page) // self.replicas[0].alloc.num_pages]
    return rep.alloc.refcount(int(page) - rep.offset)

  # -- the engine's calls -------------------------------------------------------------------------

  def admit(self, slots, seq_lens, draft_len: int, prompt_len: int = 0) -> bool:
    """`ReplicaPages.admit` on the replica of `slots` (which must all be on one: a group's
    samples share their prompt pages)."""
    owners = {self.replica_of(s) for s in slots}
    if len(owners) != 1:
      raise ValueError(f"slots {list(slots)} lie on replicas {sorted(owners)}: the rows admitted "
                       f"together must be on one replica")
    return self.replicas[owners.pop()].admit(slots, seq_lens, draft_len, prompt_len)

  def admit_row(self, slot: int, seq_len: int, draft_len: int, share_from: int | None = None,
                prefix: int = 0) -> bool:
    """`ReplicaPages.admit_row` on the replica of `slot` (`share_from` must be on it too)."""
    if share_from is not None and self.replica_of(share_from) != self.replica_of(slot):
      raise ValueError(f"slot {slot} and share_from {share_from} lie on different replicas")
    return self._of(slot).admit_row(slot, seq_len, draft_len, share_from, prefix)

  def table(self, homes, row_ids) -> np.ndarray:
    """int32[len(homes), max_pages]: the (global) pages of each bucket row's home slot; NO_PAGE
    for padding and for rows that hold none (finished, free or swapped out)."""
    table = np.full((len(homes), self.max_pages), NO_PAGE, np.int32)
    homes, row_ids = np.asarray(homes), np.asarray(row_ids)
    for r, rep in enumerate(self.replicas):
      mine = np.flatnonzero([self.replica_of(h) == r for h in homes])
      if len(mine):
        table[mine] = rep.table(homes[mine], row_ids[mine])
    return table

  def visit(self, pools: tuple[PagedKV, ...], live, seq_lens, homes,
            draft_len: int) -> tuple[PagedKV, ...]:
    """`ReplicaPages.visit` on every replica."""
    for rep in self.replicas:
      pools = rep.visit(pools, live, seq_lens, homes, draft_len)
    return pools

  def compile_swaps(self, pools: tuple[PagedKV, ...]) -> None:
    """Compile swapping's copies before the rollout (the write, which takes the pools' buffers,
    compiled, not run)."""
    none = self.replicas[0]._padded([])
    buffers = tuple((p.k, p.v) for p in pools)
    write_pages_program.lower(buffers, none,
                              jax.device_get(read_pages_program(buffers, none))).compile()
