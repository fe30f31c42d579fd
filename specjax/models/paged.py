"""Paged KV memory: a pool of fixed-size KV pages per layer and a page table per row.

A row holds pages for the tokens it has instead of a dense max-length buffer. Token position p of
row b lives in page `page_table[b, p // page_size]`, slot `p % page_size`. Which page goes to which
row is decided on the host (`specjax.sampling.pages.PageAllocator`); this module is the device
side: the pool, writes through the page table, and attention over a row's pages (a pure-JAX
reference, a pure-JAX path that reads only the live pages, a chunk at a time, and a Pallas
kernel).

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
import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding

from specjax.models import cache as cache_lib
from specjax.models.attention import (online_softmax_init, online_softmax_result,
                                      online_softmax_step)

NO_PAGE = -1  # the page-table sentinel (the host allocator uses the same value)
NEG_INF = -1e30
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

  @classmethod
  def create(cls, num_layers: int, num_pages: int, page_size: int, batch: int,
             max_pages_per_row: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None, kernel_pages: int = 0,
             kernel_warps: int = 0) -> PagedKV:
    """An empty pool. With `mesh`, `num_pages` is the whole pool's (the data-parallel size
    times each replica's), made on the devices in place. `kernel_pages`, `kernel_warps`: the
    GPU kernel's launch settings (0: its defaults)."""
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)
    if mesh is not None:
      pool_spec(mesh, shape, batch)  # (checks that pages and rows split alike)
      zeros = jax.jit(zeros, out_shardings=NamedSharding(mesh, pool_spec(mesh, shape)))
    return cls(k=zeros(), v=zeros(),
               page_table=jnp.full((batch, max_pages_per_row), NO_PAGE, jnp.int32),
               lengths=jnp.zeros((batch,), jnp.int32), mesh=mesh, kernel_pages=kernel_pages,
               kernel_warps=kernel_warps)

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

  def layer_view(self, layer: int) -> PagedLayer:
    return PagedLayer(pool=self, layer=layer)

  def advance(self, n: jax.Array) -> PagedKV:
    """Commit `n[b]` freshly written entries of row b."""
    return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

  def with_lengths(self, lengths: jax.Array) -> PagedKV:
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

  def with_page_table(self, page_table: jax.Array) -> PagedKV:
    return self.replace(page_table=jnp.asarray(page_table, jnp.int32))

  def write(self, layer, k: jax.Array, v: jax.Array, start: jax.Array | None = None) -> PagedKV:
    """Write k/v [B, T, Hkv, Dh] of `layer` at `start` (default: the committed lengths)."""
    start = self.lengths if start is None else start
    if self.mesh is None:
      pk, pv = write(self.k, self.v, k, v, self.page_table, start, layer=layer)
    else:
      pk, pv = _write_on_replicas(self.mesh, self.k, self.v, k, v, self.page_table, start,
                                  jnp.asarray(layer, jnp.int32))
    return self.replace(k=pk, v=pv)

  def attention(self, layer, q: jax.Array, start: jax.Array | None = None, **kwargs) -> jax.Array:
    """`paged_attention` of queries q [B, T, H, Dh] at `start` (default: the committed lengths)
    over `layer`, after their own keys were written: each row sees start + T keys."""
    start = self.lengths if start is None else start
    kwargs = dict(pages_per_block=self.kernel_pages or None,
                  num_warps=self.kernel_warps or None, **kwargs)
    if self.mesh is None:
      return paged_attention(q, self.k, self.v, self.page_table, start + q.shape[1], start,
                             layer=layer, **kwargs)
    return _attention_on_replicas(self.mesh, q, self.k, self.v, self.page_table,
                                  start + q.shape[1], start, jnp.asarray(layer, jnp.int32),
                                  **kwargs)


@dataclasses.dataclass(frozen=True)
class PagedLayer:
  """One layer of a `PagedKV`, what a decoder layer's attention receives in place of a dense
  layer's (k, v) buffers: it writes its new keys and attends through the pool, and hands the
  updated pool on."""

  pool: PagedKV
  layer: int

  def write_and_attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
                       start: jax.Array) -> tuple[jax.Array, PagedKV]:
    """Write k/v [B, T, Hkv, Dh] at `start`, then attend q [B, T, H, Dh] over each row's keys
    up to its own position. Returns (attended [B, T, H, Dh], the updated pool)."""
    pool = self.pool.write(self.layer, k, v, start)
    visible = self.pool.visible
    out = pool.attention(self.layer, q, start,
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


def _attention_on_replicas(mesh, q, pool_k, pool_v, page_table, lengths, start, layer, **kwargs):
  from jax.sharding import PartitionSpec as P
  pool, row, heads, axes = _replica_specs(mesh, pool_k.shape, page_table.shape[0])
  queries = P(row[0], None, heads, None)

  def local(q, pk, pv, table, lengths, start, layer):
    return paged_attention(q, pk, pv, _local_ids(table, pk.shape[2], axes), lengths, start,
                           layer=layer, **kwargs)

  return jax.shard_map(local, mesh=mesh,
                       in_specs=(queries, pool, pool, P(row[0], None), row, row, P()),
                       out_specs=queries, check_vma=False)(
      q, pool_k, pool_v, page_table, jnp.asarray(lengths, jnp.int32),
      jnp.asarray(start, jnp.int32), layer)


def _stacked(pool_k, pool_v, layer):
  """Pools as [L, Hkv, P, S, Dh] and a layer index: a single layer's pool is layer 0 of one."""
  if pool_k.shape != pool_v.shape:
    raise ValueError(f"pool_k {pool_k.shape} and pool_v {pool_v.shape} differ")
  if layer is None:
    if pool_k.ndim != 4:
      raise ValueError(f"pool_k: expected [Hkv, num_pages, page_size, Dh] without `layer`, got "
                       f"shape {pool_k.shape}")
    return pool_k[None], pool_v[None], jnp.int32(0)
  if pool_k.ndim != 5:
    raise ValueError(f"pool_k: expected [L, Hkv, num_pages, page_size, Dh] with `layer`, got "
                     f"shape {pool_k.shape}")
  return pool_k, pool_v, jnp.asarray(layer, jnp.int32)


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
  pk, pv, layer = _stacked(pool_k, pool_v, layer)
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


# -- attention ----------------------------------------------------------------------------------

def _pages_read(page_table: jax.Array, page_size: int, max_len: int | None) -> int:
  width = page_table.shape[1]
  return width if max_len is None else max(1, min(width, -(-int(max_len) // page_size)))


def paged_attention_reference(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                              page_table: jax.Array, lengths: jax.Array, start: jax.Array, *,
                              layer=None, max_len: int | None = None) -> jax.Array:
  """Attention of q [B, T, H, Dh] (H = G * Hkv) over each row's pages; query t of row b sits at
  position start[b] + t and sees the row's key positions j with j <= start[b] + t and
  j < lengths[b] (the keys written so far; for a forward that just wrote its T keys at `start`,
  lengths = start + T). Positions on sentinel pages are empty; a query that sees no key returns 0.
  Float32 softmax; returns [B, T, H, Dh] in q's dtype.

  Gathers the first ceil(max_len / page_size) pages of each row (static; default all of the
  table) into a dense view, then masks: the plain formula the kernel is checked against."""
  pk, pv, layer = _stacked(pool_k, pool_v, layer)
  _, hkv, num_pages, page_size, dh = pk.shape
  b, t, h, _ = q.shape
  n = _pages_read(page_table, page_size, max_len)
  table = page_table[:, :n]
  valid = (table >= 0) & (table < num_pages)
  idx = jnp.where(valid, table, 0)
  # one gather of the rows' pages straight out of the (stacked) pool, no layer slice copied
  k = pk[layer, :, idx].transpose(0, 2, 1, 3, 4).reshape(b, hkv, n * page_size, dh)
  v = pv[layer, :, idx].transpose(0, 2, 1, 3, 4).reshape(b, hkv, n * page_size, dh)
  kpos = jnp.arange(n * page_size, dtype=jnp.int32)
  qpos = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
  mask = ((kpos[None, None, :] <= qpos[:, :, None])
          & (kpos[None, None, :] < jnp.asarray(lengths, jnp.int32)[:, None, None])
          & jnp.repeat(valid, page_size, axis=1)[:, None, :])  # [B, T, n*S]
  qg = q.reshape(b, t, hkv, h // hkv, dh)
  scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask[:, None, None], scores / math.sqrt(dh), NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(jnp.any(mask, axis=-1)[:, None, None, :, None], probs, 0.0)
  out = jnp.einsum("bkgts,bksd->btkgd", probs, v.astype(jnp.float32))
  return out.reshape(b, t, h, dh).astype(q.dtype)


def paged_attention_chunked(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                            page_table: jax.Array, lengths: jax.Array, start: jax.Array, *,
                            layer=None, max_len: int | None = None, chunk: int | None = None,
                            min_bytes: int | None = None) -> jax.Array:
  """`paged_attention_reference`, reading the rows' pages a chunk of about `chunk` positions at a
  time (whole pages) with an online softmax, up to the last page any row has a visible key on: a
  dynamic trip count, so a step over short rows gathers only their first pages (as
  `layers.attend_cache` reads a dense cache). Gathers of under `min_bytes` of keys, or of one
  chunk, are the reference itself (defaults: `cache.CACHE_CHUNK`, `cache.chunk_min_bytes()`)."""
  pk, pv, layer = _stacked(pool_k, pool_v, layer)
  _, hkv, num_pages, page_size, dh = pk.shape
  b, t, h, _ = q.shape
  chunk = cache_lib.CACHE_CHUNK if chunk is None else int(chunk)
  min_bytes = cache_lib.chunk_min_bytes() if min_bytes is None else int(min_bytes)
  n = _pages_read(page_table, page_size, max_len)
  per = max(1, chunk // page_size)
  n_max = -(-n // per)
  if n_max == 1 or b * hkv * n * page_size * dh * pk.dtype.itemsize < min_bytes:
    return paged_attention_reference(q, pk, pv, page_table, lengths, start, layer=layer,
                                     max_len=max_len)
  per = -(-n // n_max)  # chunks of equal width covering the pages read
  table = jnp.asarray(page_table, jnp.int32)[:, :n]
  lengths = jnp.asarray(lengths, jnp.int32)
  qpos = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
  # a key is visible below min(length, last query + 1): read the pages up to the furthest one
  extent = jnp.max(jnp.minimum(lengths, qpos[:, -1] + 1))
  steps = jnp.clip((extent + per * page_size - 1) // (per * page_size), 1, n_max)
  qg = q.reshape(b, t, hkv, h // hkv, dh).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, Dh]
  scale = 1.0 / math.sqrt(dh)

  def body(i, carry):
    first = jnp.minimum(i * per, n - per)  # the last chunk may overlap the one before
    pages = jax.lax.dynamic_slice_in_dim(table, first, per, axis=1)
    valid = (pages >= 0) & (pages < num_pages)
    idx = jnp.where(valid, pages, 0)
    kc = pk[layer, :, idx].transpose(0, 2, 1, 3, 4).reshape(b, hkv, per * page_size, dh)
    vc = pv[layer, :, idx].transpose(0, 2, 1, 3, 4).reshape(b, hkv, per * page_size, dh)
    kpos = first * page_size + jnp.arange(per * page_size, dtype=jnp.int32)
    mask = ((kpos[None, None, :] <= qpos[:, :, None])
            & (kpos[None, None, :] < lengths[:, None, None])
            & (kpos >= i * per * page_size)[None, None, :]
            & jnp.repeat(valid, page_size, axis=1)[:, None, :])[:, None, None]  # [B,1,1,T,c]
    sc = jnp.einsum("bkgtd,bksd->bkgts", qg, kc, preferred_element_type=jnp.float32) * scale
    return online_softmax_step(carry, sc, mask, vc.astype(jnp.float32), "bkgts,bksd->bkgtd")

  carry = online_softmax_init((b, hkv, h // hkv, t), dh)
  out = online_softmax_result(jax.lax.fori_loop(0, steps, body, carry))
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh).astype(q.dtype)


# the kernel's launch settings (`paged_attention_pallas`): pages of K and V one loop step reads,
# and Triton's warps per program (None: its default)
PAGES_PER_BLOCK = 1
NUM_WARPS = None


def _kernel(lengths_ref, start_ref, table_ref, layer_ref, q_ref, k_ref, v_ref, o_ref, *,
            group: int, num_tokens: int, scale: float, pages_per_block: int):
  """One (row, kv head) program: the row's T * G queries of this kv head against its pages,
  `pages_per_block` pages per loop step, with an online softmax (running max m, denominator l,
  numerator o)."""
  b, h = pl.program_id(0), pl.program_id(1)
  rows, dh = q_ref.shape
  _, _, num_pages, page_size, _ = k_ref.shape
  width = table_ref.shape[1]  # a multiple of pages_per_block (the caller pads the table)
  per = pages_per_block
  block = per * page_size
  length, start, layer = lengths_ref[b], start_ref[b], layer_ref[0]
  q = q_ref[...]
  # query row r is token r // G (rows past T * G are padding, dropped by the caller)
  qpos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
  # keys past both the row's length and the last query are never visible: read only the pages
  # that hold visible keys
  end = jnp.minimum(length, start + num_tokens)
  pages = jnp.clip((end + page_size - 1) // page_size, 0, width)

  def body(i, carry):
    o, m, l = carry
    if per == 1:
      page = table_ref[b, i]
      valid = (page >= 0) & (page < num_pages)
      page = jnp.where(valid, page, 0)  # never read outside the pool
      k = k_ref[layer, h, page]  # [S, Dh]
      v = v_ref[layer, h, page]
    else:  # a gather of `per` pages: one [per * S, Dh] tile
      ids = table_ref[b, pl.ds(i * per, per)]
      ok = (ids >= 0) & (ids < num_pages)
      ids = jnp.where(ok, ids, 0)
      k = k_ref[layer, h, ids].reshape(block, dh)
      v = v_ref[layer, h, ids].reshape(block, dh)
      valid = jnp.broadcast_to(ok[:, None], (per, page_size)).reshape(1, block)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale  # [rows, block]
    kpos = i * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    mask = (kpos <= qpos) & (kpos < length) & valid
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    # masked entries are zeroed explicitly: while a query has seen no key, m_new is NEG_INF too
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    l = corr * l + jnp.sum(p, axis=1, keepdims=True)
    o = corr * o + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
    return o, m_new, l

  init = (jnp.zeros((rows, dh), jnp.float32), jnp.full((rows, 1), NEG_INF, jnp.float32),
          jnp.zeros((rows, 1), jnp.float32))
  o, _, l = jax.lax.fori_loop(0, (pages + per - 1) // per, body, init)
  o_ref[...] = (o / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def paged_attention_pallas(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                           page_table: jax.Array, lengths: jax.Array, start: jax.Array, *,
                           layer=None, max_len: int | None = None, interpret: bool = False,
                           pages_per_block: int | None = None,
                           num_warps: int | None = None) -> jax.Array:
  """`paged_attention_reference` as a Pallas kernel: grid (row, kv head); each program loops
  over only the pages its row has visible keys in (a dynamic trip count from lengths and start),
  loading `pages_per_block` (default `PAGES_PER_BLOCK`) [page_size, Dh] tiles of K and V per
  loop step. A stacked pool is indexed with `layer` inside the kernel, so no layer slice is
  copied out of it. `num_warps` (default `NUM_WARPS`) is Triton's per program.

  Lowered with Triton on GPUs, whatever Pallas's default GPU backend: the queries of a (row, kv
  head) are padded to a power of two >= 16 rows; page_size and Dh must then be powers of two >= 16
  (tl.dot's minimum). Tested in interpret mode on CPU against the reference, and lowered for CUDA
  on CPU at every launch setting; `experiments/bench_gpu.py` checks it compiled on a GPU (against
  the reference, and inside the paged engine) and times it at several `pages_per_block` and
  `num_warps`. No split over pages for long rows."""
  pk, pv, layer = _stacked(pool_k, pool_v, layer)
  _, hkv, _, page_size, dh = pk.shape
  b, t, h, _ = q.shape
  per = PAGES_PER_BLOCK if pages_per_block is None else pages_per_block
  warps = NUM_WARPS if num_warps is None else num_warps
  if h % hkv:
    raise ValueError(f"q: {h} heads is not a multiple of the pool's {hkv} kv heads")
  if not isinstance(per, int) or per < 1 or per & (per - 1):
    raise ValueError(f"pages_per_block={per!r}: expected a power of two >= 1")
  if not interpret:
    for name, n in (("page_size", page_size), ("head_dim", dh)):
      if n < 16 or n & (n - 1):
        raise ValueError(f"{name}={n}: the Pallas GPU kernel needs a power of two >= 16")
  g = h // hkv
  rows = max(16, pl.next_power_of_2(t * g))
  table = jnp.asarray(page_table, jnp.int32)[:, :_pages_read(page_table, page_size, max_len)]
  table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % per)), constant_values=NO_PAGE)
  # [B, T, Hkv, G, Dh] -> [B, Hkv, T * G, Dh]: a kv head's queries as one tile, token-major
  qk = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dh)
  qk = jnp.pad(qk, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
  whole = pl.BlockSpec()  # the whole array: scalars and pages are indexed inside the kernel
  tile = pl.BlockSpec((None, None, rows, dh), lambda i, j: (i, j, 0, 0))
  params = {}
  if not interpret:
    # Triton, named: with no compiler parameters Pallas lowers to Mosaic GPU wherever it is
    # installed (the `jax_pallas_use_mosaic_gpu` option is on by default in jax 0.10.2), and
    # Mosaic GPU stages the whole pool (a `BlockSpec()` operand) in shared memory, which no pool
    # fits
    from jax.experimental.pallas import triton as pl_triton
    params["compiler_params"] = pl_triton.CompilerParams(
        num_warps=None if warps is None else int(warps))
  out = pl.pallas_call(
      functools.partial(_kernel, group=g, num_tokens=t, scale=1.0 / math.sqrt(dh),
                        pages_per_block=per),
      out_shape=jax.ShapeDtypeStruct((b, hkv, rows, dh), q.dtype),
      grid=(b, hkv),
      in_specs=[whole, whole, whole, whole, tile, whole, whole],
      out_specs=tile,
      interpret=interpret,
      name="paged_attention",
      **params,
  )(jnp.asarray(lengths, jnp.int32), jnp.asarray(start, jnp.int32), table,
    jnp.reshape(layer, (1,)), qk, pk, pv)
  out = out[:, :, :t * g].reshape(b, hkv, t, g, dh).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, t, h, dh)


def paged_attention(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, page_table: jax.Array,
                    lengths: jax.Array, start: jax.Array, *, layer=None,
                    max_len: int | None = None, implementation: str | None = None,
                    interpret: bool = False, pages_per_block: int | None = None,
                    num_warps: int | None = None) -> jax.Array:
  """Paged attention (semantics of `paged_attention_reference`). `implementation`: "pallas"
  (the kernel; `interpret=True` runs it on any backend), "reference", "chunked"
  (`paged_attention_chunked`), or None: the kernel on GPU, chunked elsewhere.
  `pages_per_block` and `num_warps` are the kernel's launch settings (None: its defaults), which
  the other implementations ignore (one configuration serves every backend)."""
  if implementation is None:
    implementation = "pallas" if jax.default_backend() == "gpu" else "chunked"
  if implementation == "reference":
    return paged_attention_reference(q, pool_k, pool_v, page_table, lengths, start, layer=layer,
                                     max_len=max_len)
  if implementation == "chunked":
    return paged_attention_chunked(q, pool_k, pool_v, page_table, lengths, start, layer=layer,
                                   max_len=max_len)
  if implementation == "pallas":
    return paged_attention_pallas(q, pool_k, pool_v, page_table, lengths, start, layer=layer,
                                  max_len=max_len, interpret=interpret,
                                  pages_per_block=pages_per_block, num_warps=num_warps)
  raise ValueError(f"implementation={implementation!r}: expected None, 'reference', 'chunked' or "
                   "'pallas'")
