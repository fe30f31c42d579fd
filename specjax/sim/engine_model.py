"""A model of specjax's rollout engine (`specjax.sampling.engine`): static batch buckets, live-batch
compaction, attention windows, adaptive draft length per bucket; and the static loop (full batch,
fixed K).

Pure numpy. `simulate_engine(cfg, lengths, rates, step_cost, prefill_s)` returns the segments the
engine would run and their seconds; `step_cost(bucket, K, window)` is any per-iteration cost. The
policy the model shares with the engine (defaults, buckets, windows, iteration budgets) is the
engine's own plain-Python code (`specjax.sampling.engine_config`, `buckets`, `adaptive`).
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist
from typing import Callable, Sequence

import numpy as np

from specjax.config_tree import refuse
from specjax.sampling.adaptive import AcceptanceEstimate, DraftLenPolicy
from specjax.sampling.buckets import bucket_sizes, window_for
from specjax.sampling.engine_config import EngineConfig
from specjax.sampling.engine_config import AdaptiveConfig, BucketConfig
from specjax.sim.workload import rate_for_acceptance

ARMS = ("ar_static", "ar_compact", "spec_static", "spec_compact", "spec_adaptive")
_NORMAL = NormalDist()
ENGINE_DEFAULTS = EngineConfig()


def _check(cond: bool, field: str, msg: str) -> None:
  if not cond:
    refuse(f"EngineModelConfig.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class EngineModelConfig:
  """How the engine runs one rollout batch. `draft_len` is the fixed K of non-adaptive runs
  (0 = plain AR); adaptive runs pick K in [0, max_draft_len] per bucket. `compact` gathers the
  live rows into the smallest bucket that holds them (the engine's `bucket_sizes`); `windowed`
  attends over [0, W) with W the smallest window_multiple * 2^j holding the longest live row
  + K + 1 (the engine's `window_for`). Defaults shared with the engine are its own
  (`EngineConfig()`)."""

  batch: int
  prompt_len: int
  max_new: int
  draft_len: int = 0
  max_draft_len: int = 4
  adaptive: bool = False
  compact: bool = True
  windowed: bool = True
  min_bucket: int = ENGINE_DEFAULTS.buckets.min_bucket
  max_buckets: int = ENGINE_DEFAULTS.buckets.max_buckets
  dp: int = 1  # data-parallel size: every bucket is a multiple of it
  window_multiple: int = 128
  # adaptive: steps of a drafting segment while fewer than probe_drafts drafts back the
  # acceptance estimate, then first_segment_iters doubling per segment at a bucket's K up to
  # max_segment_iters (`DraftLenPolicy.budget`); the estimate starts empty, as in a first rollout
  probe_iters: int = ENGINE_DEFAULTS.adaptive.probe_iters
  probe_drafts: float = ENGINE_DEFAULTS.adaptive.probe_drafts
  first_segment_iters: int = ENGINE_DEFAULTS.adaptive.first_segment_iters
  max_segment_iters: int = ENGINE_DEFAULTS.adaptive.max_segment_iters
  segment_overhead_s: float = 0.0  # host work per segment: sync, summary, compaction gather

  def __post_init__(self):
    for f in ("batch", "prompt_len", "max_new", "min_bucket", "max_buckets", "dp",
              "window_multiple", "probe_iters"):
      _check(getattr(self, f) >= 1, f, f"must be >= 1, got {getattr(self, f)}")
    _check(self.probe_drafts >= 0, "probe_drafts", f"must be >= 0, got {self.probe_drafts}")
    _check(self.batch % self.dp == 0, "batch", f"{self.batch} must be divisible by dp={self.dp}")
    _check(0 <= self.draft_len <= self.max_draft_len, "draft_len",
           f"must be in [0, max_draft_len={self.max_draft_len}], got {self.draft_len}")
    _check(self.max_draft_len >= 0, "max_draft_len", f"must be >= 0, got {self.max_draft_len}")
    _check(1 <= self.first_segment_iters <= self.max_segment_iters, "first_segment_iters",
           f"must be in [1, max_segment_iters={self.max_segment_iters}], got "
           f"{self.first_segment_iters}")
    _check(self.segment_overhead_s >= 0, "segment_overhead_s",
           f"must be >= 0, got {self.segment_overhead_s}")

  @classmethod
  def for_arm(cls, arm: str, **kw) -> "EngineModelConfig":
    """The configuration of a bench_engine arm name (ar_static, spec_adaptive, ...)."""
    if arm not in ARMS:
      refuse(f"EngineModelConfig.arm: must be one of {ARMS}, got {arm!r}")
    spec = arm.startswith("spec")
    k = kw.pop("draft_len", None)
    if spec and k is None:
      k = min(3, kw.get("max_draft_len", 4))
    static = arm.endswith("static")
    return cls(draft_len=k if spec else 0, adaptive=arm == "spec_adaptive", compact=not static,
               windowed=not static, **kw)

  @property
  def cache_size(self) -> int:
    """Static cache per row: prompt + completion + the K+1 positions a verify writes past it."""
    return self.prompt_len + self.max_new + self.max_draft_len + 1

  def buckets(self) -> list[int]:
    """The engine's buckets: the batch, then the powers of two below it that are multiples of dp
    and >= min_bucket, at most max_buckets."""
    return bucket_sizes(self.batch, self.dp, self.min_bucket, self.max_buckets)

  def window(self, longest: float, k: int) -> int:
    """The attention window of a step (the engine's `window_for`), the whole static cache when
    that reaches it or windows are off."""
    block = self.window_multiple if self.windowed else 0
    return window_for(longest, k, block, self.cache_size) or self.cache_size

  def draft_len_policy(self) -> DraftLenPolicy:
    """The engine's K policy at this config, with an empty acceptance estimate (the model takes
    only its iteration budget: K itself is chosen from the given rates)."""
    engine = EngineConfig(buckets=BucketConfig(compaction=self.compact, min_bucket=self.min_bucket,
                                               max_buckets=self.max_buckets),
                          adaptive=AdaptiveConfig(enabled=self.adaptive,
                                                  max_draft_len=self.max_draft_len,
                                                  probe_iters=self.probe_iters,
                                                  probe_drafts=self.probe_drafts,
                                                  first_segment_iters=self.first_segment_iters,
                                                  max_segment_iters=self.max_segment_iters))
    k_choices = tuple(range(self.max_draft_len + 1)) if self.adaptive else (self.draft_len,)
    estimate = AcceptanceEstimate(max(self.max_draft_len, 1), engine.adaptive.prior_acceptance,
                                  engine.adaptive.prior_weight)
    return DraftLenPolicy(k_choices, estimate, engine.adaptive)


def tokens_per_step(rates: Sequence[float], draft_len: int) -> tuple[float, float]:
  """Mean and variance of tokens committed per row per iteration at K = draft_len, from vLLM
  cumulative per-position acceptance rates (rates[i] = P(the first i+1 drafts are accepted))."""
  r = np.concatenate([[1.0], np.asarray(rates, float)[:draft_len], [0.0]])
  if len(r) < draft_len + 2:
    raise ValueError(f"tokens_per_step: {len(rates)} acceptance rates given, draft_len "
                     f"{draft_len} needs {draft_len}")
  p = r[:-1] - r[1:]  # P(exactly a drafts accepted), a = 0..K
  tok = np.arange(1, draft_len + 2)
  mean = float((p * tok).sum())
  return mean, float((p * tok * tok).sum() - mean * mean)


def cumulative_rates(acceptance_length: float, max_draft_len: int, at: int | None = None,
                     decay: float = 0.8) -> list[float]:
  """Cumulative per-position rates for max_draft_len drafts whose acceptance length at `at`
  drafts (default max_draft_len) is `acceptance_length`: conditional rate at position i is
  first * decay**(i-1) (specjax.sim.workload's model)."""
  at = at or max_draft_len
  if at == 0 or max_draft_len == 0:
    return [0.0] * max_draft_len
  first = rate_for_acceptance(min(acceptance_length, at + 1), at, decay)
  cond = np.minimum(1.0, first * decay ** np.arange(max_draft_len))
  return [float(x) for x in np.cumprod(cond)]


@dataclasses.dataclass(frozen=True)
class SimSegment:
  """One simulated segment, in the form of the engine's log (`specjax.sampling.Segment`)."""

  bucket: int
  draft_len: int
  window: int
  iterations: int
  live_rows_start: int
  seconds: float
  tokens: float


@dataclasses.dataclass(frozen=True)
class EngineModelRun:
  seconds: float  # prefill + segments
  prefill_s: float
  segments: tuple[SimSegment, ...]
  k_per_bucket: dict

  @property
  def iterations(self) -> int:
    return sum(s.iterations for s in self.segments)

  def to_dict(self) -> dict:
    return {"rollout_s": self.seconds, "prefill_s": self.prefill_s,
            "iterations": self.iterations,
            "k_per_bucket": {str(b): k for b, k in self.k_per_bucket.items()},
            "segments": [dataclasses.asdict(s) for s in self.segments]}


def _scramble(n: int) -> np.ndarray:
  """A deterministic order of n items that spreads neighbours apart (golden-ratio sequence)."""
  return np.argsort(np.modf(np.arange(n) * 0.6180339887498949)[0])


def effective_lengths(lengths: np.ndarray, mean: float, var: float) -> np.ndarray:
  """Tokens-equivalent work per row including acceptance noise: a row of L tokens needs
  L/E +- sqrt(L var / E^3) iterations; rows get evenly spaced normal quantiles in an order
  unrelated to their length, so the longest rows' tail is that of the whole batch."""
  n = len(lengths)
  if var <= 0 or n == 0:
    return lengths.astype(float)
  z = np.array([_NORMAL.inv_cdf((i + 0.5) / n) for i in range(n)])[_scramble(n)]
  return np.maximum(lengths + z * np.sqrt(np.maximum(lengths, 0.0) * var / mean), 1.0)


def choose_draft_len(cfg: EngineModelConfig, bucket: int, window: int, rates, step_cost) -> int:
  """Adaptive K of a bucket: argmax_K E[tokens per step | K] / cost(bucket, K, window)."""
  if not cfg.adaptive:
    return cfg.draft_len
  best = max(range(cfg.max_draft_len + 1),
             key=lambda k: tokens_per_step(rates, k)[0] / step_cost(bucket, k, window))
  return best


def simulate_engine(cfg: EngineModelConfig, lengths: Sequence[float], rates: Sequence[float],
                    step_cost: Callable[[int, int, int], float], prefill_s: float = 0.0,
                    k_per_bucket: dict | None = None) -> EngineModelRun:
  """Segments of one rollout of `cfg.batch` rows with completion lengths `lengths` (tokens,
  the first sampled by the prefill). Every live row advances the same expected number of tokens
  per iteration (acceptance noise folded into each row's work, see effective_lengths). A
  segment ends when the live rows fit the next bucket (then they are compacted into the
  smallest bucket that holds them), the window must grow, or (adaptive) its iteration budget
  runs out and K is chosen again. `k_per_bucket` fixes K per bucket (as a measured run chose)."""
  lengths = np.asarray(lengths, float)
  if len(lengths) != cfg.batch:
    raise ValueError(f"simulate_engine: {len(lengths)} lengths for "
                     f"EngineModelConfig.batch={cfg.batch}")
  if len(rates) < cfg.max_draft_len and (cfg.adaptive or cfg.draft_len):
    raise ValueError(f"simulate_engine: rates need max_draft_len={cfg.max_draft_len} entries, "
                     f"got {len(rates)}")
  fixed = dict(k_per_bucket or {})
  adaptive = cfg.adaptive and not fixed  # choose K here (else as measured / fixed)
  buckets = cfg.buckets() if cfg.compact else [cfg.batch]
  # Work per row in committed tokens after the prefill's first one, with acceptance noise at
  # the K of the first bucket.
  if fixed:
    noise_k = fixed.get(cfg.batch, max(fixed.values()))
  elif adaptive:
    noise_k = choose_draft_len(cfg, cfg.batch, cfg.window(cfg.prompt_len + 1, cfg.max_draft_len),
                               rates, step_cost)
  else:
    noise_k = cfg.draft_len
  work = np.sort(effective_lengths(np.clip(lengths, 1, cfg.max_new) - 1.0,
                                   *tokens_per_step(rates, noise_k)))
  done_tokens = 0.0  # tokens each live row has committed since the prefill
  policy = cfg.draft_len_policy()  # the engine's iteration budget per segment
  segments, chosen, per_bucket, last_k = [], {}, {}, {}
  bi = 0
  while True:
    live = int((work > done_tokens + 1e-9).sum())
    if live == 0:
      break
    while cfg.compact and bi + 1 < len(buckets) and live <= buckets[bi + 1]:
      bi += 1
    bucket = buckets[bi]
    longest = cfg.prompt_len + 1 + done_tokens
    if bucket in fixed:
      k = fixed[bucket]
    elif adaptive:
      k = choose_draft_len(cfg, bucket, cfg.window(longest, cfg.max_draft_len), rates, step_cost)
    else:
      k = cfg.draft_len
    mean, _ = tokens_per_step(rates, k)
    window = cfg.window(longest, k)
    # iterations until: the live rows fit the next bucket, the window must grow, all done
    limits = [work[-1]]
    if cfg.compact and bi + 1 < len(buckets):
      limits.append(work[len(work) - buckets[bi + 1] - 1])
    if cfg.windowed and window < cfg.cache_size:
      limits.append(window - k - 1 - cfg.prompt_len - 1)
    target = max(min(limits), done_tokens + 1e-6)
    iters = max(1, math.ceil((target - done_tokens) / mean - 1e-9))
    # the engine re-decides K after a budget that grows per segment at the bucket's K (as its
    # host loop counts them)
    j = per_bucket.get(bucket, 0) if last_k.get(bucket) in (None, k) else 0
    per_bucket[bucket], last_k[bucket] = j + 1, k
    iters = min(iters, policy.budget(k, j))
    policy.ran(k, iters)  # (AR steps fade the counts, as in the engine)
    step = step_cost(bucket, k, window)
    new_done = done_tokens + iters * mean
    tokens = float(np.clip(np.minimum(work, new_done) - done_tokens, 0, None).sum())
    if k > 0:  # the drafts behind the engine's acceptance estimate: one per live row per step
      drafts = tokens / mean
      policy.estimate.add(k, drafts, drafts * np.asarray(rates[:k], float))
    segments.append(SimSegment(bucket, k, window, iters, live,
                               iters * step + cfg.segment_overhead_s, tokens))
    chosen[bucket] = k
    done_tokens = new_done
  total = prefill_s + sum(s.seconds for s in segments)
  return EngineModelRun(total, prefill_s, tuple(segments), chosen)
