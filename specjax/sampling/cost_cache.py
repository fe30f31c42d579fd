"""Where the rollout engine's measured step costs are kept between runs, and the checks every cost
passes before any run uses one.

`CostCache`: one JSON file of (step, segment) seconds per (program, bucket, K), shared by the runs
of a machine. `RunCosts`: the costs one run reads, fixed for the run: a snapshot of the machine's
file taken when the run starts (on resume, the run's own copy of it), plus what the run measured,
kept in the run directory so that a resumed run reads what the uninterrupted one read, whatever
the machine's file holds by then. `cost_problem` and `implausible_keys`: a cost is positive,
finite, below `MAX_COST_S` and in line with its program's other costs, or it is dropped (one
warning naming the file and key) and measured again. A measured cost can come out 0 or absurd on
a loaded machine; no such figure is stored, read or used.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import tempfile
from typing import Any

COSTS_FORMAT = 1
MIN_STEP_S = 1e-6  # no decode step of any model takes under a microsecond (a launch alone does)
MAX_COST_S = 600.0  # no step, prefill or segment overhead of a rollout takes ten minutes
# a step at more rows or a longer draft costs no less than 1 / COST_SLACK of one at fewer, and no
# more than COST_SLACK times its share of the work (rows x verified positions) over it
COST_SLACK = 4.0
_log = logging.getLogger(__name__)

COST_CACHE_ENV = "SPECJAX_COST_CACHE"  # overrides the default cost cache path ("off": none)
Costs = tuple[float, float]  # (seconds per step, fixed seconds per segment)


def default_cost_cache_path() -> str:
  """$SPECJAX_COST_CACHE, else <$XDG_CACHE_HOME or ~/.cache>/specjax/engine_costs.json."""
  if os.environ.get(COST_CACHE_ENV):
    return os.environ[COST_CACHE_ENV]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "specjax", "engine_costs.json")


def cost_key(key: tuple) -> str:
  """'program/bucket/K' of a (program id, bucket, K) key."""
  return "/".join(str(x) for x in key)


def parse_key(text: str) -> tuple:
  program, bucket, k = text.rsplit("/", 2)
  return (program, int(bucket), int(k))


def cost_problem(value: Any) -> str | None:
  """Why `value` is no (step seconds, segment seconds) pair a run may use; None if it is one."""
  if not isinstance(value, (list, tuple)) or len(value) != 2:
    return f"{value!r} is not a [step seconds, segment seconds] pair"
  for name, v in zip(("step", "segment"), value):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      return f"its {name} cost {v!r} is not a finite number"
  step, segment = value
  if step < MIN_STEP_S:
    return f"its step cost {step!r} s is not positive" if step <= 0 else \
        f"its step cost {step!r} s is under {MIN_STEP_S:g} s"
  if segment < 0:
    return f"its segment cost {segment!r} s is negative"
  if max(step, segment) > MAX_COST_S:
    return f"a cost of {max(step, segment):.4g} s is over {MAX_COST_S:.0f} s"
  return None


def _work(key: tuple) -> int:
  return key[-2] * (key[-1] + 1)


def _dominates(b: tuple, a: tuple) -> bool:
  return b[-2] >= a[-2] and b[-1] >= a[-1]


def _conflict(a: tuple, cost_a: float, b: tuple, cost_b: float) -> bool:
  """Step costs of two (bucket, K) of one program out of line with each other: the one at no
  fewer rows and no shorter a draft costs under the other's / COST_SLACK, or over the other's
  times its share of the work times COST_SLACK. Keys neither of which dominates: no conflict."""
  if _dominates(a, b):
    a, cost_a, b, cost_b = b, cost_b, a, cost_a
  elif not _dominates(b, a):
    return False
  return cost_b < cost_a / COST_SLACK or cost_b > cost_a * _work(b) / _work(a) * COST_SLACK


def plausible_range(key: tuple, costs: dict[tuple, float]) -> tuple[float, float]:
  """(lo, hi): the step costs of `key` in line (`_conflict`) with the others of its program in
  `costs`. A run keeps its own timings within it, so that what it stores passes a later run's
  check (`implausible_keys`) and that run uses the very costs this one did."""
  lo, hi = MIN_STEP_S, MAX_COST_S
  if key[-1] < 0:
    return lo, hi
  for other, cost in costs.items():
    if other == key or other[:-2] != key[:-2] or other[-1] < 0:
      continue
    if _dominates(key, other):
      lo = max(lo, cost / COST_SLACK)
      hi = min(hi, cost * _work(key) / _work(other) * COST_SLACK)
    elif _dominates(other, key):
      lo = max(lo, cost * _work(key) / _work(other) / COST_SLACK)
      hi = min(hi, cost * COST_SLACK)
  return lo, max(lo, hi)


def implausible_keys(step_costs: dict[tuple, float],
                     trusted: dict[tuple, float] | None = None) -> dict[tuple, str]:
  """{key: why} of the step costs (K >= 0; a queue's refill costs, K = -1, are left alone) out of
  line with the other costs of their program (`_conflict`): the key in the most conflicts goes
  first, then the next, until none is left (two keys in one conflict and no third to side with
  either: both go). Costs in `trusted` (measured by this run) are compared with but never
  dropped."""
  trusted = trusted or {}
  live = {k: v for k, v in step_costs.items() if k[-1] >= 0 and k not in trusted}
  dropped: dict[tuple, str] = {}
  while True:
    pool = {**{k: v for k, v in trusted.items() if k[-1] >= 0}, **live}
    count: dict[tuple, list] = {}
    for a in live:
      for b, cost_b in pool.items():
        if b != a and b[:-2] == a[:-2] and _conflict(a, live[a], b, cost_b):
          count.setdefault(a, []).append(b)
    if not count:
      return dropped
    worst = max(len(v) for v in count.values())
    for k, against in count.items():
      if len(against) == worst:
        other = against[0]
        dropped[k] = (f"its step cost {live[k] * 1e3:.4g} ms is out of line with "
                      f"{pool[other] * 1e3:.4g} ms at bucket {other[-2]}, K {other[-1]}")
    for k in dropped:
      live.pop(k, None)


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


class CostCacheError(OSError):
  """The machine's engine cost cache could not be read or written."""


def read_costs(path: str, what: str, warn: bool = True) -> dict[str, list] | None:
  """The raw {key: value} entries of a costs file; None when there is none. A file that is not
  one (damaged, another format) gives a one-line warning naming it (`warn`), and no entries."""
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    return None
  except (ValueError, UnicodeDecodeError) as e:
    if warn:
      _log.warning("%s %s is damaged (%s): its costs are measured anew", what, path, e)
    return {}
  except OSError as e:
    raise CostCacheError(e.errno, f"{what} {path}: {e.strerror}") from None
  if not isinstance(data, dict) or data.get("format") != COSTS_FORMAT or \
      not isinstance(data.get("costs"), dict):
    if warn:
      _log.warning("%s %s is not a costs file of format %d: its costs are measured anew", what,
                   path, COSTS_FORMAT)
    return {}
  return data["costs"]


def valid_entries(raw: dict[str, Any], path: str, what: str,
                  left_out: dict[tuple, Any] | None = None,
                  relative: bool = True) -> dict[tuple, Costs]:
  """The entries of `raw` that pass `cost_problem` and (`relative`) `implausible_keys`; each
  other one is left out with a one-line warning naming the file and key (and put in `left_out`,
  when given, as it was)."""
  out: dict[tuple, Costs] = {}
  left_out = {} if left_out is None else left_out
  for name, value in raw.items():
    try:
      key = parse_key(name)
    except ValueError:
      _log.warning("%s %s: key %r is no program/bucket/K: left out", what, path, name)
      continue
    why = cost_problem(value)
    if why is not None:
      _log.warning("%s %s: %s left out and measured again: %s", what, path, name, why)
      left_out[key] = value
      continue
    out[key] = (float(value[0]), float(value[1]))
  checked = implausible_keys({k: v[0] for k, v in out.items()}) if relative else {}
  for key, why in checked.items():
    _log.warning("%s %s: %s left out and measured again: %s", what, path, cost_key(key), why)
    left_out[key] = out.pop(key)
  return out


class CostCache:
  """The measured (step, segment) seconds of (program, bucket, K), in one JSON file shared by the
  runs of a machine. `put` keeps the first valid value written (under a file lock): runs that
  measure the same key at once all adopt the one that reached the file first. An entry that is
  no valid cost (`cost_problem`) counts as absent and is written over. A damaged file is read
  as empty (one warning naming it) and written anew."""

  WHAT = "engine cost cache"

  def __init__(self, path: str):
    self.path = os.path.abspath(os.path.expanduser(path))

  def entries(self, left_out: dict[tuple, Any] | None = None) -> dict[tuple, Costs]:
    """Every valid entry; each invalid one is left out with a warning (`valid_entries`)."""
    return valid_entries(read_costs(self.path, self.WHAT) or {}, self.path, self.WHAT, left_out)

  def put(self, key: tuple, costs: Costs, stale: Costs | None = None) -> Costs:
    """Store `costs` for `key` unless the file has a valid value for it already (that value then
    stays) or holds `stale` there (a figure found wrong: it is replaced); returns the value the
    file holds for `key` afterwards."""
    import fcntl

    if cost_problem(costs) is not None:
      raise ValueError(f"{self.WHAT} {self.path}: refusing to store {cost_key(key)} = {costs}: "
                       f"{cost_problem(costs)}")
    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      with open(self.path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # (damage is reported where the file is read for use)
        entries = read_costs(self.path, self.WHAT, warn=False) or {}
        name = cost_key(key)
        held = entries.get(name)
        if held is None or cost_problem(held) is not None or \
            (stale is not None and tuple(map(float, held)) == tuple(map(float, stale))):
          entries[name] = [float(costs[0]), float(costs[1])]
          write_json_atomic(self.path, {"format": COSTS_FORMAT, "costs": entries})
        return float(entries[name][0]), float(entries[name][1])
    except OSError as e:
      if isinstance(e, CostCacheError):
        raise
      raise CostCacheError(e.errno, f"{self.WHAT} {self.path}: "
                           f"{e.strerror or os.strerror(e.errno or errno.EIO)}") from None


class RunCosts:
  """The costs one run reads, fixed for the run, and what it measures.

  On `start` (or the first `get`) the machine's `CostCache` is read once, checked
  (`valid_entries`) and kept as this run's snapshot; with a run file (`start(path)`), the
  snapshot is written there, and a run that resumes reads that file instead of the machine's,
  so it finds what the uninterrupted run found. Costs the run measures join the snapshot (and
  the file) and are offered to the machine's cache for later runs; the value another run stored
  there first is adopted, so runs measuring at once agree. Only process 0 reads and writes
  files (the engine agrees the values across processes)."""

  WHAT = "run's engine costs"

  def __init__(self, cache: CostCache | None = None):
    self.cache = cache
    self.path: str | None = None
    self._entries: dict[tuple, Costs] | None = None
    self._dropped: dict[tuple, Any] = {}  # keys left out of the snapshot: their stale value

  def start(self, path: str | None, resume: bool) -> None:
    """Take the run's snapshot now; `path`: the run's file (read when `resume` and present,
    else written from the machine's cache)."""
    self.path = path
    stored = read_costs(path, self.WHAT) if path and resume else None
    if stored is not None:  # (the costs the run used: only damage is left out)
      self._entries = valid_entries(stored, path, self.WHAT, relative=False)
    else:
      # (what the cache holds for a key left out, a measurement replaces there)
      self._entries = self.cache.entries(self._dropped) if self.cache is not None else {}
      self._save()

  def _snapshot(self) -> dict[tuple, Costs]:
    if self._entries is None:
      self.start(self.path, resume=False)
    return self._entries

  def get(self, key: tuple) -> Costs | None:
    return self._snapshot().get(key)

  def items(self) -> dict[tuple, Costs]:
    return dict(self._snapshot())

  def drop(self, key: tuple, why: str) -> None:
    """Leave `key` out of the snapshot (one warning) so it is measured again; the measurement
    then replaces the dropped value in the machine's cache too."""
    costs = self._snapshot().pop(key)
    self._dropped[key] = costs
    _log.warning("%s %s: %s left out and measured again: %s", self.WHAT,
                 self.path or (self.cache.path if self.cache else "(none)"), cost_key(key), why)
    self._save()

  def put(self, key: tuple, costs: Costs) -> Costs:
    """Record the run's measurement of `key` (or the valid one another run stored first in the
    machine's cache); returns the costs the run uses."""
    stale = self._dropped.pop(key, None)
    if cost_problem(stale) is not None:  # (the cache counts such an entry as absent anyway)
      stale = None
    if self.cache is not None:
      costs = self.cache.put(key, costs, stale)
    self._snapshot()[key] = costs
    self._save()
    return costs

  def correct(self, key: tuple, stale: Costs, costs: Costs) -> Costs:
    """Replace a cached figure this run found contradicted, in the machine's cache only (later
    runs read it; this run keeps its own); returns what the machine's cache holds now."""
    return self.cache.put(key, costs, stale) if self.cache is not None else costs

  def _save(self) -> None:
    if not self.path:
      return
    try:
      write_json_atomic(self.path, {"format": COSTS_FORMAT, "costs": {
          cost_key(k): list(v) for k, v in self._entries.items()}})
    except OSError as e:
      raise CostCacheError(e.errno, f"{self.WHAT} {self.path}: "
                           f"{e.strerror or os.strerror(e.errno or errno.EIO)}") from None
