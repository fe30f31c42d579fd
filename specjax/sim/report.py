"""Sweeps, tables and plots of simulated comparisons (used by experiments/simulate.py).

Plots use matplotlib's Agg backend and are only imported when a plot is written.
"""

from __future__ import annotations

import os
from typing import Sequence

from specjax.sim.simulate import Comparison, Scenario, compare
from specjax.sim.workload import acceptance_from_rate, rate_for_acceptance

PHASES = ("prepare", "gen", "logprob", "train", "other", "exposed_gen", "step")


def breakdown_table(c: Comparison) -> str:
  """Per-phase seconds for AR and speculative rollouts, and the speedups."""
  s = c.scenario
  lines = [f"{s.model} on {s.gpus} x {s.hardware}, {s.mode}"
           + (f" (policy lag {s.policy_lag})" if s.mode == "async" else "")
           + f", workload {s.workload.name}: {s.workload.prompts} prompts x "
           f"{s.workload.samples} samples, drafter {s.drafter} K={s.draft_len}, "
           f"acceptance length {c.spec.acceptance_length:.2f}",
           f"{'phase':<12}{'AR (s)':>10}{'spec (s)':>10}"]
  for p in PHASES:
    lines.append(f"{p:<12}{getattr(c.ar, p):>10.1f}{getattr(c.spec, p):>10.1f}")
  for label, a, b in (("gen GPUs", c.ar.gen_gpus, c.spec.gen_gpus),
                      ("train GPUs", c.ar.train_gpus, c.spec.train_gpus),
                      ("gen mp", c.ar.gen_detail.mp, c.spec.gen_detail.mp)):
    lines.append(f"{label:<12}{a:>10d}{b:>10d}")
  lines.append(f"rollout speedup {c.rollout_speedup:.2f}x, step speedup {c.step_speedup:.2f}x")
  return "\n".join(lines)


def sweep_draft_len(s: Scenario, draft_lens: Sequence[int]) -> list[Comparison]:
  """The same scenario at each draft length. A given acceptance length is read as measured at
  `s.draft_len` and carried to other K by the workload's per-position decay."""
  out = []
  rate = None
  if s.acceptance_length is not None and s.draft_len > 0:
    rate = rate_for_acceptance(s.acceptance_length, s.draft_len, s.workload.acceptance_decay)
  for k in draft_lens:
    acc = None
    if rate is not None:
      acc = acceptance_from_rate(rate, k, s.workload.acceptance_decay) if k > 0 else 1.0
    out.append(compare(s.replace(draft_len=k, acceptance_length=acc)))
  return out


def sweep_gpus(s: Scenario, gpus: Sequence[int]) -> list[Comparison]:
  return [compare(s.replace(gpus=g)) for g in gpus]


def sweep_table(rows: Sequence[Comparison], key: str) -> str:
  head = (f"{key:>9}{'acc':>6}{'AR gen':>9}{'AR step':>9}{'spec gen':>10}{'spec step':>10}"
          f"{'rollout x':>10}{'step x':>8}")
  lines = [head]
  for c in rows:
    v = c.scenario.draft_len if key == "draft_len" else c.scenario.gpus
    lines.append(f"{v:>9d}{c.spec.acceptance_length:>6.2f}{c.ar.gen:>9.1f}{c.ar.step:>9.1f}"
                 f"{c.spec.gen:>10.1f}{c.spec.step:>10.1f}{c.rollout_speedup:>10.2f}"
                 f"{c.step_speedup:>8.2f}")
  return "\n".join(lines)


def sweep_plot(rows: Sequence[Comparison], key: str, path: str) -> str:
  """Step / generation seconds (left) and speedups (right) against the swept value."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  xs = [c.scenario.draft_len if key == "draft_len" else c.scenario.gpus for c in rows]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  ax1.plot(xs, [c.ar.step for c in rows], "o-", label="AR step")
  ax1.plot(xs, [c.spec.step for c in rows], "o-", label="spec step")
  ax1.plot(xs, [c.ar.gen for c in rows], "s--", label="AR gen")
  ax1.plot(xs, [c.spec.gen for c in rows], "s--", label="spec gen")
  ax1.set_ylabel("seconds per RL step")
  ax2.plot(xs, [c.rollout_speedup for c in rows], "o-", label="rollout speedup")
  ax2.plot(xs, [c.step_speedup for c in rows], "s-", label="step speedup")
  ax2.axhline(1.0, color="gray", lw=0.8)
  ax2.set_ylabel("speedup (x)")
  for ax in (ax1, ax2):
    ax.set_xlabel(key.replace("_", " "))
    if key == "gpus":
      ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
  s = rows[0].scenario
  fig.suptitle(f"{s.model} / {s.hardware} / {s.mode} / {s.drafter} ({s.workload.name})")
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def validation_plot(rows: Sequence[dict], path: str, paper_rows: Sequence[dict] = ()) -> str:
  """Predicted vs measured seconds (log-log), y = x and +-20% lines: specjax's CPU cases by
  split / group (left) and, if given, the published GB200 cases (right)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = [("specjax on a 2-core CPU", rows)] + (
      [("NeMo-RL Qwen3-8B, 32 GB200", paper_rows)] if paper_rows else [])
  fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.4))
  axes = [axes] if len(panels) == 1 else list(axes)
  markers = {"forward": "o", "step": "^", "rollout": "s", "paper": "D"}
  for ax, (title, rs) in zip(axes, panels):
    keys = sorted({(r.get("split", "fit"), r.get("group", "rollout")) for r in rs})
    for split, group in keys:
      sel = [r for r in rs if r.get("split", "fit") == split and r.get("group") == group]
      ax.scatter([r["measured_s"] for r in sel], [r["predicted_s"] for r in sel], s=18,
                 marker=markers.get(group, "o"), alpha=0.8,
                 facecolors="none" if split == "fit" else None,
                 edgecolors=None if split != "fit" else f"C{len(ax.collections)}",
                 label=f"{group} ({split})")
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rs) / 1.5
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rs) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.plot([lo, hi], [1.2 * lo, 1.2 * hi], "k:", lw=0.6, label="+-20%")
    ax.plot([lo, hi], [lo / 1.2, hi / 1.2], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (s)")
    ax.set_ylabel("predicted (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=72)
  plt.close(fig)
  return path
