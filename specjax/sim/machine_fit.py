"""Per-machine calibration of the engine model from specjax's own measurements: forward timings
(`measure.py`), bench_rollout.py JSON (the old static engine) and bench_engine.py JSON (segments,
buckets, adaptive K). Fit on some cases, predict the others, report the errors.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

import numpy as np

from specjax.sim import calibrate
from specjax.sim.catalog import HardwareSpec, ModelSpec, get_hardware
from specjax.sim.cost import Efficiency
from specjax.sim.engine import EngineConfig, cumulative_rates, run_engine
from specjax.sim.engine_cost import EngineCost

CPU = get_hardware("cpu")
# Start values of a CPU fit: compute and memory traffic do not overlap (overlap_p = 1).
CPU_START = Efficiency(bw=0.1, kv_bw=0.05, flops=0.2, attn_flops=0.02, step_overhead_s=2e-4,
                       draft_overhead_s=1e-4, layer_overhead_s=5e-5, logit_s=1e-9, overlap_p=1.0,
                       segment_overhead_s=2e-3)
CPU_FIELDS = ("bw", "kv_bw", "flops", "attn_flops", "step_overhead_s", "layer_overhead_s",
              "logit_s", "draft_overhead_s", "segment_overhead_s")
BOUNDS = {"bw": (1e-3, 1.0), "kv_bw": (1e-4, 1.0), "flops": (1e-3, 1.0), "attn_flops": (1e-4, 1.0),
          "step_overhead_s": (1e-7, 0.05), "draft_overhead_s": (1e-7, 0.05),
          "layer_overhead_s": (1e-8, 1e-2), "logit_s": (1e-13, 1e-5),
          "segment_overhead_s": (1e-6, 0.5)}


def _need(d: dict, key: str, where: str):
  if not isinstance(d, dict) or key not in d:
    raise ValueError(f"{where}: missing field {key!r}")
  return d[key]


def model_spec(fields: dict, name: str = "measured", where: str = "model") -> ModelSpec:
  """A ModelSpec from a JSON dict of its fields (`intermediate` defaults to 3 x hidden)."""
  f = {k: fields[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab",
                              "intermediate", "tie_embeddings", "bytes_per_param", "kv_bytes")
       if k in fields}
  for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab"):
    _need(f, k, where)
  f.setdefault("intermediate", 3 * int(f["hidden"]))
  f.setdefault("bytes_per_param", 4)
  f.setdefault("kv_bytes", f["bytes_per_param"])
  return ModelSpec(name=name, **f)


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
  cost_args: tuple  # (model, draft_model | None, drafter, draft vocabulary)
  bucket: int
  draft_len: int
  window: int
  seconds: float
  iters: int = 3  # steps per timed call: the call's host overhead is spread over them
  weight: float = 0.5  # a few steps timed once: noisy
  group: str = "step"

  def predict(self, eff: Efficiency, hw: HardwareSpec = CPU) -> float:
    model, draft, drafter, vocab = self.cost_args
    step = EngineCost(model, hw, eff, drafter if self.draft_len else "none", draft,
                      draft_vocab=vocab).step(
        self.bucket, self.draft_len, self.window)
    return step + eff.segment_overhead_s / self.iters


@dataclasses.dataclass(frozen=True)
class RolloutCase:
  """One timed rollout of a batch by an engine arm; the prediction runs `engine.run_engine`."""

  name: str
  model: ModelSpec
  draft_model: ModelSpec | None
  drafter: str
  config: EngineConfig
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
    ec = EngineCost(self.model, hw, eff, self.drafter if spec else "none", self.draft_model,
                    draft_vocab=self.draft_vocab)
    prefill = ec.prefill(c.batch, c.prompt_len, c.cache_size, c.max_draft_len if spec else 0)
    c = dataclasses.replace(c, segment_overhead_s=eff.segment_overhead_s)
    return run_engine(c, list(self.lengths), list(self.rates), ec.step, prefill,
                      dict(self.k_per_bucket) or None)

  def predict(self, eff: Efficiency, hw: HardwareSpec = CPU) -> float:
    return self.run(eff, hw).seconds


CLOCKS = ("wall", "cpu")


def _clock(clock: str) -> str:
  if clock not in CLOCKS:
    raise ValueError(f"clock: must be one of {CLOCKS}, got {clock!r}")
  return clock


def forward_cases(path: str, models: Sequence[str] | None = None,
                  clock: str = "wall") -> list[ForwardCase]:
  """Cases from a `measure.run_probes` JSON ({"kind": "forward_costs", "models": {...}}).
  clock 'cpu': the process CPU seconds (`seconds_cpu`), robust to other jobs' load."""
  key = "seconds" if _clock(clock) == "wall" else "seconds_cpu"
  with open(path) as f:
    data = json.load(f)
  if data.get("kind") != "forward_costs":
    raise ValueError(f"{path}: field 'kind' must be 'forward_costs', got {data.get('kind')!r}")
  out = []
  for name, entry in _need(data, "models", path).items():
    if models is not None and name not in models:
      continue
    m = model_spec(_need(entry, "model", f"{path}:models.{name}"), name,
                   f"{path}:models.{name}.model")
    for r in _need(entry, "rows", f"{path}:models.{name}"):
      w = f"{path}:models.{name}.rows"
      out.append(ForwardCase(f"{name} b={r['batch']} T={r['tokens']} W={r['window']}", m,
                             int(_need(r, "batch", w)), int(_need(r, "tokens", w)),
                             int(_need(r, "window", w)), float(_need(r, key, w))))
  return out


def rollout_cases(path: str) -> list[RolloutCase]:
  """Static-engine rollouts from a bench_rollout.py JSON: AR and draft-model rows (every row
  decodes max_new tokens: bench_rollout samples no EOS). Other drafters are skipped."""
  with open(path) as f:
    data = json.load(f)
  args = _need(data, "args", path)
  model = model_spec(_need(data, "model", path), "bench", f"{path}:model")
  out = []
  for i, r in enumerate(_need(data, "results", path)):
    where = f"{path}:results[{i}]"
    method = _need(r, "method", where)
    if method not in ("ar", "draft_model"):
      continue
    k = int(_need(r, "draft_len", where))
    batch = int(_need(r, "batch", where))
    draft = None
    if method == "draft_model":
      if not args.get("draft_from_target", True):
        draft = model_spec({**data["model"], "hidden": args["draft_hidden"],
                            "layers": args["draft_layers"], "heads": args["draft_heads"],
                            "kv_heads": 1, "intermediate": 3 * args["draft_hidden"]}, "draft")
      else:
        draft = dataclasses.replace(model, name="draft", layers=int(args["draft_layers"]))
    rates = tuple(r.get("per_position_acceptance_rate") or ())
    if k and len(rates) < k:
      rates = tuple(cumulative_rates(float(r.get("acceptance_length", 1.0)), k))
    cfg = EngineConfig(batch=batch, prompt_len=int(args["prompt_len"]),
                       max_new=int(args["max_new"]), draft_len=k, max_draft_len=k,
                       compact=False, windowed=False)
    lengths = (float(r["tokens"]) / batch,) * batch
    label = f"{_label(data, path)} {method} K={k}" if k else f"{_label(data, path)} ar"
    out.append(RolloutCase(label, model, draft, "draft-model" if k else "none", cfg, lengths,
                           rates, float(_need(r, "seconds", where))))
  return out


def _label(data: dict, path: str) -> str:
  m, a = data.get("model", {}), data.get("args", {})
  return (f"d{m.get('hidden')}-l{m.get('layers')}-v{m.get('vocab')} b={a.get('batch')} "
          f"N={a.get('max_new')}")


def quantile_lengths(quantiles, batch: int, max_new: int | None = None) -> np.ndarray:
  """`batch` lengths from completion-length quantiles: a list of evenly spaced quantiles, or a
  dict {"p10": x, "p50": y, ...} (bench_engine.py; values <= 1 are fractions of max_new),
  interpolated piecewise-linearly and held flat beyond the outermost percentiles."""
  if isinstance(quantiles, dict):
    try:
      pts = sorted((float(k.lstrip("p")) / 100.0, float(v)) for k, v in quantiles.items())
    except ValueError:
      raise ValueError(f"config.length_quantiles: keys must look like 'p50', got "
                       f"{sorted(quantiles)}") from None
    if not pts:
      raise ValueError("config.length_quantiles: empty")
    vals = np.array([v for _, v in pts])
    if max_new and vals.max() <= 1.0:
      vals = vals * max_new
    at = (np.arange(batch) + 0.5) / batch
    return np.maximum(np.interp(at, [p for p, _ in pts], vals), 1.0)
  q = np.asarray(quantiles, float)
  if q.ndim != 1 or len(q) == 0:
    raise ValueError("config.length_quantiles: must be a non-empty list of lengths")
  if len(q) == batch:
    return np.sort(q)
  at = (np.arange(batch) + 0.5) / batch
  return np.interp(at, np.linspace(0, 1, len(q)), np.sort(q))


def engine_cases(path: str, measured_k: bool = True, clock: str = "wall"
                 ) -> tuple[list[StepCase], list[RolloutCase]]:
  """Startup-calibration steps and arm rollouts from a bench_engine.py JSON (schema in
  docs/SIMULATOR.md). Arms name their engine (ar_static, ar_compact, spec_static,
  spec_compact, spec_adaptive); spec arms draft with the JSON's calibration drafter. Optional
  per-arm `lengths` (else config.length_quantiles) and `per_position_acceptance_rate` (else
  derived from acceptance_length). `measured_k`: adaptive arms keep the K per bucket the engine
  chose from its (noisy) startup timings; False: the model chooses K from its own costs.
  clock 'cpu': arms' `rollout_cpu_s` (process CPU seconds; specjax.sim.measure writes it); the
  startup calibration is wall time only, so it gives no cases then."""
  arm_key = "rollout_s" if _clock(clock) == "wall" else "rollout_cpu_s"
  with open(path) as f:
    data = json.load(f)
  cfgj = _need(data, "config", path)
  where = f"{path}:config"
  model = model_spec(cfgj, "engine", where)
  batch = int(_need(cfgj, "batch", where))
  prompt_len = int(_need(cfgj, "prompt_len", where))
  max_new = int(_need(cfgj, "max_new", where))
  max_k = int(_need(cfgj, "max_draft_len", where))
  lengths = quantile_lengths(_need(cfgj, "length_quantiles", where), batch, max_new)
  calib = _need(data, "calibration", path)
  calib_drafter = str(calib.get("drafter", "draft-model"))
  # "eagle3+ngram": one table for two drafters, rows not attributable: no step cases
  mixed = "+" in calib_drafter
  drafter, draft = _engine_drafter(calib_drafter.split("+")[0], cfgj, model)
  draft_vocab = int(cfgj.get("draft_vocab", 32000))
  extra = {k: int(cfgj[k]) for k in ("min_bucket", "dp", "window_multiple") if k in cfgj}
  arms = _need(data, "arms", path)
  first_window = {}  # (bucket, K) -> window of the first segment that ran it
  for a in arms.values():
    for seg in a.get("segments") or []:
      first_window.setdefault((seg.get("bucket"), seg.get("draft_len")), seg.get("window"))
  steps = []
  rows = _need(calib, "rows", f"{path}:calibration")
  for i, r in enumerate(rows if clock == "wall" and not mixed else ()):
    w = f"{path}:calibration.rows[{i}]"
    b, k = int(_need(r, "bucket", w)), int(_need(r, "draft_len", w))
    window = r.get("window") or first_window.get((b, k)) or prompt_len + max_new + max_k + 1
    steps.append(StepCase(f"{_engine_label(cfgj)} calib b={b} K={k}",
                          (model, draft, drafter, draft_vocab),
                          b, k, int(window),
                          # the startup figure (step_s is refined by the run's segments since)
                          float(r.get("calibrated_step_s") or _need(r, "step_s", w)),
                          int(r.get("iters", 3))))
  rollouts = []
  for arm, a in arms.items():
    w = f"{path}:arms.{arm}"
    # "<drafter>_<engine>": ar / spec (the calibration drafter) / ngram / eagle3 / draft_model,
    # then static / compact / adaptive
    kind, _, mode = arm.rpartition("_")
    if mode not in ("static", "compact", "adaptive"):
      kind, mode = arm, "compact"
    base = ("ar_" if kind == "ar" else "spec_") + mode
    arm_drafter, arm_draft = (drafter, draft) if kind in ("spec", "") else (
        _engine_drafter(kind, cfgj, model) if kind != "ar" else ("none", None))
    segs = a.get("segments") or []
    kw = dict(batch=batch, prompt_len=prompt_len, max_new=max_new, max_draft_len=max_k, **extra)
    blocks = [s_["window"] for s_ in segs if s_.get("window")]
    if blocks:
      kw["window_multiple"] = min(blocks)
    if base in ("spec_static", "spec_compact"):
      k_fixed = max((s_.get("draft_len", 0) for s_ in segs), default=0) or int(
          cfgj.get("static_k", cfgj.get("draft_len", min(3, max_k))))
      kw["draft_len"] = kw["max_draft_len"] = max(1, min(k_fixed, max_k))
    elif base.startswith("ar"):
      kw["max_draft_len"] = 0  # the cache holds prompt + completion only
    cfg = EngineConfig.for_arm(base, **kw)
    if segs and not blocks:  # the engine ran without windows (its default)
      cfg = dataclasses.replace(cfg, windowed=False)
    acc = float(a.get("acceptance_length", 1.0))
    rates = tuple(a.get("per_position_acceptance_rate") or ())
    if base.startswith("spec") and len(rates) < cfg.max_draft_len:
      rates = tuple(cumulative_rates(acc, max_k, at=_at(a, cfg, max_k)))
    kpb = tuple((int(b), int(k)) for b, k in (a.get("k_per_bucket") or {}).items())
    arm_lengths = a.get("lengths")
    if arm_lengths is not None and len(arm_lengths) != batch:
      raise ValueError(f"{w}.lengths: {len(arm_lengths)} lengths for config.batch={batch}")
    rollouts.append(RolloutCase(f"{_engine_label(cfgj)} {arm}", model, arm_draft,
                                arm_drafter, cfg,
                                tuple(arm_lengths if arm_lengths is not None else lengths),
                                rates, float(_need(a, arm_key, w)),
                                kpb if cfg.adaptive and measured_k else (),
                                draft_vocab=draft_vocab))
  return steps, rollouts


def _engine_label(c: dict) -> str:
  return (f"d{c.get('hidden')}-l{c.get('layers')}-v{c.get('vocab')} b={c.get('batch')} "
          f"N={c.get('max_new')}" + (f" eos{c['eos_tokens']}" if "eos_tokens" in c else ""))


def _at(arm: dict, cfg: EngineConfig, max_k: int) -> int:
  """The K at which an arm's acceptance length was measured: the token-weighted K of its
  segments (fixed K arms: that K)."""
  segs = [s for s in arm.get("segments") or [] if s.get("draft_len", 0) > 0]
  if not segs:
    return cfg.draft_len or max_k
  tot = sum(s.get("tokens", 1) for s in segs)
  k = sum(s["draft_len"] * s.get("tokens", 1) for s in segs) / max(tot, 1)
  return max(1, min(max_k, round(k)))


def _engine_drafter(name: str, cfgj: dict, model: ModelSpec):
  name = name.replace("_", "-")
  if name in ("draft-model", "truncated", "draft"):
    layers = int(cfgj.get("draft_layers", 1))
    return "draft-model", dataclasses.replace(model, name="draft", layers=layers)
  if name in ("eagle3", "mtp", "ngram"):
    return name, None
  raise ValueError(f"calibration.drafter: must be draft_model, eagle3, mtp or ngram, got "
                   f"{name!r}")


def fit(cases: Sequence, start: Efficiency = CPU_START, fields: Sequence[str] = CPU_FIELDS,
        hw: HardwareSpec = CPU, ridge: float = 1e-4) -> Efficiency:
  """Levenberg-Marquardt on log factors (calibrate.fit_efficiency) for machine cases."""
  wrapped = [_OnHardware(c, hw) for c in cases]
  return calibrate.fit_efficiency(wrapped, start, fields, ridge=ridge, iters=60,
                                  bounds={**calibrate.BOUNDS, **BOUNDS})


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
