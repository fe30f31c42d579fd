"""Paged KV memory: a pool of fixed-size KV pages per layer and a page table per row.

A row holds pages for the tokens it has instead of a dense max-length buffer. Token position p of
row b lives in page `page_table[b, p // page_size]`, slot `p % page_size`. Which page goes to which
row is decided on the host (`specjax.sampling.page_allocator.PageAllocator`); this module is the
device side: the pool, its sharding, and writes through the page table. Attention over a row's
pages (a pure-JAX reference, a chunked path and a Pallas kernel) is
`specjax.models.paged_attention`.

Layout: keys and values are separate pools, each [L, Hkv, num_pages, page_size, Dh] (one leading
layer axis, so a scan over layers carries one array and indexes it with `layer`). Head-major pages
make the tile a (row, kv head) program reads per page, [page_size, Dh], one contiguous block: the
layout of JAX's Pallas GPU paged-attention kernel. (vLLM's and sglang-jax's TPU ragged kernels
keep pages token-major, [num_pages, page_size, Hkv (K and V interleaved), Dh], which suits a TPU
DMA of whole pages; a Triton program per kv head wants its head's page contiguous.) A write puts
Hkv short rows per token, and writes are few (T tokens per row per step) next to the reads.

Sentinel: page-table entries outside [0, num_pages) (`NO_PAGE` = -1 by convention) name no page:
writes through them are dropped and attention treats their positions as empty, so padding rows
(all sentinels) cost nothing and never touch another row's memory.

On a mesh (`PagedKV.mesh`) the pool's pages are split over the data-parallel (batch) axes as the
rows are, and kv heads over the tensor axis as the layers that produce them: replica r holds
pages [r * P, (r + 1) * P) of the pool's global page ids, and its rows hold only those (the host
allocator sees to it). A step's writes and attention then run per replica (`jax.shard_map`) on
its own rows and pages, with the page ids made local, so no device reads another's KV memory.
Everything else that indexes the pool (a prefill's copy into pages, swapping) uses global ids
under the compiler's partitioning.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from specjax.models.paged_attention import NO_PAGE, paged_attention, stacked_pools

__all__ = ["NO_PAGE", "POOL_AXES", "PagedKV", "PagedLayer", "copy_pages", "keep_path", "pool_spec",
           "write"]

# logical axes of a pool [L, Hkv, num_pages, page_size, Dh] (`specjax.sharding.rules`): pages on
# the batch axes, as the rows that hold them
POOL_AXES = ("layers", "kv_heads", "batch", None, None)


@struct.dataclass
class PagedKV:
  k: jax.Array  # [L, Hkv, num_pages, page_size, Dh]
  v: jax.Array  # [L, Hkv, num_pages, page_size, Dh]
  page_table: jax.Array  # int32[B, max_pages_per_row]; NO_PAGE where a row has no page
  lengths: jax.Array  # int32[B] committed tokens per row
  # positions attention reads (static; 0 = the whole table), as `KVCache.window`
  window: int = struct.field(pytree_node=False, default=0)
  # the mesh the pool is split over (static; None: one device): see the module docstring
  mesh: jax.sharding.Mesh | None = struct.field(pytree_node=False, default=None)
  # the Pallas kernel's launch settings (static; 0: its defaults), `paged_attention_pallas`
  kernel_pages: int = struct.field(pytree_node=False, default=0)
  kernel_warps: int = struct.field(pytree_node=False, default=0)
  kernel_splits: int = struct.field(pytree_node=False, default=0)

  @classmethod
  def create(cls, num_layers: int, num_pages: int, page_size: int, batch: int,
             max_pages_per_row: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None, kernel_pages: int = 0,
             kernel_warps: int = 0, kernel_splits: int = 0) -> PagedKV:
    """An empty pool. With `mesh`, `num_pages` is the whole pool's (the data-parallel size
    times each replica's), made on the devices in place. `kernel_pages`, `kernel_warps`,
    `kernel_splits`: the GPU kernel's launch settings (0: its defaults)."""
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)
    if mesh is not None:
      pool_spec(mesh, shape, batch)  # (checks that pages and rows split alike)
      zeros = jax.jit(zeros, out_shardings=NamedSharding(mesh, pool_spec(mesh, shape)))
    return cls(k=zeros(), v=zeros(),
               page_table=jnp.full((batch, max_pages_per_row), NO_PAGE, jnp.int32),
               lengths=jnp.zeros((batch,), jnp.int32), mesh=mesh, kernel_pages=kernel_pages,
               kernel_warps=kernel_warps, kernel_splits=kernel_splits)

  @property
  def num_layers(self) -> int:
    return self.k.shape[0]

  @property
  def num_pages(self) -> int:
    return self.k.shape[2]

  @property
  def page_size(self) -> int:
    return self.k.shape[3]

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  @property
  def max_pages_per_row(self) -> int:
    return self.page_table.shape[1]

  @property
  def size(self) -> int:
    """Positions a row's page table can address."""
    return self.max_pages_per_row * self.page_size

  @property
  def visible(self) -> int:
    return min(self.window, self.size) if self.window else self.size

  def with_window(self, window: int) -> PagedKV:
    return self.replace(window=int(window))

  def capacity(self) -> jax.Array:
    """int32[B]: positions each row's pages hold (pages are taken from the table's front)."""
    held = (self.page_table >= 0) & (self.page_table < self.num_pages)
    return jnp.sum(held, axis=1, dtype=jnp.int32) * self.page_size

  def layer_view(self, layer: int, tree_mask: jax.Array | None = None) -> PagedLayer:
    """`layer` as a decoder layer's attention takes it; `tree_mask` bool [B, T, T]: the T new
    tokens are a draft tree's nodes (`paged_attention`)."""
    return PagedLayer(pool=self, layer=layer, tree_mask=tree_mask)

  def advance(self, n: jax.Array) -> PagedKV:
    """Commit `n[b]` freshly written entries of row b."""
    return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

  def with_lengths(self, lengths: jax.Array) -> PagedKV:
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

  def with_page_table(self, page_table: jax.Array) -> PagedKV:
    return self.replace(page_table=jnp.asarray(page_table, jnp.int32))

  def keep_path(self, path: jax.Array, nodes: int | None = None) -> PagedKV:
    """After a forward over a draft tree (node t written at lengths + t): the entries of the
    nodes on `path` int32[B, P] moved to lengths + 0 .. P - 1 in every layer, through the page
    table, where the next steps read them as a chain (`KVCache.keep_path`; `nodes` is not needed
    here: the positions map to pages one by one)."""
    path = jnp.asarray(path, jnp.int32)
    if self.mesh is None:
      pk, pv = keep_path(self.k, self.v, self.page_table, self.lengths, path)
    else:
      pk, pv = _keep_path_on_replicas(self.mesh, self.k, self.v, self.page_table, self.lengths,
                                      path)
    return self.replace(k=pk, v=pv)

  def write(self, layer, k: jax.Array, v: jax.Array, start: jax.Array | None = None) -> PagedKV:
    """Write k/v [B, T, Hkv, Dh] of `layer` at `start` (default: the committed lengths)."""
    start = self.lengths if start is None else start
    if self.mesh is None:
      pk, pv = write(self.k, self.v, k, v, self.page_table, start, layer=layer)
    else:
      pk, pv = _write_on_replicas(self.mesh, self.k, self.v, k, v, self.page_table, start,
                                  jnp.asarray(layer, jnp.int32))
    return self.replace(k=pk, v=pv)

  def attention(self, layer, q: jax.Array, start: jax.Array | None = None,
                tree_mask: jax.Array | None = None, **kwargs) -> jax.Array:
    """`paged_attention` of queries q [B, T, H, Dh] at `start` (default: the committed lengths)
    over `layer`, after their own keys were written: each row sees start + T keys (with
    `tree_mask` [B, T, T], of the new ones only those the mask names)."""
    start = self.lengths if start is None else start
    kwargs = dict(pages_per_block=self.kernel_pages or None,
                  num_warps=self.kernel_warps or None, num_splits=self.kernel_splits or None,
                  **kwargs)
    if self.mesh is None:
      return paged_attention(q, self.k, self.v, self.page_table, start + q.shape[1], start,
                             layer=layer, tree_mask=tree_mask, **kwargs)
    return _attention_on_replicas(self.mesh, q, self.k, self.v, self.page_table,
                                  start + q.shape[1], start, jnp.asarray(layer, jnp.int32),
                                  tree_mask, **kwargs)


@dataclasses.dataclass(frozen=True)
class PagedLayer:
  """One layer of a `PagedKV`, what a decoder layer's attention receives in place of a dense
  layer's (k, v) buffers: it writes its new keys and attends through the pool, and hands the
  updated pool on."""

  pool: PagedKV
  layer: int
  # bool [B, T, T] (None: a chain): the T new tokens are a draft tree's nodes, query i sees new
  # key j iff tree_mask[b, i, j] (`specjax.models.tree`)
  tree_mask: jax.Array | None = None

  def write_and_attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
                       start: jax.Array) -> tuple[jax.Array, PagedKV]:
    """Write k/v [B, T, Hkv, Dh] at `start`, then attend q [B, T, H, Dh] over each row's keys
    up to its own position (a tree: its ancestors among the new keys). Returns (attended
    [B, T, H, Dh], the updated pool)."""
    pool = self.pool.write(self.layer, k, v, start)
    visible = self.pool.visible
    out = pool.attention(self.layer, q, start, tree_mask=self.tree_mask,
                         max_len=None if visible >= pool.size else visible)
    return out, pool


# -- on a mesh ----------------------------------------------------------------------------------

def pool_spec(mesh: jax.sharding.Mesh, shape, rows: int | None = None) -> jax.sharding.PartitionSpec:
  """How a pool of `shape` [L, Hkv, P, S, Dh] splits over `mesh` (`POOL_AXES`). With `rows`:
  ValueError unless a batch of that many rows splits over the same axes as the pages (a
  replica's rows and its pages on the same devices)."""
  from specjax.sharding.rules import logical_to_spec  # (the mesh layer; imported on use)
  spec = logical_to_spec(POOL_AXES, shape=shape, mesh=mesh, where="PagedKV pool")
  if rows is not None:
    row_axes = logical_to_spec(("batch",), shape=(rows,), mesh=mesh)[0]
    if row_axes != spec[2]:
      raise ValueError(f"PagedKV on a mesh: {shape[2]} pages split over {spec[2]} but {rows} "
                       f"rows over {row_axes}; give every data-parallel replica the same number "
                       f"of pages and rows")
  return spec


def _replica_specs(mesh, pool_shape, rows):
  """(pool, per-row, per-head, page-axis) specs of one per-replica call."""
  from jax.sharding import PartitionSpec as P
  pool = pool_spec(mesh, pool_shape, rows)
  return pool, P(pool[2]), pool[1], pool[2]


def _local_ids(table: jax.Array, pages_here: int, axes) -> jax.Array:
  """A replica's global page ids -> its own shard's (`pages_here` pages); ids of no page, or of
  another replica's, fall outside [0, pages_here) and so name no page."""
  if axes is None:
    return table
  return table - jax.lax.axis_index(axes) * pages_here


def _write_on_replicas(mesh, pool_k, pool_v, k, v, page_table, start, layer):
  from jax.sharding import PartitionSpec as P
  pool, row, heads, axes = _replica_specs(mesh, pool_k.shape, page_table.shape[0])
  new = P(row[0], None, heads, None)

  def local(pk, pv, k, v, table, start, layer):
    return write(pk, pv, k, v, _local_ids(table, pk.shape[2], axes), start, layer=layer)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(pool, pool, new, new, P(row[0], None), row, P()),
                       out_specs=(pool, pool), check_vma=False)(
      pool_k, pool_v, k, v, page_table, jnp.asarray(start, jnp.int32), layer)


def _attention_on_replicas(mesh, q, pool_k, pool_v, page_table, lengths, start, layer,
                           tree_mask=None, **kwargs):
  from jax.sharding import PartitionSpec as P
  pool, row, heads, axes = _replica_specs(mesh, pool_k.shape, page_table.shape[0])
  queries = P(row[0], None, heads, None)
  tree = () if tree_mask is None else (jnp.asarray(tree_mask, bool),)  # per row, as the rows

  def local(q, pk, pv, table, lengths, start, layer, *tree):
    return paged_attention(q, pk, pv, _local_ids(table, pk.shape[2], axes), lengths, start,
                           layer=layer, tree_mask=tree[0] if tree else None, **kwargs)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(queries, pool, pool, P(row[0], None), row, row, P())
                       + (P(row[0], None, None),) * len(tree),
                       out_specs=queries, check_vma=False)(
      q, pool_k, pool_v, page_table, jnp.asarray(lengths, jnp.int32),
      jnp.asarray(start, jnp.int32), layer, *tree)


def _keep_path_on_replicas(mesh, pool_k, pool_v, page_table, start, path):
  from jax.sharding import PartitionSpec as P
  pool, row, _, axes = _replica_specs(mesh, pool_k.shape, page_table.shape[0])

  def local(pk, pv, table, start, path):
    return keep_path(pk, pv, _local_ids(table, pk.shape[2], axes), start, path)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(pool, pool, P(row[0], None), row, P(row[0], None)),
                       out_specs=(pool, pool), check_vma=False)(
      pool_k, pool_v, page_table, jnp.asarray(start, jnp.int32), path)


def _pages_at(page_table: jax.Array, positions: jax.Array, page_size: int,
              num_pages: int) -> jax.Array:
  """The page of each token position (int[B, T]); `num_pages` (out of range) where the row has
  no page there: a sentinel entry, a negative position or one past the table."""
  width = page_table.shape[1]
  idx = positions // page_size
  page = jnp.take_along_axis(page_table, jnp.clip(idx, 0, width - 1), axis=1)
  ok = (positions >= 0) & (idx < width) & (page >= 0) & (page < num_pages)
  return jnp.where(ok, page, num_pages)


def write(pool_k: jax.Array, pool_v: jax.Array, k: jax.Array, v: jax.Array,
          page_table: jax.Array, start: jax.Array, layer=None) -> tuple[jax.Array, jax.Array]:
  """Write k/v [B, T, Hkv, Dh] at token positions start[b] .. start[b] + T - 1 of each row b,
  through its page table. Pools are [Hkv, P, S, Dh], or [L, Hkv, P, S, Dh] with `layer` (an int
  or a traced scalar). Positions without a page are dropped. One scatter per pool, in place under
  jit when the pools are donated or loop-carried."""
  stacked = layer is not None
  pk, pv, layer = stacked_pools(pool_k, pool_v, layer)
  _, hkv, num_pages, page_size, _ = pk.shape
  t = k.shape[1]
  pos = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  page = _pages_at(page_table, pos, page_size, num_pages)[:, :, None]  # [B, T, 1]
  slot = (pos % page_size)[:, :, None]
  heads = jnp.arange(hkv)[None, None, :]  # all index arrays broadcast to [B, T, Hkv]
  idx = (layer, heads, page, slot)
  pk = pk.at[idx].set(k.astype(pk.dtype), mode="drop")
  pv = pv.at[idx].set(v.astype(pv.dtype), mode="drop")
  return (pk, pv) if stacked else (pk[0], pv[0])


def keep_path(pool_k: jax.Array, pool_v: jax.Array, page_table: jax.Array, start: jax.Array,
              path: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Every layer's k/v at position start[b] + path[b, j] of row b moved to start[b] + j, for the
  P = path.shape[1] positions j, through each row's page table: a draft tree's accepted path
  (nodes at start + node index) made a chain. Pools [L, Hkv, P, S, Dh]. Every entry is read
  before any is written, so a path that reads where another of its entries lands is moved
  whole; entries already in place (path[b, j] == j, the accepted chain) are not written, and
  positions without a page read as zeros and write nowhere."""
  _, _, num_pages, page_size, _ = pool_k.shape
  start = jnp.asarray(start, jnp.int32)[:, None]
  here = jnp.arange(path.shape[1], dtype=jnp.int32)[None, :]
  src, dst = start + path, start + here  # [B, P]
  src_page = _pages_at(page_table, src, page_size, num_pages)
  dst_page = jnp.where(path == here, num_pages, _pages_at(page_table, dst, page_size, num_pages))

  def move(pool):
    moved = pool.at[:, :, src_page, src % page_size].get(mode="fill", fill_value=0)
    return pool.at[:, :, dst_page, dst % page_size].set(moved, mode="drop")

  return move(pool_k), move(pool_v)


def copy_pages(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
  """pool[..., dst[i], :, :] = pool[..., src[i], :, :] for every layer and kv head (the private
  copies of a shared prefix's partly filled last page). Pairs whose dst is out of range (padding
  to a static count) are dropped. Pool [..., P, S, Dh]."""
  num_pages = pool.shape[-3]
  src = jnp.clip(jnp.asarray(src, jnp.int32), 0, num_pages - 1)
  dst = jnp.asarray(dst, jnp.int32)
  dst = jnp.where((dst >= 0) & (dst < num_pages), dst, num_pages)
  # one advanced index in place: a gather and a scatter of the named pages, no pool transpose
  return pool.at[..., dst, :, :].set(pool[..., src, :, :], mode="drop")
