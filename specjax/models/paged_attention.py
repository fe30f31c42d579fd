"""Attention over a paged KV pool: a pure-JAX reference, a pure-JAX path that reads only a row's
live pages a chunk at a time, and a Pallas kernel (the device kernels of paged KV memory; the pool
and its writes are `specjax.models.paged`).

Pools are [L, Hkv, num_pages, page_size, Dh] (or without the layer axis); token position p of row
b lives in page `page_table[b, p // page_size]`, slot `p % page_size`. Page-table entries outside
[0, num_pages) (`NO_PAGE` = -1 by convention) name no page: attention treats their positions as
empty.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specjax.models import cache as cache_lib
from specjax.models.attention import (online_softmax_init, online_softmax_result,
                                      online_softmax_step)

NO_PAGE = -1  # the page-table sentinel (the host allocator uses the same value)
NEG_INF = -1e30


def stacked_pools(pool_k, pool_v, layer):
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
  pk, pv, layer = stacked_pools(pool_k, pool_v, layer)
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
  pk, pv, layer = stacked_pools(pool_k, pool_v, layer)
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
  pk, pv, layer = stacked_pools(pool_k, pool_v, layer)
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
