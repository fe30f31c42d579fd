"""Measured step costs of the rollout engine's programs: `CostTable`, one per `EngineTuning`
(`specjax.sampling.calibration`, where the whole story of a run's costs is told), over the run's
snapshot of the machine's cost cache (`specjax.sampling.cost_cache`). Plain Python; the engine
hands it timed segment runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import sys
import time
from typing import Any, Callable

from specjax.sampling.cost_cache import (COST_SLACK, CostCache, RunCosts, cost_key, cost_problem,
                                         implausible_keys, parse_key, plausible_range)

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_log = logging.getLogger(__name__)


def device_description() -> str:
  """What the costs were measured on: backend, device kind and count, processes, jax version,
  XLA flags and (CPU) the core count."""
  import jax

  d = jax.devices()[0]
  cores = os.cpu_count() if d.platform == "cpu" else None
  return (f"backend={jax.default_backend()} kind={d.device_kind} devices={jax.device_count()} "
          f"processes={jax.process_count()} jax={jax.__version__} cores={cores} "
          f"xla_flags={os.environ.get('XLA_FLAGS', '')}")


def stable_digest(*parts: Any) -> str:
  """A digest of the reprs of `parts` that is the same in every process: memory addresses (reprs
  of functions, plain objects) are blanked, never Python object ids."""
  text = "\n".join(_ADDRESS.sub("0x?", repr(p)) for p in parts)
  return hashlib.sha256(text.encode()).hexdigest()[:20]


def _process_index() -> int:
  jax = sys.modules.get("jax")
  return 0 if jax is None else jax.process_index()


def _agreed(values: tuple[float, float] | None) -> tuple[float, float] | None:
  """Process 0's `values` in every process of a multi-process job (each then picks the same K
  and runs the same programs); `values` itself in a single process. Exact float64 bits."""
  jax = sys.modules.get("jax")
  if jax is None or jax.process_count() == 1:
    return values
  import numpy as np
  from jax.experimental import multihost_utils

  words = np.array([0.0 if values is None else 1.0, *(values or (0.0, 0.0))],
                   np.float64).view(np.uint32).astype(np.int32)
  got = np.asarray(multihost_utils.broadcast_one_to_all(words)).astype(np.uint32)
  flag, step_s, segment_s = got.view(np.float64).tolist()
  return (step_s, segment_s) if flag else None


def time_steps(run: Callable[[int], int | tuple[int, float]], iters: int,
               repeats: int) -> tuple[float, float, int]:
  """(seconds per step, seconds, steps) of the longer timed segment: `run(m)` runs a segment of
  at most m steps and returns the steps it ran, or (steps, seconds) when it times itself. After
  one untimed run, each repeat times a segment of n = `iters` steps and one of 2n; the slope
  (t_2n - t_n) / n is the cost of a step without the segment's fixed cost (dispatch, loop entry,
  the host round trip). The fastest of `repeats` timings of each is kept, since load on the
  machine only ever adds time."""
  run(iters)
  best = {iters: (float("inf"), 0), 2 * iters: (float("inf"), 0)}
  for _ in range(repeats):
    for m in best:
      t0 = time.perf_counter()
      ran = run(m)
      seconds = time.perf_counter() - t0
      if isinstance(ran, tuple):  # (steps, seconds of the steps alone)
        ran, seconds = ran
      best[m] = min(best[m], (seconds, ran))
  (t1, i1), (t2, i2) = best[iters], best[2 * iters]
  per_step = t2 / max(i2, 1)  # (the segment's fixed cost included)
  slope = (t2 - t1) / (i2 - i1) if i2 > i1 and t2 > t1 else per_step
  # a segment's fixed cost is never negative: a steeper slope is noise in the longer timing;
  # a slope near zero is noise too (two timings a hair apart): a step costs a fair share
  return min(max(slope, per_step / (2 * COST_SLACK)), per_step), t2, i2


@dataclasses.dataclass
class _Unchecked:
  """A cost read from the cache and not yet checked against this run's segments (`check_cached`):
  what those segments added up to so far (the first left out) and the (step, segment) seconds
  read."""

  read: tuple[float, float]
  seconds: float = 0.0  # the segments' seconds with their fixed cost taken off
  steps: int = 0
  segments: int = 0
  total_s: float = 0.0  # the segments' seconds, fixed cost included

  def add(self, iters: int, seconds: float, fixed_s: float, enough: int) -> float | None:
    """Count a segment of `iters` steps in `seconds` (fixed cost `fixed_s`); once the segments
    after the first add up to `enough` steps, their seconds per step, else None. (Segments
    faster than the fixed cost leave nothing per step: a step still costs a fair share of the
    segments' time, as at calibration.)"""
    self.segments += 1
    if self.segments == 1:
      return None
    self.seconds += max(seconds - fixed_s, 0.0)
    self.steps += iters
    self.total_s += seconds
    if self.steps < enough:
      return None
    return max(self.seconds, self.total_s / (2 * COST_SLACK)) / self.steps


class CostTable:
  """Seconds per step and fixed seconds per segment of each (program, bucket, K) measured so far.

  A program is a (graphdef, drafter, sampling config, cache size, mesh) combination; its id is a
  stable digest of their reprs and the device (`stable_digest`, `device_description`): the same
  in every process, so costs can be stored and found again. It is taken once per rollout, since
  hashing a policy's graphdef costs ~0.3 ms (its digest ~2 ms, once per program).

  `cache`: the machine's `CostCache`, read through this table's `RunCosts` (`run_costs`): a
  snapshot taken when the run starts (`keep_in`, else at the first cost asked for), so that
  nothing another run writes there later changes this run's costs. A cost not in the table is
  read from the snapshot, and one measured here is written to both (a valid value another run
  stored first wins). A queue's refill cost is kept the same way under (program, rows prefilled
  at once, -1): seconds per prefill in place of a step's, fixed seconds per refill (admission,
  the host round trip) in place of a segment's.

  A cost read from the cache was measured by another run, perhaps under other load: it is
  checked against the program's other costs before it is used (`implausible_keys`; out of line:
  it is measured again), and once against this run's own segments (`check_cached`), whose
  figure replaces it in the machine's cache for later runs where they contradict it (this run
  keeps the figure it read, so that its K choices do not hang on its timings).

  Timed costs are kept monotone (`_set`): a step costs no less with more rows or a longer draft,
  and load only adds time, so a timing above that of a larger (bucket, K) is taken for noise."""

  def __init__(self, cache: CostCache | None = None):
    self.cache = cache
    self.run_costs = RunCosts(cache)
    self._program_ids: dict[tuple, str] = {}
    self._step: dict[tuple, float] = {}  # (program id, bucket, K) -> seconds per step now
    self._segment: dict[tuple, float] = {}  # ... -> fixed seconds per segment (calibration)
    self._calibrated: dict[tuple, list] = {}  # ... -> [startup seconds per step, steps refined]
    self._prepared: set[tuple] = set()  # keys of runs whose programs are all compiled
    self._from_line: set[tuple] = set()  # keys whose startup cost came from `line`, not a timing
    self._measured: set[tuple] = set()  # keys this run timed itself
    self._unchecked: dict[tuple, _Unchecked] = {}  # keys whose cost was read from `cache`
    # keys whose cached cost this run's segments contradicted (and replaced in the cache):
    # key -> {"bucket", "draft_len", "cached_step_s", "observed_step_s", "observed_steps"}
    self.corrected: dict[tuple, dict] = {}

  def keep_in(self, path: str | None, resume: bool) -> None:
    """Fix this run's costs now: the machine's cache is read once (or, when `resume`, the run's
    own file at `path`, if there is one) and kept at `path` with every cost the run measures."""
    if _process_index() == 0:
      self.run_costs.start(path, resume)

  def program_id(self, program: tuple) -> str:
    got = self._program_ids.get(program)
    if got is None:
      got = self._program_ids[program] = stable_digest(*program, device_description())
    return got

  def first_preparation(self, key: tuple) -> bool:
    """True once per `key`: the caller compiles (and calibrates) what that key needs now."""
    if key in self._prepared:
      return False
    self._prepared.add(key)
    return True

  def step_cost(self, key: tuple, run: Callable[[int], int | tuple[int, float]], iters: int,
                repeats: int) -> float:
    """Seconds per step of `key`, measured the first time it is asked for. `run(m)` runs a
    segment of at most m steps to completion (results discarded) and returns the steps it ran,
    or (steps, seconds) when it times the segment itself (leaving out its own preparation).

    Timed by `time_steps` (the first run finds the program compiled, or compiles it): the slope
    of two segment lengths, so the segment's fixed cost does not weigh on cheap steps more than
    on dear ones. With a `cache`, a key it holds is not measured, and a measured
    one is stored there (the value another run stored first wins; `check_cached` may later
    replace a cached one by the run's own figure)."""
    if key not in self._step:
      got = _agreed(self._read(key) if _process_index() == 0 else None)
      if got is not None:
        self._set(key, *got)
        self._unchecked[key] = _Unchecked(got)
    if key not in self._step:
      slope, t2, i2 = time_steps(run, iters, repeats)
      segment = max(t2 - slope * i2, 0.0)  # (process 0's figures are the ones used: `_agreed`)
      if _process_index() == 0:
        # (a timing under a load spike is kept in line with the costs the run uses, so that a
        # later run reading them keeps them all and picks the K this one did)
        used = {k: v[0] for k, v in self.run_costs.items().items()
                if k in self._step and k not in self._from_line}
        lo, hi = plausible_range(key, used)
        slope = min(max(slope, lo), hi)
        segment = max(t2 - slope * i2, 0.0)
        slope, segment = self.run_costs.put(key, (slope, segment))
      self._measured.add(key)
      self._set(key, *_agreed((slope, segment)))
    return self._step[key]

  def _read(self, key: tuple) -> tuple[float, float] | None:
    """`key`'s costs in the run's snapshot of the cache, unless out of line with the costs this
    run timed itself for the same program (then left out of the snapshot: measured again)."""
    got = self.run_costs.get(key)
    if got is None:
      return None
    trusted = {k: self._calibrated[k][0] for k in self._measured if k[:-2] == key[:-2]}
    why = implausible_keys({key: got[0]}, trusted).get(key)
    if why is not None:
      self.run_costs.drop(key, why)
      return None
    return got

  def check_cached(self, key: tuple, iters: int, seconds: float, factor: float,
                   steps: int) -> bool:
    """Weigh a cached cost against the segments of this run that ran `key` (`iters` steps in
    `seconds`, the segment's fixed cost taken off), but the first: a process's first call of a
    program compiled ahead also sets up its dispatch, a cost per process the cached figure
    leaves out (a calibration's untimed run takes it). Once they add up to `steps` steps, it is
    checked, once: where their seconds per step differ from it by more than `factor` either
    way, it was measured under other conditions (a loaded machine, a noisy slope), so their
    figure, from many more steps than a calibration times, replaces it in the machine's cache
    for later runs (unless another run replaced it there first: its figure then stands); this
    run keeps the figure it read, so that its K choices never hang on its own timings. Returns
    True when the cache's figure was replaced. A cost measured by this run, or adopted from a
    stored tuning (`load_json`, a resumed run), is never checked. In a multi-process job
    process 0's timings decide for all (the point of the check, a count of steps, is the same in
    every process)."""
    seen = self._unchecked.get(key)
    if seen is None or factor <= 0 or iters <= 0:
      return False
    observed = seen.add(iters, seconds, self._segment[key], steps)
    if observed is None:
      return False
    del self._unchecked[key]
    observed = _agreed((observed, float(seen.steps)))[0]
    cached = self._calibrated[key][0]  # (as the table uses it: `_set` may have lowered it)
    new = (observed, seen.read[1])
    if cached / factor <= observed <= cached * factor or cost_problem(new) is not None:
      return False
    if _process_index() == 0:
      self.run_costs.correct(key, seen.read, new)
    self.corrected[key] = {"bucket": key[-2], "draft_len": key[-1], "cached_step_s": cached,
                           "observed_step_s": observed, "observed_steps": seen.steps}
    _log.warning("engine cost cache %s: bucket %d, K %d: the cached %.2f ms per step is "
                 "contradicted by this run's %d steps at %.2f ms, which replace it there for "
                 "later runs", self.cache.path if self.cache is not None else "(none)", key[-2],
                 key[-1], cached * 1e3, seen.steps, observed * 1e3)
    return True

  def _set(self, key: tuple, step_s: float, segment_s: float) -> None:
    """Adopt a timed (or cached) cost, kept monotone: a step of a program costs no less with
    more rows or a longer draft, and load only ever adds time, so a timing above that of a
    larger (bucket, K) of the same program is noise: the key takes the smallest cost among the
    timed keys that dominate it, and lowers those it dominates to its own. (A queue's refill
    costs, K = -1, and costs from `line` are left as they are.)"""
    if key[-1] >= 0:
      for other, cost in self._timed_of(key):
        if other[-2] >= key[-2] and other[-1] >= key[-1]:
          step_s = min(step_s, cost)
    self._step[key] = step_s
    self._segment[key] = segment_s
    self._calibrated[key] = [step_s, 0]
    if key[-1] >= 0:
      for other, cost in self._timed_of(key):
        if other[-2] <= key[-2] and other[-1] <= key[-1] and cost > step_s:
          self._step[other] = self._calibrated[other][0] = step_s

  def _timed_of(self, key: tuple) -> list[tuple[tuple, float]]:
    """(key, cost) of the other timed costs of `key`'s program (K >= 0, not from `line`)."""
    return [(k, v) for k, v in self._step.items()
            if k[:-2] == key[:-2] and k != key and k[-1] >= 0 and k not in self._from_line]

  def has(self, key: tuple) -> bool:
    return key in self._step

  def fixed_cost(self, key: tuple) -> float:
    """Fixed seconds per segment of `key` (measured with its step cost)."""
    return self._segment[key]

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
    first (a step still costs a fair share of the segment: at least 1 / (2 COST_SLACK) of its
    seconds); weight iterations / (iterations + memory)."""
    if key not in self._step or iters <= 0 or memory <= 0:
      return
    per_step = max(seconds - self._segment.get(key, 0.0), seconds / (2 * COST_SLACK)) / iters
    if cost_problem((per_step, 0.0)) is not None:
      return
    w = iters / (iters + memory)
    self._step[key] = (1.0 - w) * self._step[key] + w * per_step
    self._calibrated[key][1] += iters

  def rows(self) -> list[dict]:
    """[{"bucket", "draft_len", "step_s", "segment_s", "calibrated_step_s", "steps_measured",
    "from_line", "corrected"}]: seconds per step the engine now uses (the startup calibration
    refined by the segments of later rollouts), the fixed seconds per segment, the startup
    figure, how many in-rollout steps refined it, whether the startup figure came from `line`
    rather than a timing, and whether it replaced a cached figure this run contradicted
    (`corrected`). (A queue's refill costs, kept under K = -1 with the prefill in place of the
    step, are left out.)"""
    return [{"bucket": k[-2], "draft_len": k[-1], "step_s": v, "segment_s": self._segment.get(k),
             "calibrated_step_s": self._calibrated[k][0],
             "steps_measured": self._calibrated[k][1], "from_line": k in self._from_line,
             "corrected": k in self.corrected}
            for k, v in self._step.items() if k[-1] >= 0]

  def to_json(self) -> list[dict]:
    """Every cost of the table (exact floats), for `load_json` in another process."""
    return [{"key": cost_key(k), "step_s": v, "segment_s": self._segment.get(k, 0.0),
             "calibrated_step_s": self._calibrated[k][0], "steps_measured": self._calibrated[k][1],
             "from_line": k in self._from_line} for k, v in self._step.items()]

  def load_json(self, rows: list[dict], source: str = "stored engine tuning") -> None:
    """Adopt stored costs (`to_json`); they replace the table's own for the same keys. A row
    that is no valid cost is left out (one warning naming `source` and the key), so that the
    engine measures it again."""
    for r in rows:
      try:
        key = parse_key(r["key"])
        costs = (r["step_s"], r["segment_s"])
        why = cost_problem(costs) or cost_problem((r["calibrated_step_s"], 0.0))
        steps = int(r["steps_measured"])
      except (KeyError, TypeError, ValueError) as e:
        _log.warning("%s: a cost row %r is damaged (%s): left out", source, r, e)
        continue
      if why is not None:
        _log.warning("%s: %s left out and measured again: %s", source, r["key"], why)
        continue
      self._step[key], self._segment[key] = float(costs[0]), float(costs[1])
      self._calibrated[key] = [float(r["calibrated_step_s"]), steps]
      self._unchecked.pop(key, None)
      if r.get("from_line"):
        self._from_line.add(key)
      else:
        self._from_line.discard(key)
