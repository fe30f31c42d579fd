"""AR vs speculative RL over several seeds per arm: is the difference in accuracy within noise?

One RL run per arm cannot separate the arms (docs/BENCHMARKS.md: single seeds swing by tens of
points). This runs `rl_zero.py` (or `--experiment rl_think`: `rl_think.py`) once per RL seed,
every seed on the same base policy and draft head (`--base.seed 0`; cached after the first), both
arms of a seed with the same data order, and reports per arm the mean and standard deviation of
the final greedy validation accuracy and of its gain over the base policy, and an exact paired
sign-flip permutation test of spec - AR over the seeds (two-sided; no distributional assumption;
with n seeds the smallest possible p is 2 / 2^n, so "agree" means "no detectable difference at
this n").

  python experiments/rl_zero_seeds.py --seeds 0 1 2 [any rl_zero.py flag ...]
  python experiments/rl_zero_seeds.py --experiment rl_think --seeds 0 1 2 [rl_think.py flags]

Writes <out-dir>/<experiment>_seeds.json (default runs/) and one run directory per seed
(<out-dir>/<experiment>_seed<s>/, the experiment's usual report).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os

import numpy as np

from specjax.jobs import run_main

EXPERIMENTS = ("rl_zero", "rl_think")  # modules beside this file with main(argv) -> summary


def sign_flip_test(diffs: list[float]) -> float:
  """Exact two-sided p-value of H0 "paired differences are symmetric about 0": the share of the
  2^n sign assignments whose |mean| is at least the observed one."""
  d = np.asarray(diffs, np.float64)
  observed = abs(d.mean())
  flips = [abs(np.mean(d * np.asarray(s))) >= observed - 1e-12
           for s in itertools.product((1, -1), repeat=len(d))]
  return float(np.mean(flips))


def arm_stats(values: list[float]) -> dict[str, float]:
  v = np.asarray(values, np.float64)
  return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
          "values": [float(x) for x in v]}


def summarize(per_seed: dict[int, dict]) -> dict:
  """Per-arm final accuracy and gain (mean, std), paired spec - AR test, speedups per seed."""
  seeds = sorted(per_seed)
  out = {"seeds": seeds, "arms": {}}
  for arm in ("ar", "spec"):
    final = [per_seed[s]["runs"][arm]["final_val_accuracy"] for s in seeds]
    base = [per_seed[s]["initial_validation"].get("val/accuracy", float("nan")) for s in seeds]
    out["arms"][arm] = {"final_accuracy": arm_stats(final),
                        "gain": arm_stats([f - b for f, b in zip(final, base)])}
  diffs = [per_seed[s]["runs"]["spec"]["final_val_accuracy"]
           - per_seed[s]["runs"]["ar"]["final_val_accuracy"] for s in seeds]
  p = sign_flip_test(diffs)
  out["paired_test"] = {"test": "exact two-sided paired sign-flip permutation test of final "
                                "accuracy, spec - AR, over seeds",
                        "differences": diffs, "mean_difference": float(np.mean(diffs)),
                        "p_value": p, "min_possible_p": 2 / 2 ** len(seeds),
                        "agree_at_0.05": p >= 0.05}
  for key in ("rollout_speedup", "step_speedup", "acceptance_length", "train_rows_ratio"):
    values = [per_seed[s][key] for s in seeds if per_seed[s].get(key) is not None]
    if values:
      out[key] = arm_stats(values)
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--experiment", choices=EXPERIMENTS, default="rl_zero")
  parser.add_argument("--out-dir", default="runs")
  args, rest = parser.parse_known_args(argv)
  experiment = importlib.import_module(args.experiment)

  per_seed = {}
  for seed in args.seeds:
    per_seed[seed] = experiment.main(["--out-dir", args.out_dir,
                                      "--name", f"{args.experiment}_seed{seed}",
                                      "--rl.seed", str(seed), "--base.seed", "0", *rest])
  result = dict(summarize(per_seed), experiment=args.experiment)
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f"{args.experiment}_seeds.json")
  with open(f"{path}.tmp", "w") as f:
    json.dump(result, f, indent=2)
  os.replace(f"{path}.tmp", path)
  for arm, s in result["arms"].items():
    final, gain = s["final_accuracy"], s["gain"]
    print(f"{arm}: final accuracy {final['mean']:.3f} +- {final['std']:.3f}, "
          f"gain {gain['mean']:+.3f} +- {gain['std']:.3f}")
  t = result["paired_test"]
  print(f"spec - AR: {t['mean_difference']:+.3f}, sign-flip p = {t['p_value']:.3f} "
        f"(smallest possible {t['min_possible_p']:.3f})")
  for key in ("rollout_speedup", "step_speedup", "train_rows_ratio"):
    if key in result:
      print(f"{key}: {result[key]['mean']:.2f} +- {result[key]['std']:.2f} "
            f"({', '.join(f'{v:.2f}' for v in result[key]['values'])})")
  return result


if __name__ == "__main__":
  # a user's mistake, a failed write or a stop: one line on stderr and an exit code (README)
  run_main(main)
