"""Per-machine calibration of the engine model from specjax's own measurements: timed forwards,
engine iterations and rollouts (cases read from JSON by `bench_data`). Fit on some cases, predict
the others, report the errors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from specjax.sim import fitting
from specjax.sim.catalog import HardwareSpec, ModelSpec, get_hardware
from specjax.sim.cost import Efficiency
from specjax.sim.drafter_costs import NO_DRAFT
from specjax.sim.engine_cost import EngineCost
from specjax.sim.engine_model import EngineModelConfig, simulate_engine

CPU = get_hardware("cpu")
# Start values of a CPU fit: compute and memory traffic do not overlap (overlap_p = 1).
CPU_START = Efficiency(bw=0.1, kv_bw=0.05, flops=0.2, attn_flops=0.02, step_overhead_s=2e-4,
                       draft_overhead_s=1e-4, layer_overhead_s=5e-5, logit_s=1e-9, overlap_p=1.0,
                       segment_overhead_s=2e-3)
CPU_FIELDS = ("bw", "kv_bw", "flops", "attn_flops", "step_overhead_s", "layer_overhead_s",
              "logit_s", "draft_overhead_s", "segment_overhead_s")
CPU_BOUNDS = {"bw": (1e-3, 1.0), "kv_bw": (1e-4, 1.0), "flops": (1e-3, 1.0),
              "attn_flops": (1e-4, 1.0), "step_overhead_s": (1e-7, 0.05),
              "draft_overhead_s": (1e-7, 0.05), "layer_overhead_s": (1e-8, 1e-2),
              "logit_s": (1e-13, 1e-5), "segment_overhead_s": (1e-6, 0.5)}


@dataclasses.dataclass(frozen=True)
class ForwardCase:
  """One timed target forward: `tokens` per row at `batch` rows over a `window` cache."""

  name: str
  model: ModelSpec
  batch: int
  tokens: int
  window: int
  seconds: float
  weight: float = 0.25  # many, short and noisy: together they weigh like a few rollouts
  group: str = "forward"

  def predict(self, eff: Efficiency, hw: HardwareSpec = CPU) -> float:
    return EngineCost(self.model, hw, eff).target_forward(self.batch, self.tokens, self.window,
                                                          bare=True)


@dataclasses.dataclass(frozen=True)
class StepCase:
  """One timed engine iteration (bench_engine's startup calibration)."""

  name: str
  cost_args: tuple  # (model, draft_model | None, drafter name, draft vocabulary)
  bucket: int
  draft_len: int
  window: int
  seconds: float
  iters: int = 3  # steps per timed call: the call's host overhead is spread over them
  weight: float = 0.5  # a few steps timed once: noisy
  group: str = "step"

  def predict(self, eff: Efficiency, hw: HardwareSpec = CPU) -> float:
    model, draft, drafter, vocab = self.cost_args
    step = EngineCost(model, hw, eff, drafter if self.draft_len else NO_DRAFT.name, draft,
                      draft_vocab=vocab).step(self.bucket, self.draft_len, self.window)
    return step + eff.segment_overhead_s / self.iters


@dataclasses.dataclass(frozen=True)
class RolloutCase:
  """One timed rollout of a batch by an engine arm; the prediction runs
  `engine_model.simulate_engine`."""

  name: str
  model: ModelSpec
  draft_model: ModelSpec | None
  drafter: str  # a name in drafters.DRAFTER_COSTS
  config: EngineModelConfig
  lengths: tuple
  rates: tuple
  seconds: float
  k_per_bucket: tuple = ()  # ((bucket, K), ...) as the run chose, for adaptive arms
  weight: float = 2.0
  group: str = "rollout"
  draft_vocab: int = 32000

  def run(self, eff: Efficiency, hw: HardwareSpec = CPU):
    c = self.config
    spec = c.draft_len > 0 or c.adaptive
    ec = EngineCost(self.model, hw, eff, self.drafter if spec else NO_DRAFT.name,
                    self.draft_model, draft_vocab=self.draft_vocab)
    prefill = ec.prefill(c.batch, c.prompt_len, c.cache_size, c.max_draft_len if spec else 0)
    c = dataclasses.replace(c, segment_overhead_s=eff.segment_overhead_s)
    return simulate_engine(c, list(self.lengths), list(self.rates), ec.step, prefill,
                           dict(self.k_per_bucket) or None)

  def predict(self, eff: Efficiency, hw: HardwareSpec = CPU) -> float:
    return self.run(eff, hw).seconds


def fit(cases: Sequence, start: Efficiency = CPU_START, fields: Sequence[str] = CPU_FIELDS,
        hw: HardwareSpec = CPU, ridge: float = 1e-4) -> Efficiency:
  """The machine's factors fitted to its cases on `hw` (`fitting.fit_factors`)."""
  wrapped = [_OnHardware(c, hw) for c in cases]
  return fitting.fit_factors(wrapped, start, fields, {**fitting.BOUNDS, **CPU_BOUNDS}, ridge=ridge,
                             iters=60)


@dataclasses.dataclass(frozen=True)
class _OnHardware:
  case: object
  hw: HardwareSpec

  @property
  def seconds(self):
    return self.case.seconds

  @property
  def weight(self):
    return self.case.weight

  def predict(self, eff):
    return self.case.predict(eff, self.hw)


def errors(cases: Sequence, eff: Efficiency, hw: HardwareSpec = CPU) -> list[dict]:
  """Measured vs predicted per case, with the relative error."""
  out = []
  for c in cases:
    p = c.predict(eff, hw)
    out.append({"case": c.name, "group": c.group, "measured_s": c.seconds, "predicted_s": p,
                "error": p / c.seconds - 1.0})
  return out


def summary(rows: Sequence[dict]) -> dict:
  """Median and max absolute relative error of a list of `errors` rows."""
  e = np.abs([r["error"] for r in rows])
  return {"n": len(rows), "median_abs_error": float(np.median(e)) if len(e) else math.nan,
          "max_abs_error": float(e.max()) if len(e) else math.nan}


def efficiency_dict(eff: Efficiency) -> dict:
  return dataclasses.asdict(eff)


def run_scale(steps: Sequence[StepCase], eff: Efficiency, hw: HardwareSpec = CPU) -> float:
  """Load factor of one run: geometric mean of measured / predicted over its own startup
  calibration steps (on a shared machine the same program runs slower when others load it)."""
  if not steps:
    return 1.0
  return float(np.exp(np.mean([math.log(c.seconds / c.predict(eff, hw)) for c in steps])))


def validate(fit_cases: Sequence, heldout: Sequence, start: Efficiency = CPU_START,
             fields: Sequence[str] = CPU_FIELDS, hw: HardwareSpec = CPU,
             run_steps: dict | None = None) -> dict:
  """Fit on `fit_cases`, predict `heldout`; both error tables and their summaries.
  `run_steps` maps a case-name prefix (one run) to that run's startup-calibration steps: its
  held-out rollouts are also predicted times the run's load factor (`error_scaled`)."""
  eff = fit(fit_cases, start, fields, hw)
  fit_rows = [dict(r, split="fit") for r in errors(fit_cases, eff, hw)]
  held_rows = [dict(r, split="held-out") for r in errors(heldout, eff, hw)]
  scaled = []
  for prefix, steps in (run_steps or {}).items():
    scale = run_scale(steps, eff, hw)
    for r in held_rows:
      if r["case"].startswith(prefix) and r["group"] == "rollout":
        r["load_factor"] = scale
        r["error_scaled"] = r["predicted_s"] * scale / r["measured_s"] - 1.0
        scaled.append({"error": r["error_scaled"]})
  by_group = {}
  for r in held_rows:
    by_group.setdefault(r["group"], []).append(r)
  return {"efficiency": efficiency_dict(eff), "fit": summary(fit_rows),
          "held_out": summary(held_rows), "held_out_rollouts_load_scaled": summary(scaled),
          "held_out_by_group": {g: summary(rs) for g, rs in by_group.items()},
          "rows": fit_rows + held_rows}
