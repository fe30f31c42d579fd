"""The engine's host loop: between segments it asks the KV manager to visit the rows, the
scheduler to refill free slots, the batch to compact the live rows into a smaller bucket and the
speculation manager for the next segment's K; then it runs the segment and reports it.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from specjax.sampling.buckets import (bucket_sizes, compaction, data_parallel_size,
                                      prompt_group, queue_slots)
from specjax.sampling.calibration import EngineTuning
from specjax.sampling.core import Rollout, SamplingConfig
from specjax.sampling.drafter import Drafter
from specjax.sampling.engine.batch import Batch, Summary
from specjax.sampling.engine.kv import kv_manager
from specjax.sampling.engine.programs import Programs
from specjax.sampling.engine.scheduler import Scheduler
from specjax.sampling.engine.speculation import Speculation
from specjax.sampling.engine_config import EngineConfig, Segment
from specjax.sampling.metrics import AcceptanceCounts


class EngineRun:
  """One call of the engine: the host loop over segments, and the log of the segments it ran."""

  def __init__(self, graphdef, params, drafter: Drafter | None, drafter_params,
               cfg: SamplingConfig, cache_size: int, engine: EngineConfig, mesh,
               tuning: EngineTuning):
    self.programs = Programs(graphdef, params, drafter, drafter_params, cfg, cache_size, engine,
                             mesh)
    self.speculation = Speculation(self.programs, tuning)
    self.engine = engine
    self.segments: list[Segment] = []
    self._swaps = 0  # rows swapped out before the segments logged so far

  def run(self, prompts, prompt_lengths, key) -> Rollout:
    p, spec, engine = self.programs, self.speculation, self.engine
    batch_size = prompts.shape[0]
    dp = data_parallel_size(p.mesh)
    group = prompt_group(prompts, prompt_lengths, dp) if engine.queue.share_prefill else 1
    kv = kv_manager(p, prompt_lengths)
    # a queue: `slots` rows step at once; a segment returns once `refill` slots are free, and
    # they take waiting rows, prefilled `prefill_rows` (whole prompt groups) at a time
    queue_ok = p.drafter is None or p.drafter.row_local
    max_rows = engine.queue.max_rows if queue_ok else 0
    if kv.paged and queue_ok and not max_rows:
      max_rows = kv.slots_held(group)
    slots, refill, prefill_rows = queue_slots(batch_size, max_rows, group, dp,
                                              engine.queue.refill_fraction)
    compact = engine.buckets.compaction and queue_ok
    buckets = bucket_sizes(slots, dp, engine.buckets.min_bucket, engine.buckets.max_buckets) \
        if compact else bucket_sizes(slots, dp, slots)
    key_prefill, key_loop = jax.random.split(key)
    spec.start(key_loop)
    batch = Batch.start(p.prefill(prompts[:slots], prompt_lengths[:slots], key_prefill, group),
                        batch_size)
    unplaced = batch.run(lambda state: kv.start(state, group))
    rows = np.concatenate([unplaced, np.arange(slots, batch_size)]).astype(np.int64)
    sched = Scheduler(p, kv, rows, prompts, prompt_lengths, key_prefill, group, slots, refill,
                      prefill_rows, dp)
    spec.prepare(batch, buckets if engine.compile.ahead else buckets[:1],
                 sched.compile_jobs(batch) + kv.compile_jobs(batch))
    if sched.waiting() and engine.queue.refill_from_costs:
      sched.measure_refill_costs(batch, spec.costs)
    total_steps = 0
    # one host round trip per segment: the summary after a segment is the next one's "before"
    summary = batch.summary()
    while True:
      if kv.paged:  # pages: finished rows give theirs back, live rows take more, swaps
        batch.apply(lambda state: kv.visit(state, summary))
      summary, no_pages = sched.refill_slots(batch, summary)
      live = int(summary.live.sum())
      if live == 0:
        if not sched.waiting():
          break
        sched.check_stalled()
        continue
      # (paged KV on a mesh: a row's pages lie on its replica, so it stays there)
      new, idx, pad = compaction(summary.homes[np.flatnonzero(summary.live)], buckets, slots,
                                 dp, by_replica=kv.paged)
      if compact and not sched.waiting() and new < batch.bucket:
        batch.compact(idx, pad, new)
        if not engine.compile.ahead:  # (a no-op once the bucket is prepared)
          spec.prepare(batch, [new])
        # token and acceptance counts now cover only the rows in the bucket
        summary = batch.summary()
      summary = self._segment(batch, sched, summary, live, buckets, compact, no_pages, key_loop)
      total_steps += self.segments[-1].iterations
    results = batch.finish()
    stats = None
    if p.drafter is not None:
      stats = results.counts if p.k_max >= 1 else AcceptanceCounts.zeros(1, batch_size)
    rollout = p.finish(prompts, prompt_lengths, results, total_steps, stats)
    return rollout.replace(segments=tuple(self.segments))

  def _segment(self, batch: Batch, sched: Scheduler, summary: Summary, live: int,
               buckets: list[int], compact: bool, no_pages: bool, key_loop) -> Summary:
    """Choose the next segment's shape, run it on the batch and log it: the summary after."""
    spec, kv, bucket = self.speculation, sched.kv, batch.bucket
    longest = int(summary.seq_lengths.max())
    k, width, expected, window, max_iters = spec.choose(batch, longest, live)
    refilling = sched.waiting() > 0 and bucket == sched.slots
    if refilling:
      sched.update_refill(spec.cost(batch, bucket, k, longest, width),
                          spec.costs.fixed_cost(spec.cost_key(bucket, k, width)))
    stop_at_live = sched.stop_at_live(live, bucket, buckets, compact, no_pages)
    paused_rows = kv.paused
    stop_at_paused = sched.stop_at_paused(live)
    key = jax.random.fold_in(key_loop, len(self.segments))
    t0 = time.perf_counter()
    iters = batch.run(lambda state: self.programs.segment(
        state, key, k, width, spec.observes(k), window, max_iters, stop_at_live, stop_at_paused))
    after = batch.summary()
    seconds = time.perf_counter() - t0
    iters = int(iters)
    if refilling:
      sched.observe(live, after, iters)
    spec.learn(bucket, k, width, summary, after, iters, seconds)
    self.segments.append(Segment(
        bucket=bucket, draft_len=k, tree_width=width, window=window, live_rows_start=live,
        iterations=iters, tokens=int(after.tokens - summary.tokens), seconds=seconds,
        expected_tokens_per_s=expected, drafter_retired=spec.policy.retired,
        pages_in_use=kv.pages_in_use, swapped_out=kv.swaps - self._swaps,
        waiting_for_pages=paused_rows,
        refill_at=sched.refill if sched.waiting() else 0))
    self._swaps = kv.swaps
    return after


def run_engine(graphdef, params, drafter: Drafter | None, drafter_params, prompts: jax.Array,
               prompt_lengths: jax.Array, key: jax.Array, cfg: SamplingConfig, cache_size: int,
               engine: EngineConfig, mesh=None, tuning: EngineTuning | None = None) -> Rollout:
  """Sample completions with the engine (inputs already checked and the largest draft length
  resolved by `generate` / `speculative_generate`). `mesh` None: the mesh the params are sharded
  over, if any. `tuning` None: calibrate afresh for this call only."""
  mesh = params_mesh(params) if mesh is None else mesh
  if mesh is not None:
    from specjax.sharding.rules import shard_batch
    prompts, prompt_lengths = shard_batch((prompts, prompt_lengths), mesh)
  tuning = EngineTuning() if tuning is None else tuning
  return EngineRun(graphdef, params, drafter, drafter_params, cfg, cache_size, engine, mesh,
                   tuning).run(prompts, prompt_lengths, key)


def params_mesh(params):
  """The mesh the parameters are sharded over, when they are (more than one device)."""
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and mesh.size > 1:
      return mesh
    if sharding is not None:
      return None
  return None
