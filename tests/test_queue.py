"""The engine as a queue: more rows than slots; finished rows' slots take waiting rows between
segments. What it emits is what the plain loop emits (greedy: token for token; temperature 1: in
distribution, every row keeping its own prompt's distribution), in the caller's row order."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import stats
from program_count import assert_the_count_rises_when_programs_compile

from specjax.drafters import DraftModelDrafter, NgramDrafter
from specjax.models import Decoder, ModelConfig
from specjax.sampling import (STATIC, EngineConfig, EngineTuning, SamplingConfig, generate,
                              speculative_generate)
from specjax.sampling.engine_config import (AdaptiveConfig, BucketConfig, CalibrationConfig,
                                            CompileConfig, QueueConfig)
from specjax.sampling import engine as eng
from specjax.sampling.engine import batch as batch_programs
from specjax.sampling.engine import programs
from specjax.sampling.adaptive import RefillPolicy, best_refill
from specjax.sampling.buckets import queue_slots
from specjax.sampling.metrics import AcceptanceMetrics
from specjax.sampling.engine.paged_state import bytes_per_page
from specjax.sharding import MeshConfig, make_mesh, shard_model

CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, mlp_hidden=64, init_std=0.5)
_rng = np.random.default_rng(5)
# 24 ragged prompts; greedy lengths 1..24 (several rows end at their first token, so an admitted
# row can be done at once)
PROMPTS = jnp.asarray(_rng.integers(1, 32, (24, 6)), jnp.int32)
PROMPT_LENGTHS = jnp.asarray(_rng.integers(1, 7, 24), jnp.int32)
GREEDY = SamplingConfig(max_new_tokens=24, temperature=0.0, eos_ids=(1, 2))


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def static_ar(target):
  return generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=STATIC)


def assert_same_rollout(a, b):
  np.testing.assert_array_equal(a.lengths, b.lengths)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.sequences, b.sequences)
  np.testing.assert_array_equal(a.eos, b.eos)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_refills_and_compaction_update_the_state_in_place(target, static_ar, monkeypatch):
  """A harvest, an admission and compaction's write-back take (donate) the full-size state they
  update: XLA writes into its buffers instead of a second copy of every cache. The rollout is
  the plain loop's."""
  calls = {}

  def record(name):
    real = getattr(batch_programs, name)

    class Recorded:
      lower = real.lower

      def __call__(self, *a, **kw):
        calls.setdefault(name, []).append(a)
        return real(*a, **kw)

    monkeypatch.setattr(batch_programs, name, Recorded())
    return real

  real = {name: record(name) for name in ("harvest", "admit", "write_back")}
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY,
                 engine=EngineConfig(queue=QueueConfig(max_rows=8)))
  assert_same_rollout(out, static_ar)
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
  nbytes = lambda tree: sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                            for x in jax.tree.leaves(tree))
  for name, fn in real.items():
    args = jax.tree.map(shape, calls[name][0])  # (the call took its arguments' buffers)
    full = args[1] if name == "harvest" else args[0]  # the full-size state
    memory = fn.lower(*args).compile().memory_analysis()
    assert memory.alias_size_in_bytes >= nbytes(full.cache) > 0, (name, memory)


def test_the_fixture_has_long_tailed_lengths_and_rows_done_at_once(static_ar):
  lengths = np.asarray(static_ar.lengths)
  assert lengths.min() == 1 and lengths.max() == 24 and (lengths == 1).sum() >= 4


@pytest.mark.parametrize("max_rows,refill", [(8, 0.25), (4, 0.25), (8, 1.0)])
def test_greedy_queue_equals_the_plain_loop(target, static_ar, max_rows, refill):
  engine = EngineConfig(queue=QueueConfig(max_rows=max_rows, refill_fraction=refill),
                        buckets=BucketConfig(window_block=8))
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=engine)
  assert_same_rollout(out, static_ar)
  # the slots stayed full while rows waited: every segment before the drain started with all of
  # them but fewer than a refill's worth
  slots, per_refill, _ = queue_slots(24, max_rows, 1, 1, refill)
  assert max(s.bucket for s in out.segments) == slots
  assert len(out.segments) > 24 // slots
  assert out.segments[0].live_rows_start > slots - per_refill


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_greedy_speculative_queue_equals_the_plain_loop(target, static_ar, kind):
  if kind == "draft_model":  # a copy of the target: every draft accepted, EOS inside windows
    drafter, params = DraftModelDrafter.from_model(target, 3)
  else:
    drafter, params = NgramDrafter(draft_len=3, n=2), ()
  engine = EngineConfig(queue=QueueConfig(max_rows=8, refill_fraction=0.25))
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=engine)
  assert_same_rollout(out, static_ar)
  assert any(s.draft_len > 0 for s in out.segments)
  # acceptance counts come back per caller row: a row's drafts are at most its steps
  drafts = np.asarray(out.stats.num_drafts)
  assert drafts.shape == (24,) and drafts.sum() > 0
  assert np.all(drafts <= np.maximum(np.asarray(static_ar.lengths) - 1, 0))


def test_queue_prefills_whole_groups_and_shares_their_prefill(target):
  """GRPO groups (4 samples of each of 6 prompts) are prefilled whole; sharing each group's
  prefill changes nothing the rows emit."""
  prompts = jnp.repeat(PROMPTS[:6], 4, axis=0)
  lengths = jnp.repeat(PROMPT_LENGTHS[:6], 4)
  cfg = dataclasses.replace(GREEDY, temperature=1.0)
  # (refills of 4 rows either way, not chosen from timings, so both runs admit at the same
  # steps and draw the same keys)
  run = lambda share: generate(target, prompts, lengths, jax.random.key(3), cfg,
                               engine=EngineConfig(queue=QueueConfig(max_rows=8,
                                                                     refill_fraction=0.5,
                                                                     refill_from_costs=False,
                                                                     share_prefill=share)))
  assert queue_slots(24, 8, 4, 1, 0.5) == queue_slots(24, 8, 1, 1, 0.5) == (8, 4, 4)
  assert_same_rollout(run(True), run(False))


def test_queue_slots_are_whole_groups_over_the_data_parallel_size():
  # (slots, refill, prefill)
  assert queue_slots(64, 0, 4, 1, 0.125) == (64, 64, 64)  # no queue
  assert queue_slots(64, 64, 4, 1, 0.125) == (64, 64, 64)
  assert queue_slots(64, 16, 1, 1, 0.125) == (16, 2, 2)
  # a refill of 2 slots; a prefill is at least one group, whose other samples wait prefilled
  assert queue_slots(64, 16, 4, 1, 0.125) == (16, 2, 4)
  # slots and prefills are groups on each data-parallel replica, refills whole rows per replica
  assert queue_slots(64, 18, 4, 2, 0.125) == (16, 2, 8)
  assert queue_slots(64, 3, 4, 2, 0.5) == (8, 4, 8)
  with pytest.raises(ValueError, match="EngineConfig.queue.max_rows"):
    EngineConfig(queue=QueueConfig(max_rows=-1))
  with pytest.raises(ValueError, match="EngineConfig.queue.refill_fraction"):
    EngineConfig(queue=QueueConfig(refill_fraction=0.0))


def test_a_groups_samples_take_slots_as_they_free_from_one_prefill(target, monkeypatch):
  """Refills of 2 slots with GRPO groups of 4: a group is prefilled once, its first samples take
  the free slots and the others wait, prefilled, for the next ones. Greedy: what each row emits
  is the plain loop's."""
  prompts = jnp.repeat(PROMPTS[:6], 4, axis=0)
  lengths = jnp.repeat(PROMPT_LENGTHS[:6], 4)
  static = generate(target, prompts, lengths, jax.random.key(0), GREEDY, engine=STATIC)
  prefilled = []
  real = programs.init_jit

  def counted(graphdef, params, drafter, drafter_params, prompts, *args, **kwargs):
    prefilled.append(prompts.shape[0])
    return real(graphdef, params, drafter, drafter_params, prompts, *args, **kwargs)

  monkeypatch.setattr(programs, "init_jit", counted)
  # (refills of 2 throughout: none chosen from costs, whose timing would prefill too)
  engine = EngineConfig(queue=QueueConfig(max_rows=8, refill_fraction=0.25,
                                          refill_from_costs=False))
  assert queue_slots(24, 8, 4, 1, 0.25) == (8, 2, 4)
  out = generate(target, prompts, lengths, jax.random.key(0), GREEDY, engine=engine)
  assert_same_rollout(out, static)
  # the 8 first rows, the admission program's compile probe, then each of the 4 waiting groups
  # once
  assert prefilled == [8, 4, 4, 4, 4, 4]
  # the slots were refilled 2 at a time: the first segment returned with 2 slots free
  assert out.segments[0].live_rows_start == 8 and len(out.segments) > 4


def test_best_refill_weighs_a_refills_cost_against_idle_slots():
  # 32 slots, 10 ms steps, a row ends every 4 steps
  cheap = best_refill(32, 1, 0.010, 0.25, 0.0001, 0.0005)
  dear = best_refill(32, 1, 0.010, 0.25, 0.5, 0.0005)
  assert cheap == 1 and 8 < dear < 32
  # (the threshold grows with the refill's fixed cost, and is a multiple of the unit)
  steps = [best_refill(32, 2, 0.010, 0.25, r, 0.0005) for r in (0.01, 0.05, 0.2, 1.0)]
  assert steps == sorted(steps) and all(f % 2 == 0 for f in steps) and steps[0] < steps[-1]
  assert best_refill(32, 4, 0.010, 0.0, 1.0, 0.0) == 4  # no finishes seen: the smallest
  policy = RefillPolicy(32, 1, first=4)
  assert policy.threshold(0.010) == 4  # costs unknown
  policy.costs = (0.5, 0.0005)
  assert policy.threshold(0.010) == 4  # no row has finished yet
  policy.observe(finished=8, steps=32)
  assert policy.threshold(0.010) == dear
  # a segment's own fixed cost counts too: each refill ends a segment early
  policy.costs = (0.0001, 0.0005)
  assert policy.threshold(0.010) == cheap
  assert policy.threshold(0.010, segment_s=0.5 - 0.0001) == dear


def test_refills_chosen_from_measured_costs_keep_the_rollout_and_one_seed_gives_one(target,
                                                                                   static_ar):
  """By default the free slots that make a segment return come from the refill's cost, timed
  once (kept in the tuning under K = -1, out of the step-cost table) and the rate rows finish.
  Greedy: the plain loop's rollout. Temperature 1: with the stored costs, a seed's second run is
  its first, token for token."""
  tuning = EngineTuning()
  engine = EngineConfig(queue=QueueConfig(max_rows=8))
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=engine,
                 tuning=tuning)
  assert_same_rollout(out, static_ar)
  refills = [c for c in tuning.to_json()["costs"] if c["key"].endswith("/-1")]
  assert len(refills) == 1 and refills[0]["step_s"] > 0
  assert all(r["draft_len"] >= 0 for r in tuning.calibration_table())
  assert {s.refill_at for s in out.segments} - {0} <= set(range(1, 9))
  assert out.segments[0].refill_at == 1  # refill_fraction's: no row had finished yet
  sampled = dataclasses.replace(GREEDY, temperature=1.0)
  run = lambda: generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(7), sampled,
                         engine=engine, tuning=tuning)
  first, second = run(), run()
  assert_same_rollout(first, second)
  assert [s.refill_at for s in first.segments] == [s.refill_at for s in second.segments]


def assert_nothing_compiles_after_the_first_rollout(target, engine: EngineConfig, rounds: int):
  """`rounds` rollouts at temperature 1 with new keys, after a first one with the same tuning,
  compile no engine program."""
  sampled = dataclasses.replace(GREEDY, temperature=1.0)
  tuning = EngineTuning()
  run = lambda i: generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(i), sampled,
                           engine=engine, tuning=tuning)
  jax.block_until_ready(run(0).tokens)
  before = eng.compiled_programs()
  for i in range(1, rounds + 1):
    jax.block_until_ready(run(i).tokens)
  assert eng.compiled_programs() == before
  assert_the_count_rises_when_programs_compile(lambda: run(0).tokens)


def test_after_the_first_queued_rollout_nothing_compiles(target):
  # compile_ahead: by default a later rollout may reach a bucket the first did not, and compile it
  assert_nothing_compiles_after_the_first_rollout(
      target, EngineConfig(queue=QueueConfig(max_rows=8, refill_fraction=0.25),
                           adaptive=AdaptiveConfig(enabled=False),
                           compile=CompileConfig(ahead=True)),
      rounds=3)


def test_sharded_queue_equals_one_device(target, static_ar):
  mesh = make_mesh(MeshConfig(2, 1, 4))
  sharded = shard_model(nnx.clone(target), mesh)
  engine = EngineConfig(queue=QueueConfig(max_rows=8, refill_fraction=0.25))
  out = speculative_generate(sharded, NgramDrafter(draft_len=2, n=2), (), PROMPTS,
                             PROMPT_LENGTHS, jax.random.key(1), GREEDY, engine=engine)
  assert_same_rollout(out, static_ar)
  assert all(s.bucket % 2 == 0 for s in out.segments)


# -- temperature 1: a queued rollout is distributed as the plain loop's ---------------------------

ROWS = 2048
SAMPLE = SamplingConfig(max_new_tokens=6, temperature=1.0, eos_ids=(5,))
POSITIONS = (0, 1, 2, 3)
ALPHA = 1e-3  # family-wise, Bonferroni over the positions and the pair test of each arm


def stat_prompts():
  """Two ragged prompts alternating over the rows (the second repeats itself for the n-gram)."""
  a = jnp.array([3, 7, 3, 7, 3, 7, 3, 7])
  b = jnp.array([9, 4, 11, 9, 4, 0, 0, 0])
  prompts = jnp.where((jnp.arange(ROWS) % 2 == 0)[:, None], a, b).astype(jnp.int32)
  return prompts, jnp.where(jnp.arange(ROWS) % 2 == 0, 8, 5).astype(jnp.int32)


def categories(out, kinds=None) -> np.ndarray:
  """int[B, N]: (prompt kind, token) per position; finished positions are token V (end). A row
  that came back in another row's place shows up as the other prompt's distribution. `kinds`:
  each row's prompt (default: alternating, as `stat_prompts`)."""
  v = CFG.vocab_size
  tok = np.where(np.asarray(out.mask), np.asarray(out.tokens), v)
  kinds = np.arange(ROWS) % 2 if kinds is None else np.asarray(kinds)
  return tok + (v + 1) * kinds[:, None]


@pytest.fixture(scope="module")
def plain_samples(target):
  prompts, lengths = stat_prompts()
  return generate(target, prompts, lengths, jax.random.key(10), SAMPLE, engine=STATIC)


@pytest.mark.parametrize("kind", ["ar", "ngram", "paged"])
def test_temperature_one_queue_matches_the_plain_loop_in_distribution(target, plain_samples,
                                                                      kind):
  """`paged`: the n-gram arm on a KV pool of 300 pages of 2 positions, an eighth of what the 256
  slots would hold at full length, so admissions wait for pages and rows wait to grow."""
  prompts, lengths = stat_prompts()
  engine = EngineConfig(queue=QueueConfig(max_rows=256, refill_fraction=0.125),
                        buckets=BucketConfig(max_buckets=2),
                        calibration=CalibrationConfig(repeats=1))
  if kind == "paged":
    page_bytes = bytes_per_page(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 2, jnp.float32)
    engine = engine.replace(paging=dict(kv_cache_gb=300 * page_bytes / 2**30, page_size=2,
                                        page_ahead=1))
  if kind == "ar":
    out = generate(target, prompts, lengths, jax.random.key(20), SAMPLE, engine=engine)
  else:
    # K fixed: adaptive K may retire a drafter its measured costs do not pay for (timing, so
    # machine load), which would leave no drafts to test
    out = speculative_generate(target, NgramDrafter(draft_len=3, n=2), (), prompts, lengths,
                               jax.random.key(20), SAMPLE,
                               engine=engine.replace(adaptive=dict(enabled=False)))
    accepted = AcceptanceMetrics.from_counts(out.stats).num_accepted_tokens
    assert accepted > ROWS // 8, f"too few accepted drafts ({accepted}) to be a test"
  if kind == "paged":
    assert sum(s.waiting_for_pages for s in out.segments) > 0
  assert len(out.segments) > ROWS // 256  # the queue refilled
  assert_same_distribution(plain_samples, out, kind)


def test_temperature_one_groups_admitted_in_parts_match_the_plain_loop(target, plain_samples):
  """GRPO groups of 4 (`stat_prompts`' two prompts in alternating blocks), 64 slots refilled 7
  at a time from prefills of 8 rows (two groups): most refills admit part of a group, whose
  other samples wait prefilled. Each prompt's rows keep the plain loop's distribution."""
  a, a_len = (x[0] for x in stat_prompts())
  b, b_len = (x[1] for x in stat_prompts())
  kinds = (np.arange(ROWS) // 4) % 2
  prompts = jnp.where(jnp.asarray(kinds == 0)[:, None], a, b)
  lengths = jnp.where(jnp.asarray(kinds == 0), a_len, b_len)
  engine = EngineConfig(queue=QueueConfig(max_rows=64, refill_fraction=0.1),
                        buckets=BucketConfig(max_buckets=2),
                        calibration=CalibrationConfig(repeats=1))
  assert queue_slots(ROWS, 64, 4, 1, 0.1) == (64, 7, 8)
  out = generate(target, prompts, lengths, jax.random.key(21), SAMPLE, engine=engine)
  # (each admission places 7 rows, so a prefill of 8 always leaves one waiting)
  assert len(out.segments) > ROWS // 64  # the queue refilled
  assert_same_distribution(plain_samples, out, "groups in parts", kinds)


def assert_same_distribution(plain, out, what: str, kinds=None) -> None:
  """Two rollouts of `stat_prompts` agree in distribution: each of POSITIONS and the pair of
  positions (1, 2), per prompt, two-sample chi-square tests at family-wise level ALPHA. `kinds`:
  `out`'s prompt per row (default: alternating)."""
  a, b = categories(plain), categories(out, kinds)
  num_cats = 2 * (CFG.vocab_size + 1)
  alpha = stats.bonferroni(ALPHA, len(POSITIONS) + 1)
  for j in POSITIONS:
    stats.assert_two_sample_same(a[:, j], b[:, j], num_cats, alpha, what=f"{what} position {j}")
  stats.assert_two_sample_same(stats.pair_index(a[:, 1], a[:, 2], num_cats),
                               stats.pair_index(b[:, 1], b[:, 2], num_cats), num_cats ** 2,
                               alpha, what=f"{what} positions (1, 2)")
