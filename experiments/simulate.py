"""Project RL step time with and without speculative rollouts (specjax.sim), from the shell.

  python experiments/simulate.py --model qwen3-235b-a22b --hardware gb200 --gpus 512 \
      --mode sync --draft eagle3 --draft-len 3 --acceptance-length 3.0 [--json]
  python experiments/simulate.py --sweep draft-len|gpus [--out runs/sim/]
  python experiments/simulate.py --calibrate [--bench-json run.json ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specjax.sim import calibrate, catalog, phases, report  # noqa: E402
from specjax.sim.simulate import MODES, Scenario, compare  # noqa: E402
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
  p.add_argument("--draft", choices=phases.DRAFTERS, default="eagle3")
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
                  memory_fraction=a.memory_fraction)


def run_calibration(a: argparse.Namespace) -> dict:
  cases = calibrate.paper_cases()
  for path in a.bench_json:
    cases += calibrate.cases_from_benchmark_json(path)
  eff = calibrate.fit_efficiency(cases)  # from the nominal Efficiency() values
  rows = calibrate.report(cases, eff)
  if not a.json:
    print("fitted efficiency factors (gb200):")
    for k, v in dataclasses.asdict(eff).items():
      print(f"  {k} = {v:.4g}")
    print("\n| case | measured (s) | simulated (s) | error | weight |\n|---|---:|---:|---:|---:|")
    for r in rows:
      print(f"| {r['case']} | {r['measured_s']:.1f} | {r['simulated_s']:.1f} | "
            f"{100 * r['error']:+.1f}% | {r['weight']:g} |")
  return {"efficiency": dataclasses.asdict(eff), "cases": rows}


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


def main(argv=None) -> int:
  a = parse_args(argv)
  for path in a.catalog:
    catalog.load_catalog(path)
  if a.calibrate:
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
  sys.exit(main())
