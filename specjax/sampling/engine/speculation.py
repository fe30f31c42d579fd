"""The engine's speculation manager: which draft length K (and draft tree width) each segment
runs, from measured step costs (`cost_table.CostTable`) and running acceptance estimates
(`adaptive.DraftShapePolicy`); the calibration of those costs on dry runs of the rollout's own
state; each bucket's programs compiled before it first steps; and what a segment's outcome
teaches (acceptance counts, refined costs). Every choice depends only on timings and on tokens
already emitted, so every step is verified exactly as in the static loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from specjax.sampling.adaptive import DraftLenPolicy, DraftShapePolicy
from specjax.sampling.buckets import window_for
from specjax.sampling.calibration import EngineTuning
from specjax.sampling.engine import batch as batch_programs
from specjax.sampling.engine.batch import Batch, Summary
from specjax.sampling.engine.programs import Programs, program_statics

logger = logging.getLogger("specjax.sampling.engine")


class Speculation:
  """K and tree-width choices over one engine run. `drafter.draft_len` is the largest K
  (resolved by `speculative_generate`); with `EngineConfig.adaptive.enabled.enabled` K is chosen per
  segment among `AdaptiveConfig.k_choices` of it."""

  def __init__(self, programs: Programs, tuning: EngineTuning):
    self.programs = p = programs
    drafter, engine = p.drafter, p.engine
    self.engine, self.costs, self.k_max = engine, tuning.costs, p.k_max
    if drafter is None:
      k_choices = (0,)
    else:
      k_choices = engine.adaptive.k_choices(self.k_max) if engine.adaptive.enabled else \
          (self.k_max,)
    # the tree widths a segment may verify: the drafter's; adaptive, also the plain chain (1)
    tree = 1 if drafter is None else drafter.tree_width
    self.widths = (1, tree) if engine.adaptive.enabled and tree > 1 else (tree,)
    policies = {}
    for w in self.widths:  # one acceptance estimate per width: a tree accepts more
      key = (None if drafter is None else
             dataclasses.replace(drafter, draft_len=max(self.k_max, 1), tree_width=w),
             p.cfg, p.graphdef)
      estimate = tuning.estimates.get(key, max(self.k_max, 1), engine.adaptive)
      estimate.decay(engine.adaptive.estimate_decay)
      policies[w] = DraftLenPolicy(k_choices, estimate, engine.adaptive,
                                   retire=drafter is not None and drafter.stateful)
    self.policy = DraftShapePolicy(policies, engine.adaptive)
    self.adaptive = self.policy.adaptive  # K (and the tree width) is chosen per segment
    # the K each bucket compiles and times when it is prepared; another K costs the line
    # through 0 and k_max until a segment runs it
    self.timed_ks = k_choices[:1] if not self.adaptive else k_choices \
        if engine.calibration.every_k else tuple(k for k in k_choices if k in (0, self.k_max))
    self.program_id = self.costs.program_id((p.graphdef, drafter, p.cfg, p.cache_size, p.mesh,
                                             program_statics(engine)))
    self.probe_key = None  # a key of the caller's kind, for dry runs (`start`)
    self._per_bucket: dict[int, int] = {}  # bucket -> segments run there at its last shape
    self._last_shape: dict[int, tuple] = {}

  def start(self, key_loop) -> None:
    # calibration and bucket preparation run segments with a key of the caller's kind (a typed
    # key or raw uint32[2]: they are different programs), so they compile what the run uses
    self.probe_key = jax.random.fold_in(key_loop, 2**31 - 1)

  def span(self, k: int, width: int = 1) -> int:
    """Cache positions a step at K writes past a row's last committed token (a draft tree of
    `width`: its drafted nodes, `Drafter.write_span`)."""
    if k == 0 or width == 1:
      return k
    return dataclasses.replace(self.programs.drafter, draft_len=k, tree_width=width).write_span

  def window(self, longest: int, k: int, width: int = 1) -> int:
    return window_for(longest, self.span(k, width), self.engine.buckets.window_block,
                      self.programs.cache_size)

  def observes(self, k: int) -> bool:
    """An AR segment still feeds a stateful drafter its steps, until the drafter retires."""
    drafter = self.programs.drafter
    return k > 0 or (drafter is not None and drafter.stateful and not self.policy.retired)

  def shapes(self, ks) -> list[tuple[int, int]]:
    """(K, width) of every program the K in `ks` need: K = 0 once, each K > 0 at every width."""
    return [(k, w) for k in ks for w in (self.widths[:1] if k == 0 else self.widths)]

  # -- costs ------------------------------------------------------------------------------------

  def cost_key(self, bucket: int, k: int, width: int = 1) -> tuple:
    """(program, bucket, K) of a step cost; a tree's programs are another program than the
    chain's at the same K (K = 0: one program whatever the width)."""
    if width == 1 or k == 0:
      return (self.program_id, bucket, k)
    return (self.costs.program_id((self.program_id, "tree", width)), bucket, k)

  def line_point(self, bucket: int, k: int, width: int = 1) -> tuple:
    """(key of K = 0, key of k_max, fraction): where K lies on the line of `CostTable.line`."""
    return (self.cost_key(bucket, 0), self.cost_key(bucket, self.k_max, width), k / self.k_max)

  def cost(self, batch: Batch, bucket: int, k: int, longest: int, width: int = 1) -> float:
    """Seconds per step at (bucket, K, tree width): for a timed K, measured on the batch's
    state by dry runs (which take it and give it back) the first time it is asked for; for
    another, its own cost once a segment ran it, else the line through the bucket's timed K = 0
    and k_max (of that width)."""
    if k not in self.timed_ks:
      for end in (0, self.k_max):
        self.cost(batch, bucket, end, longest, width)
      key = self.cost_key(bucket, k, width)
      line = self.costs.line(key, *self.line_point(bucket, k, width))
      # no segment ran this K yet: its cost is a guess and choosing it compiles a program, so it
      # must beat the timed K by min_gain
      return line if self.costs.has(key) else line * (1.0 + self.engine.adaptive.min_gain)
    window = self.window(longest, k, width)

    def dry_run(state, m: int):
      # it steps the state in its own buffers and gives it back as it was, so every run starts
      # where the rollout is, the rollout is left as it was, and no copy of the state (its KV
      # memory) is made
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      state, iters = self.programs.segment(state, self.probe_key, k, width, self.observes(k),
                                           window, m, 0, commit=False)
      iters = int(iters)  # (waits for the segment)
      return state, (iters, time.perf_counter() - t0)

    # (a program compiled ahead has not run yet: the first, untimed run finds it compiled)
    return self.costs.step_cost(self.cost_key(bucket, k, width),
                                lambda m: batch.run(lambda state: dry_run(state, m)),
                                self.engine.calibration.iters, self.engine.calibration.repeats)

  def prepare(self, batch: Batch, buckets: list[int], extra_jobs: tuple = ()) -> None:
    """Compile the programs of `buckets` (the first is the batch's own bucket; the others'
    states are its first rows) on throwaway states: each bucket's segment at every timed K
    (`timed_ks`; `EngineConfig.compile.ahead`: at every K), and for the smaller buckets
    compaction's gather, summary and write-back, with `extra_jobs` (the queue's and the KV
    manager's programs) alongside. Then (adaptive) each smaller bucket's timed K are calibrated,
    one at a time (the first bucket's are timed when the policy first asks for them). Programs
    already compiled, and costs already measured, are reused.

    compile_ahead prepares every bucket at every K before the first segment, so a later rollout
    compiles nothing whichever buckets and K it runs; the default prepares a bucket when a
    rollout first reaches it, so the first rollout compiles only what it runs."""
    if not self.costs.first_preparation((self.program_id, self.engine, tuple(buckets),
                                         len(extra_jobs))):
      return
    state = batch.state
    prompt_len = int(jax.device_get(jnp.max(state.seq.lengths)))
    # ahead: every K a segment may choose (those between the timed ones would compile in a later
    # step); else the timed K only
    ks = self.policy.k_choices if self.engine.compile.ahead else self.timed_ks
    # what compaction to bucket b runs: gather from the full batch, summary, write-back
    # (a paged state's buckets share its page buffers: the pool is held once)
    subs = {buckets[0]: state}
    for b in buckets[1:]:
      subs[b] = batch_programs.gather(state, jnp.arange(b, dtype=jnp.int32),
                                      jnp.zeros((b,), bool))
    jobs = [lambda s=subs[b]: (batch_programs.summarize(s),
                               batch_programs.compile_write_back(state, s))
            for b in buckets[1:]]
    jobs += list(extra_jobs)
    for b in buckets:
      for k, width in self.shapes(ks):
        jobs.append(lambda b=b, k=k, w=self.window(prompt_len, k, width), width=width:
                    self.programs.compile_segment(subs[b], self.probe_key, k, width,
                                                  self.observes(k), w))
    compiled = self.programs.compile_all(jobs)
    t0 = time.perf_counter()
    if self.adaptive:  # (the first bucket's are timed when the policy first asks for them)
      for b in buckets[1:]:
        with batch.borrowed(subs[b]):
          for k, width in self.shapes(self.timed_ks):
            self.cost(batch, b, k, prompt_len, width)
    # (progress for a user waiting on a first rollout: compiled programs found in a cache are
    # counted too)
    timed = time.perf_counter() - t0
    contiguous = list(ks) == list(range(min(ks), max(ks) + 1))
    k_range = f"{min(ks)}-{max(ks)}" if len(ks) > 1 and contiguous else "/".join(map(str, ks))
    logger.info(f"[engine] buckets {'/'.join(map(str, buckets))} at K {k_range}: "
                f"{len(jobs)} program{'s' * (len(jobs) != 1)} compiled in {compiled:.1f} s" +
                (f", step costs measured in {timed:.1f} s" if timed >= 0.05 else ""))

  # -- a segment's shape ------------------------------------------------------------------------

  def choose(self, batch: Batch, longest: int, live: int) -> tuple[int, int, float, int, int]:
    """(K, tree width, expected tokens/s, window, iteration budget) of the next segment of the
    batch's bucket. A K that no segment ran yet is compiled first (outside any timing)."""
    bucket = batch.bucket
    k, width, expected = self.policy.choose(
        lambda k, w: self.cost(batch, bucket, k, longest, w), live)
    window = self.window(longest, k, width)
    shape = (k, width)
    j = self._per_bucket.get(bucket, 0) if self._last_shape.get(bucket) in (None, shape) else 0
    self._per_bucket[bucket], self._last_shape[bucket] = j + 1, shape
    max_iters = self.policy.budget(k, width, j)
    if k not in self.timed_ks and not self.costs.has(self.cost_key(bucket, k, width)):
      # its first segment: compile it first, so the timing below holds only steps
      self.programs.compile_segment(batch.state, self.probe_key, k, width, self.observes(k),
                                    window)
      self.cost(batch, bucket, k, longest, width)  # (the line's ends are timed, if not yet)
      self.costs.start_from_line(self.cost_key(bucket, k, width),
                                 *self.line_point(bucket, k, width))
    return k, width, expected, window, max_iters

  def learn(self, bucket: int, k: int, width: int, before: Summary, after: Summary,
            iters: int, seconds: float) -> None:
    """A segment ran: its acceptance counts join the estimate of its width; (adaptive) its
    seconds per step refine, or check, the cost of its (bucket, K)."""
    if k > 0:
      self.policy.estimate(width).add(k, float(after.drafts - before.drafts),
                                      (after.accepted - before.accepted).astype("float64"))
    self.policy.ran(k, width, iters)
    if self.adaptive and not self.policy.retired:  # the costs of the drafter's programs
      key = self.cost_key(bucket, k, width)
      self.costs.refine(key, iters, seconds, self.engine.calibration.cost_memory)
      self.costs.check_cached(key, iters, seconds, self.engine.calibration.recheck_cached_costs,
                              self.engine.calibration.recheck_steps)
