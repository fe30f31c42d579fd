"""The rollout engine: live-batch compaction, attention windows and adaptive draft length change
how much work a rollout does, never what it emits; rows stay in order and on their devices."""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from program_count import assert_the_count_rises_when_programs_compile

from specjax.models import Decoder, ModelConfig
from specjax.sampling import (STATIC, Drafter, EngineConfig, EngineTuning, SamplingConfig, generate,
                              speculative_generate)
from specjax.sampling.engine_config import (AdaptiveConfig, BucketConfig, CalibrationConfig,
                                            CompileConfig)
from specjax.drafters import DraftModelDrafter, NgramDrafter
from specjax.sampling import engine as eng
from specjax.sampling.engine import programs
from specjax.sampling import buckets
from specjax.sampling.buckets import NO_LIMIT
from specjax.sampling.cost_cache import CostCache
from specjax.sampling.cost_table import CostTable
from specjax.sampling.adaptive import (AcceptanceEstimate, DraftLenPolicy, DraftShapePolicy,
                                      best_draft_len)
from specjax.sharding import MeshConfig, make_mesh, shard_model

CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, mlp_hidden=64, init_std=0.5)
# greedy lengths with this target: [13, 2, 3, 1, 6, 1, 24, 1]: the live rows fall 8 -> 4 -> 2 ->
# 1 (every bucket boundary), row 6 stops at the length limit, the rest at an EOS
PROMPTS = jnp.asarray(np.random.default_rng(5).integers(1, 32, (8, 6)), jnp.int32)
PROMPT_LENGTHS = jnp.asarray([6, 3, 5, 2, 6, 4, 1, 6], jnp.int32)
GREEDY = SamplingConfig(max_new_tokens=24, temperature=0.0, eos_ids=(1, 2))
# small windows, so rows cross window boundaries too
ENGINE = EngineConfig(buckets=BucketConfig(window_block=8))


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


def test_the_fixture_crosses_every_bucket_boundary(static_ar):
  np.testing.assert_array_equal(static_ar.lengths, [13, 2, 3, 1, 6, 1, 24, 1])


def test_ar_with_compaction_and_windows_equals_the_static_loop(target, static_ar):
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=ENGINE)
  assert_same_rollout(out, static_ar)
  assert {s.bucket for s in out.segments} == {8, 4, 2, 1}
  assert len({s.window for s in out.segments}) >= 3
  assert int(out.num_steps) == int(static_ar.num_steps) == 23
  assert sum(s.iterations for s in out.segments) == 23


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_greedy_speculative_with_compaction_and_adaptive_k_equals_greedy_ar(target, static_ar,
                                                                            kind):
  if kind == "draft_model":  # a copy of the target: every draft accepted, EOS inside windows
    drafter, params = DraftModelDrafter.from_model(target, 3)
  else:
    drafter, params = NgramDrafter(draft_len=3, n=2), ()
  tuning = EngineTuning()
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=ENGINE, tuning=tuning)
  assert_same_rollout(out, static_ar)
  assert {s.bucket for s in out.segments} == {8, 4, 2, 1}
  assert out.segments[0].draft_len >= 1  # the first segment drafts, so acceptance is measured
  # every bucket's timed K (0 and the largest) were calibrated (compiled) on its first visit;
  # a K in between has a cost only where a segment ran it, started from the line through 0 and 3
  table = {(r["bucket"], r["draft_len"]): r for r in tuning.calibration_table()}
  timed = {(b, k) for b in (8, 4, 2, 1) for k in (0, 3)}
  assert timed <= set(table) and not any(table[bk]["from_line"] for bk in timed)
  ran = {(s.bucket, s.draft_len) for s in out.segments}
  assert {bk for bk, r in table.items() if r["from_line"]} == set(table) - timed <= ran
  counts = out.stats
  assert counts.num_drafts.shape == (8,) and int(counts.num_drafts.sum()) > 0


def test_static_speculative_loop_keeps_a_fixed_draft_length(target, static_ar):
  drafter, params = DraftModelDrafter.from_model(target, 3)
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=STATIC)
  assert_same_rollout(out, static_ar)
  assert [(s.bucket, s.draft_len, s.window) for s in out.segments] == [(8, 3, 0)]


@dataclasses.dataclass(frozen=True)
class RejectedDrafter(Drafter):
  """Proposes a token the greedy target never emits here: every draft is rejected."""

  token: int = 0

  @property
  def stateful(self) -> bool:
    return False

  def propose(self, params, state, seq, key):
    b = seq.tokens.shape[0]
    return jnp.full((b, self.draft_len), self.token, jnp.int32), None, state


def test_adaptive_k_turns_speculation_off_when_no_draft_is_accepted(target, static_ar):
  never = int(np.setdiff1d(np.arange(CFG.vocab_size), np.asarray(static_ar.tokens))[0])
  # a fresh estimate (no counts from another call: the first segment probes), and a min_gain
  # that no K can promise after the probe's 5 rejected drafts (E[tokens | K] <= 1.21 < 1.25), so
  # every later K is 0 whatever the step timings: with the default 0.05, K > 0 stays a candidate
  # until ~22 drafts were rejected, and the measured costs (load) decided whether it drafted again
  engine = EngineConfig(buckets=BucketConfig(window_block=0),
                        adaptive=AdaptiveConfig(min_gain=0.25))
  out = speculative_generate(target, RejectedDrafter(draft_len=3, token=never), (), PROMPTS,
                             PROMPT_LENGTHS, jax.random.key(1), GREEDY, engine=engine)
  assert_same_rollout(out, static_ar)
  assert int(out.stats.accepted_per_position.sum()) == 0
  # the first segment probes; once the estimate knows drafts fail, K = 0 (plain AR) wins, since a
  # draft must promise min_gain more tokens/s than AR and E[tokens | K] tends to 1
  assert out.segments[0].draft_len >= 1
  assert all(s.draft_len == 0 for s in out.segments[1:])
  assert out.segments[-1].iterations >= 5
  assert int(out.stats.num_drafts.sum()) <= 60
  assert int(out.num_steps) == int(static_ar.num_steps)  # a rejected draft still emits a token


@dataclasses.dataclass(frozen=True)
class ObservingRejectedDrafter(RejectedDrafter):
  """A stateful drafter (like EAGLE-3) whose drafts are all rejected; every observe it runs
  calls back to the host, so a test can count them."""

  @property
  def stateful(self) -> bool:
    return True

  def init(self, params, batch, cache_size):
    return jnp.zeros((batch,), jnp.int32)

  def observe(self, params, state, step):
    jax.debug.callback(lambda: OBSERVED.append(1))
    return state + step.num_new


OBSERVED = []


def test_a_stateful_drafter_that_never_pays_is_retired_for_the_rest_of_the_rollout(target,
                                                                                   static_ar):
  never = int(np.setdiff1d(np.arange(CFG.vocab_size), np.asarray(static_ar.tokens))[0])
  drafter = ObservingRejectedDrafter(draft_len=3, token=never)
  # min_gain 0.5: after the first rollout's probe no K can promise it (E[tokens | K] <= 1.28,
  # even with the counts decayed at the next rollout), whatever the step timings; probe_drafts
  # 2: the probe's 5 drafts, and the 3.5 the next rollout keeps of them, are counts enough to
  # retire it on (with the default 16 it would keep observing and probe again: these rows
  # finish within a few steps)
  engine = EngineConfig(buckets=BucketConfig(window_block=0),
                        adaptive=AdaptiveConfig(min_gain=0.5, probe_drafts=2.0),
                        calibration=CalibrationConfig(repeats=1))
  tuning = EngineTuning()  # the second rollout starts from the first one's estimate
  run = lambda: speculative_generate(target, drafter, (), PROMPTS, PROMPT_LENGTHS,
                                     jax.random.key(1), GREEDY, engine=engine, tuning=tuning)
  first = run()
  assert_same_rollout(first, static_ar)
  assert first.segments[0].draft_len >= 1 and not first.segments[0].drafter_retired
  assert all(s.draft_len == 0 and s.drafter_retired for s in first.segments[1:])
  OBSERVED.clear()
  second = jax.block_until_ready(run())
  assert_same_rollout(second, static_ar)
  assert all(s.draft_len == 0 and s.drafter_retired for s in second.segments)
  # the prefill's observe and nothing after it: a retired drafter costs no step (before, every
  # plain AR step of a stateful drafter ran its observe)
  jax.effects_barrier()
  assert len(OBSERVED) == 1


def test_ar_segments_recheck_a_drafter_that_failed_once(target, static_ar):
  never = int(np.setdiff1d(np.arange(CFG.vocab_size), np.asarray(static_ar.tokens))[0])
  # as above, every draft rejected and no K promising min_gain after the probe; AR segments
  # re-decide every 3 steps, and the counts fade meanwhile
  adaptive = AdaptiveConfig(min_gain=0.25, recheck_iters=3, recheck_decay=0.5)
  engine = EngineConfig(buckets=BucketConfig(window_block=0), adaptive=adaptive)
  tuning = EngineTuning()
  out = speculative_generate(target, RejectedDrafter(draft_len=3, token=never), (), PROMPTS,
                             PROMPT_LENGTHS, jax.random.key(1), GREEDY, engine=engine,
                             tuning=tuning)
  assert_same_rollout(out, static_ar)
  ar = [s for s in out.segments if s.draft_len == 0]
  assert ar and all(s.iterations <= 3 for s in ar)
  assert not any(s.drafter_retired for s in out.segments)  # stateless: rechecked, not retired
  (est,) = tuning.estimates._by_key.values()
  drafted = float(out.stats.num_drafts.sum())
  assert 0 < est.offered[0] < drafted  # the AR steps faded what the drafts counted


def _rejecting_policy(retire: bool, **adaptive) -> DraftLenPolicy:
  cfg = AdaptiveConfig(**adaptive)
  est = AcceptanceEstimate(4, cfg.prior_acceptance, cfg.prior_weight)
  return DraftLenPolicy((0, 2, 4), est, cfg, retire=retire)


def test_the_draft_length_policy_rechecks_a_stateless_drafter_and_retires_a_stateful_one():
  cost = {0: 1.0, 2: 1.2, 4: 1.4}.get  # seconds per step: drafting pays at high acceptance
  policy = _rejecting_policy(retire=False)
  assert policy.choose(cost, 8)[0] > 0  # nothing seen: it drafts
  policy.estimate.add(4, 64.0, np.zeros(4))  # 64 drafts, none accepted
  policy.ran(4, 8)
  assert policy.choose(cost, 8)[0] == 0 and not policy.retired
  assert policy.budget(0, 0) == 64  # re-decide after recheck_iters AR steps
  ar_steps = 0
  while policy.choose(cost, 8)[0] == 0:
    policy.ran(0, 64)
    ar_steps += 64
    assert ar_steps <= 64 * 8, "a drafter that failed once is never drafted again"
  k = policy.choose(cost, 8)[0]
  assert policy.budget(k, 0) == policy.cfg.probe_iters  # the recheck is a short segment
  policy.estimate.add(k, 32.0, np.zeros(4))  # it fails again: back to AR
  policy.ran(k, 4)
  assert policy.choose(cost, 8)[0] == 0
  # without rechecks an AR segment runs to its bucket's end and the counts stay
  still = _rejecting_policy(retire=False, recheck_iters=0)
  still.estimate.add(4, 64.0, np.zeros(4))
  assert still.choose(cost, 8)[0] == 0 and still.budget(0, 0) == NO_LIMIT
  still.ran(0, 10_000)
  assert still.estimate.offered[0] == 64.0
  # a stateful drafter is retired, but only on counts that are not thin
  stateful = _rejecting_policy(retire=True)
  stateful.estimate.add(4, 8.0, np.zeros(4))  # 8 < probe_drafts = 16
  assert stateful.choose(cost, 8)[0] == 0 and not stateful.retired
  stateful.estimate.add(4, 64.0, np.zeros(4))
  assert stateful.choose(cost, 8)[0] == 0 and stateful.retired
  assert stateful.budget(0, 0) == NO_LIMIT
  stateful.ran(0, 10_000)  # a retired drafter's counts stay for the next rollout
  assert stateful.estimate.offered[0] == 72.0


def test_acceptance_estimate_follows_the_counts_and_the_prior():
  est = AcceptanceEstimate(3, prior=0.5, weight=2.0)
  assert est.expected_tokens(0) == 1.0
  assert est.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)
  est.add(2, drafts=100, accepted_per_position=np.array([80, 40, 0]))
  a = est.conditional()
  assert a[0] == pytest.approx(81 / 102) and a[1] == pytest.approx((40 + 2 * a[0]) / 82)
  assert a[2] == pytest.approx(a[1])  # never offered: falls back to the previous position
  assert est.expected_tokens(2) == pytest.approx(1 + a[0] + a[0] * a[1])


def test_best_draft_length_trades_expected_tokens_against_step_cost():
  expected = {0: 1.0, 1: 1.8, 2: 2.4, 3: 2.8}
  cheap_verify = {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.15}  # weight-read bound
  costly_verify = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}  # arithmetic bound
  assert best_draft_len(expected, cheap_verify, live=2)[0] == 3
  assert best_draft_len(expected, costly_verify, live=32)[0] == 0
  k, rate = best_draft_len(expected, cheap_verify, live=2)
  assert rate == pytest.approx(2 * 2.8 / 1.15)
  nothing_accepted = {0: 1.0, 1: 1.01, 2: 1.02}
  noisy_costs = {0: 1.0, 1: 0.99, 2: 0.995}  # timing noise: a verify measured "cheaper" than AR
  assert best_draft_len(nothing_accepted, noisy_costs, live=1, min_gain=0.05)[0] == 0


def test_a_draft_tree_runs_only_where_its_acceptance_pays_for_its_wider_verify():
  engine = EngineConfig()

  def policy(chain_hits, tree_hits):
    """Chain and tree estimates after 100 drafts each, `*_hits` accepted at positions 0..2."""
    policies = {}
    for w, hits in ((1, chain_hits), (3, tree_hits)):
      est = AcceptanceEstimate(3, engine.adaptive.prior_acceptance, engine.adaptive.prior_weight)
      if hits is not None:
        est.add(3, 100.0, np.asarray(hits, np.float64))
      policies[w] = DraftLenPolicy((0, 1, 2, 3), est, engine.adaptive)
    return DraftShapePolicy(policies, engine.adaptive)

  # a step costs 1.0 + 0.1 per verified position (1 + K * width of them)
  cost = lambda k, w: 1.0 + 0.1 * k * w
  # the tree's alternatives add little: its wider verify does not pay
  k, w, _ = policy([60, 36, 22], [62, 38, 23]).choose(cost, live=1)
  assert w == 1 and k > 0
  # they add much: the tree runs
  k, w, _ = policy([40, 16, 6], [85, 70, 58]).choose(cost, live=1)
  assert (k, w) == (3, 3)
  # the chain measured, the tree not yet: the tree is tried once, to measure it
  k, w, rate = policy([60, 36, 22], None).choose(cost, live=1)
  assert w == 3 and k > 0 and np.isnan(rate)
  # where a verified position costs as much as a step, neither drafts
  assert policy([60, 36, 22], [62, 38, 23]).choose(lambda k, w: 1.0 + k * w, live=1)[0] == 0


def test_buckets_and_windows():
  assert buckets.bucket_sizes(32) == [32, 16, 8, 4, 2, 1]
  assert buckets.bucket_sizes(32, max_buckets=3) == [32, 16, 8]
  assert buckets.bucket_sizes(24, dp=8) == [24, 16, 8]
  assert buckets.bucket_sizes(8, dp=4) == [8, 4]
  with pytest.raises(ValueError, match="not divisible by the data-parallel size 4"):
    buckets.bucket_sizes(6, dp=4)
  assert buckets.window_for(100, 3, 128, 1024) == 128
  assert buckets.window_for(125, 3, 128, 1024) == 256  # writes reach position 128
  assert buckets.window_for(600, 3, 128, 1024) == 0  # 1024 would be the whole cache
  assert buckets.window_for(10, 3, 0, 1024) == 0


def test_compaction_keeps_each_replicas_rows_on_it():
  """Live rows in slots 1, 2, 3 (replica 0 of 2, slots 0-7) and 9 (replica 1): globally they fit
  bucket 4; kept on their replicas (paged KV on a mesh) they need 3 per replica, bucket 8."""
  homes = [1, 2, 3, 9]
  size, idx, pad = buckets.compaction(homes, [16, 8, 4, 2], 16, dp=2)
  assert size == 4 and list(idx) == homes and not pad.any()
  size, idx, pad = buckets.compaction(homes, [16, 8, 4, 2], 16, dp=2, by_replica=True)
  assert size == 8
  assert list(idx[:3]) == [1, 2, 3] and idx[4] == 9
  assert list(pad) == [False, False, False, True, False, True, True, True]
  assert all(i // 8 == r // 4 for r, i in enumerate(idx))  # padding from the row's own replica
  size, idx, pad = buckets.compaction([1, 9], [16, 8, 4, 2], 16, dp=2, by_replica=True)
  assert (size, list(idx), list(pad)) == (2, [1, 9], [False, False])


def test_prompt_groups_are_found_only_where_rows_repeat_and_divide_over_the_mesh():
  grouped = jnp.repeat(PROMPTS[:2], 4, axis=0)
  lengths = jnp.repeat(PROMPT_LENGTHS[:2], 4)
  assert buckets.prompt_group(grouped, lengths) == 4
  assert buckets.prompt_group(grouped, lengths, dp=4) == 2  # 2 prompts cannot feed 4 devices
  assert buckets.prompt_group(grouped, lengths, dp=8) == 1
  assert buckets.prompt_group(PROMPTS, PROMPT_LENGTHS) == 1
  assert buckets.prompt_group(grouped.at[4:6, 0].add(1), lengths) == 2  # two rows differ
  assert buckets.prompt_group(grouped.at[5, 0].add(1), lengths) == 1
  assert buckets.prompt_group(grouped, lengths.at[3].add(-1)) == 1  # same tokens, another length


@pytest.mark.parametrize("kind", ["ar", "ngram"])
def test_a_shared_prefill_for_grouped_prompts_changes_no_rollout(target, kind):
  """GRPO groups (2 prompts x 4 rows): one prefill per prompt gives the rollout of 8 prefills,
  greedy, with compaction and adaptive K on."""
  prompts, lengths = jnp.repeat(PROMPTS[1:3], 4, axis=0), jnp.repeat(PROMPT_LENGTHS[1:3], 4)
  cfg = dataclasses.replace(GREEDY, eos_ids=())
  assert buckets.prompt_group(prompts, lengths) == 4

  def run(share):
    engine = ENGINE.replace(queue=dict(share_prefill=share))
    if kind == "ar":
      return generate(target, prompts, lengths, jax.random.key(0), cfg, engine=engine)
    return speculative_generate(target, NgramDrafter(draft_len=2), (), prompts, lengths,
                                jax.random.key(0), cfg, engine=engine)

  assert_same_rollout(run(True), run(False))


def test_a_segment_updates_its_state_in_place_so_the_cache_is_held_once(target, monkeypatch):
  """A segment takes (donates) its state: XLA writes the updated caches into the buffers it was
  given instead of new ones, so a rollout does not hold its KV memory twice while a segment
  runs. The speculative engine's segments (target and draft caches) too, and their rollouts are
  those of the plain loop."""
  calls, real = [], programs.segment_jit

  class Recorded:  # the segment program, its calls recorded
    lower = real.lower

    def __call__(self, *a, **kw):
      calls.append((a, kw))
      return real(*a, **kw)

  monkeypatch.setattr(programs, "segment_jit", Recorded())
  drafter, dparams = DraftModelDrafter.from_model(Decoder(CFG, rngs=nnx.Rngs(1)), draft_len=2)
  out = speculative_generate(target, drafter, dparams, PROMPTS, PROMPT_LENGTHS,
                             jax.random.key(0), GREEDY, engine=ENGINE)
  assert_same_rollout(out, generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY,
                                    engine=STATIC))
  spec = [(a, kw) for a, kw in calls if a[2] is not None]  # a drafting segment
  for a, kw in (calls[-1], spec[0]):
    state = a[5]
    if state.tokens.is_deleted():  # (a segment took it: the state of the arguments is gone)
      state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    memory = real.lower(*a[:5], state, *a[6:], **kw).compile().memory_analysis()
    caches = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(state.cache))
    assert memory.alias_size_in_bytes >= caches > 0, (memory, caches)


def test_new_params_reuse_every_compiled_program(target):
  graphdef, params = nnx.split(target)
  generate((graphdef, params), PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=ENGINE)
  before = eng.compiled_programs()
  for scale in (1.0, 1.0001):
    new = jax.tree.map(lambda x: x * scale, params)
    jax.block_until_ready(generate((graphdef, new), PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                                   GREEDY, engine=ENGINE).tokens)
  assert eng.compiled_programs() == before
  assert_the_count_rises_when_programs_compile(lambda: generate(
      (graphdef, params), PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY,
      engine=ENGINE).tokens)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_after_the_first_rollout_no_bucket_path_compiles_anything(target, make_key):
  """Compaction's programs (gather, summary, write-back, segment) exist once per bucket and, with
  `compile_ahead`, are all compiled in the first rollout, whichever buckets its rows pass
  through; sampled rollouts then take other paths (8 -> 2, 4 -> 1, ...) without compiling.
  Also with the raw uint32 keys the RL loop passes (a segment taking a raw key is another
  program than one taking a typed key)."""
  sampled = dataclasses.replace(GREEDY, temperature=1.0)
  engine = EngineConfig(adaptive=AdaptiveConfig(enabled=False), compile=CompileConfig(ahead=True))
  jax.clear_caches()
  tuning = EngineTuning()
  run = lambda i: generate(target, PROMPTS, PROMPT_LENGTHS, make_key(i), sampled, engine=engine,
                           tuning=tuning)
  jax.block_until_ready(run(0).tokens)
  before = eng.compiled_programs()
  paths = set()
  for i in range(1, 7):
    out = run(i)
    paths.add(tuple(s.bucket for s in out.segments))
  assert eng.compiled_programs() == before
  assert_the_count_rises_when_programs_compile(lambda: run(1).tokens)
  assert len(paths) > 1, paths  # the rollouts did take different paths


@pytest.mark.parametrize("draft_lens,ks,label", [((), (0, 1, 2, 3), "0-3"),
                                                  ((2,), (0, 2, 3), "0/2/3")],
                         ids=["every-K", "K-ladder"])
def test_ahead_every_bucket_compiles_every_draft_len_in_the_first_rollout(target, caplog,
                                                                         draft_lens, ks, label):
  """Adaptive K with `compile_ahead`: the first rollout compiles each bucket's segment at every
  K it may choose (0..max, or 0, `draft_lens` and the largest), so a later rollout that picks
  another K compiles nothing, and no segment runs a K outside the choices. The preparation is
  logged once (a user waiting on a first rollout sees what it compiles and how long it took),
  later rollouts log nothing."""
  caplog.set_level(logging.INFO, logger="specjax.sampling.engine")
  sampled = dataclasses.replace(GREEDY, temperature=1.0)
  jax.clear_caches()
  tuning = EngineTuning()
  engine = EngineConfig(adaptive=AdaptiveConfig(draft_lens=draft_lens),
                        compile=CompileConfig(ahead=True))
  run = lambda i: speculative_generate(target, NgramDrafter(draft_len=3, n=2), (), PROMPTS,
                                       PROMPT_LENGTHS, jax.random.key(i), sampled,
                                       engine=engine, tuning=tuning)
  out = run(0)
  (line,) = [r.getMessage() for r in caplog.records if r.name == "specjax.sampling.engine"]
  m = re.fullmatch(r"\[engine\] buckets (\d+(?:/\d+)*) at K (\S+): (\d+) programs? compiled "
                   r"in [\d.]+ s(, step costs measured in [\d.]+ s)?", line)
  assert m and m.group(2) == label, line
  # a segment program per bucket and K choice (none at another K), compaction's per smaller bucket
  buckets = len(m.group(1).split("/"))
  assert int(m.group(3)) == buckets * len(ks) + buckets - 1, line
  caplog.clear()
  before = eng.compiled_programs()
  used = {s.draft_len for s in out.segments}
  for i in range(1, 4):
    later = run(i)
    jax.block_until_ready(later.tokens)
    used |= {s.draft_len for s in later.segments}
  assert eng.compiled_programs() == before
  assert used <= set(ks) and used - {0}, used
  assert_the_count_rises_when_programs_compile(lambda: run(1).tokens)
  assert not [r for r in caplog.records if r.name == "specjax.sampling.engine"]


def test_by_default_a_bucket_compiles_when_a_rollout_first_reaches_it(target):
  """Without `compile_ahead` the first rollout compiles the segment programs of the buckets it
  runs and no other (AR: one K per bucket); a later rollout compiles only the buckets it reaches
  for the first time. The rollouts equal those of an engine that compiled every bucket ahead."""
  sampled = dataclasses.replace(GREEDY, temperature=1.0)
  jax.clear_caches()
  tuning = EngineTuning()
  reached, counts = set(), []
  for i in range(4):
    out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(i), sampled,
                   engine=EngineConfig(adaptive=AdaptiveConfig(enabled=False)), tuning=tuning)
    reached |= {s.bucket for s in out.segments}
    counts.append(len(reached))
    assert programs.segment_jit._cache_size() == len(reached), (i, reached)
  assert counts[0] < 4 and len(set(counts)) > 1, counts  # buckets skipped at first, then reached
  ahead = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(3), sampled,
                   engine=EngineConfig(adaptive=AdaptiveConfig(enabled=False),
                                       compile=CompileConfig(ahead=True)))
  assert_same_rollout(out, ahead)


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_sharded_generation_equals_one_device_with_rows_sharded(target, static_ar, shape):
  mesh = make_mesh(MeshConfig(*shape))
  sharded = shard_model(nnx.clone(target), mesh)
  drafter, params = NgramDrafter(draft_len=2, n=2), ()
  out = speculative_generate(sharded, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=ENGINE)
  assert_same_rollout(out, static_ar)
  dp = shape[0] * shape[1]
  assert min(s.bucket for s in out.segments) == dp  # buckets stay divisible by the dp size
  # the state the segments step is split over the data-parallel axes, caches included
  graphdef, state_params = nnx.split(sharded)
  state = programs.init_jit(programs.HashedOnce(graphdef), state_params, None, None, PROMPTS,
                            PROMPT_LENGTHS, jax.random.key(0), cfg=GREEDY, cache_size=32,
                            max_draft_len=1, mesh=mesh)
  for x in (state.tokens, state.cache.k[0], state.cache.lengths, state.seq.tokens):
    spec = x.sharding.spec
    assert spec and spec[0] is not None, f"rows replicated: {spec}"
    assert len(x.addressable_shards) == 8
    assert x.addressable_shards[0].data.shape[0] == 8 // dp


def test_segments_refine_the_calibrated_step_costs(target):
  """Each segment moves its (bucket, K) step cost toward the seconds per step it measured (its
  calibrated fixed cost taken off), with weight iterations / (iterations + cost_memory); costs
  of programs no segment ran keep their startup calibration."""
  engine = EngineConfig(calibration=CalibrationConfig(cost_memory=16.0))
  tuning = EngineTuning()
  out = speculative_generate(target, NgramDrafter(draft_len=2, n=2), (), PROMPTS, PROMPT_LENGTHS,
                             jax.random.key(1), GREEDY, engine=engine, tuning=tuning)
  table = {(r["bucket"], r["draft_len"]): r for r in tuning.calibration_table()}
  cost = {bk: r["calibrated_step_s"] for bk, r in table.items()}
  steps = dict.fromkeys(table, 0)
  for s in out.segments:
    bk = (s.bucket, s.draft_len)
    if s.iterations:
      per_step = max(s.seconds - table[bk]["segment_s"], s.seconds / 8) / s.iterations
      w = s.iterations / (s.iterations + engine.calibration.cost_memory)
      cost[bk] = (1 - w) * cost[bk] + w * per_step
      steps[bk] += s.iterations
  assert sum(steps.values()) == int(out.num_steps) > 0
  for bk, r in table.items():
    assert r["steps_measured"] == steps[bk], bk
    assert r["step_s"] == pytest.approx(cost[bk], rel=1e-9), bk
  assert any(r["step_s"] != r["calibrated_step_s"] for r in table.values())
  assert any(r["steps_measured"] == 0 and r["step_s"] == r["calibrated_step_s"]
             for r in table.values())


def test_measured_costs_belong_to_the_tuning_object_passed_in(target):
  """A call without `tuning` keeps nothing; calls sharing one `EngineTuning` reuse its
  calibration (the second rollout measures no new cost); another object starts empty."""
  engine = EngineConfig(calibration=CalibrationConfig(repeats=1))
  drafter = NgramDrafter(draft_len=2, n=2)
  call = lambda tuning, i: speculative_generate(target, drafter, (), PROMPTS, PROMPT_LENGTHS,
                                                jax.random.key(i), GREEDY, engine=engine,
                                                tuning=tuning)
  shared, other = EngineTuning(), EngineTuning()
  call(None, 0)
  assert shared.calibration_table() == [] and other.calibration_table() == []
  call(shared, 0)
  first = {(r["bucket"], r["draft_len"]): r["calibrated_step_s"]
           for r in shared.calibration_table()}
  assert first and len(shared.estimates) == 1
  call(shared, 1)
  again = {(r["bucket"], r["draft_len"]): r["calibrated_step_s"]
           for r in shared.calibration_table()}
  assert again == first  # the startup calibration was reused, not measured again
  assert other.calibration_table() == [] and len(other.estimates) == 0


def test_a_cached_cost_is_checked_once_against_the_runs_own_steps(tmp_path):
  """A cost read from the machine's cache is weighed against this run's segments once they ran
  `steps` steps of it: within `factor` it stays (and is not checked again); outside, the
  segments' figure replaces it in the file, for later runs, while this run keeps the figure it
  read (its K choices never hang on its own timings). Costs this run measured, or adopted from
  a stored tuning, are never checked."""
  path = str(tmp_path / "costs.json")
  cache = CostCache(path)
  kept, stale, own = ("p", 8, 0), ("p", 8, 3), ("o", 4, 0)
  cache.put(kept, (0.010, 0.001))
  cache.put(stale, (0.010, 0.002))
  table, other = CostTable(CostCache(path)), CostTable(CostCache(path))
  never = lambda m: pytest.fail("measured a cached cost")
  assert table.step_cost(kept, never, 2, 1) == 0.010
  assert table.step_cost(stale, never, 2, 1) == 0.010
  assert other.step_cost(stale, never, 2, 1) == 0.010
  # (a process's first segment of a program is left out: it may set up the program's dispatch)
  assert not table.check_cached(kept, 100, 100.0, 1.5, 20)
  assert not table.check_cached(stale, 100, 100.0, 1.5, 20)
  # 10 + 10 steps at 14 ms (within 1.5x): kept; then it is not checked again, however far off
  assert not table.check_cached(kept, 10, 10 * 0.014 + 0.001, 1.5, 20)
  assert not table.check_cached(kept, 10, 10 * 0.014 + 0.001, 1.5, 20)
  assert not table.check_cached(kept, 100, 100.0, 1.5, 20)
  assert table.has(kept) and table.corrected == {}
  # 20 steps at 30 ms (their fixed cost of 2 ms taken off) against a cached 10: replaced in the
  # file; the run goes on with the figure it read
  assert table.check_cached(stale, 20, 20 * 0.030 + 0.002, 1.5, 20)
  assert table.step_cost(stale, never, 2, 1) == 0.010
  assert CostTable(CostCache(path)).step_cost(stale, never, 2, 1) == pytest.approx(0.030)
  assert CostCache(path).entries()[stale] == pytest.approx((0.030, 0.002))
  assert CostCache(path).entries()[kept] == (0.010, 0.001)
  assert table.corrected[stale] == pytest.approx(
      {"bucket": 8, "draft_len": 3, "cached_step_s": 0.010, "observed_step_s": 0.030,
       "observed_steps": 20})
  assert [r["corrected"] for r in table.rows() if r["bucket"] == 8] == [False, True]
  # another run that read the same stale figure keeps the first replacement in the file
  for _ in range(2):
    other.check_cached(stale, 20, 20 * 0.050 + 0.002, 1.5, 20)
  assert other.corrected and CostCache(path).entries()[stale] == pytest.approx((0.030, 0.002))
  # measured by this run, or adopted from a stored tuning: never checked
  assert table.step_cost(own, lambda m: (m, 0.028 * m), 2, 1) == pytest.approx(0.028)
  assert not table.check_cached(own, 100, 100.0, 1.5, 20)
  resumed = CostTable(CostCache(path))
  resumed.load_json(table.to_json())
  assert not resumed.check_cached(kept, 100, 100.0, 1.5, 20)
  # the RL run's setting reaches the engine; a factor of 1 or less is a clear error
  from specjax.rl.config import RLConfig, RolloutConfig
  from specjax.rl.rollout import engine_config
  cfg = RLConfig(rollout=RolloutConfig(
      engine=RolloutConfig.engine.replace(calibration=dict(recheck_cached_costs=2.0))))
  assert engine_config(cfg).calibration.recheck_cached_costs == 2.0
  with pytest.raises(ValueError, match="EngineConfig.calibration.recheck_cached_costs.*got 0.5"):
    CalibrationConfig(recheck_cached_costs=0.5)
  with pytest.raises(ValueError, match="EngineConfig.calibration.recheck_cached_costs.*got 1.0"):
    EngineConfig(calibration=CalibrationConfig(recheck_cached_costs=1.0))


def test_timed_costs_are_kept_monotone_in_rows_and_draft_length_and_slopes_bounded():
  """Load only adds time, and a step costs no less with more rows or a longer draft: a timed
  cost above that of a (bucket, K) that dominates it is lowered to it, whichever is timed first;
  a slope steeper than the longer timing's seconds per step (a negative fixed cost) is cut to
  it. Refill costs (K = -1) and other programs are left alone."""
  def timed(per_step, fixed=0.0, long_extra=0.0):
    return lambda m: (m, fixed + per_step * m + (long_extra if m == 4 else 0.0))

  table = CostTable()
  cost = lambda key, *a: table.step_cost(key, timed(*a), 2, 1)
  assert cost(("p", 16, 0), 0.010, 0.001) == pytest.approx(0.010)
  assert cost(("p", 8, 0), 0.019) == pytest.approx(0.010)  # above bucket 16's: noise
  assert cost(("p", 16, 4), 0.040) == pytest.approx(0.040)
  assert cost(("p", 8, 4), 0.030) == pytest.approx(0.030)
  assert cost(("p", 4, 4), 0.050) == pytest.approx(0.030)
  assert cost(("p", 2, 0), 0.009) == pytest.approx(0.009)
  assert cost(("p", 4, 0), 0.007) == pytest.approx(0.007)
  assert table.step_cost(("p", 2, 0), None, 2, 1) == pytest.approx(0.007)  # lowered after
  assert cost(("q", 2, 0), 0.020) == pytest.approx(0.020)  # another program
  assert cost(("p", 1, -1), 0.050) == pytest.approx(0.050)  # a refill's prefill
  # 2 steps in 10 ms, 4 in 60 ms: the slope (25 ms) would make the fixed cost negative
  assert cost(("r", 8, 0), 0.005, 0.0, 0.040) == pytest.approx(0.015)
  assert table.fixed_cost(("r", 8, 0)) == 0.0


def test_a_cost_cache_a_rollout_contradicts_is_replaced_by_its_steps(target, static_ar,
                                                                     tmp_path):
  """Costs a first rollout stored in the machine's cache, then set to a second per step (as if
  measured on a loaded machine; far above any step of this tiny model, whose calibrated slope
  can come out near zero): a run reading them replaces each one its segments ran for
  `recheck_steps` steps (after the first segment) by their figure, in the file too; with the
  check off, the stale figures stay. Either way the tokens are the plain loop's."""
  import json
  path = str(tmp_path / "costs.json")
  engine = EngineConfig(calibration=CalibrationConfig(repeats=1, recheck_steps=4))
  drafter, params = NgramDrafter(draft_len=2, n=2), ()
  call = lambda tuning, engine: speculative_generate(
      target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY,
      engine=engine, tuning=tuning)
  assert_same_rollout(call(EngineTuning.with_cache(path), engine), static_ar)
  with open(path) as f:
    data = json.load(f)
  data["costs"] = {k: [1.0, v[1]] for k, v in data["costs"].items()}
  with open(path, "w") as f:
    json.dump(data, f)
  for check, want in ((0.0, False), (1.5, True)):
    tuning = EngineTuning.with_cache(path)
    for _ in range(2):  # (a key's first segment in a process is not weighed)
      out = call(tuning, engine.replace(calibration=dict(recheck_cached_costs=check)))
      assert_same_rollout(out, static_ar)
    corrected = tuning.costs.corrected
    assert bool(corrected) == want
    with open(path) as f:
      stored = json.load(f)["costs"]
    by_key = {tuple(k.rsplit("/", 2)[1:]): v for k, v in stored.items()}
    for key, row in corrected.items():
      assert row["observed_steps"] >= 4
      assert row["observed_step_s"] < row["cached_step_s"] / 1.5
      assert by_key[(str(key[-2]), str(key[-1]))][0] == row["observed_step_s"]
    if not want:
      assert stored == data["costs"]


def test_a_dry_segment_steps_and_gives_the_state_back_as_it_was(target):
  """`commit=False` (the engine's calibration): the segment steps its state in that state's own
  buffers (taken, so no copy) and returns it as it was: every committed token, length, count
  and drafter state, the caches' lengths; what it wrote lies past those lengths. A rollout
  continued from it is the one continued from the original. AR and speculative (a draft model,
  whose cache is restored too), at temperature 1."""
  from specjax.sampling.segment import SegmentSpec

  graphdef, params = nnx.split(target)
  graphdef = programs.HashedOnce(graphdef)  # as the engine passes it (the drafter too)
  drafter, dparams = DraftModelDrafter.from_model(Decoder(CFG, rngs=nnx.Rngs(1)), draft_len=2)
  drafter = programs.HashedOnce(drafter)
  sampled = dataclasses.replace(GREEDY, temperature=1.0)
  init = lambda: programs.init_jit(graphdef, params, drafter, dparams, PROMPTS, PROMPT_LENGTHS,
                                   jax.random.key(3), cfg=sampled, cache_size=40,
                                   max_draft_len=2)

  def run(state, k, commit, key=0):
    return programs.segment_jit(graphdef, params, drafter if k else None, dparams,
                                jax.random.key(key), state, jnp.int32(6), jnp.int32(0),
                                spec=SegmentSpec(cfg=sampled, drafts=k > 0, window=0),
                                stop_at_paused=jnp.int32(1), commit=jnp.asarray(commit))

  kv_buffer = lambda path: any(getattr(p, "name", None) in ("k", "v") for p in path)
  for k in (0, 2):
    state = init()
    # (a copy: on the CPU a host view of a buffer would keep the segment from taking it)
    before = jax.tree.map(lambda x: np.array(x, copy=True), state)
    dry, iters = run(state, k, False)
    # it ran, in the caches' own buffers (taken: no copy of the KV memory)
    assert int(iters) == 6 and all(x.is_deleted() for x in state.cache.k + state.cache.v)
    after = jax.device_get(dry)
    flat = jax.tree_util.tree_leaves_with_path(before)
    assert sum(kv_buffer(path) for path, _ in flat) >= 2 * CFG.num_layers * (1 + (k > 0))
    for (path, x), y in zip(flat, jax.tree.leaves(after)):
      if not kv_buffer(path):
        np.testing.assert_array_equal(x, y, err_msg=f"K={k} {jax.tree_util.keystr(path)}")
    moved, _ = run(init(), k, True)  # a committing segment does move the state
    assert (np.asarray(moved.lengths) > np.asarray(before.lengths)).any()
    ref, _ = run(init(), k, True, key=7)
    cont, _ = run(dry, k, True, key=7)
    for x, y in zip(jax.tree.leaves(jax.device_get(ref.replace(cache=None, drafter_state=None))),
                    jax.tree.leaves(jax.device_get(cont.replace(cache=None,
                                                                drafter_state=None)))):
      np.testing.assert_array_equal(x, y)
