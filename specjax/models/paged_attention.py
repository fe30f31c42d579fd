"""Attention over a paged KV pool: a pure-JAX reference, a pure-JAX path that reads only a row's
live pages a chunk at a time, and a Pallas kernel (`specjax.models.paged_kernel`), optionally
split over each row's pages (the device kernels of paged KV memory; the pool and its writes are
`specjax.models.paged`).

Pools are [L, Hkv, num_pages, page_size, Dh] (or without the layer axis); token position p of row
b lives in page `page_table[b, p // page_size]`, slot `p % page_size`. Page-table entries outside
[0, num_pages) (`NO_PAGE` = -1 by convention) name no page: attention treats their positions as
empty.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specjax.models import cache as cache_lib
from specjax.models.attention import (NEG_INF, online_softmax_init, online_softmax_result,
                                      online_softmax_step)
from specjax.models.paged_kernel import (MAX_TREE_TOKENS, TARGET_PROGRAMS, choose_num_splits,
                                         combine_splits, launch)

__all__ = ["MAX_TREE_TOKENS", "NEG_INF", "NO_PAGE", "NUM_SPLITS", "NUM_WARPS", "PAGES_PER_BLOCK",
           "TARGET_PROGRAMS", "choose_num_splits", "combine_splits", "paged_attention",
           "paged_attention_chunked", "paged_attention_pallas", "paged_attention_reference",
           "stacked_pools"]

NO_PAGE = -1  # the page-table sentinel (the host allocator uses the same value)


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


def _checked_tree(tree_mask, b: int, t: int) -> jax.Array | None:
  """tree_mask as bool [B, T, T] (None stays None), or ValueError naming what is wrong."""
  if tree_mask is None:
    return None
  if tuple(jnp.shape(tree_mask)) != (b, t, t):
    raise ValueError(f"tree_mask: expected [B, T, T] = {(b, t, t)}, got {jnp.shape(tree_mask)}")
  if t > MAX_TREE_TOKENS:
    raise ValueError(f"tree_mask: at most {MAX_TREE_TOKENS} new tokens, got T={t}")
  return jnp.asarray(tree_mask, bool)


def _visible(kpos: jax.Array, start: jax.Array, lengths: jax.Array, t: int,
             tree: jax.Array | None) -> jax.Array:
  """bool [B, T, K]: whether query t of row b (at start[b] + t) sees key position kpos[k]: a
  key below lengths[b] that is at or before the query's own position or, with a tree [B, T, T],
  before start[b] or the new key n (at start[b] + n) with tree[b, t, n]."""
  qpos = start[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
  seen = kpos[None, None, :] <= qpos[:, :, None]
  if tree is not None:
    rel = kpos[None, :] - start[:, None]  # [B, K]
    new = (rel >= 0) & (rel < t)
    at = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (qpos.shape[0], t, kpos.shape[0]))
    seen = jnp.where(new[:, None, :], jnp.take_along_axis(tree, at, axis=2), seen)
  return seen & (kpos[None, None, :] < lengths[:, None, None])


def paged_attention_reference(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                              page_table: jax.Array, lengths: jax.Array, start: jax.Array, *,
                              layer=None, max_len: int | None = None,
                              tree_mask: jax.Array | None = None) -> jax.Array:
  """Attention of q [B, T, H, Dh] (H = G * Hkv) over each row's pages; query t of row b sits at
  position start[b] + t and sees the row's key positions j with j <= start[b] + t and
  j < lengths[b] (the keys written so far; for a forward that just wrote its T keys at `start`,
  lengths = start + T). With `tree_mask` [B, T, T] (the T new tokens as a tree of drafts), query t
  sees new key n (position start[b] + n) iff tree_mask[b, t, n], and every earlier key as
  without it. Positions on sentinel pages are empty; a query that sees no key returns 0.
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
  mask = (_visible(kpos, jnp.asarray(start, jnp.int32), jnp.asarray(lengths, jnp.int32), t,
                   _checked_tree(tree_mask, b, t))
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
                            min_bytes: int | None = None,
                            tree_mask: jax.Array | None = None) -> jax.Array:
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
                                     max_len=max_len, tree_mask=tree_mask)
  tree = _checked_tree(tree_mask, b, t)
  per = -(-n // n_max)  # chunks of equal width covering the pages read
  table = jnp.asarray(page_table, jnp.int32)[:, :n]
  lengths, start = jnp.asarray(lengths, jnp.int32), jnp.asarray(start, jnp.int32)
  # a key is visible below min(length, last query + 1): read the pages up to the furthest one
  extent = jnp.max(jnp.minimum(lengths, start + t))
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
    mask = (_visible(kpos, start, lengths, t, tree)
            & (kpos >= i * per * page_size)[None, None, :]
            & jnp.repeat(valid, page_size, axis=1)[:, None, :])[:, None, None]  # [B,1,1,T,c]
    sc = jnp.einsum("bkgtd,bksd->bkgts", qg, kc, preferred_element_type=jnp.float32) * scale
    return online_softmax_step(carry, sc, mask, vc.astype(jnp.float32), "bkgts,bksd->bkgtd")

  carry = online_softmax_init((b, hkv, h // hkv, t), dh)
  out = online_softmax_result(jax.lax.fori_loop(0, steps, body, carry))
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh).astype(q.dtype)


# the kernel's launch settings (`paged_attention_pallas`): pages of K and V one loop step reads,
# Triton's warps per program (None: its default), and splits of each row's pages over programs
# (1: none, one program per (row, kv head); None: `choose_num_splits` for each shape)
PAGES_PER_BLOCK = 1
NUM_WARPS = None
NUM_SPLITS = 1


def paged_attention_pallas(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                           page_table: jax.Array, lengths: jax.Array, start: jax.Array, *,
                           layer=None, max_len: int | None = None, interpret: bool = False,
                           pages_per_block: int | None = None, num_warps: int | None = None,
                           num_splits: int | None = None,
                           tree_mask: jax.Array | None = None) -> jax.Array:
  """`paged_attention_reference` as a Pallas kernel (`paged_kernel`): grid (row, kv head[,
  split]); each program loops over only the pages its row has visible keys in (a dynamic trip
  count from lengths and start), loading `pages_per_block` (default `PAGES_PER_BLOCK`)
  [page_size, Dh] tiles of K and V per loop step. A stacked pool is indexed with `layer` inside
  the kernel, so no layer slice is copied out of it. `num_warps` (default `NUM_WARPS`) is
  Triton's per program.

  `num_splits` (default `NUM_SPLITS` = 1; None there: `choose_num_splits`, enough programs for
  an H100's or H200's SMs) splits each row's loop steps over its visible pages into that many
  equal shares, each one program's (flash-decoding: with a few long rows, batch * kv heads
  programs alone leave most of a GPU idle); their partial softmaxes are combined in plain JAX.
  Shares follow each row's own length, not the table's width, so rows shorter than their table
  still spread over every split. 1: one program per (row, kv head) that writes the attended
  values itself, with no combine. Capped at the loop steps a full table takes. `tree_mask` as in
  the reference, at most `MAX_TREE_TOKENS` new tokens (each query's bits of it one int32). The
  splits, their automatic choice and the tree mask are lowered for CUDA in the tests but not
  yet compiled, checked or timed on a GPU.

  Lowered with Triton on GPUs, whatever Pallas's default GPU backend: the queries of a (row, kv
  head) are padded to a power of two >= 16 rows; page_size and Dh must then be powers of two >= 16
  (tl.dot's minimum). Tested in interpret mode on CPU against the reference, and lowered for CUDA
  on CPU at every launch setting; `experiments/bench_gpu.py` checks it compiled on a GPU (against
  the reference, and inside the paged engine) and times it at several `pages_per_block` and
  `num_warps`."""
  pk, pv, layer = stacked_pools(pool_k, pool_v, layer)
  _, hkv, _, page_size, dh = pk.shape
  b, t, h, _ = q.shape
  per = PAGES_PER_BLOCK if pages_per_block is None else pages_per_block
  warps = NUM_WARPS if num_warps is None else num_warps
  splits = NUM_SPLITS if num_splits is None else num_splits
  if h % hkv:
    raise ValueError(f"q: {h} heads is not a multiple of the pool's {hkv} kv heads")
  if not isinstance(per, int) or per < 1 or per & (per - 1):
    raise ValueError(f"pages_per_block={per!r}: expected a power of two >= 1")
  if splits is not None and (not isinstance(splits, int) or splits < 1):
    raise ValueError(f"num_splits={splits!r}: expected an int >= 1")
  if not interpret:
    for name, n in (("page_size", page_size), ("head_dim", dh)):
      if n < 16 or n & (n - 1):
        raise ValueError(f"{name}={n}: the Pallas GPU kernel needs a power of two >= 16")
  tree = _checked_tree(tree_mask, b, t)
  g = h // hkv
  rows = max(16, pl.next_power_of_2(t * g))
  table = jnp.asarray(page_table, jnp.int32)[:, :_pages_read(page_table, page_size, max_len)]
  table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % per)), constant_values=NO_PAGE)
  steps = table.shape[1] // per
  splits = min(steps, choose_num_splits(b, hkv, steps * per, per) if splits is None else splits)
  # [B, T, Hkv, G, Dh] -> [B, Hkv, T * G, Dh]: a kv head's queries as one tile, token-major
  qk = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dh)
  qk = jnp.pad(qk, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
  bits = None
  if tree is not None:  # query row r (token r // G) sees new key n iff bit n of bits[b, r]
    bits = jnp.sum(jnp.where(tree, jnp.left_shift(1, jnp.arange(t, dtype=jnp.int32)), 0),
                   axis=2, dtype=jnp.int32)  # [B, T]: distinct bits, so the sum is their or
    bits = jnp.pad(jnp.repeat(bits, g, axis=1), ((0, 0), (0, rows - t * g)))
  out = launch(qk, pk, pv, table, jnp.asarray(lengths, jnp.int32), jnp.asarray(start, jnp.int32),
               jnp.reshape(layer, (1,)), bits, group=g, num_tokens=t, scale=1.0 / math.sqrt(dh),
               pages_per_block=per, num_splits=splits, num_warps=warps, interpret=interpret)
  out = out[:, :, :t * g].reshape(b, hkv, t, g, dh).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, t, h, dh)


def paged_attention(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, page_table: jax.Array,
                    lengths: jax.Array, start: jax.Array, *, layer=None,
                    max_len: int | None = None, implementation: str | None = None,
                    interpret: bool = False, pages_per_block: int | None = None,
                    num_warps: int | None = None, num_splits: int | None = None,
                    tree_mask: jax.Array | None = None) -> jax.Array:
  """Paged attention (semantics of `paged_attention_reference`, `tree_mask` included).
  `implementation`: "pallas" (the kernel; `interpret=True` runs it on any backend), "reference",
  "chunked" (`paged_attention_chunked`), or None: the kernel on GPU, chunked elsewhere.
  `pages_per_block`, `num_warps` and `num_splits` are the kernel's launch settings (None: its
  defaults; splits over pages, default none, are not yet measured on a GPU), which the other
  implementations ignore (one configuration serves every backend)."""
  if implementation is None:
    implementation = "pallas" if jax.default_backend() == "gpu" else "chunked"
  if implementation == "reference":
    return paged_attention_reference(q, pool_k, pool_v, page_table, lengths, start, layer=layer,
                                     max_len=max_len, tree_mask=tree_mask)
  if implementation == "chunked":
    return paged_attention_chunked(q, pool_k, pool_v, page_table, lengths, start, layer=layer,
                                   max_len=max_len, tree_mask=tree_mask)
  if implementation == "pallas":
    return paged_attention_pallas(q, pool_k, pool_v, page_table, lengths, start, layer=layer,
                                  max_len=max_len, interpret=interpret,
                                  pages_per_block=pages_per_block, num_warps=num_warps,
                                  num_splits=num_splits, tree_mask=tree_mask)
  raise ValueError(f"implementation={implementation!r}: expected None, 'reference', 'chunked' or "
                   "'pallas'")
