"""The report of an AR-vs-speculative experiment: summary.json, three PNG plots and a short table.

Timings exclude compile steps (the first step of every process segment, marked
"perf/compile_step" by the loop: a resumed run compiles again) where a run has other steps. The
two arms' final accuracies are reported side by side, with no test between them (ARMS_NOTE).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import numpy as np

from specjax.jobs.device_report import MFU_NOTE, device_stats, format_device_lines
from specjax.rl.metrics_log import read_metrics

logger = logging.getLogger(__name__)

PHASE_ORDER = ("data", "prepare", "gen", "reward", "logprob", "train")

# what one run's two final accuracies can and cannot say (summary.json and the text report)
ARMS_NOTE = (
    "AR and spec are two policies: the same seed, but each trains on its own sampled rollouts, "
    "so their training trajectories diverge, and one run's two accuracies do not test agreement.",
    "The speculative sampler's losslessness is checked by the distribution tests "
    "(tests/test_rejection.py, tests/test_speculative.py, tests/test_tree_verify.py); the arms' "
    "accuracy over seeds is compared by python experiments/rl_zero_seeds.py.")


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
  pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
  return [p[0] for p in pts], [float(p[1]) for p in pts]


def _is_compile_step(records: list[dict], i: int) -> bool:
  """Marked by the loop; records written before the mark existed: the first one only."""
  r = records[i]
  return bool(r["perf/compile_step"]) if "perf/compile_step" in r else i == 0


def compile_mask(steps: list[dict]) -> list[bool]:
  """Steps that compiled: the loop marks each process's first step (`perf/compile_step`); the
  rollout engine compiles and calibrates every live-batch bucket in that step's rollout, so no
  later step compiles. Totals keep every step."""
  return [_is_compile_step(steps, i) for i in range(len(steps))]


def _mean_after_compile(values: list[float], compile_mask: list[bool]) -> float:
  """Mean over the steps that did not compile (all of them when every step compiled)."""
  v = [x for x, c in zip(values, compile_mask) if not c] or values
  return float(np.mean(v)) if v else float("nan")


def _by_epoch(steps: list[dict], compiled: list[bool]) -> dict[str, dict[str, float | None]]:
  """A run over a revisited prompt pool (TaskConfig.pool_size): per epoch (its steps' first
  prompt's), mean acceptance length and rollout seconds per step (compile steps left out);
  {} for a run over a stream."""
  out: dict[str, dict[str, float | None]] = {}
  for e in sorted({r["data/epoch"] for r in steps if "data/epoch" in r}):
    mine = [(r, c) for r, c in zip(steps, compiled) if r.get("data/epoch") == e]
    acc = [r["spec/acceptance_length"] for r, _ in mine if "spec/acceptance_length" in r]
    acc = [a for a in acc if np.isfinite(a)]
    gen = [r.get("time/gen", 0.0) for r, c in mine if not c]
    out[str(e)] = {"steps": len(mine), "acceptance_length": float(np.mean(acc)) if acc else None,
                   "rollout_time_s": float(np.mean(gen)) if gen else None}
  return out


def run_stats(records: list[dict]) -> dict[str, Any]:
  steps = [r for r in records if "time/step" in r]
  compiled = compile_mask(steps)
  gen = [r.get("time/gen", 0.0) for r in steps]
  step = [r["time/step"] for r in steps]
  _, acc_len = _series(records, "spec/acceptance_length")
  val_steps, val_acc = _series(records, "val/accuracy")
  names = [k[len("time/"):] for k in (steps[0] if steps else {}) if k.startswith("time/")
           and k != "time/step"]
  phases = {k: _mean_after_compile([r.get(f"time/{k}", 0.0) for r in steps], compiled)
            for k in names}
  total_phase = sum(phases.values()) or 1.0
  skipped = [(r["train/skipped_seqs"], c) for r, c in zip(steps, compiled)
             if "train/skipped_seqs" in r]
  return {
      "steps": len(steps),
      "rollout_time_s": _mean_after_compile(gen, compiled),  # per step, compile excluded
      "step_time_s": _mean_after_compile(step, compiled),
      "compile_steps": [r["step"] for r, c in zip(steps, compiled) if c],
      "rollout_time_total_s": float(np.sum(gen)),
      "step_time_total_s": float(np.sum(step)),
      "first_step_s": float(step[0]) if step else float("nan"),
      "phase_mean_s": phases,
      "phase_fraction": {k: v / total_phase for k, v in phases.items()},
      "acceptance_length": acc_len,
      # steps where the adaptive engine drafted nothing have no acceptance length (nan)
      "acceptance_length_mean": float(np.nanmean(acc_len)) if np.isfinite(acc_len).any()
      else None,
      "train_reward": _series(records, "reward/mean")[1],
      # the packed train step leaves out zero-advantage sequences: how much each run trained on
      "trained_seq_fraction": _mean_after_compile([1.0 - v for v, _ in skipped],
                                                  [c for _, c in skipped]) if skipped else None,
      "by_epoch": _by_epoch(steps, compiled),
      "val_steps": val_steps,
      "val_accuracy": val_acc,
      "final_val_accuracy": val_acc[-1] if val_acc else None,
  }


def _save(fig, ax, path: str, xlabel: str, ylabel: str, title: str) -> str:
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  if ax.get_legend_handles_labels()[0]:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def _plots(out: str, stats: dict[str, dict], initial: dict[str, float] | None) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = []
  fig, ax = plt.subplots(figsize=(6, 4))
  for label, s in stats.items():
    xs, ys = list(s["val_steps"]), list(s["val_accuracy"])
    if initial and "val/accuracy" in initial:
      xs, ys = [0] + xs, [initial["val/accuracy"]] + ys
    ax.plot(xs, ys, marker="o", label=f"{label} rollouts")
  ax.grid(alpha=0.3)
  paths.append(_save(fig, ax, os.path.join(out, "val_accuracy.png"), "GRPO step",
                     "validation accuracy", "Validation accuracy: AR vs speculative rollouts"))

  fig, ax = plt.subplots(figsize=(6, 4))
  for label, s in stats.items():
    if s["acceptance_length"]:
      ax.plot(range(1, len(s["acceptance_length"]) + 1), s["acceptance_length"], label=label)
  ax.grid(alpha=0.3)
  paths.append(_save(fig, ax, os.path.join(out, "acceptance_length.png"), "GRPO step",
                     "acceptance length (tokens per target forward)",
                     "Acceptance length during RL"))

  fig, ax = plt.subplots(figsize=(5, 4))
  labels = list(stats)
  bottom = np.zeros(len(labels))
  names = [p for p in PHASE_ORDER if any(p in s["phase_mean_s"] for s in stats.values())]
  for name in names:
    vals = np.array([stats[l]["phase_mean_s"].get(name, 0.0) for l in labels])
    ax.bar(labels, vals, bottom=bottom, label=name)
    bottom += vals
  paths.append(_save(fig, ax, os.path.join(out, "phase_times.png"), "run",
                     "mean seconds per step", "Where a step's time goes"))
  plt.close("all")
  return paths


def scaled_projection(cfg: Any, results: dict[str, dict], stats: dict[str, dict]) -> dict | None:
  """The simulator's projection of this configuration (batch, completion lengths, drafter, K,
  measured acceptance) scaled to Qwen3-8B on 8 H100s: a projection, not a measurement."""
  spec = stats.get("spec")
  if spec is None or not spec["acceptance_length"]:
    return None
  from specjax.sim import project_scaled

  records = read_metrics(results["spec"]["metrics_path"])
  lengths = [r["response/length_mean"] for r in records if "response/length_mean" in r]
  rl = cfg.rl
  try:
    p = project_scaled(batch=rl.rollout_batch, group_size=rl.grpo.group_size,
                       completion_lengths=lengths or [rl.rollout.max_new_tokens / 2],
                       max_new=rl.rollout.max_new_tokens,
                       acceptance_length=spec["acceptance_length_mean"],
                       draft_kind=rl.draft.kind, draft_len=rl.draft.draft_len,
                       model="qwen3-8b", hardware="h100", gpus=8,
                       adaptive=rl.rollout.engine.adaptive.enabled)
  except (ValueError, KeyError) as e:  # a kind or shape the simulator does not model
    return {"label": "projection unavailable", "reason": str(e)}
  return {"label": "PROJECTION (simulator, not measured): this workload scaled to Qwen3-8B on "
                   "8 H100s", **{k: p[k] for k in ("rollout_speedup", "step_speedup", "ar_gen_s",
                                                   "spec_gen_s", "ar_step_s", "spec_step_s",
                                                   "acceptance_length", "mean_completion_len")}}


def paired_speedups(ar_records: list[dict], spec_records: list[dict]) -> dict[str, Any]:
  """rollout_speedup and step_speedup over the steps that compiled in neither run: both runs
  then time the same steps (same prompts), and a compile in one run does not count against it;
  with the runs' generated tokens logged, their ratio over those steps (spec / AR) and the
  rollout speedup in tokens/s."""
  def by_step(records):
    steps = [r for r in records if "time/step" in r]
    return {r["step"]: (r, c) for r, c in zip(steps, compile_mask(steps))}

  ar, sp = by_step(ar_records), by_step(spec_records)
  common = sorted(k for k in ar.keys() & sp.keys() if not ar[k][1] and not sp[k][1])
  if not common:  # every step compiled somewhere: all common steps
    common = sorted(ar.keys() & sp.keys())
  if not common:
    return {}

  def total(runs, key):
    return sum(runs[k][0].get(key, 0.0) for k in common)

  out = {"rollout_speedup": total(ar, "time/gen") / max(total(sp, "time/gen"), 1e-12),
         "step_speedup": total(ar, "time/step") / max(total(sp, "time/step"), 1e-12),
         "speedup_steps": common}
  if total(ar, "gen/tokens") > 0 and total(sp, "gen/tokens") > 0:
    # the two runs are two policies: when their completions grow apart in length, the time
    # ratio above measures that, not the drafts; tokens/s over the same steps does not
    out["gen_tokens_ratio"] = total(sp, "gen/tokens") / total(ar, "gen/tokens")
    out["rollout_tokens_per_s_speedup"] = out["rollout_speedup"] * out["gen_tokens_ratio"]
  if total(ar, "train/packed_rows") > 0:
    # each run trains on its own rollouts: with zero-advantage sequences left out, the train
    # work differs between the runs by chance, and the step speedup with it
    out["train_rows_ratio"] = total(sp, "train/packed_rows") / total(ar, "train/packed_rows")
  return out


def write_report(cfg: Any, out: str, results: dict[str, dict], *, wall_s: float,
                 initial: dict[str, float] | None = None, model_cfg: Any = None,
                 device_kind: str | None = None,
                 budget_stopped_after: int | None = None) -> dict[str, Any]:
  """`model_cfg` and `device_kind` (the policy's ModelConfig, JAX's name of the device): each
  run's device figures (`device_report`); `budget_stopped_after`: the steps each run had taken
  in this process when the experiment's time budget ended them."""
  records = {label: read_metrics(r["metrics_path"]) for label, r in results.items()}
  stats = {label: run_stats(recs) for label, recs in records.items()}
  if device_kind is not None:
    for label, recs in records.items():
      steps = [r for r in recs if "time/step" in r]
      stats[label]["device"] = device_stats(steps, compile_mask(steps), model_cfg, device_kind,
                                            model_cfg.dtype if model_cfg is not None else "")
  summary: dict[str, Any] = {
      "name": cfg.name, "wall_time_s": wall_s, "initial_validation": initial or {},
      "budget_stopped_after_steps": budget_stopped_after,
      "runs": stats, "config": dataclasses.asdict(cfg),
      "notes": ("times are means per step without the compile steps (the first step of every "
                "process segment: a resumed run compiles again); "
                "speedup = AR time / speculative time, summed over "
                "the steps that compiled in neither run (same steps, same prompts)"),
  }
  if device_kind is not None:
    summary["device_note"] = MFU_NOTE
  if "ar" in stats and "spec" in stats:
    ar, sp = stats["ar"], stats["spec"]
    summary.update(paired_speedups(records["ar"], records["spec"]))
    summary["final_val_accuracy"] = {"ar": ar["final_val_accuracy"],
                                     "spec": sp["final_val_accuracy"]}
    summary["final_accuracy_note"] = list(ARMS_NOTE)
  if "spec" in stats:
    summary["acceptance_length"] = stats["spec"]["acceptance_length_mean"]
  summary["validation"] = {label: {"steps": s["val_steps"], "accuracy": s["val_accuracy"]}
                           for label, s in stats.items()}
  summary["projection"] = scaled_projection(cfg, results, stats)
  summary["plots"] = _plots(out, stats, initial)
  path = os.path.join(out, "summary.json")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(summary, f, indent=2, default=float)
  os.replace(tmp, path)
  logger.info(format_table(summary))
  logger.info(f"report: {path}")
  return summary


def format_table(summary: dict[str, Any]) -> str:
  runs = summary["runs"]
  init = summary.get("initial_validation", {}).get("val/accuracy")
  lines = [f"{'run':<6}{'rollout s/step':>16}{'train s/step':>14}{'step s/step':>13}"
           f"{'gen share':>11}{'seqs trained':>14}{'accept len':>12}{'val acc start':>15}"
           f"{'val acc end':>13}"]
  def fmt(x, spec):
    return "-" if x is None else format(x, spec)

  for label, s in runs.items():
    share = s.get("phase_fraction", {}).get("gen")
    train = s.get("phase_mean_s", {}).get("train")
    lines.append(f"{label:<6}{fmt(s['rollout_time_s'], '.3f'):>16}{fmt(train, '.3f'):>14}"
                 f"{fmt(s['step_time_s'], '.3f'):>13}{fmt(share, '.0%'):>11}"
                 f"{fmt(s.get('trained_seq_fraction'), '.0%'):>14}"
                 f"{fmt(s['acceptance_length_mean'], '.2f'):>12}{fmt(init, '.3f'):>15}"
                 f"{fmt(s['final_val_accuracy'], '.3f'):>13}")
  if "rollout_speedup" in summary:
    rows = summary.get("train_rows_ratio")
    lines.append(f"rollout speedup {summary['rollout_speedup']:.2f}x, "
                 f"step speedup {summary['step_speedup']:.2f}x" +
                 (f" (spec trained on {rows:.2f}x AR's packed rows)" if rows else ""))
    if "gen_tokens_ratio" in summary:
      lines.append(f"rollout tokens/s: spec {summary['rollout_tokens_per_s_speedup']:.2f}x AR's "
                   f"(spec generated {summary['gen_tokens_ratio']:.2f}x AR's tokens over the same "
                   f"steps; where that is far from 1 the runs' completions grew apart and the "
                   f"time ratios above are the policies', not the drafts')")
  for label, s in runs.items():
    epochs = s.get("by_epoch") or {}
    if epochs:
      lines.append(f"{label} by prompt-pool epoch (acceptance length / rollout s per step): " +
                   ", ".join(f"{e}:{fmt(v['acceptance_length'], '.2f')}/"
                             f"{fmt(v['rollout_time_s'], '.3f')}" for e, v in epochs.items()))
  lines += format_device_lines(runs)
  if summary.get("budget_stopped_after_steps") is not None:
    lines.append(f"the runs stopped after {summary['budget_stopped_after_steps']} steps each in "
                 f"this process: the experiment's time budget (--budget-s) was spent")
  for label, v in summary.get("validation", {}).items():
    lines.append(f"{label} validation accuracy by step: " +
                 ", ".join(f"{st}:{a:.2f}" for st, a in zip(v["steps"], v["accuracy"])))
  if "ar" in runs and "spec" in runs:
    lines += ARMS_NOTE
  proj = summary.get("projection")
  if proj and "rollout_speedup" in proj:
    lines.append(f"{proj['label']}: rollout {proj['rollout_speedup']:.2f}x, "
                 f"step {proj['step_speedup']:.2f}x")
  return "\n".join(lines)
