"""Project RL step time with and without speculative rollouts (specjax.sim), from the shell.

  python experiments/simulate.py --model qwen3-235b-a22b --hardware gb200 --gpus 512 \
      --mode sync --draft eagle3 --draft-len 3 --acceptance-length 3.0 [--json]
  python experiments/simulate.py --sweep draft-len|gpus [--out runs/sim/]
  python experiments/simulate.py --calibrate [--bench-json run.json ...]
  python experiments/simulate.py --advise --model qwen3-8b --hardware h100 --gpus 8 [--engine specjax]
  python experiments/simulate.py --engine specjax-continuous [--adaptive] [--refill-fraction F]
                                 [--refill-from-costs]
  python experiments/simulate.py --measure-forwards out.json [--probe-models d128-l4-v256,...]
  python experiments/simulate.py --validate-cpu --forward-json f.json --fit-models m1,m2 \
      --rollout-json r.json ... --fit-rollout r1.json [--engine-json e.json] [--plot p.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specjax.errors import UserError  # noqa: E402
from specjax.jobs.console import run_main  # noqa: E402
from specjax.sim import bench_data, calibrate, catalog, machine_fit, report  # noqa: E402
from specjax.sim.advise import DEFAULT_DRAFTERS, advice_text, advise  # noqa: E402
from specjax.sim.calibrate import BENCH_FIELDS, LONG_CONTEXT  # noqa: E402
from specjax.sim.drafter_costs import DRAFTER_COSTS, EAGLE3  # noqa: E402
from specjax.sim.factors import efficiency_for  # noqa: E402
from specjax.sim.simulate import ENGINES, MODES, Scenario, compare  # noqa: E402
from specjax.sim.workload import WORKLOADS  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--model", default="qwen3-8b")
  p.add_argument("--hardware", default="gb200")
  p.add_argument("--gpus", type=int, default=32)
  p.add_argument("--mode", choices=MODES, default="sync")
  p.add_argument("--policy-lag", type=int, default=1)
  p.add_argument("--gen-fraction", type=float, default=None,
                 help="async: share of GPUs generating (default: best split)")
  p.add_argument("--draft", choices=tuple(DRAFTER_COSTS), default=EAGLE3.name)
  p.add_argument("--draft-len", type=int, default=3)
  p.add_argument("--acceptance-length", type=float, default=None,
                 help="measured at --draft-len (default: the workload's)")
  p.add_argument("--draft-model", default="qwen3-0.6b", help="for --draft draft-model")
  p.add_argument("--online-draft", action="store_true", help="EAGLE-3 online adaptation cost")
  p.add_argument("--reference-logprob", action="store_true", help="KL to a reference policy")
  p.add_argument("--workload", choices=sorted(WORKLOADS), default="rl-think")
  p.add_argument("--prompts", type=int, default=None)
  p.add_argument("--samples", type=int, default=None)
  p.add_argument("--prompt-len", type=int, default=None)
  p.add_argument("--mean-response-len", type=float, default=None)
  p.add_argument("--max-response-len", type=int, default=None)
  p.add_argument("--length-sigma", type=float, default=None)
  p.add_argument("--acceptance-decay", type=float, default=None)
  p.add_argument("--gen-mp", type=int, default=None, help="GPUs per generation replica")
  p.add_argument("--memory-fraction", type=float, default=0.85)
  p.add_argument("--catalog", action="append", default=[],
                 help="YAML file adding hardware: / models: entries")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--sweep", choices=("draft-len", "gpus"), default=None)
  p.add_argument("--values", default=None, help="comma-separated sweep values")
  p.add_argument("--out", default="runs/sim/", help="folder for sweep plots and tables")
  p.add_argument("--calibrate", action="store_true",
                 help="fit efficiency factors to the paper's cases (+ --bench-json)")
  p.add_argument("--bench-json", action="append", default=[])
  p.add_argument("--bench-only", action="store_true",
                 help="--calibrate: fit the --bench-json cases alone (one hardware), from that "
                      "hardware's current factors, and print them before and after")
  p.add_argument("--fit-fields", nargs="+", default=None,
                 help="--calibrate: the factors fitted (default: the paper's; with --bench-only: "
                      f"{' '.join(BENCH_FIELDS)}, and kv_bw where a step reads "
                      f"{LONG_CONTEXT}+ cached positions)")
  p.add_argument("--engine", choices=ENGINES, default="vllm",
                 help="rollout engine model: vLLM-like, specjax's bucketed engine (static cache "
                      "per row) or specjax's queue-fed paged engine (specjax-continuous)")
  p.add_argument("--adaptive", action="store_true",
                 help="specjax engines: K per segment in [0, --draft-len] by cost")
  p.add_argument("--min-bucket", type=int, default=8)
  p.add_argument("--max-rows", type=int, default=None,
                 help="specjax-continuous: row slots per replica (default: KV budget / an "
                      "average row)")
  p.add_argument("--refill-fraction", type=float, default=None,
                 help="specjax-continuous: share of free slots that makes a segment refill")
  p.add_argument("--refill-overhead-s", type=float, default=None,
                 help="specjax-continuous: host seconds per refill besides the prefill")
  p.add_argument("--refill-from-costs", action="store_true", default=None,
                 help="specjax-continuous: once rows finish, refill thresholds from the costs "
                      "(the engine's default rule) instead of --refill-fraction")
  p.add_argument("--advise", action="store_true",
                 help="recommend drafter, K (or adaptive), sync vs async with policy lag")
  p.add_argument("--max-lag", type=int, default=2, help="--advise: largest policy lag to try")
  p.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS),
                 help="--advise: drafters to consider (mtp only if the model has the head)")
  p.add_argument("--drafter-acceptance", action="append", default=[],
                 help="--advise: DRAFTER=LENGTH, acceptance length at the workload's K")
  v = p.add_argument_group("CPU calibration and validation (specjax's own measurements)")
  v.add_argument("--measure-forwards", default=None, metavar="OUT",
                 help="time target forwards of the probe models on this machine (imports jax)")
  v.add_argument("--probe-models", default=None, help="comma-separated measure.PROBE_MODELS")
  v.add_argument("--measure-engine", default=None, metavar="OUT",
                 help="time specjax's engine arms on the first --probe-models model (imports "
                      "jax); --engine-run sets measure.time_engine_arms' keywords")
  v.add_argument("--engine-run", default='{"batch": 16, "prompt_len": 32, "max_new": 96, '
                 '"eos_tokens": 4}', help="JSON keywords of measure.time_engine_arms")
  v.add_argument("--validate-cpu", action="store_true",
                 help="fit the CPU factors on some cases, report errors on held-out ones")
  v.add_argument("--forward-json", action="append", default=[])
  v.add_argument("--fit-models", default="", help="probe models whose forwards are fitted")
  v.add_argument("--rollout-json", action="append", default=[],
                 help="bench_rollout.py JSON (held out unless also --fit-rollout)")
  v.add_argument("--fit-rollout", action="append", default=[])
  v.add_argument("--engine-json", action="append", default=[],
                 help="bench_engine.py JSON, held out (its startup calibration rows and arms)")
  v.add_argument("--fit-engine-json", action="append", default=[],
                 help="bench_engine.py JSON whose calibration rows and arms are fitted")
  v.add_argument("--fit-engine-calibration", action="append", default=[],
                 help="bench_engine.py JSON whose calibration rows are fitted, arms held out")
  v.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                 help="validate wall time or this process's CPU time (robust to other jobs)")
  v.add_argument("--plot", default=None, help="predicted-vs-measured PNG")
  v.add_argument("--save", default=None, help="write the validation JSON here")
  return p.parse_args(argv)


def build_scenario(a: argparse.Namespace) -> Scenario:
  overrides = {k: getattr(a, k) for k in ("prompts", "samples", "prompt_len",
                                          "mean_response_len", "max_response_len",
                                          "length_sigma", "acceptance_decay")
               if getattr(a, k) is not None}
  workload = WORKLOADS[a.workload].replace(**overrides)
  return Scenario(model=a.model, hardware=a.hardware, gpus=a.gpus, mode=a.mode,
                  policy_lag=a.policy_lag, gen_fraction=a.gen_fraction, drafter=a.draft,
                  draft_len=a.draft_len, acceptance_length=a.acceptance_length,
                  draft_model=a.draft_model, online_draft=a.online_draft,
                  reference_logprob=a.reference_logprob, workload=workload, gen_mp=a.gen_mp,
                  memory_fraction=a.memory_fraction, engine=a.engine,
                  adaptive=a.adaptive, min_bucket=a.min_bucket, max_rows=a.max_rows,
                  refill_fraction=a.refill_fraction, refill_overhead_s=a.refill_overhead_s,
                  refill_from_costs=a.refill_from_costs)


def run_calibration(a: argparse.Namespace) -> dict:
  if a.bench_only:
    return run_bench_calibration(a)
  cases = calibrate.paper_cases()
  for path in a.bench_json:
    cases += bench_data.cases_from_benchmark_json(path)
  eff = calibrate.fit_efficiency(cases, fields=a.fit_fields or calibrate.PAPER_FIELDS)
  rows = calibrate.report(cases, eff)  # (from the nominal Efficiency() values)
  if not a.json:
    print("fitted efficiency factors (gb200):")
    for k, v in dataclasses.asdict(eff).items():
      print(f"  {k} = {v:.4g}")
    print("\n| case | measured (s) | simulated (s) | error | weight |\n|---|---:|---:|---:|---:|")
    for r in rows:
      print(f"| {r['case']} | {r['measured_s']:.1f} | {r['simulated_s']:.1f} | "
            f"{100 * r['error']:+.1f}% | {r['weight']:g} |")
  return {"efficiency": dataclasses.asdict(eff), "cases": rows}


def run_bench_calibration(a: argparse.Namespace) -> dict:
  """One hardware's factors from its measured decode steps alone (e.g. bench_gpu.py's JSON):
  the steps as the current factors predict them, the fit, and the steps as it predicts them."""
  if not a.bench_json:
    raise UserError("--bench-only: give the measured cases with --bench-json")
  cases = [c for path in a.bench_json for c in bench_data.cases_from_benchmark_json(path)]
  names = sorted({c.probe.hardware.name for c in cases})
  if len(names) != 1:
    raise UserError(f"--bench-only: the cases must come from one hardware, got {names}")
  fields = a.fit_fields or calibrate.bench_fields(cases)
  before = efficiency_for(names[0])
  eff = calibrate.fit_efficiency(cases, before, fields, iters=100)
  rows_before, rows = calibrate.report(cases, before), calibrate.report(cases, eff)
  if not a.json:
    print(f"{names[0]}: {len(cases)} measured steps; fitted {', '.join(fields)}:")
    for k in fields:
      print(f"  {k} = {getattr(eff, k):.4g} (was {getattr(before, k) or 0:.4g})")
    print("\n| case | measured ms | current factors ms | error | fitted ms | error |\n"
          "|---|---:|---:|---:|---:|---:|")
    for r0, r in zip(rows_before, rows):
      print(f"| {r['case']} | {1e3 * r['measured_s']:.2f} | {1e3 * r0['simulated_s']:.2f} | "
            f"{100 * r0['error']:+.1f}% | {1e3 * r['simulated_s']:.2f} | {100 * r['error']:+.1f}% |")
  return {"hardware": names[0], "fields": list(fields),
          "efficiency_before": dataclasses.asdict(before), "efficiency": dataclasses.asdict(eff),
          "cases_before": rows_before, "cases": rows}


def run_sweep(a: argparse.Namespace, s: Scenario) -> dict:
  key = "draft_len" if a.sweep == "draft-len" else "gpus"
  if a.values:
    values = [int(v) for v in a.values.split(",")]
  elif key == "draft_len":
    values = list(range(0, 9))
  else:
    values = [s.gpus * 2**i for i in range(-3, 3) if s.gpus * 2**i >= 8]
  rows = (report.sweep_draft_len(s, values) if key == "draft_len"
          else report.sweep_gpus(s, values))
  table = report.sweep_table(rows, key)
  name = f"sweep_{key}_{s.model}_{s.hardware}_{s.mode}_{s.drafter}_{s.workload.name}"
  plot = report.sweep_plot(rows, key, os.path.join(a.out, name + ".png"))
  with open(os.path.join(a.out, name + ".json"), "w") as f:
    json.dump([c.to_dict() for c in rows], f, indent=1)
  if not a.json:
    print(table)
    print(f"plot: {plot}")
  return {"sweep": key, "plot": plot, "rows": [c.to_dict() for c in rows]}


def run_validation(a: argparse.Namespace) -> dict:
  fit_models = [m for m in a.fit_models.split(",") if m]
  fit_cases, held = [], []
  for path in a.forward_json:
    for c in bench_data.forward_cases(path, clock=a.clock):
      (fit_cases if c.name.split(" ")[0] in fit_models else held).append(c)
  if a.clock == "cpu" and (a.fit_rollout or a.rollout_json):
    raise UserError("--clock cpu: bench_rollout.py JSON has wall time only")
  for path in a.fit_rollout:
    fit_cases += bench_data.rollout_cases(path)
  for path in a.rollout_json:
    if path not in a.fit_rollout:
      held += bench_data.rollout_cases(path)
  for path in a.fit_engine_json:
    steps, arms = bench_data.engine_cases(path, clock=a.clock)
    fit_cases += steps + arms
  for path in a.fit_engine_calibration:
    steps, arms = bench_data.engine_cases(path, clock=a.clock)
    fit_cases += steps
    held += arms
  run_steps = {}
  for path in a.engine_json:
    steps, arms = bench_data.engine_cases(path, clock=a.clock)
    held += steps + arms
    if steps:
      run_steps[arms[0].name.rsplit(" ", 1)[0] + " "] = steps
  if not fit_cases:
    raise UserError("--validate-cpu: no fit cases (give --forward-json with --fit-models, "
                    "--fit-rollout, --fit-engine-json or --fit-engine-calibration)")
  out = machine_fit.validate(fit_cases, held, run_steps=run_steps)
  out["command"] = "python experiments/simulate.py " + " ".join(sys.argv[1:])
  if not a.json:
    print("fitted CPU factors:")
    for k, v in out["efficiency"].items():
      print(f"  {k} = {v}")
    print("\n| split | case | measured (s) | predicted (s) | error | x load factor |\n"
          "|---|---|---:|---:|---:|---:|")
    for r in out["rows"]:
      if r["group"] != "forward":
        sc = f"{100 * r['error_scaled']:+.1f}%" if "error_scaled" in r else "-"
        print(f"| {r['split']} | {r['case']} | {r['measured_s']:.4g} | {r['predicted_s']:.4g} | "
              f"{100 * r['error']:+.1f}% | {sc} |")
    print(f"fit: {out['fit']}\nheld out: {out['held_out']}\nby group: "
          f"{out['held_out_by_group']}\nheld-out rollouts x load factor: "
          f"{out['held_out_rollouts_load_scaled']}")
  if a.plot:
    paper = [{"case": r["case"], "measured_s": r["measured_s"], "predicted_s": r["simulated_s"],
              "group": "paper", "split": "fit" if r["weight"] >= 0.5 else "low weight"}
             for r in calibrate.report(calibrate.paper_cases(), efficiency_for("gb200"))]
    report.validation_plot(out["rows"], a.plot, paper)
  if a.save:
    os.makedirs(os.path.dirname(os.path.abspath(a.save)), exist_ok=True)
    with open(a.save, "w") as f:
      json.dump(out, f, indent=1)
  return out


def run_advice(a: argparse.Namespace, s: Scenario) -> dict:
  names = tuple(DRAFTER_COSTS)
  given = {}
  for item in a.drafter_acceptance:
    name, _, val = item.partition("=")
    if name not in DRAFTER_COSTS or not val:
      raise UserError(f"--drafter-acceptance: expected DRAFTER=LENGTH with DRAFTER in "
                      f"{names}, got {item!r}")
    given[name] = float(val)
  drafters = tuple(d for d in a.drafters.split(",") if d)
  speculative = tuple(n for n, d in DRAFTER_COSTS.items() if d.speculative)
  for d in drafters:
    if d not in speculative:
      raise UserError(f"--drafters: {d!r} is not one of {speculative}")
  out = advise(s, drafters=drafters, max_lag=a.max_lag, acceptance=given)
  if not a.json:
    print(advice_text(out))
  return out


def main(argv=None) -> int:
  a = parse_args(argv)
  for path in a.catalog:
    catalog.load_catalog(path)
  if a.measure_forwards or a.measure_engine:  # measure.py logs each timing as it goes
    logging.basicConfig(level=logging.INFO, format="%(message)s")
  if a.measure_forwards:
    from specjax.sim import measure  # jax, only here
    names = a.probe_models.split(",") if a.probe_models else list(measure.PROBE_MODELS)
    out = measure.run_probes(names)
    out["command"] = "python experiments/simulate.py " + " ".join(sys.argv[1:])
    with open(a.measure_forwards, "w") as f:
      json.dump(out, f, indent=1)
    return 0
  if a.measure_engine:
    from specjax.sim import measure  # jax, only here
    name = (a.probe_models or "d128-l4-v256").split(",")[0]
    out = measure.time_engine_arms(measure.model_config(**measure.PROBE_MODELS[name]),
                                   **json.loads(a.engine_run))
    out["command"] = "python experiments/simulate.py " + " ".join(sys.argv[1:])
    with open(a.measure_engine, "w") as f:
      json.dump(out, f, indent=1)
    return 0
  if a.validate_cpu:
    out = run_validation(a)
  elif a.advise:
    out = run_advice(a, build_scenario(a))
  elif a.calibrate:
    out = run_calibration(a)
  else:
    s = build_scenario(a)
    if a.sweep:
      out = run_sweep(a, s)
    else:
      c = compare(s)
      out = c.to_dict()
      if not a.json:
        print(report.breakdown_table(c))
  if a.json:
    print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(run_main(main))
