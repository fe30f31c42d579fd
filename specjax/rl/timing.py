"""Phase timers for the RL loop: wall time per phase with device synchronisation at its end.

`with timer.phase("gen") as p: out = p.sync(generate(...))` blocks on `out` before the clock stops,
so asynchronous dispatch never shifts time from one phase into the next.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any

import jax

from specjax.sampling.engine.programs import compile_seconds

PHASES = ("data", "prepare", "gen", "reward", "logprob", "train")


class _Phase:
  def __init__(self):
    self.pending: list[Any] = []

  def sync(self, tree: Any) -> Any:
    """Mark `tree` as this phase's output: the phase ends when its arrays are ready."""
    self.pending.append(tree)
    return tree


def peak_device_bytes() -> int | None:
  """The largest device memory in use so far on this process's first device (the allocator's
  own figure), or None where the backend keeps none (the CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return int(peak) if peak is not None else None


class PhaseTimer:
  """Accumulates seconds per phase for the current step and over the whole run, and the seconds
  of compiling from a step's first phase to its end (`compile_seconds`; runs that take turns in
  one process never overlap in time, so each step's compiles are its own)."""

  def __init__(self):
    self.step_times: dict[str, float] = {}
    self.totals: dict[str, float] = defaultdict(float)
    self.steps = 0
    self.first_step: dict[str, float] = {}  # compilation lands here
    self._compiled_at = compile_seconds()

  @contextlib.contextmanager
  def phase(self, name: str):
    p = _Phase()
    if not self.step_times:  # a step's first phase: its compiles count from here
      self._compiled_at = compile_seconds()
    t0 = time.perf_counter()
    try:
      yield p
    finally:
      if p.pending:
        jax.block_until_ready(p.pending)
      dt = time.perf_counter() - t0
      self.step_times[name] = self.step_times.get(name, 0.0) + dt

  def end_step(self) -> dict[str, Any]:
    """This step's times ("time/<phase>", "time/step") and reset for the next step;
    "perf/compile_step" marks the first step of this timer (of this process: a resumed run's
    first step compiles again), which reports leave out of their timings."""
    out: dict[str, Any] = {f"time/{k}": v for k, v in self.step_times.items()}
    out["time/step"] = sum(self.step_times.values())
    out["perf/compile_step"] = self.steps == 0
    out["perf/compile_s"] = compile_seconds() - self._compiled_at
    peak = peak_device_bytes()
    if peak is not None:
      out["perf/peak_device_gib"] = peak / 2**30
    for k, v in self.step_times.items():
      self.totals[k] += v
    if self.steps == 0:
      self.first_step = dict(self.step_times)
    self.steps += 1
    self.step_times = {}
    return out

  def summary(self) -> dict[str, Any]:
    """Totals, per-step means and fractions of the run time per phase."""
    total = sum(self.totals.values())
    names = [p for p in PHASES if p in self.totals] + [p for p in self.totals if p not in PHASES]
    phases = {
        k: {"total_s": self.totals[k], "mean_s": self.totals[k] / max(self.steps, 1),
            "fraction": self.totals[k] / total if total > 0 else 0.0} for k in names}
    first = sum(self.first_step.values())
    rest = self.steps - 1
    return {"steps": self.steps, "total_s": total,
            "mean_step_s": total / max(self.steps, 1),
            "mean_step_s_after_first": (total - first) / rest if rest > 0 else float("nan"),
            "first_step_s": first, "phases": phases}


def format_summary(summary: dict[str, Any]) -> str:
  lines = [f"phase breakdown over {summary['steps']} steps "
           f"(mean step {summary['mean_step_s']:.3f} s, {summary['mean_step_s_after_first']:.3f} s "
           f"after the first (compilation), total {summary['total_s']:.1f} s)",
           f"  {'phase':<10}{'mean s':>10}{'total s':>10}{'share':>8}"]
  for name, p in summary["phases"].items():
    lines.append(f"  {name:<10}{p['mean_s']:>10.4f}{p['total_s']:>10.2f}{100 * p['fraction']:>7.1f}%")
  return "\n".join(lines)
