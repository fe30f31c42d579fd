"""What the rollout engine learns by running, and who keeps it: the measured cost of each compiled
(program, bucket, K) (`CostTable`) and the running acceptance estimates, bundled as
`EngineTuning`. Plain Python; the engine hands it the timed segment runs.

Whoever runs rollouts owns one `EngineTuning` and passes it to every `generate` /
`speculative_generate` call that should reuse it (an RL run keeps one for all its rollouts); a
call without one calibrates afresh and forgets. Two engines never share costs by accident.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from specjax.sampling.adaptive import AcceptanceEstimates


class CostTable:
  """Seconds per step and fixed seconds per segment of each (program, bucket, K) measured so far.

  A program is a (graphdef, drafter, sampling config, cache size, mesh) combination; its id is
  taken once per rollout, since hashing a policy's graphdef costs ~0.3 ms."""

  def __init__(self):
    self._program_ids: dict[tuple, int] = {}
    self._step: dict[tuple, float] = {}  # (program id, bucket, K) -> seconds per step now
    self._segment: dict[tuple, float] = {}  # ... -> fixed seconds per segment (calibration)
    self._calibrated: dict[tuple, list] = {}  # ... -> [startup seconds per step, steps refined]
    self._prepared: set[tuple] = set()  # keys of runs whose programs are all compiled
    self._from_line: set[tuple] = set()  # keys whose startup cost came from `line`, not a timing

  def program_id(self, program: tuple) -> int:
    return self._program_ids.setdefault(program, len(self._program_ids))

  def first_preparation(self, key: tuple) -> bool:
    """True once per `key`: the caller compiles (and calibrates) what that key needs now."""
    if key in self._prepared:
      return False
    self._prepared.add(key)
    return True

  def step_cost(self, key: tuple, run: Callable[[int], int], iters: int, repeats: int) -> float:
    """Seconds per step of `key`, measured the first time it is asked for. `run(m)` runs a
    segment of at most m steps to completion (results discarded) and returns the steps it ran.

    After one untimed run that compiles it, each repeat times a segment of n steps and one of
    2n; the slope (t_2n - t_n) / n is the cost of a step without the segment's fixed cost
    (dispatch, loop entry, the host round trip), which would otherwise weigh on cheap steps more
    than on dear ones. The fastest of `repeats` timings of each is kept, since load on the
    machine only ever adds time."""
    if key not in self._step:
      run(iters)
      best = {iters: (float("inf"), 0), 2 * iters: (float("inf"), 0)}
      for _ in range(repeats):
        for m in best:
          t0 = time.perf_counter()
          ran = run(m)
          best[m] = min(best[m], (time.perf_counter() - t0, ran))
      (t1, i1), (t2, i2) = best[iters], best[2 * iters]
      slope = (t2 - t1) / (i2 - i1) if i2 > i1 and t2 > t1 else t2 / max(i2, 1)
      self._step[key] = slope
      self._segment[key] = max(t2 - slope * i2, 0.0)
      self._calibrated[key] = [slope, 0]
    return self._step[key]

  def has(self, key: tuple) -> bool:
    return key in self._step

  def line(self, key: tuple, lo: tuple, hi: tuple, frac: float) -> float:
    """Seconds per step of `key` once it has a cost of its own; until then the point at `frac`
    on the line through the costs of `lo` and `hi` (both measured): a verify step's cost grows
    about linearly in K between two measured draft lengths."""
    if key in self._step:
      return self._step[key]
    return self._step[lo] + frac * (self._step[hi] - self._step[lo])

  def start_from_line(self, key: tuple, lo: tuple, hi: tuple, frac: float) -> None:
    """Give `key` its own cost, taken from `line` (step and segment costs), so the segments that
    run it refine it from there."""
    if key in self._step:
      return
    self._step[key] = self.line(key, lo, hi, frac)
    self._segment[key] = self._segment[lo] + frac * (self._segment[hi] - self._segment[lo])
    self._calibrated[key] = [self._step[key], 0]
    self._from_line.add(key)

  def refine(self, key: tuple, iters: int, seconds: float, memory: float) -> None:
    """Move `key`'s step cost toward what a segment of a rollout measured: the startup
    calibration times a few steps on the prompt's first positions, a rollout's own segments every
    step the engine takes there. The segment's fixed cost (measured at calibration) is taken off
    first; weight iterations / (iterations + memory)."""
    if key not in self._step or iters <= 0 or memory <= 0:
      return
    per_step = max(seconds - self._segment.get(key, 0.0), 0.0) / iters
    w = iters / (iters + memory)
    self._step[key] = (1.0 - w) * self._step[key] + w * per_step
    self._calibrated[key][1] += iters

  def rows(self) -> list[dict]:
    """[{"bucket", "draft_len", "step_s", "segment_s", "calibrated_step_s", "steps_measured",
    "from_line"}]: seconds per step the engine now uses (the startup calibration refined by the
    segments of later rollouts), the fixed seconds per segment, the startup figure, how many
    in-rollout steps refined it, and whether the startup figure came from `line` rather than a
    timing."""
    return [{"bucket": k[-2], "draft_len": k[-1], "step_s": v, "segment_s": self._segment.get(k),
             "calibrated_step_s": self._calibrated[k][0],
             "steps_measured": self._calibrated[k][1], "from_line": k in self._from_line}
            for k, v in self._step.items()]


@dataclasses.dataclass(eq=False)
class EngineTuning:
  """The engine's measured step costs and acceptance estimates, owned by whoever runs rollouts
  and passed as `tuning=` to every call that should reuse them."""

  costs: CostTable = dataclasses.field(default_factory=CostTable)
  estimates: AcceptanceEstimates = dataclasses.field(default_factory=AcceptanceEstimates)

  def calibration_table(self) -> list[dict]:
    return self.costs.rows()
