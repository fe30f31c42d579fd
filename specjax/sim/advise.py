"""Recommend a speculative setup for one model, cluster and workload: drafter, draft length (or
adaptive), sync vs async with policy lag, with projected speedups and the assumptions behind them.
"""

from __future__ import annotations

import dataclasses

from specjax.sim.drafter_costs import (DRAFT_MODEL, EAGLE3, NGRAM, NO_DRAFT, DrafterCost,
                                  get_drafter_cost)
from specjax.sim.simulate import ENGINE_KINDS, Scenario, StepResult, simulate_step
from specjax.sim.workload import acceptance_from_rate, rate_for_acceptance

DRAFT_LENS = (1, 2, 3, 4, 5, 7)
DEFAULT_DRAFTERS = (EAGLE3.name, DRAFT_MODEL.name, NGRAM.name)


@dataclasses.dataclass(frozen=True)
class Option:
  label: str
  scenario: Scenario
  result: StepResult


def _acceptance(s: Scenario, drafter: DrafterCost, k: int, given: dict) -> float:
  """Acceptance length of `drafter` at K = k: given at the workload's reference K (default:
  the workload's figure for that drafter), carried to k by the per-position decay model."""
  w = s.workload
  base = given.get(drafter.name)
  if base is None:
    base = drafter.workload_acceptance(w)
  rate = rate_for_acceptance(base, w.acceptance_at, w.acceptance_decay)
  return acceptance_from_rate(rate, k, w.acceptance_decay)


def advise(base: Scenario, drafters=DEFAULT_DRAFTERS, max_lag: int = 2,
           acceptance: dict | None = None, draft_lens=DRAFT_LENS) -> dict:
  """Every (drafter, K or adaptive, sync / async lag <= max_lag) option of `base`'s model,
  cluster and workload, ranked by step time. `acceptance` maps a drafter to its acceptance
  length at the workload's reference K (`acceptance_at`). Returns the best option, the best
  per drafter, the AR baselines and the assumptions."""
  acceptance = dict(acceptance or {})
  costs = [get_drafter_cost(d, "advise.drafters") for d in drafters]
  modes = [("sync", 1)] + [("async", lag) for lag in range(1, max_lag + 1)]
  ar = {}
  for mode, lag in modes:
    s = base.replace(mode=mode, policy_lag=lag, drafter=NO_DRAFT.name, adaptive=False)
    ar[(mode, lag)] = simulate_step(s)
  options = []
  for d in costs:
    for mode, lag in modes:
      for k in draft_lens:
        s = base.replace(mode=mode, policy_lag=lag, drafter=d.name, draft_len=k,
                         acceptance_length=_acceptance(base, d, k, acceptance), adaptive=False)
        options.append(Option(f"{d.name} K={k}", s, simulate_step(s)))
      if ENGINE_KINDS[base.engine].adaptive and d.advise_adaptive:
        k = max(draft_lens)
        s = base.replace(mode=mode, policy_lag=lag, drafter=d.name, draft_len=k,
                         acceptance_length=_acceptance(base, d, k, acceptance), adaptive=True)
        options.append(Option(f"{d.name} adaptive K<={k}", s, simulate_step(s)))
  options.sort(key=lambda o: o.result.step)
  ar_sync = ar[("sync", 1)]

  def describe(o: Option) -> dict:
    s, r = o.scenario, o.result
    same = ar[(s.mode, s.policy_lag)]
    return {"drafter": s.drafter, "draft_len": "adaptive" if s.adaptive else s.draft_len,
            "label": o.label, "mode": s.mode, "policy_lag": s.policy_lag if s.mode == "async"
            else 0, "acceptance_length": r.acceptance_length, "gen_s": r.gen, "step_s": r.step,
            "rollout_speedup_vs_ar_same_mode": same.gen / r.gen,
            "step_speedup_vs_ar_same_mode": same.step / r.step,
            "step_speedup_vs_ar_sync": ar_sync.step / r.step}

  best_per = {}
  for o in options:
    best_per.setdefault(o.scenario.drafter, describe(o))
  best = describe(options[0])
  best_ar = min(ar.items(), key=lambda kv: kv[1].step)
  speculate = best["step_s"] < best_ar[1].step
  w = base.workload
  assumptions = [
      f"workload {w.name}: {w.prompts} prompts x {w.samples} samples, prompt {w.prompt_len} "
      f"tokens, lognormal lengths mean {w.mean_response_len:g} (sigma {w.length_sigma}) "
      f"clipped at {w.max_response_len}",
      "acceptance lengths at K=" + str(w.acceptance_at) + ": " + ", ".join(
          f"{d.name} {_acceptance(base, d, w.acceptance_at, acceptance):.2f}"
          + ("" if d.name in acceptance else " (workload default)") for d in costs)
      + f"; other K by per-position decay {w.acceptance_decay}",
      *(f"{d.name} {d.acceptance_note}" for d in costs
        if d.acceptance_note and d.name not in acceptance),
      f"engine {base.engine}: {ENGINE_KINDS[base.engine].description}",
      f"efficiency factors of {base.hardware} (docs/SIMULATOR.md: fitted on GB200 / CPU "
      "measurements; other GPUs inherit GB200's)",
      "async policy lag L means rollouts come from a policy up to L steps old: the RL "
      "algorithm must tolerate it (importance-sampling correction); sync is on-policy",
  ]
  return {"model": base.model, "hardware": base.hardware, "gpus": base.gpus,
          "workload": w.name, "engine": base.engine,
          "recommendation": best if speculate else {"drafter": NO_DRAFT.name,
                                                    "mode": best_ar[0][0],
                                                    "policy_lag": best_ar[0][1]},
          "speculate": speculate, "best_per_drafter": best_per,
          "ar": {f"{m}" + (f" lag {lag}" if m == "async" else ""): {"gen_s": r.gen,
                                                                   "step_s": r.step}
                 for (m, lag), r in ar.items()},
          "assumptions": [a for a in assumptions if a]}


def advice_text(a: dict) -> str:
  r = a["recommendation"]
  lines = [f"{a['model']} on {a['gpus']} x {a['hardware']}, workload {a['workload']}, "
           f"engine {a['engine']}"]
  if a["speculate"]:
    mode = "sync" if r["mode"] == "sync" else f"async, policy lag {r['policy_lag']}"
    lines.append(f"recommended: drafter {r['drafter']}, K {r['draft_len']}, {mode}")
    lines.append(f"  acceptance length {r['acceptance_length']:.2f}; generation "
                 f"{r['gen_s']:.1f} s, step {r['step_s']:.1f} s per RL step")
    lines.append(f"  vs AR in the same mode: rollout {r['rollout_speedup_vs_ar_same_mode']:.2f}x,"
                 f" step {r['step_speedup_vs_ar_same_mode']:.2f}x; vs AR sync: step "
                 f"{r['step_speedup_vs_ar_sync']:.2f}x")
  else:
    lines.append(f"recommended: no speculation ({r['mode']}); no drafter shortens the step")
  lines.append("best per drafter:")
  for d, o in a["best_per_drafter"].items():
    lines.append(f"  {d:<12} K {str(o['draft_len']):<9} {o['mode']:<5} lag {o['policy_lag']}  "
                 f"step {o['step_s']:7.1f} s  rollout x{o['rollout_speedup_vs_ar_same_mode']:.2f}"
                 f"  step x{o['step_speedup_vs_ar_same_mode']:.2f}")
  lines.append("AR: " + ", ".join(f"{k} step {v['step_s']:.1f} s" for k, v in a["ar"].items()))
  lines.append("assumptions:")
  lines += [f"  - {x}" for x in a["assumptions"]]
  return "\n".join(lines)
