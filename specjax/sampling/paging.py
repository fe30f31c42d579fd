"""The engine's paged KV memory: a pool of target KV pages (`specjax.models.paged`) shared by the
slots, handed out by a host `PageAllocator` as rows grow, so a slot holds memory for the tokens
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

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import UserError
from specjax.models.cache import KVCache
from specjax.models.paged import NO_PAGE, PagedKV, write
from specjax.sampling.pages import PADDING_ROW, PageAllocator
from specjax.sampling.segment import EngineState, is_cache, map_rows


def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                   dtype) -> int:
  """Keys and values of `page_size` tokens over every layer."""
  return 2 * num_layers * num_kv_heads * page_size * head_dim * jnp.dtype(dtype).itemsize


def pool_size(kv_cache_gb: float, page_bytes: float, page_size: int, cache_size: int,
              field: str = "EngineConfig.kv_cache_gb",
              positions: str = "prompt + max_new_tokens + K + 1") -> int:
  """Pages in a pool of `kv_cache_gb` GiB; a UserError naming `field` when one row of
  `cache_size` positions (`positions` says of what) cannot fit in it."""
  num_pages = int(kv_cache_gb * 2**30 // page_bytes)
  need = -(-cache_size // page_size)
  if num_pages < need:
    raise UserError(
        f"{field}: {kv_cache_gb:g} GiB holds {num_pages} pages of {page_size} tokens "
        f"({page_bytes / 2**20:.3f} MiB each), but one row needs {need} pages ({cache_size} "
        f"positions: {positions}); raise it to at least {need * page_bytes / 2**30:.4g}")
  return num_pages


def kv_cache_gb_for(fraction: float, device=None, field: str = "kv_cache_fraction") -> float:
  """GiB of KV memory that are `fraction` of what `device` (default: the first) has free now
  (its allocator's limit less the bytes in use: weights, optimizer state and everything else
  already placed). ValueError naming `field` where the device reports no memory (CPU)."""
  device = device or jax.devices()[0]
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    raise ValueError(f"{field}={fraction}: device {device} reports no memory limit "
                     f"(memory_stats), so no share of it can be taken; set the KV memory in GiB "
                     f"(kv_cache_gb) instead")
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  return fraction * max(free, 0) / 2**30


# -- device side ----------------------------------------------------------------------------------

def pools(state: EngineState) -> tuple[PagedKV, ...]:
  """The state's page pools: the target's, then the drafter's when its cache is paged too (it
  shares the target's page table: a page id names a target page and a drafter page)."""
  return tuple(x for x in jax.tree.leaves(state, is_leaf=is_cache) if isinstance(x, PagedKV))


def with_pools(state: EngineState, new: tuple[PagedKV, ...]) -> EngineState:
  """`state` with its pools (as `pools` lists them) replaced."""
  leaves, tree = jax.tree.flatten(state, is_leaf=is_cache)
  new = iter(new)
  return jax.tree.unflatten(tree, [next(new) if isinstance(x, PagedKV) else x for x in leaves])


def without_buffers(state: EngineState) -> EngineState:
  """`state` with its pools' page buffers (k, v) replaced by empty arrays: what a program that
  moves rows between a full-size state and a bucket (compaction's gather, its write-back) takes
  of a paged state, so that it never copies the pool (`with_buffers` puts them back)."""
  empty = lambda x: jnp.zeros((0,), x.dtype)
  return with_pools(state, tuple(p.replace(k=empty(p.k), v=empty(p.v)) for p in pools(state)))


def with_buffers(state: EngineState, source: EngineState) -> EngineState:
  """`state` with the page buffers of `source`'s pools: the same arrays, not a copy, so a paged
  run holds its pool once whichever bucket steps. A program that takes (donates) them, as a
  segment does, leaves every other state that shares them without: such a state is read again
  only through `without_buffers`, or with the live buffers put back. A no-op without pools."""
  return with_pools(state, tuple(p.replace(k=s.k, v=s.v)
                                 for p, s in zip(pools(state), pools(source))))


def drafter_cache(drafter_state) -> KVCache | PagedKV:
  """The one KV cache in a drafter's state whose cache pages (`Drafter.page_layout`)."""
  [cache] = [x for x in jax.tree.leaves(drafter_state, is_leaf=is_cache) if is_cache(x)]
  return cache


def _into_pages(dense: KVCache, pool: PagedKV, table: jax.Array) -> PagedKV:
  """Each row's cached positions of a dense cache written into the pages of its row of
  `table` (int32[b, max_pages]; NO_PAGE rows write nothing): the rows on `pool`."""
  for layer in range(len(dense.k)):
    k = jnp.transpose(dense.k[layer], (0, 3, 1, 2))  # [b, Hkv, Dh, S] -> [b, S, Hkv, Dh]
    v = jnp.transpose(dense.v[layer], (0, 2, 1, 3))  # [b, Hkv, S, Dh] -> [b, S, Hkv, Dh]
    pk, pv = write(pool.k, pool.v, k, v, table, jnp.zeros_like(dense.lengths), layer=layer)
    pool = pool.replace(k=pk, v=pv)
  return pool.replace(page_table=jnp.asarray(table, jnp.int32), lengths=dense.lengths)


@jax.jit
def to_paged(state: EngineState, pool: PagedKV, table: jax.Array,
             draft_pool: PagedKV | None = None) -> EngineState:
  """A prefilled state with dense caches -> the same rows on `pool` (and the drafter's cache on
  `draft_pool`, through the same table)."""
  state = state.replace(cache=_into_pages(state.cache, pool, table))
  if draft_pool is not None:
    state = state.replace(drafter_state=jax.tree.map(
        lambda x: _into_pages(x, draft_pool, table) if isinstance(x, KVCache) else x,
        state.drafter_state, is_leaf=is_cache))
  return state


@functools.partial(jax.jit, donate_argnames=("pool", "draft_pool"))
def start_paged(state: EngineState, pool: PagedKV, table: jax.Array, admitted: jax.Array,
                draft_pool: PagedKV | None = None) -> EngineState:
  """The engine's first prefilled rows on `pool` (and `draft_pool`); rows not `admitted` (no
  pages for them yet) become free slots, to be admitted again later. Takes the pools (their
  buffers become the state's: the pool is never held twice)."""
  state = to_paged(state, pool, table, draft_pool)
  return state.replace(done=state.done | ~admitted,
                       row_ids=jnp.where(admitted, state.row_ids, -1))


@functools.partial(jax.jit, donate_argnames=("state",))
def admit_paged(state: EngineState, new: EngineState, slots: jax.Array, row_ids: jax.Array,
                table: jax.Array) -> EngineState:
  """`engine._admit` for a paged state: the prefilled rows `new` (dense prompt caches) into
  their pages and their free `slots` as the caller's `row_ids` (-1: padding, dropped)."""
  new = to_paged(new, *pools(state)[:1], table, *pools(state)[1:])
  idx = jnp.where(row_ids >= 0, slots, state.done.shape[0])
  new = new.replace(row_ids=row_ids, slots=slots)
  return map_rows(lambda o, s: o.at[idx].set(s, mode="drop"), state, new)


@jax.jit
def _read_pages(buffers: tuple, pages: jax.Array) -> tuple:
  def one(k, v):
    idx = jnp.clip(pages, 0, k.shape[2] - 1)
    return k[:, :, idx], v[:, :, idx]
  return tuple(one(k, v) for k, v in buffers)


@functools.partial(jax.jit, donate_argnames=("buffers",))
def _write_pages(buffers: tuple, pages: jax.Array, values: tuple) -> tuple:
  def one(k, v, new_k, new_v):
    idx = jnp.where((pages >= 0) & (pages < k.shape[2]), pages, k.shape[2])
    return k.at[:, :, idx].set(new_k, mode="drop"), v.at[:, :, idx].set(new_v, mode="drop")
  return tuple(one(k, v, *new) for (k, v), new in zip(buffers, values))


def read_pages(pools: tuple[PagedKV, ...], pages: jax.Array) -> tuple:
  """((k, v) of `pages` in every pool). One program whatever the pools' page tables (a
  compacted bucket's are smaller): only the page buffers go in."""
  return _read_pages(tuple((p.k, p.v) for p in pools), pages)


def write_pages(pools: tuple[PagedKV, ...], pages: jax.Array, kv: tuple) -> tuple[PagedKV, ...]:
  """`read_pages`' values back into `pages` of every pool. Takes the pools' page buffers (the
  returned pools hold them, written in place): the caller drops `pools`."""
  new = _write_pages(tuple((p.k, p.v) for p in pools), pages, kv)
  return tuple(p.replace(k=k, v=v) for p, (k, v) in zip(pools, new))


def _padded(pages, width: int) -> jax.Array:
  out = np.full((width,), NO_PAGE, np.int32)
  out[:len(pages)] = pages
  return jnp.asarray(out)


# -- host side ------------------------------------------------------------------------------------

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
    (up to seq_len - 1 + K) and `page_ahead` more, within the cache size."""
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
    _write_pages.lower(buffers, none, jax.device_get(_read_pages(buffers, none))).compile()
