"""Step time of synchronous and asynchronous GRPO, with and without speculative rollouts.

`compare(Scenario(...))` is the main entry point: AR and speculative breakdowns and speedups.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import numpy as np

from specjax.config_tree import refuse
from specjax.sim import phases
from specjax.sim.catalog import get_hardware, get_model
from specjax.sim.cost import Efficiency, auto_model_parallel
from specjax.sim.drafter_costs import EAGLE3, NO_DRAFT, DrafterCost, get_drafter_cost
from specjax.sim.factors import efficiency_for
from specjax.sim.workload import Workload, get_workload

MODES = ("sync", "async")


@dataclasses.dataclass(frozen=True)
class EngineKind:
  """A rollout engine the simulator models: its phase function (`phases.generation*`), whether
  it chooses K adaptively, and a one-line description (advise's assumptions)."""

  name: str
  description: str
  adaptive: bool  # supports Scenario.adaptive (K per segment by measured cost)
  generate: Callable[..., phases.GenResult]


def _vllm(s: "Scenario", model, hw, gpus, **kw) -> phases.GenResult:
  return phases.generation(model, hw, s.eff, gpus, s.workload, **kw)


def _specjax(s: "Scenario", model, hw, gpus, **kw) -> phases.GenResult:
  return phases.generation_specjax(model, hw, s.eff, gpus, s.workload, adaptive=s.adaptive,
                                   min_bucket=s.min_bucket, **kw)


def _specjax_continuous(s: "Scenario", model, hw, gpus, **kw) -> phases.GenResult:
  engine = {k: getattr(s, k) for k in ("refill_fraction", "refill_overhead_s",
                                       "refill_from_costs")
            if getattr(s, k) is not None}
  return phases.generation_continuous(model, hw, s.eff, gpus, s.workload, adaptive=s.adaptive,
                                      min_bucket=s.min_bucket, max_rows=s.max_rows, **engine,
                                      **kw)


ENGINE_KINDS: dict[str, EngineKind] = {e.name: e for e in (
    EngineKind("vllm", "paged KV cache, continuous batching (vLLM-like)", False, _vllm),
    EngineKind("specjax", "static cache per row, buckets + compaction (specjax)", True,
               _specjax),
    EngineKind("specjax-continuous", "queue-fed row slots over paged KV, refill between "
               "segments, compaction in the drain (specjax)", True, _specjax_continuous),
)}
ENGINES = tuple(ENGINE_KINDS)


def _check(cond: bool, field: str, msg: str) -> None:
  if not cond:
    refuse(f"Scenario.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One RL setup: model and hardware by catalog name, GPU count, sync (colocated) or async
  (split groups, policy lag), the drafter and its draft length, and the step's workload."""

  model: str = "qwen3-8b"
  hardware: str = "gb200"
  gpus: int = 32
  mode: str = "sync"
  policy_lag: int = 1  # async: rollouts of up to `policy_lag` steps are in flight
  gen_fraction: float | None = None  # async: share of GPUs generating; None = best split
  drafter: str = EAGLE3.name  # a name in drafters.DRAFTER_COSTS
  draft_len: int = 3
  acceptance_length: float | None = None  # None = workload's (rescaled to draft_len)
  draft_model: str = "qwen3-0.6b"
  online_draft: bool = False
  reference_logprob: bool = False
  workload: Workload = dataclasses.field(default_factory=lambda: get_workload("rl-think"))
  gen_mp: int | None = None  # GPUs per generation replica; None = fastest layout
  memory_fraction: float = 0.85  # HBM share the generation engine may use
  efficiency: Efficiency | None = None  # None = calibrated factors of `hardware`
  engine: str = "vllm"
  adaptive: bool = False  # specjax engines: K per segment in [0, draft_len] by measured cost
  min_bucket: int = 8  # specjax engines: smallest live-batch bucket
  # specjax-continuous (None: the engine model's default, `ContinuousEngineConfig`)
  max_rows: int | None = None  # row slots per replica (None: the KV budget / an average row)
  refill_fraction: float | None = None  # share of slots free that makes a segment refill
  refill_overhead_s: float | None = None  # host work per refill besides the prefill
  refill_from_costs: bool | None = None  # refill thresholds from costs, as the engine's default
  drafter_cost: DrafterCost = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    get_model(self.model), get_hardware(self.hardware)
    _check(self.gpus >= 1, "gpus", f"must be >= 1, got {self.gpus}")
    _check(self.mode in MODES, "mode", f"must be one of {MODES}, got {self.mode!r}")
    _check(self.policy_lag >= 1, "policy_lag", f"must be >= 1, got {self.policy_lag}")
    _check(self.gen_fraction is None or 0 < self.gen_fraction < 1, "gen_fraction",
           f"must be in (0, 1), got {self.gen_fraction}")
    object.__setattr__(self, "drafter_cost", get_drafter_cost(self.drafter, "Scenario.drafter"))
    _check(0 <= self.draft_len <= 16, "draft_len", f"must be in [0, 16], got {self.draft_len}")
    if self.acceptance_length is not None:
      _check(1.0 <= self.acceptance_length <= self.draft_len + 1, "acceptance_length",
             f"must be in [1, draft_len + 1 = {self.draft_len + 1}], got "
             f"{self.acceptance_length}")
    _check(0 < self.memory_fraction <= 1, "memory_fraction",
           f"must be in (0, 1], got {self.memory_fraction}")
    if self.drafter_cost.needs_draft_model:
      get_model(self.draft_model)
    _check(self.engine in ENGINES, "engine", f"must be one of {ENGINES}, got {self.engine!r}")
    adaptive = tuple(e for e, k in ENGINE_KINDS.items() if k.adaptive)
    _check(not self.adaptive or self.engine in adaptive, "adaptive",
           f"adaptive draft length needs an engine of {adaptive}")
    _check(self.min_bucket >= 1, "min_bucket", f"must be >= 1, got {self.min_bucket}")
    _check(self.max_rows is None or self.max_rows >= 1, "max_rows",
           f"must be None or >= 1, got {self.max_rows}")
    _check(self.refill_fraction is None or 0 < self.refill_fraction <= 1, "refill_fraction",
           f"must be None or in (0, 1], got {self.refill_fraction}")
    _check(self.refill_overhead_s is None or self.refill_overhead_s >= 0, "refill_overhead_s",
           f"must be None or >= 0, got {self.refill_overhead_s}")

  def replace(self, **kw) -> "Scenario":
    return dataclasses.replace(self, **kw)

  @property
  def eff(self) -> Efficiency:
    return self.efficiency or efficiency_for(self.hardware)

  @property
  def speculative(self) -> bool:
    return self.drafter_cost.speculative and self.draft_len > 0

  def resolved_acceptance(self) -> float:
    """Acceptance length at `draft_len`: given, or the workload's per-position model."""
    if not self.speculative:
      return 1.0
    if self.acceptance_length is not None:
      return self.acceptance_length
    w = self.workload
    return w.acceptance_at_len(self.draft_len, self.drafter_cost.workload_acceptance(w))

  def min_mp(self) -> int:
    return auto_model_parallel(get_model(self.model), get_hardware(self.hardware))


@dataclasses.dataclass(frozen=True)
class StepResult:
  """Seconds per phase of one RL step. `gen` is the generation time per step on its GPUs;
  `exposed_gen` the part not hidden behind logprob + train (all of it when synchronous)."""

  prepare: float
  gen: float
  logprob: float
  train: float
  other: float
  exposed_gen: float
  step: float
  gen_gpus: int
  train_gpus: int
  acceptance_length: float
  gen_detail: phases.GenResult

  def to_dict(self) -> dict:
    d = {k: v for k, v in dataclasses.asdict(self).items() if k != "gen_detail"}
    g = self.gen_detail
    d.update(prefill=g.prefill_s, decode=g.decode_s, decode_steps=g.steps, gen_mp=g.mp,
             rows_per_replica=g.rows_per_replica, kv_slots=g.slots, **g.engine_stats)
    return d


def _gen(s: Scenario, gpus: int, mp: int, rows_per_replica: int | None = None
         ) -> phases.GenResult:
  model, hw = get_model(s.model), get_hardware(s.hardware)
  d = s.drafter_cost
  kw = dict(mp=mp, drafter=d if s.speculative else NO_DRAFT, draft_len=s.draft_len,
            acceptance_length=s.resolved_acceptance(),
            draft_model=get_model(s.draft_model) if d.needs_draft_model else None,
            rows_per_replica=rows_per_replica, memory_fraction=s.memory_fraction)
  return ENGINE_KINDS[s.engine].generate(s, model, hw, gpus, **kw)


def _learner(s: Scenario, gpus: int) -> tuple[float, float]:
  model, hw = get_model(s.model), get_hardware(s.hardware)
  lp = phases.logprob_time(model, hw, s.eff, gpus, s.workload, s.reference_logprob)
  online = s.online_draft and s.speculative
  tr = phases.train_time(model, hw, s.eff, gpus, s.workload,
                         online_drafter=s.drafter_cost if online else NO_DRAFT)
  return lp, tr


def _sync(s: Scenario, mp: int) -> StepResult:
  g = _gen(s, s.gpus, mp)
  lp, tr = _learner(s, s.gpus)
  prep = phases.prepare_time(get_model(s.model), get_hardware(s.hardware), s.eff, mp, True)
  step = prep + g.seconds + lp + tr + s.eff.other_s
  return StepResult(prep, g.seconds, lp, tr, s.eff.other_s, g.seconds, step, s.gpus, s.gpus,
                    g.acceptance_length, g)


def _async(s: Scenario, gen_gpus: int, mp: int) -> StepResult:
  """Policy lag L: the generation group keeps up to L steps of rollouts in flight, so the long
  tail of one step overlaps the bulk of the next (L x the rows per replica, 1/L of the time per
  step); the training group runs logprob + train meanwhile. The step is paced by the slower
  group; weight streaming and data/reward stay exposed."""
  lag = s.policy_lag
  rows = math.ceil(s.workload.rollouts / (gen_gpus // mp))
  g = _gen(s, gen_gpus, mp, rows_per_replica=rows * lag)
  gen_per_step = g.seconds / lag
  lp, tr = _learner(s, s.gpus - gen_gpus)
  prep = phases.prepare_time(get_model(s.model), get_hardware(s.hardware), s.eff, mp, False)
  exposed = max(0.0, gen_per_step - (lp + tr))
  step = max(gen_per_step, lp + tr) + prep + s.eff.other_s
  return StepResult(prep, gen_per_step, lp, tr, s.eff.other_s, exposed, step, gen_gpus,
                    s.gpus - gen_gpus, g.acceptance_length, g)


def _split_candidates(s: Scenario, mp: int) -> list[int]:
  """Generation-group sizes: whole replicas, leaving the training group enough HBM for bf16
  weights + fp32 master weights and Adam moments (16 bytes / parameter, 80% of HBM)."""
  model, hw = get_model(s.model), get_hardware(s.hardware)
  min_train = math.ceil(16 * model.num_params / (0.8 * hw.hbm_bytes))
  if s.gen_fraction is not None:
    return [max(mp, int(round(s.gen_fraction * s.gpus / mp)) * mp)]
  cands = [g for g in range(mp, s.gpus, mp) if s.gpus - g >= min_train]
  if not cands:
    refuse(f"Scenario.gpus: {s.gpus} GPUs cannot hold a {mp}-GPU generation replica "
           f"and a training group of >= {min_train} GPUs for {s.model}")
  return cands


def _best_async(s: Scenario, mp: int) -> StepResult:
  """Best split by step time: a coarse grid refined around its minimum (the step is the max of
  a falling generation time and a rising learner time, so it is unimodal in the split)."""
  cands = _split_candidates(s, mp)
  done: dict[int, StepResult] = {}
  lo, hi = 0, len(cands) - 1
  while True:
    idx = sorted({int(round(v)) for v in np.linspace(lo, hi, 9)})
    for i in idx:
      if i not in done:
        done[i] = _async(s, cands[i], mp)
    best = min(idx, key=lambda i: done[i].step)
    if hi - lo <= 8:
      return done[best]
    pos = idx.index(best)
    lo, hi = idx[max(pos - 1, 0)], idx[min(pos + 1, len(idx) - 1)]


def _mp_candidates(s: Scenario, gpus: int) -> list[int]:
  hw = get_hardware(s.hardware)
  lo = s.min_mp()
  cands = [lo * 2**i for i in range(12) if lo * 2**i <= min(hw.domain, gpus)]
  return [m for m in cands if s.mode == "async" or gpus % m == 0] or [lo]


@functools.lru_cache(maxsize=1024)
def resolve_mp(s: Scenario) -> int:
  """GPUs per generation replica: `gen_mp` if given, else the model-parallel size (powers of
  two within one NVLink domain) with the shortest step; AR and speculative runs each get
  their own best layout, as a user would tune each."""
  if s.gen_mp:
    return s.gen_mp
  if s.mode == "sync":
    return min(_mp_candidates(s, s.gpus), key=lambda m: _sync(s, m).step)
  return min(_mp_candidates(s, s.gpus - 1), key=lambda m: _best_async(s, m).step)


def simulate_step(s: Scenario) -> StepResult:
  """One RL step of `s` (speculative iff `s.speculative`: a drafter and s.draft_len > 0)."""
  mp = resolve_mp(s)
  return _sync(s, mp) if s.mode == "sync" else _best_async(s, mp)


@dataclasses.dataclass(frozen=True)
class Comparison:
  scenario: Scenario
  ar: StepResult
  spec: StepResult

  @property
  def rollout_speedup(self) -> float:
    return self.ar.gen / self.spec.gen

  @property
  def step_speedup(self) -> float:
    return self.ar.step / self.spec.step

  def to_dict(self) -> dict:
    s = self.scenario
    return {"model": s.model, "hardware": s.hardware, "gpus": s.gpus, "mode": s.mode,
            "policy_lag": s.policy_lag, "drafter": s.drafter, "draft_len": s.draft_len,
            "workload": s.workload.name, "engine": s.engine, "adaptive": s.adaptive,
            "acceptance_length": self.spec.acceptance_length,
            "rollout_speedup": self.rollout_speedup, "step_speedup": self.step_speedup,
            "ar": self.ar.to_dict(), "spec": self.spec.to_dict()}


def compare(s: Scenario) -> Comparison:
  """The same step with AR rollouts and with speculative rollouts (each picks its own best
  async split)."""
  return Comparison(s, simulate_step(s.replace(drafter=NO_DRAFT.name)), simulate_step(s))
