"""The engine on paged KV memory: rows take pages as they grow, wait (commit nothing) when none
are free, and are swapped out to host memory when too many wait. Whatever the pool's size, the
engine emits what the plain loop emits, token for token (greedy), and no page is left unaccounted
for or held by two rows, except the full prompt pages a GRPO group's samples share, which no row
writes."""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# the queue tests' tiny target config, ragged prompts (greedy lengths 1..24) and checks
from test_queue import (CFG, GREEDY, PROMPT_LENGTHS, PROMPTS,
                        assert_nothing_compiles_after_the_first_rollout, assert_same_rollout)

from specjax.drafters import (DraftModelDrafter, HistoryDrafter, HistoryParams, HistoryStore,
                              NgramDrafter, eagle3_drafter, identity_maps, init_head, mtp_drafter,
                              truncated_copy)
from specjax.models import Decoder
from specjax.models.paged import PagedKV
from specjax.models.tree import DraftTree
from specjax.sampling import (STATIC, EngineConfig, SamplingConfig, generate,
                              speculative_generate)
from specjax.sampling.engine_config import (AdaptiveConfig, BucketConfig, CompileConfig,
                                            PagingConfig, QueueConfig)
from specjax.sampling.engine import paged_state, programs, slot_pages
from specjax.sampling.engine.kv import PagedKVManager
from specjax.sampling import segment as seg
from specjax.sampling.engine.paged_state import bytes_per_page
from specjax.sharding import MeshConfig, make_mesh, shard_model

PAGE = 4
PAGE_BYTES = bytes_per_page(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, PAGE, jnp.float32)


def paged(num_pages: int, *, max_rows: int = 8, share_prefill: bool = True, adaptive: bool = True,
          compile_ahead: bool = False, window_block: int = 0, refill_from_costs: bool = True,
          **paging) -> EngineConfig:
  """An engine whose pool holds `num_pages` pages of PAGE positions (`paging`: more of its
  PagingConfig)."""
  paging = {"page_ahead": 4, **paging}
  return EngineConfig(
      queue=QueueConfig(max_rows=max_rows, refill_fraction=0.25, share_prefill=share_prefill,
                        refill_from_costs=refill_from_costs),
      paging=PagingConfig(kv_cache_gb=num_pages * PAGE_BYTES / 2**30, page_size=PAGE, **paging),
      buckets=BucketConfig(window_block=window_block), adaptive=AdaptiveConfig(enabled=adaptive),
      compile=CompileConfig(ahead=compile_ahead))


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def static_ar(target):
  return generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=STATIC)


class _Log(list):
  drafter_paged = False


@pytest.fixture
def page_checks(monkeypatch):
  """Checks, at every visit of the real engine, what the device will read: no page in two rows'
  tables, every page of the allocator in exactly the table row of its slot, every row the
  allocator holds able to hold its committed tokens, and (on a mesh) every row's pages in its
  own data-parallel replica's shard of the pool, the replica that steps it; a drafter cache on
  pages has the target's page table. Returns the per-visit (live rows, pages in use) log (its
  `drafter_paged`: a visit saw the drafter's cache on pages)."""
  log = _Log()
  real = PagedKVManager.visit

  def visit(self, state, summary):
    state = real(self, state, summary)
    pages = self.pages
    table = np.asarray(state.cache.page_table)
    for pool in paged_state.pools(state)[1:]:  # a drafter's cache on the target's pages
      np.testing.assert_array_equal(np.asarray(pool.page_table), table)
      log.drafter_paged = True
    live, seq_lengths, _, _, _, row_ids, homes = summary
    held = collections.Counter(table[table >= 0].tolist())
    assert len(held) == pages.pages_in_use, "a page in use is in no table (or leaked)"
    for page, tables in held.items():
      assert pages.refcount(page) == tables, f"page {page}: tables and holders differ"
    replicas = len(pages.replicas)
    per_replica = pages.num_pages // replicas
    for i, (home, rid) in enumerate(zip(homes, row_ids)):
      if rid >= 0 and int(home) in pages:
        assert list(table[i][table[i] >= 0]) == list(pages.row_pages(int(home)))
        replica = i // (len(homes) // replicas)  # the replica that steps bucket row i
        assert pages.replica_of(int(home)) == replica
        assert all(page // per_replica == replica for page in table[i][table[i] >= 0])
        if live[i]:
          assert (table[i] >= 0).sum() * PAGE >= seq_lengths[i] - 1
          # a shared page lies wholly below the row's cached positions: it is never written
          shared = [j for j, page in enumerate(table[i]) if page >= 0 and held[int(page)] > 1]
          assert all((j + 1) * PAGE <= seq_lengths[i] - 1 for j in shared)
    log.append((int(np.sum(live)), pages.pages_in_use))
    return state

  monkeypatch.setattr(PagedKVManager, "visit", visit)
  return log


@pytest.mark.parametrize("num_pages", [400, 24, 14])
def test_greedy_paged_queue_equals_the_plain_loop(target, static_ar, page_checks, num_pages):
  """400 pages: rows never wait; 24: rows wait for pages; 14 (two rows' worth at most): rows are
  swapped out and back."""
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY,
                 engine=paged(num_pages))
  assert_same_rollout(out, static_ar)
  assert page_checks and max(p for _, p in page_checks) <= num_pages
  swaps = sum(s.swapped_out for s in out.segments)
  if num_pages == 14:
    assert swaps > 0
  if num_pages == 400:
    assert swaps == 0


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "adaptive", "eagle3", "eagle3_history"])
def test_greedy_paged_speculative_equals_the_plain_loop(target, static_ar, page_checks, kind):
  """`adaptive`: the draft model with K chosen per segment, so calibration's dry segments step
  the paged state (pool and page tables) and give it back. `eagle3`: an (untrained) EAGLE-3
  head, its one-layer cache on the target's pages. `eagle3_history`: the history drafter over
  that head, its history holding half of the rows' own completions (the head drafts the rest):
  the head's cache on the target's pages as well."""
  if kind in ("draft_model", "adaptive"):  # a copy of the target: every draft accepted
    drafter, params = DraftModelDrafter.from_model(target, 3)
  elif kind.startswith("eagle3"):
    drafter, params = eagle3_drafter(init_head(CFG, seed=3), target.embed[...],
                                     identity_maps(CFG.vocab_size), draft_len=3)
    if kind == "eagle3_history":
      store = HistoryStore(max_prompts=16, per_prompt=2, width=32, tail=3)
      store.record(*jax.device_get((PROMPTS[::2], PROMPT_LENGTHS[::2], static_ar.tokens[::2],
                                    static_ar.lengths[::2])))
      drafter = HistoryDrafter(draft_len=3, n=3, min_match=2, inner=drafter)
      params = HistoryParams(table=store.table(), inner=params)
  else:
    drafter, params = NgramDrafter(draft_len=3, n=2), ()
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=paged(40, adaptive=kind == "adaptive"))
  assert_same_rollout(out, static_ar)
  # a draft model's or head's cache lives on the target's pages (40 pages of target + draft
  # KV; for a draft model as large as the target, 20 pages of each)
  assert page_checks.drafter_paged == (kind != "ngram")
  if kind != "adaptive":
    assert all(s.draft_len == 3 for s in out.segments)


def test_greedy_paged_mtp_equals_the_plain_loop(page_checks):
  """The decoder's own MTP module as the drafter: its one-layer cache on the target's pages."""
  model = Decoder(dataclasses.replace(CFG, mtp=True), rngs=nnx.Rngs(4))
  static = generate(model, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=STATIC)
  drafter, params = mtp_drafter(model, draft_len=3)
  out = speculative_generate(model, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=paged(40))
  assert_same_rollout(out, static)
  assert page_checks.drafter_paged


@pytest.mark.parametrize("num_pages", [150, 24])
def test_greedy_paged_draft_trees_equal_the_plain_loop(target, static_ar, page_checks, num_pages):
  """A draft tree on pages: the target's first layer as the draft, its 2 best candidates at each
  of K = 3 depths, so a verify writes 7 nodes and the accepted path (an alternative where the
  chain's draft is rejected) is moved to a chain's positions through the page table. Rows take
  pages for the tree's nodes, not K + 1 (else a row that must wait for pages would wait for
  ever). 150 pages of target KV (the draft's KV on the same pages: 100 pages of both, a row
  needs at most 10): rows never wait; 24 (16 pages): rows wait and are swapped out and back.
  Refills at the fixed fraction, so whether rows wait does not hang on the machine's load."""
  drafter, params = DraftModelDrafter.from_model(truncated_copy(target, 1), 3, tree_width=2)
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=paged(num_pages, adaptive=False,
                                                  refill_from_costs=False))
  assert_same_rollout(out, static_ar)
  assert page_checks.drafter_paged
  assert all((s.draft_len, s.tree_width) == (3, 2) for s in out.segments)
  swaps = sum(s.swapped_out for s in out.segments)
  assert swaps > 0 if num_pages == 24 else swaps == 0


def test_a_paged_run_holds_its_pool_once_whichever_bucket_steps(target, static_ar, monkeypatch):
  """Compaction hands a bucket the pool's page buffers instead of a copy, and so does the
  preparation of every bucket (compile_ahead; adaptive K, so each bucket's dry runs step it):
  whenever a segment runs, the target's pool is alive once (its k and v)."""
  alive = []
  real = programs.segment_jit

  class Counted:
    lower = real.lower

    def __call__(self, *args, **kw):
      k = args[5].cache.k  # (graphdef, params, drafter, drafter params, key, state, ...)
      alive.append(sum(x.shape == k.shape and x.dtype == k.dtype for x in jax.live_arrays()))
      return real(*args, **kw)

  monkeypatch.setattr(programs, "segment_jit", Counted())
  # K of 0 or 1: every bucket's programs at both are compiled and dry-run (K = 3 would compile
  # twice as many and check nothing more). Refills at the fixed fraction: with refills chosen
  # from measured costs the drain, and so the buckets it passes, would hang on the machine's load
  drafter, params = DraftModelDrafter.from_model(truncated_copy(target, 1), 1)
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=paged(200, compile_ahead=True,
                                                  refill_from_costs=False))
  assert_same_rollout(out, static_ar)
  assert len({s.bucket for s in out.segments}) >= 3 and len(alive) > len(out.segments)
  assert max(alive) == 2, alive


def test_swapping_a_row_back_writes_into_the_pool_in_place(target, static_ar, monkeypatch):
  """(14 pages: rows are swapped out and back) the copy back takes the pool's buffers, so the
  pool is never held twice."""
  alive = []
  real = paged_state.write_pages_program

  class Counted:
    lower = real.lower

    def __call__(self, buffers, *args):
      out = real(buffers, *args)
      k = out[0][0]
      alive.append(sum(x.shape == k.shape and x.dtype == k.dtype for x in jax.live_arrays()))
      return out

  monkeypatch.setattr(paged_state, "write_pages_program", Counted())
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=paged(14))
  assert_same_rollout(out, static_ar)
  assert alive and max(alive) == 2, alive


def test_paged_batch_without_a_queue_compacts_and_equals_the_plain_loop(target, static_ar,
                                                                         page_checks):
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY,
                 engine=paged(60, max_rows=0, window_block=8))
  assert_same_rollout(out, static_ar)
  assert min(s.bucket for s in out.segments) < 24  # compaction ran on the paged state


def test_a_kv_budget_alone_sets_the_slots(target, static_ar, page_checks):
  """`kv_cache_gb` without `max_rows`: the slots are the rows the empty pool holds at once (each
  row's prompt, its first token and `page_ahead` positions, in order), and the other rows queue
  for them instead of waiting for every slot to be free. Each row emits the plain loop's."""
  num_pages = 24
  need = -(-(np.asarray(PROMPT_LENGTHS) + 1 + 4) // PAGE)  # pages of a row when admitted
  holds = int(np.searchsorted(np.cumsum(need), num_pages, side="right"))
  assert 4 < holds < 24
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY,
                 engine=paged(num_pages, max_rows=0))
  assert_same_rollout(out, static_ar)
  assert out.segments[0].bucket == holds
  # refills came while rows were still live (a queue, not waves of the whole batch)
  assert any(s.bucket == holds and 0 < s.live_rows_start for s in out.segments[1:])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_length_mixes_keep_pages_consistent(target, page_checks, seed):
  rng = np.random.default_rng(seed)
  prompts = jnp.asarray(rng.integers(1, 32, (16, 9)), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, 10, 16), jnp.int32)
  cfg = SamplingConfig(max_new_tokens=int(rng.integers(8, 33)), temperature=0.0,
                       eos_ids=tuple(int(t) for t in rng.choice(32, 2, replace=False)))
  plain = generate(target, prompts, lengths, jax.random.key(0), cfg, engine=STATIC)
  num_pages = int(rng.integers(-(-(9 + cfg.max_new_tokens + 1) // PAGE), 40))
  out = generate(target, prompts, lengths, jax.random.key(0), cfg,
                 engine=paged(num_pages, max_rows=int(rng.choice([4, 8, 16])),
                              page_ahead=int(rng.integers(1, 9))))
  assert_same_rollout(out, plain)


@pytest.mark.parametrize("num_pages", [400, 30])
def test_a_groups_samples_share_their_prompt_pages(target, page_checks, num_pages, monkeypatch):
  """GRPO groups (4 samples of each of 6 prompts): the samples of a group share its full prompt
  pages, so the same rows take fewer pages, and every row emits what the plain loop emits (30
  pages: rows also wait and are swapped out, shared pages included). Refills of 2 slots admit a
  group's samples in parts: a later sample shares the pages a sibling still holds."""
  prompts = jnp.repeat(PROMPTS[:6] % 31 + 1, 4, axis=0)
  lengths = jnp.repeat(jnp.asarray([6, 5, 4, 6, 3, 6], jnp.int32), 4)
  plain = generate(target, prompts, lengths, jax.random.key(0), GREEDY, engine=STATIC)
  admitted = []  # (sharing a sibling's pages, admitted) per queued row
  real = slot_pages.SlotPages.admit_row

  def admit_row(self, slot, seq_len, draft_len, share_from=None, prefix=0):
    ok = real(self, slot, seq_len, draft_len, share_from, prefix)
    admitted.append((share_from is not None, ok))
    return ok

  monkeypatch.setattr(slot_pages.SlotPages, "admit_row", admit_row)
  first_visit = {}
  for share in (True, False):
    page_checks.clear()
    admitted.clear()
    out = generate(target, prompts, lengths, jax.random.key(0), GREEDY,
                   engine=paged(num_pages, share_prefill=share))
    assert_same_rollout(out, plain)
    first_visit[share] = page_checks[0]
    if num_pages == 30:
      assert sum(s.swapped_out for s in out.segments) > 0
    # (8 rows start in the slots; the other 16 come 2 at a time)
    assert sum(ok for _, ok in admitted) == 16
    assert any(shared and ok for shared, ok in admitted) == share
  (rows_shared, pages_shared), (rows_alone, pages_alone) = first_visit[True], first_visit[False]
  if num_pages == 400:  # the same rows at the first visit, in fewer pages
    assert rows_shared == rows_alone == 8
    assert pages_shared < pages_alone


def test_a_pool_too_small_for_one_row_is_a_clear_error(target):
  with pytest.raises(ValueError, match="kv_cache_gb.*one row needs 8 pages"):
    generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=paged(7))
  # a draft model as large as the target: each page holds its KV too, so 8 pages' worth of
  # target memory holds 4 pages
  drafter, params = DraftModelDrafter.from_model(target, 3)
  with pytest.raises(ValueError, match="kv_cache_gb.*holds 4 pages.*one row needs 9"):
    speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                         GREEDY, engine=paged(8))
  with pytest.raises(ValueError, match="EngineConfig.paging.page_size"):
    EngineConfig(paging=PagingConfig(page_size=0))
  with pytest.raises(ValueError, match="EngineConfig.paging.kernel_pages"):
    EngineConfig(paging=PagingConfig(kernel_pages=3))


def test_the_kernels_launch_settings_reach_every_paged_attention(target, static_ar, monkeypatch):
  """`EngineConfig.paging.kernel_pages` / `kernel_warps` / `kernel_splits` travel with the target's and the draft
  model's pools into every paged attention call (the GPU kernel's launch; the CPU path ignores
  them), and the rollout is the plain loop's."""
  from specjax.models import paged as paged_lib
  seen, real = set(), paged_lib.paged_attention

  def recorded(*args, **kw):
    seen.add((kw.get("pages_per_block"), kw.get("num_warps"), kw.get("num_splits")))
    return real(*args, **kw)

  monkeypatch.setattr(paged_lib, "paged_attention", recorded)
  drafter, params = DraftModelDrafter.from_model(truncated_copy(target, 1), 3)
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                             GREEDY, engine=paged(60, kernel_pages=4, kernel_warps=2,
                                                  kernel_splits=2))
  assert_same_rollout(out, static_ar)
  assert seen == {(4, 2, 2)}


def collective_sizes(hlo: str) -> list[int]:
  """Elements of every collective's result in a compiled program's HLO text."""
  shapes = re.findall(r"= \w+\[([\d,]*)\][^ ]* (?:all-gather|all-reduce|all-to-all|"
                      r"collective-permute|reduce-scatter)(?:-start)?\(", hlo)
  return [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]


@pytest.mark.parametrize("mesh_shape,num_pages", [((2, 1, 4), 14), ((4, 1, 2), 8)])
def test_sharded_paged_queue_equals_one_device(target, static_ar, page_checks, mesh_shape,
                                               num_pages, monkeypatch):
  """The pool split over the data-parallel replicas (`kv_cache_gb` per device: each replica
  holds `num_pages` pages), each replica's rows on its own pages; 14 pages per replica: rows
  wait and are swapped out; 8 (one row's worth) on 4 replicas: rows mostly run one at a time
  per replica and compaction keeps each replica's rows on it. An admission moves the new rows'
  prompt KV between devices (GSPMD gathers a prefill's rows), never the pool."""
  admissions = []
  real = paged_state.admit_paged

  class Recorded:
    def __call__(self, *args):
      admissions.append(args)
      return real(*args)

    def lower(self, *args):
      return real.lower(*args)

  monkeypatch.setattr(paged_state, "admit_paged", Recorded())
  mesh = make_mesh(MeshConfig(*mesh_shape))
  sharded = shard_model(nnx.clone(target), mesh)
  out = generate(sharded, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY,
                 engine=paged(num_pages))
  assert_same_rollout(out, static_ar)
  assert page_checks and max(p for _, p in page_checks) <= num_pages * mesh_shape[0]
  if num_pages == 14:
    assert sum(s.swapped_out for s in out.segments) > 0
    sizes = collective_sizes(real.lower(*admissions[0]).compile().as_text())
    pool = admissions[0][0].cache.k
    assert sizes and max(sizes) < pool.size // mesh.size  # (the new rows' KV, row state)


def test_sharded_paged_speculative_equals_one_device(target, static_ar, page_checks):
  mesh = make_mesh(MeshConfig(4, 1, 2))
  sharded = shard_model(nnx.clone(target), mesh)
  drafter, params = DraftModelDrafter.from_model(sharded, 3)
  out = speculative_generate(sharded, drafter, params, PROMPTS, PROMPT_LENGTHS,
                             jax.random.key(1), GREEDY, engine=paged(20, adaptive=True))
  assert_same_rollout(out, static_ar)


def test_decoder_forward_over_pages_equals_the_dense_cache(target):
  """Prefill then a 3-token verify block, rows on scattered pages, a window over the pages."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 32, (3, 7)), jnp.int32)
  table = np.full((3, 6), -1, np.int32)
  table[:, :4] = rng.permutation(20)[:12].reshape(3, 4)
  pool = PagedKV.create(CFG.num_layers, 20, PAGE, 3, 6, CFG.num_kv_heads,
                        CFG.head_dim).with_page_table(table)
  dense = target.init_cache(3, 24)
  a, b = target(tokens, cache=dense), target(tokens, cache=pool)
  # (float32: the two caches sum attention in different orders; logits of ~2 differ by ~1e-5)
  np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
  step = jnp.array([7, 5, 3])
  a = target(tokens[:, :3], cache=a.cache.advance(step))
  b = target(tokens[:, :3], cache=b.cache.advance(step).with_window(12))
  np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_draft_tree_over_pages_scores_and_keeps_its_path_as_the_dense_cache(target, sharded):
  """A verify forward over a draft tree (K = 3, 3 candidates per depth: 10 nodes) on scattered
  pages gives the dense cache's logits; its accepted paths (the chain, alternatives at two
  depths, rows of different lengths) moved to a chain's positions (`keep_path`), the next
  forward does too. Without the tree mask, or without the move, it would not. `sharded`: the
  pool split over 4 data-parallel replicas (and kv heads over 2), each row on its replica's
  pages, the tree's attention and the move run per replica."""
  forward = nnx.jit(lambda m, tokens, cache, tree=None: m(tokens, cache=cache, tree=tree),
                    static_argnames="tree")  # (one program per call shape, not one per op)
  rng = np.random.default_rng(1)
  mesh = make_mesh(MeshConfig(4, 1, 2)) if sharded else None
  model = shard_model(nnx.clone(target), mesh) if sharded else target
  tokens = jnp.asarray(rng.integers(1, 32, (4, 7)), jnp.int32)
  table = np.full((4, 8), -1, np.int32)
  for r in range(4):  # row r on pages of replica r (8 pages each)
    table[r, :6] = 8 * r + rng.permutation(8)[:6]
  pool = PagedKV.create(CFG.num_layers, 32, PAGE, 4, 8, CFG.num_kv_heads, CFG.head_dim,
                        mesh=mesh).with_page_table(table)
  dense, paged_ = forward(target, tokens, target.init_cache(4, 32)), forward(model, tokens, pool)
  tree = DraftTree(3, 3)
  nodes = jnp.asarray(rng.integers(1, 32, (4, tree.nodes)), jnp.int32)
  start = jnp.array([7, 5, 3, 6])
  a = forward(target, nodes, dense.cache.advance(start), tree)
  b = forward(model, nodes, paged_.cache.advance(start), tree)
  np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
  if not sharded:
    chain = forward(target, nodes, paged_.cache.advance(start))
    assert np.abs(chain.logits - b.logits).max() > 1e-2  # (the tree mask matters)
  # row 0 the whole chain; row 1 depth 1's second alternative (node 5; an alternative is a
  # leaf); row 2 the chain's first draft, then depth 2's second alternative (node 7); row 3
  # the chain's first two drafts, then depth 3's first alternative (node 8)
  path = jnp.array([[0, 1, 2, 3], [0, 5, 0, 0], [0, 1, 7, 0], [0, 1, 2, 8]], jnp.int32)
  kept = jnp.array([4, 2, 3, 4])  # positions each row commits of its path
  nxt = jnp.asarray(rng.integers(1, 32, (4, 2)), jnp.int32)
  a = forward(target, nxt, a.cache.keep_path(path, tree.nodes).advance(kept))
  moved = forward(model, nxt, b.cache.keep_path(path, tree.nodes).advance(kept))
  np.testing.assert_allclose(a.logits, moved.logits, rtol=1e-5, atol=1e-5)
  if not sharded:
    unmoved = forward(target, nxt, b.cache.advance(kept))
    assert np.abs(unmoved.logits - moved.logits)[1:].max() > 1e-2  # (the move matters)


@pytest.mark.parametrize("kind", ["eagle3", "draft_model", "mtp"])
def test_a_drafter_on_pages_drafts_as_on_its_dense_cache(target, kind):
  """The prompts prefilled and observed (dense, prompt-wide), moved onto scattered pages, then
  a K = 3 proposal at temperature 1: tokens and draft probabilities equal the dense cache's."""
  if kind == "eagle3":
    drafter, params = eagle3_drafter(init_head(CFG, seed=3), target.embed[...],
                                     identity_maps(CFG.vocab_size), draft_len=3)
  elif kind == "mtp":  # (the target's own module: a target that has one)
    target = Decoder(dataclasses.replace(CFG, mtp=True), rngs=nnx.Rngs(4))
    drafter, params = mtp_drafter(target, draft_len=3)
  else:
    drafter, params = DraftModelDrafter.from_model(Decoder(CFG, rngs=nnx.Rngs(7)), 3)
  graphdef, tparams = nnx.split(target)
  prompts, lengths = PROMPTS[:6], PROMPT_LENGTHS[:6]
  cfg = SamplingConfig(max_new_tokens=8, temperature=1.0)
  dense = seg.init_state(graphdef, tparams, drafter, params, prompts, lengths, jax.random.key(0),
                         cfg, cache_size=24, max_draft_len=3)
  small = seg.init_state(graphdef, tparams, drafter, params, prompts, lengths, jax.random.key(0),
                         cfg, cache_size=24, max_draft_len=3, target_cache_size=6)
  table = np.random.default_rng(0).permutation(60)[:36].reshape(6, 6).astype(np.int32)
  pool = lambda c: PagedKV.create(len(c.k), 60, PAGE, 6, 6, c.k[0].shape[1], c.k[0].shape[2])
  on_pages = paged_state.to_paged(small, pool(small.cache), jnp.asarray(table),
                                 pool(paged_state.drafter_cache(small.drafter_state)))
  assert isinstance(paged_state.drafter_cache(on_pages.drafter_state), PagedKV)
  key = jax.random.key(2)
  a_tok, a_probs, _ = drafter.propose(params, dense.drafter_state, dense.seq, key)
  b_tok, b_probs, _ = drafter.propose(params, on_pages.drafter_state, on_pages.seq, key)
  assert a_probs is not None
  np.testing.assert_array_equal(a_tok, b_tok)
  np.testing.assert_allclose(a_probs, b_probs, atol=1e-5)


def test_after_the_first_paged_rollout_nothing_compiles(target):
  """(14 pages: rows wait and are swapped out, so swapping's copies run too, at whichever bucket;
  compile_ahead: by default a later rollout may reach a bucket the first did not.)"""
  assert_nothing_compiles_after_the_first_rollout(
      target, paged(14, adaptive=False, compile_ahead=True), rounds=2)


# -- the KV budget as a share of device memory ----------------------------------------------------

class _Device:
  """What a GPU reports of its memory (`Device.memory_stats`); the CPU reports none."""

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats

  def __str__(self):
    return "gpu:0"


def test_a_kv_budget_as_a_share_of_free_device_memory():
  from specjax.sampling.engine.paged_state import kv_cache_gb_for

  gpu = _Device({"bytes_limit": 8 * 2**30, "bytes_in_use": 2 * 2**30})
  assert kv_cache_gb_for(0.5, gpu) == 3.0  # half of the 6 GiB free
  with pytest.raises(ValueError, match=r"kv_cache_fraction=0.5: device .* reports no memory "
                                       r"limit.*kv_cache_gb"):
    kv_cache_gb_for(0.5, jax.devices()[0])  # the CPU: memory_stats() is None


def test_rollout_kv_budget_is_fixed_at_the_first_rollout(monkeypatch):
  from specjax.config_tree import parse_args
  from specjax.jobs.config import ExperimentConfig
  from specjax.rl import rollout
  from specjax.rl.config import RolloutConfig

  cfg = parse_args(ExperimentConfig(), ["--rl.rollout.kv-cache-fraction", "0.25"])
  assert cfg.rl.rollout.kv_cache_fraction == 0.25
  paged = RolloutConfig.engine.replace(paging=dict(kv_cache_gb=1.0))
  with pytest.raises(ValueError, match="RolloutConfig.kv_cache_fraction: set it or "
                                       "engine.paging.kv_cache_gb"):
    RolloutConfig(kv_cache_fraction=0.25, engine=paged)
  with pytest.raises(ValueError, match="RolloutConfig.kv_cache_fraction: must be in"):
    RolloutConfig(kv_cache_fraction=1.0)
  with pytest.raises(ValueError, match="RolloutConfig.kv_cache_fraction=0.25: device"):
    rollout.KVBudget().resolve(cfg.rl.rollout)  # on the CPU
  gpu = _Device({"bytes_limit": 10 * 2**30, "bytes_in_use": 2 * 2**30})
  monkeypatch.setattr(jax, "devices", lambda *a: [gpu])
  budget = rollout.KVBudget()
  assert budget.resolve(cfg.rl.rollout) == 2.0  # a quarter of the 8 GiB free
  gpu.stats = {"bytes_limit": 10 * 2**30, "bytes_in_use": 6 * 2**30}  # the run placed more
  assert budget.resolve(cfg.rl.rollout) == budget.resolve(cfg.rl.rollout) == 2.0
  assert rollout.engine_config(cfg.rl, budget.gb).paging.kv_cache_gb == 2.0
  assert rollout.KVBudget().resolve(
      RolloutConfig(engine=RolloutConfig.engine.replace(paging=dict(kv_cache_gb=1.5)))) == 1.5
