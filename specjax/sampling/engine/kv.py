"""The engine's KV manager: where each slot's keys and values live, and what admitting a row or
visiting the rows between segments does to them. `DenseKV`: a cache of the longest possible row
per slot, nothing to manage. `PagedKV` memory (`EngineConfig.paging.kv_cache_gb` > 0): a pool of
pages (`paged_state`) handed out by the host (`slot_pages.SlotPages`) as rows grow, placed on the
data-parallel replica that steps the row, swapped out to host memory when rows cannot grow.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.paged import PagedKV
from specjax.sampling.buckets import data_parallel_size
from specjax.sampling.engine import batch as batch_programs
from specjax.sampling.engine import paged_state
from specjax.sampling.engine.batch import Summary
from specjax.sampling.engine.programs import Programs
from specjax.sampling.engine.slot_pages import SlotPages
from specjax.sampling.segment import EngineState, with_page_table
from specjax.sharding.rules import logical_to_spec


class DenseKV:
  """Dense caches: every slot holds the longest possible row; rows are placed in any free slot."""

  paged = False
  pages_in_use = paused = swaps = 0

  def start(self, state: EngineState, group: int):
    """(state, rows of the first slots that found no memory: none)."""
    return state, np.zeros((0,), np.int64)

  def visit(self, state: EngineState, summary: Summary) -> EngineState:
    return state

  def place(self, prefill: int, i: int, row: int, free: list[int]) -> int | None:
    """A free slot for pending row `i` of the queue's `prefill`-th prefill (the caller's `row`)."""
    return free[0]

  def admit(self, state: EngineState, new: EngineState, into: np.ndarray,
            row_ids: np.ndarray) -> EngineState:
    """Prefilled rows `new` into slots `into` as the caller's `row_ids` (takes `state`)."""
    return batch_programs.admit(state, new, jnp.asarray(into), jnp.asarray(row_ids))

  def compile_admission(self, state: EngineState, new: EngineState, rows: int):
    probe = jnp.arange(rows, dtype=jnp.int32)
    return batch_programs.admit.lower(state, new, probe, probe).compile()

  def compile_jobs(self, batch) -> tuple:
    return ()


class PagedKVManager:
  """The pool of a paged run (`EngineConfig.paging.kv_cache_gb` GiB of it on each device) and which
  slot holds which pages. A GRPO group's samples share their prompt's pages while a sibling on
  the same replica still holds them."""

  paged = True

  def __init__(self, programs: Programs, prompt_lengths: np.ndarray):
    self.programs, self.engine = programs, programs.engine
    self.prompt_lengths = prompt_lengths  # the caller's rows' (host)
    self.pages: SlotPages | None = None
    self.owner: dict[int, tuple] = {}  # slot -> (prefill, group) of the row admitted there
    self.holders: dict[tuple, list[int]] = {}  # (prefill, group) -> slots admitted for it
    self.group = 1

  # -- the pool -------------------------------------------------------------------------------

  def pool(self, slots: int = 1, replicas: int = 1) -> SlotPages:
    """An empty pool for the target's KV, and a paged drafter cache's (host-side accounting):
    `EngineConfig.paging.kv_cache_gb` of it on each device, so on a mesh each data-parallel replica
    holds that many GiB of pages times the devices its kv heads split over. A page is a target
    page and, for a drafter whose cache is paged (`Drafter.page_layout`), a drafter page."""
    p = self.programs
    cfg = nnx.merge(p.graphdef, p.params).cfg
    page_size = self.engine.paging.page_size
    layouts = [(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype)]
    if self.pages_drafter():
      layouts.append(p.drafter.page_layout(p.drafter_params))
    page_bytes = sum(paged_state.bytes_per_page(layers, hkv, dh, page_size, dtype)
                     / self.kv_head_split(hkv) for layers, hkv, dh, dtype in layouts)
    num_pages = paged_state.pool_size(self.engine.paging.kv_cache_gb, page_bytes, page_size,
                                      p.cache_size)
    return SlotPages(num_pages, page_size, p.cache_size, self.engine.paging.page_ahead, slots,
                     replicas)

  def kv_head_split(self, num_kv_heads: int) -> int:
    """Devices a page's `num_kv_heads` split over (1 off a mesh)."""
    mesh = self.programs.mesh
    if mesh is None:
      return 1
    spec = logical_to_spec(("kv_heads",), shape=(num_kv_heads,), mesh=mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(mesh.shape[a] for a in axes)

  def pages_drafter(self) -> bool:
    """A paged run keeps the drafter's KV cache on pages too (`Drafter.page_layout`)."""
    p = self.programs
    return p.drafter is not None and p.drafter.page_layout(p.drafter_params) is not None

  def shared_prefix(self, prompt_len: int, group: int) -> int:
    """Positions whose pages a GRPO group's samples share: the prompt's, less its last one when
    a paged drafter writes there a value of each sample's own (EAGLE-3 pairs the prompt's last
    state with the sample's first token); 0 without groups."""
    if group <= 1:
      return 0
    return prompt_len - 1 if self.pages_drafter() else prompt_len

  def first_admission(self, pages: SlotPages, prompt_lengths: np.ndarray,
                      group: int) -> np.ndarray:
    """Whole prompt groups of the first `len(prompt_lengths)` rows (row i in slot i) take pages
    in order while their replica has them: which rows did."""
    admitted = np.zeros(len(prompt_lengths), bool)
    full = set()  # replicas out of pages
    for first in range(0, len(prompt_lengths) - group + 1, group):
      rows = np.arange(first, first + group)
      if pages.replica_of(first) in full:
        continue
      if not pages.admit(rows, prompt_lengths[rows] + 1, self.programs.span_max,
                         self.shared_prefix(int(prompt_lengths[first]), group)):
        full.add(pages.replica_of(first))
        continue
      admitted[rows] = True
    return admitted

  def slots_held(self, group: int) -> int:
    """Slots for a memory budget instead of a batch size: as many as rows the empty pool holds
    at once (a slot beyond them could only hold a row without pages, which does not step); on a
    mesh, what one replica's pages hold of the first rows, on every replica."""
    rows = self.prompt_lengths
    holds = self.first_admission(self.pool(len(rows)), rows, group)
    return max(int(holds.sum()), 1) * data_parallel_size(self.programs.mesh)

  # -- a run ------------------------------------------------------------------------------------

  def start(self, state: EngineState, group: int):
    """The pool for a paged run and its first rows: whole prompt groups take pages in order
    while the pool has them. Returns (state, rows that found none: back to the queue)."""
    mesh, dense = self.programs.mesh, state.cache
    _, hkv, dh, _ = dense.k[0].shape
    slots = state.done.shape[0]
    self.group = group
    self.pages = pages = self.pool(slots, data_parallel_size(mesh))
    admitted = self.first_admission(pages, self.prompt_lengths[:slots], group)
    paging = self.engine.paging
    launch = dict(kernel_pages=paging.kernel_pages, kernel_warps=paging.kernel_warps,
                  kernel_splits=paging.kernel_splits)
    pool = PagedKV.create(len(dense.k), pages.num_pages, pages.page_size, slots,
                          pages.max_pages, hkv, dh, dense.k[0].dtype, mesh=mesh, **launch)
    draft_pool = None
    if self.pages_drafter():
      draft = paged_state.drafter_cache(state.drafter_state)  # (dense, prompt-wide: the prefill's)
      _, d_hkv, d_dh, _ = draft.k[0].shape
      draft_pool = PagedKV.create(len(draft.k), pages.num_pages, pages.page_size, slots,
                                  pages.max_pages, d_hkv, d_dh, draft.k[0].dtype, mesh=mesh,
                                  **launch)
    table = pages.table(np.arange(slots), np.where(admitted, 0, -1))
    state = paged_state.start_paged(state, pool, jnp.asarray(table), jnp.asarray(admitted),
                                    draft_pool)
    return state, np.flatnonzero(~admitted)

  @property
  def pages_in_use(self) -> int:
    return self.pages.pages_in_use

  @property
  def paused(self) -> int:
    return self.pages.paused

  @property
  def swaps(self) -> int:
    return self.pages.swaps

  def visit(self, state: EngineState, summary: Summary) -> EngineState:
    """`SlotPages.visit` between segments, then the state's page table brought up to date."""
    # (summary lengths are 0 for rows that are not live)
    pools = self.pages.visit(paged_state.pools(state), summary.live, summary.seq_lengths,
                             summary.homes, self.programs.span_max)
    state = paged_state.with_pools(state, pools)
    # (from the host table: each pool gets its own buffer, so a segment may donate both)
    return with_page_table(state, self.pages.table(summary.homes, summary.row_ids))

  def place(self, prefill: int, i: int, row: int, free: list[int]) -> int | None:
    """A free slot whose replica gives pending row `i` of the queue's `prefill`-th prefill (the
    caller's `row`) its pages: beside a sibling that holds the group's prompt pages (shared),
    else the replica with the most free slots that has pages. None: no replica has them."""
    pages, key, span = self.pages, (prefill, i // self.group), self.programs.span_max
    seq_len = int(self.prompt_lengths[row]) + 1
    prefix = self.shared_prefix(int(self.prompt_lengths[row]), self.group)
    siblings = [s for s in self.holders.get(key, ())
                if self.owner.get(s) == key and s in pages and s not in free]
    by_replica = {}
    for slot in free:
      by_replica.setdefault(pages.replica_of(slot), []).append(slot)
    if siblings and prefix:
      near = by_replica.get(pages.replica_of(siblings[0]), [])
      if near and pages.admit_row(near[0], seq_len, span, siblings[0], prefix):
        return self._placed(near[0], key)
    for slots in sorted(by_replica.values(), key=len, reverse=True):
      if pages.admit_row(slots[0], seq_len, span):
        return self._placed(slots[0], key)
    return None

  def _placed(self, slot: int, key: tuple) -> int:
    self.owner[slot] = key
    self.holders.setdefault(key, []).append(slot)
    return slot

  def admit(self, state: EngineState, new: EngineState, into: np.ndarray,
            row_ids: np.ndarray) -> EngineState:
    """Prefilled rows `new` onto their pages, in slots `into` (takes `state`)."""
    table = jnp.asarray(self.pages.table(into, row_ids))
    return paged_state.admit_paged(state, new, jnp.asarray(into), jnp.asarray(row_ids), table)

  def compile_admission(self, state: EngineState, new: EngineState, rows: int):
    probe = jnp.arange(rows, dtype=jnp.int32)
    table = jnp.full((rows, self.pages.max_pages), -1, jnp.int32)
    return paged_state.admit_paged.lower(state, new, probe, probe, table).compile()

  def compile_jobs(self, batch) -> tuple:
    """Swapping's page copies, compiled with the run's other programs."""
    return (lambda: self.pages.compile_swaps(paged_state.pools(batch.state)),)


def kv_manager(programs: Programs, prompt_lengths) -> DenseKV | PagedKVManager:
  """The KV manager of a run: paged when `EngineConfig.paging.kv_cache_gb` > 0 (`prompt_lengths`:
  the caller's rows', read to the host once)."""
  if programs.engine.paging.kv_cache_gb <= 0:
    return DenseKV()
  return PagedKVManager(programs, np.asarray(jax.device_get(prompt_lengths)))
