"""Benchmark JSON, read in one place: forward probes (`measure.run_probes`), bench_rollout.py
rollouts (the static loop), bench_engine.py runs (segments, buckets, adaptive K) and decode-step
benchmarks, each turned into the cases that `machine_fit` and `calibrate` predict and fit.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import numpy as np

from specjax.sim.calibrate import DecodeProbe, MeasuredCase
from specjax.sim.catalog import HardwareSpec, ModelSpec, get_hardware, get_model
from specjax.sim.drafter_costs import DRAFT_KINDS, DRAFT_MODEL, NO_DRAFT
from specjax.sim.engine_model import EngineModelConfig, cumulative_rates
from specjax.sim.machine_fit import ForwardCase, RolloutCase, StepCase

# bench_rollout.py rows this reads: AR, and the draft model its `args` describe
ROLLOUT_DRAFTERS = (NO_DRAFT, DRAFT_MODEL)
# bench_engine.py's labels of a draft model made of the target's first layers
TRUNCATED_DRAFT = ("truncated", "draft")


def _read(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


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
  data = _read(path)
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
  data = _read(path)
  args = _need(data, "args", path)
  model = model_spec(_need(data, "model", path), "bench", f"{path}:model")
  out = []
  for i, r in enumerate(_need(data, "results", path)):
    where = f"{path}:results[{i}]"
    method = _need(r, "method", where)
    drafter = NO_DRAFT if method == "ar" else DRAFT_KINDS.get(method)
    if drafter not in ROLLOUT_DRAFTERS:
      continue
    k = int(_need(r, "draft_len", where))
    batch = int(_need(r, "batch", where))
    draft = None
    if drafter.needs_draft_model:
      if not args.get("draft_from_target", True):
        draft = model_spec({**data["model"], "hidden": args["draft_hidden"],
                            "layers": args["draft_layers"], "heads": args["draft_heads"],
                            "kv_heads": 1, "intermediate": 3 * args["draft_hidden"]}, "draft")
      else:
        draft = dataclasses.replace(model, name="draft", layers=int(args["draft_layers"]))
    rates = tuple(r.get("per_position_acceptance_rate") or ())
    if k and len(rates) < k:
      rates = tuple(cumulative_rates(float(r.get("acceptance_length", 1.0)), k))
    cfg = EngineModelConfig(batch=batch, prompt_len=int(args["prompt_len"]),
                            max_new=int(args["max_new"]), draft_len=k, max_draft_len=k,
                            compact=False, windowed=False)
    lengths = (float(r["tokens"]) / batch,) * batch
    label = f"{_label(data, path)} {method} K={k}" if k else f"{_label(data, path)} ar"
    out.append(RolloutCase(label, model, draft, (drafter if k else NO_DRAFT).name, cfg,
                           lengths, rates, float(_need(r, "seconds", where))))
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
  data = _read(path)
  cfgj = _need(data, "config", path)
  where = f"{path}:config"
  model = model_spec(cfgj, "engine", where)
  batch = int(_need(cfgj, "batch", where))
  prompt_len = int(_need(cfgj, "prompt_len", where))
  max_new = int(_need(cfgj, "max_new", where))
  max_k = int(_need(cfgj, "max_draft_len", where))
  lengths = quantile_lengths(_need(cfgj, "length_quantiles", where), batch, max_new)
  calib = _need(data, "calibration", path)
  calib_drafter = str(calib.get("drafter", DRAFT_MODEL.name))
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
        _engine_drafter(kind, cfgj, model) if kind != "ar" else (NO_DRAFT.name, None))
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
    cfg = EngineModelConfig.for_arm(base, **kw)
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


def _at(arm: dict, cfg: EngineModelConfig, max_k: int) -> int:
  """The K at which an arm's acceptance length was measured: the token-weighted K of its
  segments (fixed K arms: that K)."""
  segs = [s for s in arm.get("segments") or [] if s.get("draft_len", 0) > 0]
  if not segs:
    return cfg.draft_len or max_k
  tot = sum(s.get("tokens", 1) for s in segs)
  k = sum(s["draft_len"] * s.get("tokens", 1) for s in segs) / max(tot, 1)
  return max(1, min(max_k, round(k)))


def _engine_drafter(label: str, cfgj: dict, model: ModelSpec) -> tuple[str, ModelSpec | None]:
  """(drafter name, draft model) of a bench_engine drafter label: a specjax draft kind, or a
  truncated copy of the target (its first `draft_layers` layers)."""
  d = DRAFT_MODEL if label in TRUNCATED_DRAFT else DRAFT_KINDS.get(label)
  if d is None or not d.speculative:
    labels = sorted(k for k, v in DRAFT_KINDS.items() if v.speculative) + list(TRUNCATED_DRAFT)
    raise ValueError(f"calibration.drafter: must be one of {labels}, got {label!r}")
  if d.needs_draft_model:
    layers = int(cfgj.get("draft_layers", 1))
    return d.name, dataclasses.replace(model, name="draft", layers=layers)
  return d.name, None


# device kinds (as JAX names them) of the catalog's GPUs, the more specific first
GPU_KINDS = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100"))


def hardware_of_device(kind: str, where: str = "device.device_kind") -> str:
  """The catalog name of a JAX device kind, e.g. 'NVIDIA H100 80GB HBM3' -> 'h100'."""
  for mark, name in GPU_KINDS:
    if mark in str(kind).upper():
      return name
  raise ValueError(f"{where}: {kind!r} is none of the catalog's GPUs "
                   f"({', '.join(m for m, _ in GPU_KINDS)}); write its cases in the "
                   f"hardware/model/results form with the hardware's fields")


def cases_from_gpu_benchmark(data: dict, where: str) -> list[MeasuredCase]:
  """AR decode-step cases from experiments/bench_gpu.py's JSON: every row of its `decode` and
  `context` stages, one replica (mp 1) of the catalog model of that name, bfloat16, the step's
  mean context (prompt + half the new tokens)."""
  device = _need(data, "device", where)
  hw = get_hardware(hardware_of_device(_need(device, "device_kind", f"{where}: device"),
                                       f"{where}: device.device_kind"))
  args = _need(data, "args", where)
  if args.get("dtype", "bfloat16") != "bfloat16":
    raise ValueError(f"{where}: args.dtype is {args['dtype']!r}; the simulator's models hold "
                     f"bfloat16 weights and caches")
  context = float(_need(args, "prompt_len", f"{where}: args")) + \
      float(_need(args, "new_tokens", f"{where}: args")) / 2
  cases = []
  stages = [("decode", _need(data, "decode", where))] + [("context", data.get("context", {}))]
  for stage, shapes in stages:
    for shape, rows in shapes.items():
      model = get_model(shape)
      for r in rows:
        if "step_ms" not in r:  # a batch that failed (e.g. out of memory)
          continue
        ctx = float(r.get("context_len", context))  # (older files: decode at args' prompt)
        probe = DecodeProbe(model, hw, int(r["batch"]), ctx)
        cases.append(MeasuredCase(f"{where}#{shape}/b{r['batch']}/ctx{ctx:g}",
                                  float(r["step_ms"]) / 1e3, probe=probe))
  if not cases:
    raise ValueError(f"{where}: no decode rows with a step time")
  return cases


def cases_from_benchmark_json(path: str) -> list[MeasuredCase]:
  """Decode-step cases from a benchmark JSON: experiments/bench_gpu.py's (its AR decode rows,
  `cases_from_gpu_benchmark`), or the general form (e.g. written by
  experiments/bench_rollout.py):
  {"hardware": name | {HardwareSpec fields}, "model": name | {ModelSpec fields},
   "results": [{"batch", "context_len", "drafter"?, "draft_len"?, "acceptance_length"?,
                "step_s" | "tokens_per_s", "mp"?}, ...]}.
  tokens_per_s counts committed tokens: step_s = batch * acceptance_length / tokens_per_s."""
  data = _read(path)
  if "decode" in data and "device" in data:
    return cases_from_gpu_benchmark(data, path)
  hw = data["hardware"]
  hw = get_hardware(hw) if isinstance(hw, str) else HardwareSpec(**hw)
  model = data["model"]
  model = get_model(model) if isinstance(model, str) else ModelSpec(**model)
  cases = []
  for i, r in enumerate(data["results"]):
    acc = float(r.get("acceptance_length", 1.0))
    rows = int(r["batch"])
    step = r.get("step_s") or rows * acc / float(r["tokens_per_s"])
    probe = DecodeProbe(model, hw, rows, float(r["context_len"]),
                        r.get("drafter", NO_DRAFT.name), int(r.get("draft_len", 0)), acc,
                        int(r.get("mp", 1)))
    cases.append(MeasuredCase(f"{path}#{i}", float(step), probe=probe,
                              weight=float(r.get("weight", 1.0))))
  return cases
