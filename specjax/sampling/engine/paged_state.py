"""The device side of the engine's paged KV memory: the page pools of an `EngineState` (the
target's, and a paged drafter cache's, which shares its page table), the programs that move rows
onto pages (a prefill's dense prompt caches; the queue's admissions) and copy pages to and from
host memory (swapping), and how large a pool a budget in GiB holds.

Which pages each row holds is decided on the host (`slot_pages.SlotPages`, over
`specjax.sampling.page_allocator.PageAllocator`); the pool itself and the attention over it are
the models layer's (`specjax.models.paged`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.errors import UserError
from specjax.models.cache import KVCache
from specjax.models.paged import PagedKV, write
from specjax.sampling.segment import EngineState, is_cache, map_rows


def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                   dtype) -> int:
  """Keys and values of `page_size` tokens over every layer."""
  return 2 * num_layers * num_kv_heads * page_size * head_dim * jnp.dtype(dtype).itemsize


def pool_size(kv_cache_gb: float, page_bytes: float, page_size: int, cache_size: int,
              field: str = "EngineConfig.paging.kv_cache_gb",
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
  """`batch.admit` for a paged state: the prefilled rows `new` (dense prompt caches) into
  their pages and their free `slots` as the caller's `row_ids` (-1: padding, dropped)."""
  new = to_paged(new, *pools(state)[:1], table, *pools(state)[1:])
  idx = jnp.where(row_ids >= 0, slots, state.done.shape[0])
  new = new.replace(row_ids=row_ids, slots=slots)
  return map_rows(lambda o, s: o.at[idx].set(s, mode="drop"), state, new)


@jax.jit
def read_pages_program(buffers: tuple, pages: jax.Array) -> tuple:
  def one(k, v):
    idx = jnp.clip(pages, 0, k.shape[2] - 1)
    return k[:, :, idx], v[:, :, idx]
  return tuple(one(k, v) for k, v in buffers)


@functools.partial(jax.jit, donate_argnames=("buffers",))
def write_pages_program(buffers: tuple, pages: jax.Array, values: tuple) -> tuple:
  def one(k, v, new_k, new_v):
    idx = jnp.where((pages >= 0) & (pages < k.shape[2]), pages, k.shape[2])
    return k.at[:, :, idx].set(new_k, mode="drop"), v.at[:, :, idx].set(new_v, mode="drop")
  return tuple(one(k, v, *new) for (k, v), new in zip(buffers, values))


def read_pages(pools: tuple[PagedKV, ...], pages: jax.Array) -> tuple:
  """((k, v) of `pages` in every pool). One program whatever the pools' page tables (a
  compacted bucket's are smaller): only the page buffers go in."""
  return read_pages_program(tuple((p.k, p.v) for p in pools), pages)


def write_pages(pools: tuple[PagedKV, ...], pages: jax.Array, kv: tuple) -> tuple[PagedKV, ...]:
  """`read_pages`' values back into `pages` of every pool. Takes the pools' page buffers (the
  returned pools hold them, written in place): the caller drops `pools`."""
  new = write_pages_program(tuple((p.k, p.v) for p in pools), pages, kv)
  return tuple(p.replace(k=k, v=v) for p, (k, v) in zip(pools, new))
