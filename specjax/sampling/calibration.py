"""What the rollout engine learns by running, and who keeps it: the measured cost of each compiled
(program, bucket, K) (`CostTable`) and the running acceptance estimates, bundled as
`EngineTuning`. Plain Python; the engine hands it the timed segment runs.

Whoever runs rollouts owns one `EngineTuning` and passes it to every `generate` /
`speculative_generate` call that should reuse it (an RL run keeps one for all its rollouts); a
call without one calibrates afresh and forgets. Two engines never share costs by accident.

Reproducibility: the K the adaptive engine picks depends on the step costs, and the random stream
on the K picked. A cost is measured once per program, bucket and K and then kept: in the table,
in a `CostCache` file shared by the runs of a machine (keyed by a stable description of the
program and the device, so a second run with one seed reads the first one's timings and picks
the same K), and in `EngineTuning.to_json` (an RL run stores it in every checkpoint). In-run
refinement of the costs by the segments' own timings (`EngineConfig.cost_memory` > 0) makes the
K choices follow the machine's load, hence not reproducible; it is off by default.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable

from specjax.sampling.adaptive import AcceptanceEstimates

TUNING_FORMAT = 1
COST_CACHE_ENV = "SPECJAX_COST_CACHE"  # overrides the default cost cache path ("off": none)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_log = logging.getLogger(__name__)


def default_cost_cache_path() -> str:
  """$SPECJAX_COST_CACHE, else <$XDG_CACHE_HOME or ~/.cache>/specjax/engine_costs.json."""
  if os.environ.get(COST_CACHE_ENV):
    return os.environ[COST_CACHE_ENV]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "specjax", "engine_costs.json")


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


def _cost_key(key: tuple) -> str:
  """'program/bucket/K' of a (program id, bucket, K) key."""
  return "/".join(str(x) for x in key)


def _parse_key(text: str) -> tuple:
  program, bucket, k = text.rsplit("/", 2)
  return (program, int(bucket), int(k))


class CostCacheError(OSError):
  """The machine's engine cost cache could not be read or written."""


class CostCache:
  """The measured (step, segment) seconds of (program, bucket, K), in one JSON file shared by the
  runs of a machine. `put_if_absent` keeps the first value written (under a file lock): runs that
  measure the same key at once all adopt the one that reached the file first."""

  def __init__(self, path: str):
    self.path = os.path.abspath(os.path.expanduser(path))
    self._entries: dict[str, list[float]] | None = None

  def _read(self) -> dict[str, list[float]]:
    try:
      with open(self.path) as f:
        data = json.load(f)
    except FileNotFoundError:
      return {}
    except (ValueError, UnicodeDecodeError):
      return {}  # a damaged cache is measured anew (and rewritten)
    except OSError as e:
      raise CostCacheError(e.errno, f"engine cost cache {self.path}: {e.strerror}") from None
    if not isinstance(data, dict) or data.get("format") != TUNING_FORMAT:
      return {}
    return {k: list(v) for k, v in data.get("costs", {}).items()}

  def get(self, key: tuple) -> tuple[float, float] | None:
    if self._entries is None:
      self._entries = self._read()
    got = self._entries.get(_cost_key(key))
    return None if got is None else (float(got[0]), float(got[1]))

  def put_if_absent(self, key: tuple, step_s: float, segment_s: float) -> tuple[float, float]:
    """Store the costs of `key` unless the file has them already; returns the stored ones."""
    return self._put(key, (step_s, segment_s), None)

  def replace(self, key: tuple, stale: tuple[float, float],
              costs: tuple[float, float]) -> tuple[float, float]:
    """Store `costs` for `key` in place of `stale` (a figure a run found contradicted by its own
    timings), unless another run replaced it already (its figure then stays); returns the
    stored ones."""
    return self._put(key, costs, stale)

  def _put(self, key: tuple, costs: tuple[float, float],
           stale: tuple[float, float] | None) -> tuple[float, float]:
    import fcntl

    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      with open(self.path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = self._read()
        name = _cost_key(key)
        if name not in entries or (stale is not None and
                                   tuple(map(float, entries[name])) == tuple(map(float, stale))):
          entries[name] = [float(costs[0]), float(costs[1])]
          write_json_atomic(self.path, {"format": TUNING_FORMAT, "costs": entries})
        self._entries = entries
        return float(entries[name][0]), float(entries[name][1])
    except OSError as e:
      if isinstance(e, CostCacheError):
        raise
      raise CostCacheError(e.errno, f"engine cost cache {self.path}: "
                           f"{e.strerror or os.strerror(e.errno or errno.EIO)}") from None


def write_json_atomic(path: str, data: Any) -> None:
  """Write `data` as JSON to a temporary file next to `path`, fsync, then rename it over `path`."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
  try:
    os.fchmod(fd, 0o644)  # (mkstemp's files are private)
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise


class CostTable:
  """Seconds per step and fixed seconds per segment of each (program, bucket, K) measured so far.

  A program is a (graphdef, drafter, sampling config, cache size, mesh) combination; its id is a
  stable digest of their reprs and the device (`stable_digest`, `device_description`): the same
  in every process, so costs can be stored and found again. It is taken once per rollout, since
  hashing a policy's graphdef costs ~0.3 ms (its digest ~2 ms, once per program).

  `cache`: the machine's `CostCache`; a cost not in the table is read from it, and one measured
  here is written to it (the value already there wins). A queue's refill cost is kept the same
  way under (program, rows prefilled at once, -1): seconds per prefill in place of a step's,
  fixed seconds per refill (admission, the host round trip) in place of a segment's.

  A cost read from the cache was measured by another run, perhaps under other load: it is
  checked once against this run's own segments (`check_cached`), whose figure replaces it where
  they contradict it.

  Timed costs are kept monotone (`_set`): a step costs no less with more rows or a longer draft,
  and load only adds time, so a timing above that of a larger (bucket, K) is taken for noise."""

  def __init__(self, cache: CostCache | None = None):
    self.cache = cache
    self._program_ids: dict[tuple, str] = {}
    self._step: dict[tuple, float] = {}  # (program id, bucket, K) -> seconds per step now
    self._segment: dict[tuple, float] = {}  # ... -> fixed seconds per segment (calibration)
    self._calibrated: dict[tuple, list] = {}  # ... -> [startup seconds per step, steps refined]
    self._prepared: set[tuple] = set()  # keys of runs whose programs are all compiled
    self._from_line: set[tuple] = set()  # keys whose startup cost came from `line`, not a timing
    # keys whose cost was read from `cache` and not yet checked: [seconds, steps, segments] of
    # their segments so far (fixed costs taken off; the first segment left out), and the
    # (step, segment) seconds read
    self._unchecked: dict[tuple, list] = {}
    # keys whose cached cost this run's segments contradicted and replaced:
    # key -> {"bucket", "draft_len", "cached_step_s", "observed_step_s", "observed_steps"}
    self.corrected: dict[tuple, dict] = {}

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

    After one untimed run (which finds the program compiled, or compiles it), each repeat times
    a segment of n steps and one of 2n; the slope (t_2n - t_n) / n is the cost of a step without the segment's fixed cost
    (dispatch, loop entry, the host round trip), which would otherwise weigh on cheap steps more
    than on dear ones. The fastest of `repeats` timings of each is kept, since load on the
    machine only ever adds time. With a `cache`, a key it holds is not measured, and a measured
    one is stored there (the value another run stored first wins; `check_cached` may later
    replace a cached one by the run's own figure)."""
    if key not in self._step and self.cache is not None:
      got = _agreed(self.cache.get(key) if _process_index() == 0 else None)
      if got is not None:
        self._set(key, *got)
        self._unchecked[key] = [0.0, 0, 0, got]
    if key not in self._step:
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
      slope = (t2 - t1) / (i2 - i1) if i2 > i1 and t2 > t1 else t2 / max(i2, 1)
      # a segment's fixed cost is never negative: a steeper slope is noise in the longer timing
      slope = min(slope, t2 / max(i2, 1))
      segment = max(t2 - slope * i2, 0.0)
      if self.cache is not None and _process_index() == 0:
        slope, segment = self.cache.put_if_absent(key, slope, segment)
      self._set(key, *_agreed((slope, segment)))
    return self._step[key]

  def check_cached(self, key: tuple, iters: int, seconds: float, factor: float,
                   steps: int) -> bool:
    """Weigh a cached cost against the segments of this run that ran `key` (`iters` steps in
    `seconds`, the segment's fixed cost taken off), but the first: a process's first call of a
    program compiled ahead also sets up its dispatch, a cost per process the cached figure
    leaves out (a calibration's untimed run takes it). Once they add up to `steps` steps, it is
    checked, once: where their seconds per step differ from it by more than `factor` either
    way, it was measured under other conditions (a loaded machine, a noisy slope), so their
    figure, from many more steps than a calibration times, replaces it in the table and in the
    cache (unless another run replaced it there first: its figure then stands). Returns True
    when it was replaced. A cost measured by this run, or adopted from a stored
    tuning (`load_json`, a resumed run), is never checked. In a multi-process job process 0's
    timings decide for all (the point of the check, a count of steps, is the same in every
    process)."""
    seen = self._unchecked.get(key)
    if seen is None or factor <= 0 or iters <= 0:
      return False
    seen[2] += 1
    if seen[2] == 1:
      return False
    seen[0] += max(seconds - self._segment[key], 0.0)
    seen[1] += iters
    if seen[1] < steps:
      return False
    del self._unchecked[key]
    observed = _agreed((seen[0] / seen[1], float(seen[1])))[0]
    cached = self._calibrated[key][0]  # (as the table uses it: `_set` may have lowered it)
    if cached / factor <= observed <= cached * factor:
      return False
    new = (observed, seen[3][1])
    if self.cache is not None and _process_index() == 0:
      new = self.cache.replace(key, seen[3], new)
    self._set(key, *_agreed(new))
    self.corrected[key] = {"bucket": key[-2], "draft_len": key[-1], "cached_step_s": cached,
                           "observed_step_s": observed, "observed_steps": seen[1]}
    _log.warning("engine cost cache %s: bucket %d, K %d: the cached %.2f ms per step is "
                 "contradicted by this run's %d steps at %.2f ms, which replace it",
                 self.cache.path if self.cache is not None else "(none)", key[-2], key[-1],
                 cached * 1e3, seen[1], observed * 1e3)
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
    first; weight iterations / (iterations + memory)."""
    if key not in self._step or iters <= 0 or memory <= 0:
      return
    per_step = max(seconds - self._segment.get(key, 0.0), 0.0) / iters
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
    return [{"key": _cost_key(k), "step_s": v, "segment_s": self._segment.get(k, 0.0),
             "calibrated_step_s": self._calibrated[k][0], "steps_measured": self._calibrated[k][1],
             "from_line": k in self._from_line} for k, v in self._step.items()]

  def load_json(self, rows: list[dict]) -> None:
    """Adopt stored costs (`to_json`); they replace the table's own for the same keys."""
    for r in rows:
      key = _parse_key(r["key"])
      self._step[key] = float(r["step_s"])
      self._segment[key] = float(r["segment_s"])
      self._calibrated[key] = [float(r["calibrated_step_s"]), int(r["steps_measured"])]
      self._unchecked.pop(key, None)
      if r.get("from_line"):
        self._from_line.add(key)
      else:
        self._from_line.discard(key)


@dataclasses.dataclass(eq=False)
class EngineTuning:
  """The engine's measured step costs and acceptance estimates, owned by whoever runs rollouts
  and passed as `tuning=` to every call that should reuse them."""

  costs: CostTable = dataclasses.field(default_factory=CostTable)
  estimates: AcceptanceEstimates = dataclasses.field(default_factory=AcceptanceEstimates)

  @classmethod
  def with_cache(cls, path: str) -> EngineTuning:
    """A tuning whose costs come from (and go to) the machine's cost cache at `path` ("off" or
    "": no cache)."""
    return cls(costs=CostTable(None if path in ("", "off") else CostCache(path)))

  def calibration_table(self) -> list[dict]:
    return self.costs.rows()

  def to_json(self) -> dict:
    """Costs and acceptance estimates as plain JSON (exact floats): `load_json` in another
    process continues with the very same K choices."""
    return {"format": TUNING_FORMAT, "costs": self.costs.to_json(),
            "estimates": self.estimates.to_json(estimate_key_digest)}

  def load_json(self, data: dict | None) -> None:
    """Adopt a stored tuning (`to_json`); None or {}: nothing to adopt."""
    if not data:
      return
    if data.get("format") != TUNING_FORMAT:
      raise ValueError(f"engine tuning of format {data.get('format')!r}; this version reads "
                       f"{TUNING_FORMAT}")
    self.costs.load_json(data.get("costs", []))
    self.estimates.load_json(data.get("estimates", {}), estimate_key_digest)


@functools.lru_cache(maxsize=64)
def estimate_key_digest(key: tuple) -> str:
  """Stable name of an acceptance estimate's key ((drafter, sampling config, graphdef))."""
  return stable_digest(*key)
