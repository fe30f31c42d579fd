"""How the rollout engine runs a batch (`EngineConfig`, the one home of its defaults) and what it
reports of each segment it ran (`Segment`). Plain Python: the RL config and the simulator read
these defaults without importing jax.

`EngineConfig` is a tree of parts, one per collaborator of the engine that reads it: the queue of
rows over slots (`queue`), paged KV memory (`paging`), batch buckets and windows (`buckets`), the
choice of K (`adaptive`), measured step costs (`calibration`) and compilation (`compile`). In an
RL run it sits at `RolloutConfig.engine`, so every field is a YAML key and a CLI flag
(`--rl.rollout.engine.paging.kernel-pages 4`).
"""

from __future__ import annotations

import dataclasses

from specjax.config_tree import check


@dataclasses.dataclass(frozen=True)
class QueueConfig:
  """Rows over slots: a batch longer than the slots queues, and waiting rows are admitted into
  the slots of finished ones."""

  # slots: rows stepped at once; a longer batch is a queue, admitted into slots as rows finish
  # (0: every row at once; with paging.kv_cache_gb, as many slots as rows the empty pool holds)
  max_rows: int = 0
  # a segment returns to admit waiting rows once this fraction of the slots is free; rows are
  # prefilled in whole prompt groups (at least that many rows), and a group's samples that find
  # no free slot wait prefilled (their prompt-wide caches held meanwhile) for the next ones
  refill_fraction: float = 0.125
  # True: once rows have finished, the free slots that make a segment return are chosen from
  # measured costs (a step, a refill's round trip and prefill, timed at startup) and the rate at
  # which rows finish (`adaptive.best_refill`); refill_fraction then sets only the first refills
  # and the rows prefilled at once. False: refill_fraction throughout
  refill_from_costs: bool = True
  # prefill each distinct prompt once when the rows come in blocks of identical prompts (GRPO
  # groups: G samples per prompt, consecutive); the rows' samples stay independent
  share_prefill: bool = True

  def __post_init__(self):
    check(self.max_rows >= 0, "EngineConfig.queue.max_rows",
          f"must be >= 0 (0: every row at once), got {self.max_rows}")
    check(0 < self.refill_fraction <= 1, "EngineConfig.queue.refill_fraction",
          f"must be in (0, 1], got {self.refill_fraction}")


@dataclasses.dataclass(frozen=True)
class PagingConfig:
  """Paged KV memory: rows take pages of the pool as they grow (`engine/slot_pages.py`)."""

  # the target's KV memory in GiB per device: > 0 pages it (rows take pages of page_size
  # positions as they grow) and admits waiting rows while pages are free; on a mesh each
  # data-parallel replica holds its own pages; 0: a dense cache of the longest possible row per
  # slot
  kv_cache_gb: float = 0.0
  page_size: int = 16
  page_ahead: int = 32  # positions of pages a row takes beyond its next step when it grows
  # on a GPU: the attention kernel's pages of K and V per loop step, warps per program and
  # programs a row's pages are split over (0: `specjax.models.paged_attention.PAGES_PER_BLOCK`,
  # `NUM_WARPS` and `NUM_SPLITS`); ignored elsewhere
  kernel_pages: int = 0
  kernel_warps: int = 0
  kernel_splits: int = 0

  def __post_init__(self):
    check(self.kv_cache_gb >= 0, "EngineConfig.paging.kv_cache_gb",
          f"must be >= 0 (0: dense caches), got {self.kv_cache_gb}")
    check(self.page_size >= 1, "EngineConfig.paging.page_size",
          f"must be >= 1, got {self.page_size}")
    check(self.page_ahead >= 1, "EngineConfig.paging.page_ahead",
          f"must be >= 1, got {self.page_ahead}")
    check(self.kernel_pages >= 0 and not self.kernel_pages & (self.kernel_pages - 1),
          "EngineConfig.paging.kernel_pages",
          f"must be a power of two (0: the kernel's default), got {self.kernel_pages}")
    check(self.kernel_warps >= 0, "EngineConfig.paging.kernel_warps",
          f"must be >= 0 (0: the kernel's default), got {self.kernel_warps}")
    check(self.kernel_splits >= 0, "EngineConfig.paging.kernel_splits",
          f"must be >= 0 (0: the kernel's default), got {self.kernel_splits}")


@dataclasses.dataclass(frozen=True)
class BucketConfig:
  """The batch shapes a segment runs: live rows gathered into smaller buckets as rows finish, and
  the cache window a step's program sees."""

  compaction: bool = True  # gather live rows into the next bucket when they fit
  min_bucket: int = 1  # smallest bucket (raised to the data-parallel size)
  max_buckets: int = 6  # bucket sizes per batch: B, then halvings (bounds compiled programs)
  # a step's program sees cache positions < block * 2^j >= the longest live row (0: the whole
  # cache, of which attention on CPU reads only the live part: `models.cache.CACHE_CHUNK`); each
  # window is one more compiled program per (bucket, K), so it is off unless asked for
  window_block: int = 0

  def __post_init__(self):
    check(self.min_bucket >= 1, "EngineConfig.buckets.min_bucket",
          f"must be >= 1, got {self.min_bucket}")
    check(self.max_buckets >= 1, "EngineConfig.buckets.max_buckets",
          f"must be >= 1, got {self.max_buckets}")
    check(self.window_block >= 0, "EngineConfig.buckets.window_block",
          f"must be >= 0, got {self.window_block}")


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  """The draft length K of each segment, chosen per bucket from measured step costs and running
  acceptance estimates (`adaptive.DraftShapePolicy`)."""

  enabled: bool = True  # choose K per bucket (else the drafter's draft_len throughout)
  max_draft_len: int = 0  # largest K adaptivity may pick; 0: the drafter's draft_len
  # the K below the largest it may pick besides 0 (empty: every one). Each K is a program per
  # bucket to compile (compile.ahead: all of them before the first rollout), so a large K with
  # few steps between, e.g. (2, 4) below 7, compiles half of 0..7's programs
  draft_lens: tuple[int, ...] = ()
  probe_iters: int = 4  # steps of a drafting segment while the evidence is thin ...
  probe_drafts: float = 16.0  # ... i.e. fewer drafts than this behind the estimate (decayed count)
  first_segment_iters: int = 32  # steps before a bucket's first re-decision ...
  max_segment_iters: int = 256  # ... doubling per segment up to this
  estimate_decay: float = 0.7  # weight of earlier rollouts' acceptance counts at each new rollout
  prior_acceptance: float = 0.6  # per-position acceptance assumed before any draft is seen
  prior_weight: float = 2.0  # in drafts
  # draft only when expected tokens/s beat plain AR by this fraction; a K no segment has run
  # (its cost a line estimate, its program not compiled) must also beat the timed K by it
  min_gain: float = 0.05
  # an AR (K = 0) segment re-decides after recheck_iters steps, and over every recheck_iters AR
  # steps the acceptance counts fade to recheck_decay of their weight: a poor stretch's estimate
  # drifts back toward the prior until a short drafting segment (probe_iters steps, its cost
  # counted in the rollout) measures the drafter again, so one unlucky probe does not turn
  # drafting off for a whole queue. A stateful drafter (EAGLE-3, MTP, a draft model) is retired
  # instead once enough counts rule it out: it stops observing AR steps, which saves their cost
  # but leaves it nothing current to draft from (`DraftLenPolicy.choose`). 0: an AR segment runs
  # to its bucket's end and the counts stay as they are
  recheck_iters: int = 64
  recheck_decay: float = 0.5

  def __post_init__(self):
    w = "EngineConfig.adaptive"
    check(self.max_draft_len >= 0, f"{w}.max_draft_len",
          f"must be >= 0 (0: the drafter's draft_len), got {self.max_draft_len}")
    check(all(k >= 1 for k in self.draft_lens), f"{w}.draft_lens",
          f"must be K >= 1 (0 and the largest K are always choices), got {self.draft_lens}")
    check(self.probe_iters >= 1, f"{w}.probe_iters", f"must be >= 1, got {self.probe_iters}")
    check(self.probe_drafts >= 0, f"{w}.probe_drafts", f"must be >= 0, got {self.probe_drafts}")
    check(self.first_segment_iters >= 1, f"{w}.first_segment_iters",
          f"must be >= 1, got {self.first_segment_iters}")
    check(self.max_segment_iters >= self.first_segment_iters, f"{w}.max_segment_iters",
          f"must be >= first_segment_iters={self.first_segment_iters}, "
          f"got {self.max_segment_iters}")
    check(0 <= self.estimate_decay <= 1, f"{w}.estimate_decay",
          f"must be in [0, 1], got {self.estimate_decay}")
    check(0 < self.prior_acceptance < 1, f"{w}.prior_acceptance",
          f"must be in (0, 1), got {self.prior_acceptance}")
    check(self.prior_weight > 0, f"{w}.prior_weight", f"must be > 0, got {self.prior_weight}")
    check(self.min_gain >= 0, f"{w}.min_gain", f"must be >= 0, got {self.min_gain}")
    check(self.recheck_iters >= 0, f"{w}.recheck_iters",
          f"must be >= 0 (0: no rechecks), got {self.recheck_iters}")
    check(0 <= self.recheck_decay <= 1, f"{w}.recheck_decay",
          f"must be in [0, 1], got {self.recheck_decay}")

  def k_choices(self, k_max: int) -> tuple[int, ...]:
    """The K adaptivity chooses from when the largest is k_max: 0, `draft_lens` below k_max
    (empty: every K), and k_max."""
    if not self.draft_lens:
      return tuple(range(k_max + 1))
    return tuple(sorted({0, k_max, *(k for k in self.draft_lens if k < k_max)}))


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
  """Step costs: timed once per (program, bucket, K) at startup, then kept (`cost_table.py`)."""

  iters: int = 2  # n: segments of n and 2n timed steps per (bucket, K) at startup ...
  repeats: int = 2  # ... timed this many times, the fastest kept (load noise)
  # the K per bucket compiled and timed when the bucket is prepared are 0 and the largest; a K
  # in between costs the line through them until a segment runs it (then it compiles, outside
  # the timing, and its own segments refine its cost). True: all of them
  every_k: bool = False
  # in-run refinement: each segment's measured seconds per step move its (bucket, K) cost toward
  # them with weight iterations / (iterations + cost_memory). 0 (the default): keep the startup
  # calibration, so that K choices depend on stored costs only and a seed gives one trajectory
  # (`calibration.py`); > 0 follows the machine's load, and two runs of one seed may differ
  cost_memory: float = 0.0
  # a (bucket, K) cost read from the machine's cost cache (measured by an earlier run) is
  # checked once, after this run's segments ran recheck_steps steps of it: if their seconds per
  # step differ from it by more than this factor either way, their figure replaces it in the
  # cache, for later runs (this run keeps the figure it read: `CostTable.check_cached`); 0: never
  recheck_cached_costs: float = 1.5
  recheck_steps: int = 32

  def __post_init__(self):
    w = "EngineConfig.calibration"
    check(self.iters >= 1, f"{w}.iters", f"must be >= 1, got {self.iters}")
    check(self.repeats >= 1, f"{w}.repeats", f"must be >= 1, got {self.repeats}")
    check(self.cost_memory >= 0, f"{w}.cost_memory",
          f"must be >= 0 (0: no refinement), got {self.cost_memory}")
    check(self.recheck_cached_costs == 0 or self.recheck_cached_costs > 1,
          f"{w}.recheck_cached_costs",
          f"must be 0 (never) or > 1, got {self.recheck_cached_costs}")
    check(self.recheck_steps >= 1, f"{w}.recheck_steps", f"must be >= 1, got {self.recheck_steps}")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
  """When the engine's programs compile."""

  # True: compile every bucket's programs at every K (and time the timed K) before the first
  # segment, so a later rollout compiles nothing whichever buckets and K it runs; False: a
  # bucket's programs compile when a rollout first reaches it, so the first rollout compiles
  # only the buckets it runs (a later rollout that reaches a new bucket compiles it then)
  ahead: bool = False
  threads: int = 0  # programs compiled at once at startup (0: one per core, at most 4)

  def __post_init__(self):
    check(self.threads >= 0, "EngineConfig.compile.threads", f"must be >= 0, got {self.threads}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How the engine runs a batch: one part per collaborator that reads it. Hashable. `STATIC` is
  the plain loop: full batch, whole cache, fixed K, one segment."""

  queue: QueueConfig = QueueConfig()
  paging: PagingConfig = PagingConfig()
  buckets: BucketConfig = BucketConfig()
  adaptive: AdaptiveConfig = AdaptiveConfig()
  calibration: CalibrationConfig = CalibrationConfig()
  compile: CompileConfig = CompileConfig()

  def replace(self, **parts: dict) -> EngineConfig:
    """This config with fields of its parts changed, the rest kept:
    `engine.replace(queue=dict(max_rows=64), adaptive=dict(enabled=False))`."""
    return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **fields)
                                        for name, fields in parts.items()})


STATIC = EngineConfig(buckets=BucketConfig(compaction=False, window_block=0),
                      adaptive=AdaptiveConfig(enabled=False))


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
  tree_width: int = 1  # candidates per depth its verify scored (1: a chain; K = 0: 1)
  # the drafter was set aside for the rest of the rollout: no K > 0 can beat plain AR at the
  # acceptance measured so far, so its state is no longer kept up to date (K = 0 without it)
  drafter_retired: bool = False
  pages_in_use: int = 0  # paged KV: pages held when the segment started (0: dense caches)
  swapped_out: int = 0  # paged KV: rows swapped out to host memory just before the segment
  waiting_for_pages: int = 0  # paged KV: live rows that started the segment without pages
  refill_at: int = 0  # a queue: free slots that made the segment return to refill (0: none wait)

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.seconds, 1e-12)
