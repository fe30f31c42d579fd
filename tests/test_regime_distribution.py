"""The main job's rollout regime as a whole keeps AR's distribution: GRPO groups through a queue
with refills, paged KV memory small enough that rows wait for pages (40 pages of 2 positions for
64 slots; swapped out when half of them wait), live
rows compacted into smaller buckets, adaptive K over a ladder, and drafts drawn
from each prompt's earlier sampled completions (q spread over their votes) or taken from the
cross-prompt table, at temperatures 0.7 and 1. Two-sample chi-square tests per position and
for a pair of positions, per prompt, family-wise level 1e-3 per temperature
(`test_queue.assert_same_distribution`); the same regime with the verifier's residual replaced by
p (a broken verifier) must fail them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from broken_verifier import verify_without_residual
from test_queue import CFG, ROWS, SAMPLE, assert_same_distribution, stat_prompts
from specjax.drafters import (CorpusStore, HistoryDrafter, HistoryParams, HistoryStore,
                              corpus_lookup)
from specjax.models import Decoder
from specjax.sampling.engine.paged_state import bytes_per_page
from specjax.sampling import (STATIC, EngineTuning, Sequences, generate, segment,
                              speculative_generate)
from specjax.sampling.engine_config import (AdaptiveConfig, BucketConfig, CalibrationConfig,
                                            EngineConfig, PagingConfig, QueueConfig)
from specjax.sampling.metrics import AcceptanceMetrics

GROUP = 4
KINDS = (np.arange(ROWS) // GROUP) % 2  # GRPO groups: blocks of G rows of one prompt


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


def grouped_prompts():
  prompts, lengths = stat_prompts()  # (alternating rows: the first two rows are the two kinds)
  kinds = jnp.asarray(KINDS == 0)
  return (jnp.where(kinds[:, None], prompts[0], prompts[1]),
          jnp.where(kinds, lengths[0], lengths[1]))


def regime_engine() -> EngineConfig:
  page_bytes = bytes_per_page(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 2, jnp.float32)
  return EngineConfig(
      queue=QueueConfig(max_rows=64, refill_fraction=0.125),
      paging=PagingConfig(kv_cache_gb=40 * page_bytes / 2**30, page_size=2, page_ahead=1),
      buckets=BucketConfig(max_buckets=2),
      # K among 0, 2 and 4 per segment (`drafting_tuning`'s costs); AR segments re-decide every
      # 2 steps
      adaptive=AdaptiveConfig(draft_lens=(2,), probe_iters=2, recheck_iters=2,
                              recheck_decay=0.25),
      calibration=CalibrationConfig(repeats=1))


def regime_params(target, sampling, prompts, lengths):
  """The drafter's tables from an earlier sampled rollout of the same prompts (history) and of
  both prompts (the cross-prompt table)."""
  earlier = generate(target, prompts[:64], lengths[:64], jax.random.key(11), sampling,
                     engine=STATIC)
  store = HistoryStore(max_prompts=4, per_prompt=4, width=12, tail=2,
                       corpus=CorpusStore(slots=256, width=4, min_n=2, max_n=3))
  store.record(*jax.device_get((prompts[:64], lengths[:64], earlier.tokens, earlier.lengths)))
  assert store.prompts == 2 and store.corpus.filled > 0
  # the table matches contexts longer than the history's n = 2 (a row drafts from it there): the
  # earlier rows at their third completion token
  upto = jnp.minimum(lengths[:64] + 2, lengths[:64] + earlier.lengths)
  _, matched = corpus_lookup(Sequences(tokens=earlier.sequences, lengths=upto,
                                       prompt_lengths=lengths[:64]), store.corpus.table(), 4)
  assert int(jnp.sum(matched > 2)) > 8, matched
  return HistoryParams(table=store.table(prompts[:2 * GROUP:GROUP], lengths[:2 * GROUP:GROUP]),
                       corpus=store.corpus.table())


def drafting_tuning(run) -> EngineTuning:
  """Step costs under which drafting pays, so that the K choices depend on the acceptance the
  run measures, not on this machine's timings (a verify of this tiny target's K + 1 tokens costs
  several plain steps on a CPU, and no K > 0 would be chosen): `run(tuning)` measures the
  regime's costs, then each K's step is stored at (1 + K / 4) times K = 0's of its bucket, as a
  resumed run's stored tuning is (`EngineTuning.load_json`)."""
  measured = EngineTuning.with_cache("off")
  run(measured)
  rows = measured.to_json()["costs"]
  base = {r["key"].rsplit("/", 1)[0]: r for r in rows if r["key"].endswith("/0")}
  stored = [r for r in rows if r["key"].endswith("/-1")]  # (a refill's costs, as measured)
  for prefix, r in base.items():
    for k in (0, 2, 4):
      step = r["step_s"] * (1 + k / 4)
      stored.append({"key": f"{prefix}/{k}", "step_s": step, "segment_s": r["segment_s"],
                     "calibrated_step_s": step, "steps_measured": 0, "from_line": False})
  tuning = EngineTuning.with_cache("off")
  tuning.load_json({"format": measured.to_json()["format"], "costs": stored})
  return tuning


@pytest.mark.parametrize("temperature,broken", [(0.7, False), (1.0, False), (1.0, True)],
                         ids=["t0.7", "t1", "t1-broken-residual"])
def test_the_main_jobs_regime_keeps_the_targets_distribution(target, temperature, broken,
                                                             monkeypatch):
  sampling = dataclasses.replace(SAMPLE, temperature=temperature)
  prompts, lengths = grouped_prompts()
  plain = generate(target, *stat_prompts(), jax.random.key(10), sampling, engine=STATIC)
  drafter = HistoryDrafter(draft_len=4, n=2, min_match=1, sampled=True,
                           vocab_size=CFG.vocab_size)
  params = regime_params(target, sampling, prompts, lengths)
  if broken:
    monkeypatch.setattr(segment, "verify", verify_without_residual)
    jax.clear_caches()  # the segment programs are traced again with it ...
  run = lambda tuning, rows=ROWS: speculative_generate(
      target, drafter, params, prompts[:rows], lengths[:rows], jax.random.key(21), sampling,
      engine=regime_engine(), tuning=tuning)
  tuning = drafting_tuning(lambda tuning: run(tuning, rows=256))
  try:
    out = run(tuning)
  finally:
    if broken:
      jax.clear_caches()  # ... and no later test finds them compiled
  segments = out.segments
  assert len(segments) > ROWS // 64  # the queue refilled
  assert sum(s.waiting_for_pages for s in segments) > 0  # rows waited for pages to grow
  assert len({s.bucket for s in segments}) == 2  # live rows were compacted
  ks = {s.draft_len for s in segments}
  assert len(ks) >= 2 and max(ks) > 0, ks  # K chosen per segment, drafting among them
  accepted = AcceptanceMetrics.from_counts(out.stats).num_accepted_tokens
  assert accepted > ROWS // 8, f"too few accepted drafts ({accepted}) to be a test"
  what = f"main regime at T={temperature}"
  # (the plain loop's rows alternate the prompts; these come in groups: KINDS)
  if broken:
    with pytest.raises(AssertionError, match="two samples differ"):
      assert_same_distribution(plain, out, what + ", broken residual", KINDS)
  else:
    assert_same_distribution(plain, out, what, KINDS)
