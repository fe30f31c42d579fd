"""Paged KV memory: writes through page tables, the reference paged attention against dense
attention, the Pallas kernel (interpret mode) against the reference, and the host allocator's
invariants under random admit / grow / share / release / preempt sequences."""

import copy
import importlib.util
import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import paged, paged_attention
from specjax.models.layers import attend, attend_cache, causal_mask
from specjax.sampling import page_allocator as pages
from specjax.sampling.engine import slot_pages
from specjax.sampling.page_allocator import NO_PAGE, PADDING_ROW, PageAllocator

HKV, DH, PAGE = 2, 16, 4
ROOT = os.path.join(os.path.dirname(__file__), "..")


def _random_table(rng, batch, width, num_pages, used):
  """A page table whose row b holds used[b] distinct random pages (no page in two rows)."""
  perm = rng.permutation(num_pages)
  table = np.full((batch, width), NO_PAGE, np.int32)
  at = 0
  for b, n in enumerate(used):
    table[b, :n] = perm[at:at + n]
    at += n
  assert at <= num_pages
  return table


def _scatter_dense(pool, dense, table):
  """Numpy placement of dense [B, S, Hkv, Dh] into a [Hkv, P, PAGE, Dh] pool (independent of
  `paged.write`)."""
  pool = np.array(pool)
  for b in range(dense.shape[0]):
    for p in range(dense.shape[1]):
      page = table[b, p // PAGE]
      if page != NO_PAGE:
        pool[:, page, p % PAGE] = dense[b, p]
  return pool


def _dense_reference(q, k, v, lengths, start):
  """attend_cache over dense buffers: query t of row b at start[b] + t sees keys j <= its
  position and j < lengths[b]."""
  b, t = q.shape[:2]
  s = k.shape[1]
  qpos = jnp.asarray(start)[:, None] + jnp.arange(t)[None, :]
  kpos = jnp.broadcast_to(jnp.arange(s), (b, s))
  mask = causal_mask(qpos, kpos) & (kpos[:, None, :] < jnp.asarray(lengths)[:, None, None])
  kc = jnp.transpose(k, (0, 2, 3, 1))  # KVCache layout
  vc = jnp.transpose(v, (0, 2, 1, 3))
  return attend_cache(q, kc, vc, mask)


def _problem(seed, t, heads, batch=4, width=6, num_pages=30):
  """Random q, dense k/v, a random page table, ragged starts, lengths = start + T."""
  rng = np.random.default_rng(seed)
  s = width * PAGE
  start = rng.integers(0, s - t + 1, size=batch).astype(np.int32)
  start[0] = s - t  # one row that fills its table to the last slot
  lengths = (start + t).astype(np.int32)
  used = -(-lengths // PAGE)
  table = _random_table(rng, batch, width, num_pages, used)
  q = rng.normal(size=(batch, t, heads, DH)).astype(np.float32)
  k = rng.normal(size=(batch, s, HKV, DH)).astype(np.float32)
  v = rng.normal(size=(batch, s, HKV, DH)).astype(np.float32)
  pool_k = _scatter_dense(np.zeros((HKV, num_pages, PAGE, DH), np.float32), k, table)
  pool_v = _scatter_dense(np.zeros((HKV, num_pages, PAGE, DH), np.float32), v, table)
  return q, k, v, pool_k, pool_v, table, lengths, start


# -- device side --------------------------------------------------------------------------------

@pytest.mark.parametrize("t,heads", [(1, 2), (1, 4), (5, 4), (5, 6)])
def test_reference_equals_dense_attention(t, heads):
  q, k, v, pool_k, pool_v, table, lengths, start = _problem(t * 10 + heads, t, heads)
  got = jax.jit(paged_attention.paged_attention_reference)(q, pool_k, pool_v, table, lengths, start)
  chex.assert_shape(got, q.shape)
  np.testing.assert_allclose(got, _dense_reference(q, k, v, lengths, start), atol=2e-6)


def test_reference_with_short_lengths_and_padding_rows():
  """lengths below start + T (the tail of a verify block sees only committed keys), a padding
  row (no pages, length 0: zeros, not NaN), and a static max_len that covers every row."""
  q, k, v, pool_k, pool_v, table, lengths, start = _problem(7, 5, 4)
  lengths = lengths.copy()
  lengths[1] = start[1] + 2
  table[2], lengths[2], start[2] = NO_PAGE, 0, 0
  keep = np.array([0, 1, 3])
  want = _dense_reference(q[keep], k[keep], v[keep], lengths[keep], start[keep])
  for max_len in (None, int(lengths.max())):
    got = jax.jit(paged_attention.paged_attention_reference, static_argnames="max_len")(
        q, pool_k, pool_v, table, lengths, start, max_len=max_len)
    np.testing.assert_allclose(got[keep], want, atol=2e-6)
    np.testing.assert_array_equal(got[2], 0.0)


def test_write_across_page_boundaries_and_drops():
  rng = np.random.default_rng(1)
  num_pages, width, t = 12, 3, 6
  table = np.array([[5, 2, 9], [7, 0, NO_PAGE], [NO_PAGE] * 3, [11, 3, 4]], np.int32)
  # row 0 crosses two page boundaries; row 1 runs off its last page (position 8 has no page);
  # row 2 is padding; row 3 runs past the table's end (positions 12, 13 are dropped)
  start = np.array([3, 3, 0, 8], np.int32)
  k = rng.normal(size=(4, t, HKV, DH)).astype(np.float32)
  v = rng.normal(size=(4, t, HKV, DH)).astype(np.float32)
  pool = np.full((HKV, num_pages, PAGE, DH), 7.0, np.float32)
  fn = jax.jit(paged.write, donate_argnums=(0, 1))
  got_k, got_v = fn(jnp.asarray(pool), jnp.asarray(pool), k, v, table, start)
  want_k, want_v = pool.copy(), pool.copy()
  for b in range(4):
    for j in range(t):
      p = start[b] + j
      if p // PAGE < width and table[b, p // PAGE] != NO_PAGE:
        want_k[:, table[b, p // PAGE], p % PAGE] = k[b, j]
        want_v[:, table[b, p // PAGE], p % PAGE] = v[b, j]
  np.testing.assert_array_equal(got_k, want_k)
  np.testing.assert_array_equal(got_v, want_v)
  assert (want_k != pool).any(axis=(0, 2, 3)).sum() == 6  # pages 5, 2, 9; 7, 0; 4


def test_stacked_pool_writes_and_reads_one_layer():
  """PagedKV: prefill 7 tokens, then a verify block of 5 at a traced layer index; attention over
  the pages equals causal attention over the 12 tokens, and other layers stay untouched."""
  rng = np.random.default_rng(2)
  b, heads, pre, t = 3, 4, 7, 5
  kv = paged.PagedKV.create(num_layers=3, num_pages=16, page_size=PAGE, batch=b,
                            max_pages_per_row=4, num_kv_heads=HKV, head_dim=DH)
  kv = kv.with_page_table(_random_table(rng, b, 4, 16, [3, 4, 3]))
  q = rng.normal(size=(b, pre + t, heads, DH)).astype(np.float32)
  k = rng.normal(size=(b, pre + t, HKV, DH)).astype(np.float32)
  v = rng.normal(size=(b, pre + t, HKV, DH)).astype(np.float32)

  @jax.jit
  def run(kv, layer):
    kv = kv.write(layer, k[:, :pre], v[:, :pre]).advance(jnp.full((b,), pre))
    kv = kv.write(layer, k[:, pre:], v[:, pre:])
    return kv, kv.attention(layer, q[:, pre:])

  kv, got = run(kv, jnp.int32(1))
  pos = jnp.broadcast_to(jnp.arange(pre + t), (b, pre + t))
  want = attend(q, k, v, causal_mask(pos, pos))[:, pre:]
  np.testing.assert_allclose(got, want, atol=2e-6)
  assert not np.asarray(kv.k[0]).any() and not np.asarray(kv.v[2]).any()
  chex.assert_equal(kv.lengths.tolist(), [pre] * b)


@pytest.mark.parametrize("t,heads,layer,per", [(1, 4, None, 1), (5, 4, 1, 1), (3, 2, None, 1),
                                               (1, 4, None, 4), (5, 4, 1, 2)])
def test_pallas_kernel_in_interpret_mode_equals_reference(t, heads, layer, per):
  """`per` pages per loop step (a table of 6 pages: with 4, the last step's block is padded with
  no-page entries)."""
  q, _, _, pool_k, pool_v, table, lengths, start = _problem(100 + t, t, heads, batch=3)
  table[1, :2] = table[1, 2:4]  # a row whose pages are out of order in the pool
  table[0, 0] = NO_PAGE  # a hole: its positions are empty (queries start with no visible key)
  table[2] = NO_PAGE  # a padding row that keeps a stale length: it sees nothing, returns 0
  if layer is not None:  # stacked pool; the other layers hold noise the kernel must not read
    noise = np.random.default_rng(3).normal(size=(3, *pool_k.shape)).astype(np.float32)
    pool_k = noise.copy()
    pool_k[layer] = _problem(100 + t, t, heads, batch=3)[3]
    pool_v = noise[::-1].copy()
    pool_v[layer] = _problem(100 + t, t, heads, batch=3)[4]
  args = (q, pool_k, pool_v, table, lengths, start)
  kw = {"layer": None if layer is None else jnp.int32(layer)}
  want = paged_attention.paged_attention_reference(*args, **kw)
  got = jax.jit(lambda *a: paged_attention.paged_attention(*a, implementation="pallas", interpret=True,
                                                 pages_per_block=per, **kw))(*args)
  chex.assert_shape(got, q.shape)
  np.testing.assert_allclose(got, want, atol=2e-6)
  np.testing.assert_array_equal(got[2], 0.0)


@pytest.mark.parametrize("t", [1, 5])
def test_pallas_kernel_lowers_to_triton_for_cuda_at_every_launch_setting(t):
  """The kernel lowered for CUDA on this CPU (no GPU compile): every launch setting
  `bench_gpu.py` sweeps becomes one Triton call with its warps, whatever Pallas's default GPU
  backend (Mosaic GPU where installed, which cannot stage the pool in shared memory); split over
  pages, its grid gains the splits (capped at the loop steps of the 8-page table), also with a
  tree mask."""
  pytest.importorskip("jax.experimental.pallas.triton")
  q = jax.ShapeDtypeStruct((4, t, 16, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2, 8, 64, 16, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((4, 8), jnp.int32)
  rows = jax.ShapeDtypeStruct((4,), jnp.int32)
  tree = jax.ShapeDtypeStruct((4, t, t), jnp.bool_)
  settings = [(per, warps, 1, False) for per in (1, 2, 4, 8) for warps in (None, 8)]
  settings += [(per, None, splits, tree) for per in (1, 4) for splits in (2, 4)
               for tree in (False, True)] + [(2, 4, 1, True)]
  for per, warps, splits, use_tree in settings:
    def attend(q, pk, pv, table, lengths, start, tree, per=per, warps=warps, splits=splits,
               use_tree=use_tree):
      return paged_attention.paged_attention(q, pk, pv, table, lengths, start, layer=1,
                                             implementation="pallas", pages_per_block=per,
                                             num_warps=warps, num_splits=splits,
                                             tree_mask=tree if use_tree else None)
    text = jax.jit(attend).trace(q, pool, pool, table, rows, rows, tree).lower(
        lowering_platforms=("cuda",)).as_text()
    key = (per, warps, splits, use_tree)
    assert re.findall(r"custom_call @(\S+)\(", text) == ["__gpu$xla.gpu.triton"], key
    found = re.findall(r"num_warps = (\d+)", text)  # None: Triton's default
    assert len(found) == 1 and warps in (None, int(found[0])), (key, found)
    grid = [int(n) for n in re.findall(r"grid_[xyz] = (\d+)", text)]
    assert grid == [4, 8, min(splits, 8 // per)], (key, grid)


def _gpu_shaped_problem(seed, t, dtype, width=16, num_pages=40):
  """The GPU kernel's real shapes, small: Dh 128, pages of 16, 8 query heads over 2 kv heads, a
  stacked pool of 2 layers (attention reads layer 1). Four rows: a long one (15 of its 16 pages,
  ending mid-page, so several splits share it), a short one (2 pages: later splits find nothing
  to read), a padding row (no pages, a stale length: it returns 0), and a row with a hole (a
  NO_PAGE entry) whose length stops 2 keys past its start (its later queries see only those)."""
  rng = np.random.default_rng(seed)
  length = np.array([15 * 16 - 5, 2 * 16 - 3, 45, 8 * 16 - 7], np.int32)
  start = length - t
  lengths = length.copy()
  lengths[3] = start[3] + min(t, 2)
  used = -(-length // 16)
  used[2] = 0
  table = _random_table(rng, 4, width, num_pages, used)
  table[3, 1] = NO_PAGE
  pool_k, pool_v = (jnp.asarray(rng.normal(size=(2, 2, num_pages, 16, 128)), dtype)
                    for _ in range(2))
  q = jnp.asarray(rng.normal(size=(4, t, 8, 128)), dtype)
  return q, pool_k, pool_v, table, lengths, start


def _compare_with_reference(got, args, tree=None):
  """got against the reference over the same inputs in float32: float32 to 2e-6 (values O(1));
  bfloat16 within 2^-8 of the largest |v| the pool holds, the kernel's own roundings to bf16
  (each <= 2^-9 relative): the probabilities before P @ V (sum_j p_j d_j v_j / sum_j p_j,
  |d_j| <= 2^-9, moves the output by <= 2^-9 max|v|) and the output itself (<= 2^-9 |out|,
  |out| <= max|v|); products of bf16 inputs are exact in float32 and every sum is float32."""
  q, pool_k, pool_v, table, lengths, start = args
  f32 = [jnp.asarray(x, jnp.float32) for x in (q, pool_k, pool_v)]
  want = paged_attention.paged_attention_reference(*f32, table, lengths, start,
                                                   layer=jnp.int32(1), tree_mask=tree)
  atol = 2e-6 if q.dtype == jnp.float32 else 2.0 ** -8 * float(jnp.max(jnp.abs(f32[2][1])))
  chex.assert_shape(got, q.shape)
  assert got.dtype == q.dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=atol, rtol=0)
  np.testing.assert_array_equal(np.asarray(got[2], np.float32), 0.0)


@pytest.mark.parametrize("per", [1, 4])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("t,dtype", [(1, jnp.float32), (5, jnp.bfloat16), (1, jnp.bfloat16),
                                     (5, jnp.float32)], ids=["decode-f32", "verify-bf16",
                                                             "decode-bf16", "verify-f32"])
def test_pallas_kernel_at_gpu_shapes_split_over_pages_equals_reference(t, dtype, splits, per):
  """The kernel (interpret mode) at the GPU's shapes, one program per (row, kv head) or each
  row's pages split over 2 or 4 programs and combined, 1 or 4 pages per loop step."""
  args = _gpu_shaped_problem(300 + t, t, dtype)
  got = jax.jit(lambda *a: paged_attention.paged_attention(
      *a, layer=jnp.int32(1), implementation="pallas", interpret=True, pages_per_block=per,
      num_splits=splits))(*args)
  _compare_with_reference(got, args)


def test_choose_num_splits_fills_the_gpu_up_to_the_loop_steps(monkeypatch):
  choose = paged_attention.choose_num_splits
  assert choose(1, 8, 256) == 17  # ceil(132 / 8) programs per (row, kv head)
  assert choose(4, 8, 256, 4) == 5 and choose(8, 2, 64, 2, target_programs=64) == 4
  assert choose(64, 8, 256) == 1 and choose(17, 8, 256) == 1  # enough programs already
  assert choose(1, 2, 8) == 8 and choose(1, 2, 8, 4) == 2 and choose(1, 1, 3, 4) == 1
  # the default is no split; `NUM_SPLITS = None` makes it the automatic choice per shape, with
  # the reference's values (6 splits of a 6-page table here)
  q, _, _, pool_k, pool_v, table, lengths, start = _problem(9, 1, 4, batch=3)
  args = (q, pool_k, pool_v, table, lengths, start)
  assert paged_attention.NUM_SPLITS == 1 and choose(3, HKV, 6) == 6
  monkeypatch.setattr(paged_attention, "NUM_SPLITS", None)
  got = paged_attention.paged_attention(*args, implementation="pallas", interpret=True)
  np.testing.assert_allclose(got, paged_attention.paged_attention_reference(*args), atol=2e-6)
  if importlib.util.find_spec("jax.experimental.pallas.triton") is not None:
    text = jax.jit(lambda q, k, v: paged_attention.paged_attention(
        q, k, v, table[:, :4], lengths, start, implementation="pallas")).trace(
        jax.ShapeDtypeStruct((3, 1, 4, 16), jnp.bfloat16),
        *[jax.ShapeDtypeStruct((HKV, 30, 16, 16), jnp.bfloat16)] * 2).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"grid_[xyz] = (\d+)", text) == ["3", "2", "4"]  # min(22, 4 pages)


def test_combine_splits_weighs_each_split_by_its_max():
  """Two splits' partial softmaxes of one query over keys with scores (0, 1 | 3) and values
  (1, 2 | 4), and a query no split saw a key for (0, not NaN)."""
  e = np.exp
  o = np.array([[[e(0 - 1) * 1 + e(1 - 1) * 2], [0.0]], [[e(0.0) * 4], [0.0]]], np.float32)
  m = np.array([[1.0, -1e30], [3.0, -1e30]], np.float32)
  l = np.array([[e(-1) + 1, 0.0], [1.0, 0.0]], np.float32)
  got = paged_attention.combine_splits(o, m, l)
  want = (e(0) * 1 + e(1) * 2 + e(3) * 4) / (e(0) + e(1) + e(3))
  np.testing.assert_allclose(got, [[want], [0.0]], rtol=1e-6)


def _random_tree(rng, batch, t):
  """bool [B, T, T]: each new token's ancestors and itself in a random tree of drafts (token n's
  parent an earlier token or the committed prefix), but for row 0's last query, which sees no
  new key at all (not even its own; the semantics allow it), only the keys before the block."""
  tree = np.zeros((batch, t, t), bool)
  for b in range(batch):
    for n in range(t):
      parent = int(rng.integers(-1, n))
      tree[b, n] = tree[b, parent] if parent >= 0 else False
      tree[b, n, n] = True
  tree[0, t - 1] = False
  return tree


def test_tree_mask_in_the_reference_and_chunked_paths():
  """A tree's mask among the T new queries: the reference equals dense attention under the same
  mask (earlier keys as without a tree), the chunked path equals the reference, and a causal
  tree (lower triangle) changes nothing."""
  t, heads = 5, 4
  q, k, v, pool_k, pool_v, table, lengths, start = _problem(11, t, heads)
  lengths[1] = start[1] + 3  # the last two queries of row 1 see only three new keys
  start[2], lengths[2] = 0, t  # row 2's first query, seeing no new key, sees nothing: 0
  tree = _random_tree(np.random.default_rng(12), 4, t)
  tree[2, 0, 0] = False
  args = (q, pool_k, pool_v, table, lengths, start)
  kpos = np.arange(k.shape[1])
  rel = kpos[None, None, :] - start[:, None, None]
  new = (rel >= 0) & (rel < t)
  mask = np.where(new, np.take_along_axis(tree, np.clip(rel, 0, t - 1).repeat(t, 1), axis=2),
                  rel < 0) & (kpos[None, None, :] < lengths[:, None, None])
  want = attend_cache(q, jnp.transpose(k, (0, 2, 3, 1)), jnp.transpose(v, (0, 2, 1, 3)),
                      jnp.asarray(mask))
  got = paged_attention.paged_attention_reference(*args, tree_mask=tree)
  np.testing.assert_allclose(got, want, atol=2e-6)
  np.testing.assert_array_equal(got[2, 0], 0.0)
  chunked = jax.jit(lambda *a: paged_attention.paged_attention_chunked(
      *a, chunk=2 * PAGE, min_bytes=0, tree_mask=tree))(*args)
  np.testing.assert_allclose(chunked, got, atol=2e-6)
  causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (4, t, t))
  for impl in ("reference", "chunked"):
    np.testing.assert_allclose(
        paged_attention.paged_attention(*args, implementation=impl, tree_mask=causal),
        paged_attention.paged_attention_reference(*args), atol=2e-6)
  with pytest.raises(ValueError, match="tree_mask: expected"):
    paged_attention.paged_attention_reference(*args, tree_mask=tree[:, :2])


@pytest.mark.parametrize("splits,per,dtype", [(1, 1, jnp.float32), (4, 1, jnp.bfloat16),
                                              (2, 4, jnp.float32)])
def test_tree_mask_in_the_pallas_kernel(splits, per, dtype):
  """The kernel (interpret mode, GPU shapes) with a tree's mask among its 5 verify tokens."""
  args = _gpu_shaped_problem(400 + splits, 5, dtype)
  tree = _random_tree(np.random.default_rng(13), 4, 5)
  got = jax.jit(lambda *a: paged_attention.paged_attention(
      *a, layer=jnp.int32(1), implementation="pallas", interpret=True, pages_per_block=per,
      num_splits=splits, tree_mask=tree))(*args)
  _compare_with_reference(got, args, tree)


@pytest.mark.parametrize("t,heads,layer,width", [(1, 4, None, 6), (5, 4, 1, 5), (3, 2, None, 5)])
def test_chunked_pure_jax_path_equals_reference(t, heads, layer, width):
  """Pages read two at a time up to the furthest visible key (width 5: the last chunk overlaps
  the one before); holes, out-of-order pages, a padding row, another layer's noise, and a row
  whose length stops short of its last query."""
  q, _, _, pool_k, pool_v, table, lengths, start = _problem(200 + t, t, heads, batch=4,
                                                            width=width)
  table[1, :2] = table[1, 2:4]
  table[0, 0] = NO_PAGE
  table[2] = NO_PAGE
  lengths[3] = max(int(start[3]), 1)
  if layer is not None:
    noise = np.random.default_rng(4).normal(size=(3, *pool_k.shape)).astype(np.float32)
    stacked_k, stacked_v = noise.copy(), noise[::-1].copy()
    stacked_k[layer], stacked_v[layer] = pool_k, pool_v
    pool_k, pool_v = stacked_k, stacked_v
  args = (q, pool_k, pool_v, table, lengths, start)
  kw = {"layer": None if layer is None else jnp.int32(layer)}
  want = paged_attention.paged_attention_reference(*args, **kw)
  got = jax.jit(lambda *a: paged_attention.paged_attention_chunked(*a, chunk=2 * PAGE, min_bytes=0,
                                                         **kw))(*args)
  np.testing.assert_allclose(got, want, atol=2e-6)
  np.testing.assert_array_equal(got[2], 0.0)


@pytest.mark.parametrize("mesh_shape,hkv", [((2, 1, 4), 1), ((4, 1, 2), 2), ((2, 2, 2), 2)])
def test_a_pool_split_over_a_mesh_writes_and_attends_as_one_device(mesh_shape, hkv):
  """Pages split over the data-parallel replicas as the rows are (kv heads over tensor where they
  divide): each replica's rows hold pages of its own shard (global ids), and a write then
  attention per replica equals the same on one device, with no collective in the program."""
  from specjax.sharding import MeshConfig, make_mesh
  mesh = make_mesh(MeshConfig(*mesh_shape))
  dp = mesh_shape[0] * mesh_shape[1]
  layers, per_replica, width, t = 2, 6, 5, 3
  b = 4 * dp
  rng = np.random.default_rng(0)
  table = np.full((b, width), NO_PAGE, np.int32)
  for r in range(dp):  # two rows of each replica hold 3 of its pages; the others none
    perm = rng.permutation(per_replica) + r * per_replica
    table[4 * r, :3], table[4 * r + 1, :3] = perm[:3], perm[3:]
  k, v = (jnp.asarray(rng.standard_normal((b, t, hkv, DH)), jnp.float32) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((b, t, 2 * hkv, DH)), jnp.float32)
  start = jnp.asarray(rng.integers(0, 9, b), jnp.int32)

  def step(pool, k, v, q, start):
    pool = pool.write(1, k, v, start)
    return pool.attention(1, q, start), pool.k

  outs = []
  for m in (None, mesh):
    pool = paged.PagedKV.create(layers, per_replica * dp, PAGE, b, width, hkv, DH, mesh=m)
    outs.append(jax.jit(step)(pool.with_page_table(table), k, v, q, start))
    if m is not None:
      hlo = jax.jit(step).lower(pool.with_page_table(table), k, v, q, start).compile().as_text()
      assert not any(op in hlo for op in ("all-gather", "all-reduce", "all-to-all",
                                          "collective-permute"))
  np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-5)
  np.testing.assert_array_equal(outs[1][1], outs[0][1])
  with pytest.raises(ValueError, match="pages split over"):
    paged.PagedKV.create(layers, per_replica * dp + 1, PAGE, b, width, hkv, DH, mesh=mesh)


def test_paged_attention_dispatch():
  q, _, _, pool_k, pool_v, table, lengths, start = _problem(5, 1, 4)
  args = (q, pool_k, pool_v, table, lengths, start)
  if jax.default_backend() != "gpu":
    np.testing.assert_array_equal(paged_attention.paged_attention(*args),
                                  paged_attention.paged_attention_reference(*args))
  with pytest.raises(ValueError, match="implementation='triton'"):
    paged_attention.paged_attention(*args, implementation="triton")
  with pytest.raises(ValueError, match="page_size=4"):  # too small for the GPU kernel
    paged_attention.paged_attention(*args, implementation="pallas")
  with pytest.raises(ValueError, match="with `layer`"):
    paged_attention.paged_attention(*args, layer=0)
  with pytest.raises(ValueError, match="pages_per_block=3"):
    paged_attention.paged_attention(*args, implementation="pallas", interpret=True, pages_per_block=3)
  with pytest.raises(ValueError, match="num_splits=0"):
    paged_attention.paged_attention(*args, implementation="pallas", interpret=True, num_splits=0)
  # launch settings are the kernel's; the other paths ignore them (one config for every backend)
  np.testing.assert_array_equal(
      paged_attention.paged_attention(*args, implementation="chunked", pages_per_block=4,
                                      num_warps=4, num_splits=4),
      paged_attention.paged_attention(*args, implementation="chunked"))


def test_shared_prefix_pages_and_copies_serve_every_sample():
  """A group's prompt (10 tokens: two full pages and a partial one) written once into the source
  row; share_prefix + copy_pages give every sample the same attention over the prompt, and each
  sample's next write lands on its own page."""
  rng = np.random.default_rng(4)
  prompt, group, heads = 10, 3, 4
  write, copy_pages = jax.jit(paged.write), jax.jit(paged.copy_pages)
  alloc = PageAllocator(num_pages=12, page_size=PAGE)
  assert alloc.admit(0, prompt)
  copies = alloc.share_prefix(0, [1, 2], prompt)
  assert [src for src, _ in copies] == [alloc.row_pages(0)[2]] * 2
  kv = paged.PagedKV.create(1, 12, PAGE, group, 4, HKV, DH)
  kv = kv.with_page_table(alloc.page_table([0, 1, 2], 4))
  k = rng.normal(size=(1, prompt, HKV, DH)).astype(np.float32)
  v = rng.normal(size=(1, prompt, HKV, DH)).astype(np.float32)
  # the prompt is prefilled into row 0 only: the other rows write past their tables (dropped)
  pk, pv = write(kv.k, kv.v, np.repeat(k, group, 0), np.repeat(v, group, 0), kv.page_table,
                 np.array([0, 1000, 1000]), layer=0)
  src, dst = np.array(copies).T
  pk, pv = copy_pages(pk, src, dst), copy_pages(pv, src, dst)
  kv = kv.replace(k=pk, v=pv).with_lengths(np.full(group, prompt))
  q = np.repeat(rng.normal(size=(1, 1, heads, DH)).astype(np.float32), group, 0)
  out = jax.jit(paged_attention.paged_attention_reference)(q, kv.k, kv.v, kv.page_table, kv.lengths,
                                                 kv.lengths - 1, layer=0)
  want = attend(q[:1], k, v, jnp.ones((1, 1, prompt), bool))
  np.testing.assert_allclose(out, np.repeat(want, group, 0), atol=2e-6)
  # every sample's position 10 (slot 2 of page 2) is private: different writes don't collide
  kn = rng.normal(size=(group, 1, HKV, DH)).astype(np.float32)
  pk, _ = write(kv.k, kv.v, kn, kn, kv.page_table, kv.lengths, layer=0)
  for b in range(group):
    np.testing.assert_array_equal(pk[0, :, alloc.row_pages(b)[2], 2], kn[b, 0])
  # copy pairs padded with NO_PAGE (a static count) are dropped
  padded = copy_pages(kv.k, np.array([*src, 0]), np.array([*dst, NO_PAGE]))
  np.testing.assert_array_equal(padded, kv.k)


def test_layering():
  """The allocator imports no jax; the device module nothing from sampling (models layer)."""
  code = ("import sys, specjax.sampling.page_allocator; "
          "assert 'jax' not in sys.modules, 'pages imported jax'; "
          "import specjax.models.paged; "
          "assert [m for m in sys.modules if m.startswith('specjax.sampling.')] == "
          "['specjax.sampling.page_allocator'], 'paged imported sampling'")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
  assert pages.NO_PAGE == paged.NO_PAGE


# -- host side ----------------------------------------------------------------------------------

def _state(alloc):
  return (alloc.free_pages, {r: alloc.row_pages(r) for r in alloc.rows},
          {r: alloc.row_tokens(r) for r in alloc.rows})


def _check_invariants(alloc, shared_upto):
  """Every page is free or held; refcounts equal holders; only leading prefix pages are shared;
  a row holds exactly the pages its tokens need."""
  holders = np.zeros(alloc.num_pages, np.int64)
  for row in alloc.rows:
    held = alloc.row_pages(row)
    assert len(set(held)) == len(held), f"row {row} holds a page twice"
    assert len(held) == alloc.pages_for(alloc.row_tokens(row))
    holders[list(held)] += 1
    for i, page in enumerate(held):
      if alloc.refcount(page) > 1:
        assert i < shared_upto[row], f"page {page} shared at position {i} of row {row}"
  for page in range(alloc.num_pages):
    assert alloc.refcount(page) == holders[page]
  assert alloc.free_pages == int(np.sum(holders == 0))
  assert alloc.pages_in_use == int(np.sum(holders > 0))


def test_allocator_random_operations_keep_invariants():
  rng = np.random.default_rng(0)
  alloc = PageAllocator(num_pages=24, page_size=PAGE, max_pages_per_row=10)
  shared_upto, next_row = {}, 0
  counts = dict.fromkeys(["admit", "refused", "grow", "share", "release", "preempt"], 0)
  for _ in range(400):
    op = rng.choice(["admit", "admit", "grow", "grow", "share", "release", "preempt"])
    live = list(alloc.rows)
    if op == "admit" or not live:
      before = _state(alloc)
      ok = alloc.admit(next_row, int(rng.integers(0, 10 * PAGE + 1)))
      if ok:
        shared_upto[next_row] = 0
        counts["admit"] += 1
      else:
        assert _state(alloc) == before
        counts["refused"] += 1
      next_row += 1
    elif op == "grow":
      row = int(rng.choice(live))
      new = min(alloc.row_tokens(row) + int(rng.integers(0, 3 * PAGE)), 10 * PAGE)
      before = _state(alloc)
      if alloc.grow(row, new):
        assert alloc.row_tokens(row) == new
        counts["grow"] += 1
      else:
        assert _state(alloc) == before
    elif op == "share":
      src = int(rng.choice(live))
      prefix = int(rng.integers(0, alloc.row_tokens(src) + 1))
      dsts = list(range(next_row, next_row + int(rng.integers(1, 4))))
      next_row += len(dsts)
      before = _state(alloc)
      copies = alloc.share_prefix(src, dsts, prefix)
      if copies is None:
        assert _state(alloc) == before
        continue
      full = prefix // PAGE
      assert len(copies) == (len(dsts) if prefix % PAGE else 0)
      for d in dsts:
        assert alloc.row_pages(d)[:full] == alloc.row_pages(src)[:full]
        shared_upto[d] = full
      for (s, d), row in zip(copies, dsts):
        assert s == alloc.row_pages(src)[full] and d == alloc.row_pages(row)[full]
      shared_upto[src] = max(shared_upto[src], full)
      counts["share"] += 1
    elif op == "release":
      alloc.release(int(rng.choice(live)))
      counts["release"] += 1
    else:
      need = int(rng.integers(0, alloc.num_pages + 1))
      keep = set(rng.choice(live, size=min(len(live), int(rng.integers(0, 2))), replace=False))
      rows = alloc.preempt_candidates(need, keep=keep)
      newest = [r for r in reversed(alloc.rows) if r not in keep]
      trial = copy.deepcopy(alloc)
      if rows is None:
        for r in newest:
          trial.release(r)
        assert trial.free_pages < need
        continue
      assert rows == newest[:len(rows)] and not set(rows) & keep
      for r in rows[:-1]:
        trial.release(r)
      assert not rows or trial.free_pages < need  # minimal: one row fewer is not enough
      if rows:
        trial.release(rows[-1])
      assert trial.free_pages >= need
      if rng.random() < 0.5:
        for r in rows:
          alloc.release(r)
        counts["preempt"] += 1
    _check_invariants(alloc, shared_upto)
  assert all(counts.values()), counts  # every kind of operation happened
  for row in alloc.rows:
    alloc.release(row)
  assert alloc.free_pages == alloc.num_pages and alloc.pages_in_use == 0
  assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))


def test_allocator_page_table():
  alloc = PageAllocator(num_pages=8, page_size=PAGE)
  assert alloc.admit(3, 9) and alloc.admit(5, 0) and alloc.admit(1, 4)
  table = alloc.page_table([3, PADDING_ROW, 5, 1], 4)
  chex.assert_equal(table.dtype, np.int32)
  np.testing.assert_array_equal(table, [[0, 1, 2, -1], [-1] * 4, [-1] * 4, [3, -1, -1, -1]])
  assert alloc.grow(5, 1) and alloc.page_table([5], 2).tolist() == [[4, NO_PAGE]]
  assert not alloc.admit(7, 4 * PAGE)  # 3 pages free
  assert alloc.preempt_candidates(3) == [] and alloc.preempt_candidates(4) == [1]
  assert alloc.preempt_candidates(5) == [1, 5]  # newest admission first, not newest growth


def test_allocator_errors_name_the_argument():
  alloc = PageAllocator(num_pages=6, page_size=PAGE, max_pages_per_row=4)
  assert alloc.admit(0, 5)
  with pytest.raises(ValueError, match="row 0 is already admitted"):
    alloc.admit(0, 1)
  with pytest.raises(ValueError, match="row: row 9 is not admitted"):
    alloc.release(9)
  with pytest.raises(ValueError, match="row: row 9 is not admitted"):
    alloc.grow(9, 3)
  with pytest.raises(ValueError, match="num_tokens=17 .* never fit"):
    alloc.admit(1, 17)  # 5 pages: more than a row's table holds
  with pytest.raises(ValueError, match="num_tokens must be a non-negative int, got -1"):
    alloc.admit(1, -1)
  roomy = PageAllocator(num_pages=6, page_size=PAGE)
  assert roomy.admit(0, 0)
  with pytest.raises(ValueError, match="new_length=100 .* whole pool"):
    roomy.grow(0, 100)
  with pytest.raises(ValueError, match="row: a row is a non-negative int"):
    alloc.admit(-2, 1)
  with pytest.raises(ValueError, match="dst_rows: row 0 is already admitted"):
    alloc.share_prefix(0, [0], 4)
  with pytest.raises(ValueError, match="dst_rows has repeated rows"):
    alloc.share_prefix(0, [1, 1], 4)
  with pytest.raises(ValueError, match="prefix_len=6 exceeds the 5 tokens of src_row 0"):
    alloc.share_prefix(0, [1], 6)
  with pytest.raises(ValueError, match="src_row: row 4 is not admitted"):
    alloc.share_prefix(4, [1], 1)
  with pytest.raises(ValueError, match="max_pages=1 is too small for row 0"):
    alloc.page_table([0], 1)
  with pytest.raises(ValueError, match="rows: row 4 is not admitted"):
    alloc.page_table([4], 4)
  with pytest.raises(ValueError, match="need_pages=7 exceeds the whole pool"):
    alloc.preempt_candidates(7)
  with pytest.raises(ValueError, match="page_size must be a positive int"):
    PageAllocator(num_pages=4, page_size=0)



def test_a_row_that_cannot_grow_always_finds_rows_to_swap_out_for_it():
  """What the engine's swap relies on: from any state, a row that cannot grow to a length the
  pool holds (grow gives False, not an error) has preemption candidates that free enough."""
  rng = np.random.default_rng(0)
  checked = 0
  for _ in range(200):
    alloc = PageAllocator(num_pages=int(rng.integers(2, 12)), page_size=PAGE)
    for row in range(int(rng.integers(1, 6))):  # own pages, or a group's shared prompt pages
      if alloc.rows and rng.random() < 0.5:
        src = alloc.rows[int(rng.integers(len(alloc.rows)))]
        alloc.share_prefix(src, [row], int(rng.integers(0, alloc.row_tokens(src) + 1)))
      else:
        alloc.admit(row, int(rng.integers(0, 2 * PAGE)))
    for row in alloc.rows:
      held = len(alloc.row_pages(row))
      length = int(rng.integers(0, alloc.num_pages * PAGE + 1))
      if alloc.grow(row, length):
        continue
      victims = alloc.preempt_candidates(alloc.pages_for(length) - held, keep=(row,))
      assert victims, (row, length, alloc.rows, alloc.free_pages)
      checked += 1
  assert checked > 50


@pytest.mark.parametrize("found", [None, []], ids=["none", "empty"])
def test_a_swap_that_finds_no_row_to_swap_out_is_an_internal_error_that_changes_nothing(
    monkeypatch, found):
  rep = slot_pages.ReplicaPages(num_pages=4, page_size=PAGE, cache_size=4 * PAGE, page_ahead=PAGE)
  assert rep.alloc.admit(0, 2 * PAGE) and rep.alloc.admit(1, PAGE)
  monkeypatch.setattr(rep.alloc, "preempt_candidates", lambda need, keep=(): found)
  with pytest.raises(RuntimeError, match=re.escape(
      f"no row to swap out for slot 0 (candidates: {found}), which needs 1 more pages for 9 + 2 "
      f"tokens; 1 of 4 pages free, pages held by slot (oldest admission first) {{0: 2, 1: 1}}, "
      f"swapped out []")):
    rep._swap_out((), 0, 2 * PAGE + 1, 2)
  assert rep.alloc.rows == (0, 1) and rep.alloc.free_pages == 1 and not rep.swapped
