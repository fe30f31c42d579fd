"""The Pallas kernel of paged attention (`paged_attention.paged_attention_pallas` packs its
inputs, checks its launch settings and unpacks its output), optionally split over each row's
pages (flash-decoding): several programs read one row's keys, and a plain-JAX step combines
their partial softmaxes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specjax.models.attention import NEG_INF

# an H100's (and an H200's) streaming multiprocessors: `choose_num_splits` aims for a program
# on each
TARGET_PROGRAMS = 132
MAX_TREE_TOKENS = 32  # a tree mask travels as one int32 of bits per query


def choose_num_splits(batch: int, kv_heads: int, pages: int, pages_per_block: int = 1,
                      target_programs: int = TARGET_PROGRAMS) -> int:
  """Splits of each row's pages that bring the programs, batch * kv_heads * splits, to about
  `target_programs` (a GPU's SMs: batch * kv_heads alone leaves most idle for a few rows), and
  no more splits than loop steps of `pages_per_block` over a table of `pages` pages. A pure
  function of static shapes, so a benchmark can sweep explicit values beside it."""
  steps = max(1, -(-int(pages) // int(pages_per_block)))
  return max(1, min(-(-int(target_programs) // max(1, int(batch) * int(kv_heads))), steps))


def combine_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
  """The splits' partial softmaxes, unnormalised o [..., S, R, Dh] with running max m and
  denominator l [..., S, R] (float32), as one: [..., R, Dh] float32. A split that saw no key has
  m = NEG_INF and weighs 0; a query that saw no key in any split returns 0."""
  top = jnp.max(m, axis=-2, keepdims=True)
  w = jnp.exp(m - top)
  den = jnp.sum(w * l, axis=-2)
  return jnp.sum(w[..., None] * o, axis=-3) / jnp.where(den > 0, den, 1.0)[..., None]


def _kernel(lengths_ref, start_ref, table_ref, layer_ref, q_ref, *refs, group: int,
            num_tokens: int, scale: float, pages_per_block: int, num_splits: int, tree: bool):
  """One (row, kv head[, split]) program: the row's T * G queries of this kv head against its
  pages, `pages_per_block` pages per loop step, with an online softmax (running max m,
  denominator l, numerator o). With splits, split s takes the s-th of `num_splits` equal shares
  of the loop steps over the row's visible pages (a share past them is empty) and writes its
  unnormalised o, m and l; without, the program writes the attended values. With `tree`, query
  row r's new keys (positions start .. start + T - 1) are those whose bits its int32 of bits
  holds, instead of those up to its own position."""
  if tree:
    bits_ref, k_ref, v_ref, *out_refs = refs
  else:
    bits_ref, (k_ref, v_ref, *out_refs) = None, refs
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
  bits = None if bits_ref is None else bits_ref[...][:, None]  # [rows, 1]
  # keys past both the row's length and the last query are never visible: read only the pages
  # that hold visible keys
  end = jnp.minimum(length, start + num_tokens)
  pages = jnp.clip((end + page_size - 1) // page_size, 0, width)
  steps = (pages + per - 1) // per
  first = 0  # the first loop step (block of `per` pages) this program reads
  if num_splits > 1:
    share = (steps + num_splits - 1) // num_splits
    first = pl.program_id(2) * share
    steps = jnp.clip(steps - first, 0, share)

  def body(i, carry):
    o, m, l = carry
    j = first + i
    if per == 1:
      page = table_ref[b, j]
      valid = (page >= 0) & (page < num_pages)
      page = jnp.where(valid, page, 0)  # never read outside the pool
      k = k_ref[layer, h, page]  # [S, Dh]
      v = v_ref[layer, h, page]
    else:  # a gather of `per` pages: one [per * S, Dh] tile
      ids = table_ref[b, pl.ds(j * per, per)]
      ok = (ids >= 0) & (ids < num_pages)
      ids = jnp.where(ok, ids, 0)
      k = k_ref[layer, h, ids].reshape(block, dh)
      v = v_ref[layer, h, ids].reshape(block, dh)
      valid = jnp.broadcast_to(ok[:, None], (per, page_size)).reshape(1, block)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale  # [rows, block]
    kpos = j * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    if bits is None:
      seen = kpos <= qpos
    else:  # bit n of a query's int32 says whether it sees new key n
      rel = kpos - start
      new = (rel >= 0) & (rel < num_tokens)
      seen = jnp.where(new, (jnp.right_shift(bits, jnp.clip(rel, 0, 31)) & 1) == 1,
                       kpos <= qpos)
    mask = seen & (kpos < length) & valid
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
  o, m, l = jax.lax.fori_loop(0, steps, body, init)
  if num_splits > 1:
    o_ref, m_ref, l_ref = out_refs
    o_ref[...] = o
    m_ref[...] = m.reshape(rows)
    l_ref[...] = l.reshape(rows)
  else:
    out_refs[0][...] = (o / jnp.where(l > 0, l, 1.0)).astype(out_refs[0].dtype)


def launch(qk: jax.Array, pk: jax.Array, pv: jax.Array, table: jax.Array, lengths: jax.Array,
           start: jax.Array, layer: jax.Array, bits: jax.Array | None, *, group: int,
           num_tokens: int, scale: float, pages_per_block: int, num_splits: int,
           num_warps: int | None, interpret: bool) -> jax.Array:
  """The kernel over packed queries qk [B, Hkv, R, Dh] (a kv head's T * G queries token-major,
  padded to R rows), stacked pools pk/pv [L, Hkv, P, S, Dh], an int32 table [B, W] (W a multiple
  of pages_per_block), lengths and start [B], layer [1] and, for a tree, int32 bits [B, R].
  Grid (row, kv head), or (row, kv head, split) with the splits combined after it. Returns
  [B, Hkv, R, Dh] in qk's dtype."""
  b, hkv, rows, dh = qk.shape
  split = num_splits > 1
  grid = (b, hkv, num_splits) if split else (b, hkv)
  whole = pl.BlockSpec()  # the whole array: scalars and pages are indexed inside the kernel
  tile = pl.BlockSpec((None, None, rows, dh), lambda i, j, *_: (i, j, 0, 0))
  in_specs = [whole, whole, whole, whole, tile]
  args = [lengths, start, table, layer, qk]
  if bits is not None:
    in_specs.append(pl.BlockSpec((None, rows), lambda i, j, *_: (i, 0)))
    args.append(bits)
  if split:
    out_shape = (jax.ShapeDtypeStruct((b, hkv, num_splits, rows, dh), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, num_splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, num_splits, rows), jnp.float32))
    out_specs = (pl.BlockSpec((None, None, None, rows, dh), lambda i, j, s: (i, j, s, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)))
  else:
    out_shape, out_specs = jax.ShapeDtypeStruct((b, hkv, rows, dh), qk.dtype), tile
  params = {}
  if not interpret:
    # Triton, named: with no compiler parameters Pallas lowers to Mosaic GPU wherever it is
    # installed (the `jax_pallas_use_mosaic_gpu` option is on by default in jax 0.10.2), and
    # Mosaic GPU stages the whole pool (a `BlockSpec()` operand) in shared memory, which no pool
    # fits
    from jax.experimental.pallas import triton as pl_triton
    params["compiler_params"] = pl_triton.CompilerParams(
        num_warps=None if num_warps is None else int(num_warps))
  out = pl.pallas_call(
      functools.partial(_kernel, group=group, num_tokens=num_tokens, scale=scale,
                        pages_per_block=pages_per_block, num_splits=num_splits,
                        tree=bits is not None),
      out_shape=out_shape,
      grid=grid,
      in_specs=in_specs + [whole, whole],
      out_specs=out_specs,
      interpret=interpret,
      name="paged_attention",
      **params,
  )(*args, pk, pv)
  return combine_splits(*out).astype(qk.dtype) if split else out
