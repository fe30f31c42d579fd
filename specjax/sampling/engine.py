"""The rollout engine on the host: chains segment programs (`segment.py`) with live-batch
compaction into power-of-two buckets, an attention window over the live prefix, and a draft length
chosen per bucket from measured step costs and running acceptance rates.

Why: RL completions have long-tailed lengths, so most decode steps run with few live rows; a
verify of K+1 tokens is nearly free only while the live batch is small (weight reads dominate),
and costs K+1 steps once arithmetic dominates. A fixed K and a fixed batch cannot follow that.
Every choice here depends only on timings and on tokens already emitted, so every step is
verified exactly as in the static loop: the output keeps the target's distribution.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling.core import Rollout, SamplingConfig, finish
from specjax.sampling.drafter import Drafter
from specjax.sampling.metrics import AcceptanceCounts
from specjax.sampling.segment import EngineState, SegmentSpec, init_state, run_segment, take_rows

NO_LIMIT = 2 ** 30


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How the engine runs a batch. Hashable. `STATIC` is the plain loop: full batch, whole cache,
  fixed K, one segment."""

  compaction: bool = True  # gather live rows into the next bucket when they fit
  min_bucket: int = 1  # smallest bucket (raised to the data-parallel size)
  max_buckets: int = 6  # bucket sizes per batch: B, then halvings (bounds compiled programs)
  # attention reads positions < block * 2^j >= the longest live row (0: the whole cache); each
  # window is one more compiled program per (bucket, K), so it is off unless asked for
  window_block: int = 0
  adaptive: bool = True  # choose K per bucket (else the drafter's draft_len throughout)
  max_draft_len: int = 0  # largest K adaptivity may pick; 0: the drafter's draft_len
  probe_iters: int = 4  # adaptive: steps of a drafting segment while the evidence is thin ...
  probe_drafts: float = 16.0  # ... i.e. fewer drafts than this behind the estimate (decayed count)
  first_segment_iters: int = 32  # adaptive: steps before a bucket's first re-decision ...
  max_segment_iters: int = 256  # ... doubling per segment up to this
  estimate_decay: float = 0.7  # weight of earlier rollouts' acceptance counts at each new rollout
  calibration_iters: int = 3  # n: segments of n and 2n timed steps per (bucket, K) at startup ...
  calibration_repeats: int = 3  # ... timed this many times, the fastest kept (load noise)
  # in-run refinement: each segment's measured seconds per step move its (bucket, K) cost toward
  # them with weight iterations / (iterations + cost_memory) (0: keep the startup calibration)
  cost_memory: float = 64.0
  compile_threads: int = 0  # programs compiled at once at startup (0: one per core, at most 4)
  prior_acceptance: float = 0.6  # per-position acceptance assumed before any draft is seen
  prior_weight: float = 2.0  # in drafts
  min_gain: float = 0.05  # draft only when expected tokens/s beat plain AR by this fraction
  # prefill each distinct prompt once when the rows come in blocks of identical prompts (GRPO
  # groups: G samples per prompt, consecutive); the rows' samples stay independent
  share_prefill: bool = True

  def __post_init__(self):
    def check(ok, field, msg):
      if not ok:
        raise ValueError(f"EngineConfig.{field}: {msg}")
    check(self.min_bucket >= 1, "min_bucket", f"must be >= 1, got {self.min_bucket}")
    check(self.max_buckets >= 1, "max_buckets", f"must be >= 1, got {self.max_buckets}")
    check(self.window_block >= 0, "window_block", f"must be >= 0, got {self.window_block}")
    check(self.max_draft_len >= 0, "max_draft_len", f"must be >= 0, got {self.max_draft_len}")
    check(self.probe_iters >= 1, "probe_iters", f"must be >= 1, got {self.probe_iters}")
    check(self.probe_drafts >= 0, "probe_drafts", f"must be >= 0, got {self.probe_drafts}")
    check(self.first_segment_iters >= 1, "first_segment_iters",
          f"must be >= 1, got {self.first_segment_iters}")
    check(0 <= self.estimate_decay <= 1, "estimate_decay",
          f"must be in [0, 1], got {self.estimate_decay}")
    check(self.max_segment_iters >= self.first_segment_iters, "max_segment_iters",
          f"must be >= first_segment_iters={self.first_segment_iters}, "
          f"got {self.max_segment_iters}")
    check(self.calibration_iters >= 1, "calibration_iters",
          f"must be >= 1, got {self.calibration_iters}")
    check(self.calibration_repeats >= 1, "calibration_repeats",
          f"must be >= 1, got {self.calibration_repeats}")
    check(self.cost_memory >= 0, "cost_memory", f"must be >= 0, got {self.cost_memory}")
    check(self.compile_threads >= 0, "compile_threads",
          f"must be >= 0, got {self.compile_threads}")
    check(0 < self.prior_acceptance < 1, "prior_acceptance",
          f"must be in (0, 1), got {self.prior_acceptance}")
    check(self.prior_weight > 0, "prior_weight", f"must be > 0, got {self.prior_weight}")
    check(self.min_gain >= 0, "min_gain", f"must be >= 0, got {self.min_gain}")


STATIC = EngineConfig(compaction=False, window_block=0, adaptive=False)


@dataclasses.dataclass(frozen=True)
class Segment:
  """One segment as it ran (the engine's log)."""

  bucket: int
  draft_len: int
  window: int
  live_rows_start: int
  iterations: int
  tokens: int  # tokens committed by the bucket's rows
  seconds: float
  expected_tokens_per_s: float  # what the K choice predicted (nan when not adaptive)
  # the drafter was set aside for the rest of the rollout: no K > 0 can beat plain AR at the
  # acceptance measured so far, so its state is no longer kept up to date (K = 0 without it)
  drafter_retired: bool = False

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.seconds, 1e-12)


# -- buckets, windows, mesh -----------------------------------------------------------------------

def data_parallel_size(mesh) -> int:
  if mesh is None:
    return 1
  return math.prod(mesh.shape[a] for a in ("data", "fsdp") if a in mesh.shape)


def bucket_sizes(batch: int, dp: int = 1, min_bucket: int = 1, max_buckets: int = 64) -> list[int]:
  """Descending buckets: the batch, then the powers of two below it that are multiples of `dp`
  and >= min_bucket, at most `max_buckets` in all."""
  if batch % dp:
    raise ValueError(f"batch of {batch} rows is not divisible by the data-parallel size {dp} "
                     f"(mesh axes data x fsdp): every device must hold whole rows")
  out, b = [batch], 1 << (batch - 1).bit_length()
  while b > 1:
    b //= 2
    if b < batch and b % dp == 0 and b >= max(min_bucket, dp) and len(out) < max_buckets:
      out.append(b)
  return out


def prompt_group(prompts, prompt_lengths, dp: int = 1) -> int:
  """The largest g such that the rows come in consecutive blocks of g identical prompts (GRPO
  groups) and the distinct prompts still divide over the data-parallel size `dp`; 1 when no
  block repeats or the prompts are not all on this host (a multi-process array)."""
  if not all(getattr(x, "is_fully_addressable", True) for x in (prompts, prompt_lengths)):
    return 1
  p, lengths = np.asarray(prompts), np.asarray(prompt_lengths)
  batch = p.shape[0]
  for g in range(batch, 1, -1):
    if batch % g or (batch // g) % dp:
      continue
    blocks, lens = p.reshape(batch // g, g, -1), lengths.reshape(batch // g, g)
    if (blocks == blocks[:, :1]).all() and (lens == lens[:, :1]).all():
      return g
  return 1


def window_for(longest: int, draft_len: int, block: int, cache_size: int) -> int:
  """Smallest `block * 2^j` that holds a step's writes (positions < longest + K + 1); 0 (the
  whole cache) when that reaches the cache size or windows are off. Doubling keeps the number of
  compiled windows logarithmic in the cache size."""
  if not block:
    return 0
  w = block
  while w < longest + draft_len + 1:
    w *= 2
  return 0 if w >= cache_size else w


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


# -- adaptive K ---------------------------------------------------------------------------------

class AcceptanceEstimate:
  """Running per-position conditional acceptance: a_i = P(draft i accepted | drafts < i were),
  from drafts that offered position i, shrunk toward a prior (position 0) or toward a_{i-1}."""

  def __init__(self, max_len: int, prior: float, weight: float):
    self.offered = np.zeros(max_len)
    self.hits = np.zeros(max_len)
    self.prior, self.weight = prior, weight

  def decay(self, factor: float) -> None:
    """Weigh earlier counts by `factor` (recent steps matter more; old evidence fades toward the
    prior, so a drafter that failed once is tried again later)."""
    self.offered *= factor
    self.hits *= factor

  @property
  def seen(self) -> bool:
    return bool(self.offered[0] > 0)

  def add(self, draft_len: int, drafts: float, accepted_per_position: np.ndarray) -> None:
    """One segment's counts: `drafts` drafts of length `draft_len`; accepted_per_position[i] of
    them had their first i + 1 tokens accepted."""
    for i in range(draft_len):
      self.offered[i] += drafts if i == 0 else accepted_per_position[i - 1]
      self.hits[i] += accepted_per_position[i]

  def conditional(self) -> np.ndarray:
    out, prev = np.zeros(len(self.offered)), self.prior
    for i in range(len(out)):
      prev = out[i] = (self.hits[i] + prev * self.weight) / (self.offered[i] + self.weight)
    return out

  def expected_tokens(self, draft_len: int) -> float:
    """E[tokens a row commits in one step] = 1 + sum_{i<K} prod_{j<=i} a_j."""
    return 1.0 + float(np.sum(np.cumprod(self.conditional()[:draft_len])))


def best_draft_len(expected_tokens: dict[int, float], step_costs: dict[int, float],
                   live: int, min_gain: float = 0.0) -> tuple[int, float]:
  """(K, tokens/s) maximising live * E[tokens per step | K] / seconds per step at K; a K > 0
  must beat K = 0 (when offered) by the fraction `min_gain`, so that timing noise never keeps
  drafts that are not accepted."""
  rates = {k: live * expected_tokens[k] / step_costs[k] for k in expected_tokens}
  bar = {k: r / (1.0 + min_gain) if k > 0 and 0 in rates else r for k, r in rates.items()}
  k = max(bar, key=bar.get)
  return k, rates[k]


# -- the engine -----------------------------------------------------------------------------------

_init_jit = jax.jit(init_state, static_argnames=("graphdef", "drafter", "cfg", "cache_size",
                                                 "max_draft_len", "mesh", "group"))
_segment_jit = jax.jit(run_segment, static_argnames=("graphdef", "drafter", "spec", "mesh"))
_take_jit = jax.jit(take_rows)
_finish_jit = jax.jit(finish, static_argnames=("cfg",))


@jax.jit
def _summary(state: EngineState):
  live = ~state.done
  counts = state.counts.pooled()
  return (live, jnp.where(live, state.seq.lengths, 0),
          jnp.sum(jnp.where(state.row_ids >= 0, state.lengths, 0)),
          counts.num_drafts, counts.accepted_per_position, state.row_ids)


@jax.jit
def _write_back(out: EngineState, state: EngineState) -> EngineState:
  """Rows of a bucket state back into the full-batch state at their row ids (padding dropped)."""
  idx = jnp.where(state.row_ids >= 0, state.row_ids, out.done.shape[0])
  return jax.tree.map(lambda o, s: o.at[idx].set(s, mode="drop"), out, state)


def compiled_programs() -> int:
  """Programs the engine has compiled in this process (prefills, segments, and compaction's
  gathers, summaries and write-backs)."""
  return sum(f._cache_size() for f in (_init_jit, _segment_jit, _take_jit, _summary, _write_back))


# (program id, bucket, K) -> seconds per step, measured once per process (a run's startup
# calibration, reused by every later rollout of the run)
_STEP_COSTS: dict[tuple, float] = {}
# (graphdef, drafter, cfg, cache_size, mesh) -> program id: the costs' key hashes a graphdef once
# per rollout, not at every lookup (a policy's graphdef takes ~0.3 ms to hash)
_PROGRAM_IDS: dict[tuple, int] = {}
# the same key -> the fixed cost of running a segment of that program (seconds)
_SEGMENT_COSTS: dict[tuple, float] = {}
# the same key -> [startup calibration of the step cost, steps measured in rollouts since]
_CALIBRATED: dict[tuple, list] = {}
# (graphdef, drafter, cfg, cache_size, mesh, engine, buckets) whose programs are all compiled
_PREPARED: set[tuple] = set()
# (drafter, cfg) -> running acceptance of that drafter at that sampling config, across rollouts
_ESTIMATES: dict[tuple, AcceptanceEstimate] = {}


def calibration_table() -> list[dict]:
  """The measured costs: [{"bucket", "draft_len", "step_s", "segment_s", "calibrated_step_s",
  "steps_measured"}]: seconds per step the engine now uses (the startup calibration refined by
  the segments of later rollouts), the fixed seconds per segment, the startup figure, and how many
  in-rollout steps refined it."""
  return [{"bucket": k[-2], "draft_len": k[-1], "step_s": v, "segment_s": _SEGMENT_COSTS.get(k),
           "calibrated_step_s": _CALIBRATED[k][0], "steps_measured": _CALIBRATED[k][1]}
          for k, v in _STEP_COSTS.items()]


def clear_calibration() -> None:
  """Forget measured step costs and acceptance estimates (e.g. between benchmark settings)."""
  _STEP_COSTS.clear()
  _SEGMENT_COSTS.clear()
  _CALIBRATED.clear()
  _PREPARED.clear()
  _ESTIMATES.clear()


class _Run:
  """One call of the engine: the host loop over segments."""

  def __init__(self, graphdef, params, drafter, drafter_params, cfg: SamplingConfig,
               cache_size: int, engine: EngineConfig, mesh):
    self.graphdef, self.params = graphdef, params
    self.drafter, self.drafter_params = drafter, drafter_params
    self.cfg, self.cache_size, self.engine, self.mesh = cfg, cache_size, engine, mesh
    if drafter is None:
      self.k_max, self.k_choices = 0, (0,)
    elif engine.adaptive:
      self.k_max = engine.max_draft_len or drafter.draft_len
      self.k_choices = tuple(range(self.k_max + 1))
    else:
      self.k_max = drafter.draft_len
      self.k_choices = (drafter.draft_len,)
    self.adaptive = len(self.k_choices) > 1  # K is chosen per segment
    key = (None if drafter is None else dataclasses.replace(drafter, draft_len=max(self.k_max, 1)),
           cfg, graphdef)
    if key not in _ESTIMATES:
      _ESTIMATES[key] = AcceptanceEstimate(max(self.k_max, 1), engine.prior_acceptance,
                                           engine.prior_weight)
    self.estimate = _ESTIMATES[key]
    self.estimate.decay(engine.estimate_decay)
    self.retired = False  # see `choose_k`
    self.segments: list[Segment] = []
    self.program_id = _PROGRAM_IDS.setdefault((graphdef, drafter, cfg, cache_size, mesh),
                                              len(_PROGRAM_IDS))

  def segment(self, state, key, bucket: int, k: int, window: int, max_iters: int,
              stop_at_live: int):
    observe = k > 0 or (self.drafter is not None and self.drafter.stateful and not self.retired)
    drafter = self.drafter if observe else None
    if drafter is not None:
      drafter = dataclasses.replace(drafter, draft_len=max(k, 1))
    spec = SegmentSpec(cfg=self.cfg, draft_len=k, window=window)
    return _segment_jit(self.graphdef, self.params, drafter, self.drafter_params, key, state,
                        jnp.int32(max_iters), jnp.int32(stop_at_live), spec=spec, mesh=self.mesh)

  def step_cost(self, state, bucket: int, k: int, window: int) -> float:
    """Seconds per step of the (bucket, K) program, timed on the current state (the results are
    discarded) after one untimed run that compiles it. Each repeat times a segment of n steps and
    one of 2n; the slope (t_2n - t_n) / n is the cost of a step without the segment's fixed cost
    (dispatch, loop entry, the host round trip), which would otherwise weigh on cheap steps more
    than on dear ones. The fastest of `calibration_repeats` timings of each is kept, since load on
    the machine only ever adds time."""
    key = self.cost_key(bucket, k)
    if key not in _STEP_COSTS:
      n = self.engine.calibration_iters
      probe = self.probe_key
      jax.block_until_ready(self.segment(state, probe, bucket, k, window, n, 0))
      best = {n: (float("inf"), 0), 2 * n: (float("inf"), 0)}
      for _ in range(self.engine.calibration_repeats):
        for m in best:
          t0 = time.perf_counter()
          _, iters = jax.block_until_ready(self.segment(state, probe, bucket, k, window, m, 0))
          best[m] = min(best[m], (time.perf_counter() - t0, int(iters)))
      (t1, i1), (t2, i2) = best[n], best[2 * n]
      slope = (t2 - t1) / (i2 - i1) if i2 > i1 and t2 > t1 else t2 / max(i2, 1)
      _STEP_COSTS[key] = slope
      _SEGMENT_COSTS[key] = max(t2 - slope * i2, 0.0)
      _CALIBRATED[key] = [slope, 0]
    return _STEP_COSTS[key]

  def cost_key(self, bucket: int, k: int) -> tuple:
    return (self.program_id, bucket, k)

  def refine_cost(self, bucket: int, k: int, iters: int, seconds: float) -> None:
    """Move the (bucket, K) step cost toward what a segment of the run measured: the startup
    calibration times a few steps on the prompt's first positions, the run's own segments every
    step the engine takes there. The segment's fixed cost (measured at calibration) is taken off
    first; weight iterations / (iterations + cost_memory)."""
    key = self.cost_key(bucket, k)
    if key not in _STEP_COSTS or iters <= 0 or self.engine.cost_memory <= 0:
      return
    per_step = max(seconds - _SEGMENT_COSTS.get(key, 0.0), 0.0) / iters
    w = iters / (iters + self.engine.cost_memory)
    _STEP_COSTS[key] = (1.0 - w) * _STEP_COSTS[key] + w * per_step
    _CALIBRATED[key][1] += iters

  def cost(self, state, bucket: int, k: int, longest: int) -> float:
    """Seconds per step at (bucket, K), measured (every K the engine may pick is calibrated, so
    its program is compiled with the calibration, not later in the run)."""
    return self.step_cost(state, bucket, k,
                          window_for(longest, k, self.engine.window_block, self.cache_size))

  def choose_k(self, state, bucket: int, live: int, longest: int) -> tuple[int, float]:
    """(K, expected tokens/s) maximising live * E[tokens | K] / cost(bucket, K). The first visit
    of a bucket calibrates every K, so no program of the run compiles after its first rollout.

    When the acceptance measured so far rules out every K > 0, the drafter is *retired* for the
    rest of the rollout: the estimate changes only through drafting segments, so no later choice
    of this rollout could pick a K > 0, and a stateful drafter (EAGLE-3, MTP, a draft model)
    would only keep observing at a cost per step. The K = 0 program without the drafter compiles
    the first time a bucket needs it. The next rollout starts with the drafter again."""
    if not self.adaptive:
      return self.k_choices[0], float("nan")
    if self.retired:
      return 0, float("nan")
    costs = {k: self.cost(state, bucket, k, longest) for k in self.k_choices}
    if not self.estimate.seen:  # acceptance is a guess: draft once so the estimate can learn
      choices = self.k_choices[1:]
    else:  # a K whose expected tokens cannot beat AR by min_gain is not even measured
      bar = 1.0 + self.engine.min_gain
      choices = [k for k in self.k_choices if k == 0 or self.estimate.expected_tokens(k) > bar]
      self.retired = choices == [0]
    if len(choices) == 1:
      return choices[0], float("nan")
    return best_draft_len({k: self.estimate.expected_tokens(k) for k in choices},
                          {k: costs[k] for k in choices}, live, self.engine.min_gain)

  def segment_budget(self, bucket: int, k: int, j: int) -> int:
    """Steps the segment at (bucket, K) may run before K is chosen again; `j` counts the
    segments the bucket already ran at this K."""
    if not self.adaptive or k == 0:
      # plain AR collects no acceptance evidence and the costs do not change with the live
      # count, so a re-decision would choose K = 0 again: run until the bucket or window ends
      return NO_LIMIT
    if self.estimate.offered[0] < max(self.engine.probe_drafts, 1e-9):
      # thin evidence (a first rollout, or counts decayed since): draft briefly, then decide
      # again, so a drafter that fails costs a few steps, not a segment
      return self.engine.probe_iters
    return min(self.engine.first_segment_iters << j, self.engine.max_segment_iters)

  def prepare_buckets(self, state, buckets: list[int]) -> None:
    """Compile every program the run may use now, on the first rows of the prefilled state (the
    results are discarded): each bucket's segment at every K adaptivity may pick, and compaction's
    gather, summary and write-back, so that a bucket the first rollouts never reach does not
    compile inside a later one: after the first rollout of a run, nothing compiles. The programs
    compile `compile_threads` at a time (XLA compiles one program on one core, and a run has up to
    buckets x (K + 1) of them); then (adaptive) each smaller bucket's K are calibrated, one at a
    time. Programs already compiled, and costs already measured, are reused."""
    key = (self.graphdef, self.drafter, self.cfg, self.cache_size, self.mesh, self.engine,
           tuple(buckets))
    if key in _PREPARED:
      return
    _PREPARED.add(key)
    prompt_len = int(jax.device_get(jnp.max(state.seq.lengths)))
    ks = self.k_choices if self.adaptive else self.k_choices[:1]
    # what compaction to bucket b runs: gather from the full batch, summary, write-back
    subs = {buckets[0]: state}
    for b in buckets[1:]:
      subs[b] = _take_jit(state, jnp.arange(b, dtype=jnp.int32), jnp.zeros((b,), bool))
    jobs = [lambda s=subs[b]: (_summary(s), _write_back(state, s)) for b in buckets[1:]]
    for b in buckets:
      for k in ks:
        window = window_for(prompt_len, k, self.engine.window_block, self.cache_size)
        jobs.append(lambda b=b, k=k, w=window: self.segment(subs[b], self.probe_key, b, k, w, 0,
                                                            0))
    threads = min(self.engine.compile_threads or min(os.cpu_count() or 1, 4), len(jobs))
    if threads > 1:
      with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        jax.block_until_ready(list(pool.map(lambda job: job(), jobs)))
    else:
      jax.block_until_ready([job() for job in jobs])
    if self.adaptive:
      for b in buckets[1:]:
        for k in ks:
          self.cost(subs[b], b, k, prompt_len)

  def run(self, prompts, prompt_lengths, key) -> Rollout:
    batch = prompts.shape[0]
    dp = data_parallel_size(self.mesh)
    compact = self.engine.compaction and (self.drafter is None or self.drafter.row_local)
    buckets = bucket_sizes(batch, dp, self.engine.min_bucket, self.engine.max_buckets) \
        if compact else bucket_sizes(batch, dp, batch)
    init_drafter = None if self.drafter is None else \
        dataclasses.replace(self.drafter, draft_len=max(self.k_max, 1))
    group = prompt_group(prompts, prompt_lengths, dp) if self.engine.share_prefill else 1
    key_prefill, key_loop = jax.random.split(key)
    # calibration and bucket preparation run segments with a key of the caller's kind (a typed
    # key or raw uint32[2]: they are different programs), so they compile what the run uses
    self.probe_key = jax.random.fold_in(key_loop, 2**31 - 1)
    state = _init_jit(self.graphdef, self.params, init_drafter, self.drafter_params, prompts,
                      prompt_lengths, key_prefill, cfg=self.cfg, cache_size=self.cache_size,
                      max_draft_len=max(self.k_max, 1), mesh=self.mesh, group=group)
    self.prepare_buckets(state, buckets)
    out, bucket, total_steps = state, batch, 0
    per_bucket = {}  # bucket -> segments run there (grows the iteration budget)
    last_k = {}
    # one host round trip per segment: the summary after a segment is the next one's "before"
    summary = jax.device_get(_summary(state))
    while True:
      live_mask, seq_lengths, tokens_before, drafts0, acc0, row_ids = summary
      live = int(live_mask.sum())
      if live == 0:
        break
      fits = [b for b in buckets if b >= live]
      if compact and fits[-1] < bucket:  # gather the live rows into the smallest bucket
        # from the full batch (brought up to date first): one gather program per bucket, which
        # `prepare_buckets` compiles, whichever bucket the rows come from
        out = _write_back(out, state)
        rows = row_ids[np.flatnonzero(live_mask)]
        new = fits[-1]
        idx = np.concatenate([rows, np.full(new - live, rows[0])]).astype(np.int32)
        pad = np.arange(new) >= live
        state, bucket = _take_jit(out, jnp.asarray(idx), jnp.asarray(pad)), new
        # token and acceptance counts now cover only the rows in the bucket
        live_mask, seq_lengths, tokens_before, drafts0, acc0, _ = jax.device_get(_summary(state))
      longest = int(seq_lengths.max())
      k, expected = self.choose_k(state, bucket, live, longest)
      window = window_for(longest, k, self.engine.window_block, self.cache_size)
      j = per_bucket.get(bucket, 0) if last_k.get(bucket) in (None, k) else 0
      per_bucket[bucket], last_k[bucket] = j + 1, k
      max_iters = self.segment_budget(bucket, k, j)
      smaller = [b for b in buckets if b < bucket]
      stop_at_live = smaller[0] if compact and smaller else 0
      t0 = time.perf_counter()
      state, iters = self.segment(state, jax.random.fold_in(key_loop, len(self.segments)),
                                  bucket, k, window, max_iters, stop_at_live)
      summary = jax.device_get(_summary(state))
      _, _, tokens_after, drafts1, acc1, _ = summary
      seconds = time.perf_counter() - t0
      iters = int(iters)
      total_steps += iters
      if k > 0:
        self.estimate.add(k, float(drafts1 - drafts0), np.asarray(acc1 - acc0, np.float64))
      if self.adaptive and not self.retired:  # the costs are those of the drafter's programs
        self.refine_cost(bucket, k, iters, seconds)
      self.segments.append(Segment(bucket=bucket, draft_len=k, window=window,
                                   live_rows_start=live, iterations=iters,
                                   tokens=int(tokens_after - tokens_before), seconds=seconds,
                                   expected_tokens_per_s=expected,
                                   drafter_retired=self.retired))
    out = _write_back(out, state)
    stats = None
    if self.drafter is not None:
      stats = out.counts if self.k_max >= 1 else AcceptanceCounts.zeros(1, batch)
    rollout = _finish_jit(prompts, prompt_lengths, out.tokens, out.logprobs, out.lengths,
                          self.cfg, jnp.int32(total_steps), stats)
    return rollout.replace(segments=tuple(self.segments))


def run_engine(graphdef, params, drafter: Drafter | None, drafter_params, prompts: jax.Array,
               prompt_lengths: jax.Array, key: jax.Array, cfg: SamplingConfig, cache_size: int,
               engine: EngineConfig, mesh=None) -> Rollout:
  """Sample completions with the engine (inputs already checked by `generate` /
  `speculative_generate`). `mesh` None: the mesh the params are sharded over, if any."""
  mesh = params_mesh(params) if mesh is None else mesh
  if mesh is not None:
    from specjax.sharding.rules import shard_batch
    prompts, prompt_lengths = shard_batch((prompts, prompt_lengths), mesh)
  return _Run(graphdef, params, drafter, drafter_params, cfg, cache_size, engine,
              mesh).run(prompts, prompt_lengths, key)
