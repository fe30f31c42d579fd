"""Per-step metrics: JSONL with atomic line appends, TensorBoard scalars and a tqdm progress bar.

Each record is written as one complete line with a single `write` + flush + fsync; a crash can at
worst leave a torn final line, which `read_metrics` skips and reports and the next writer trims.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from typing import Any, Iterable

import numpy as np

METRICS_FILE = "metrics.jsonl"
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_KNOWN_CAUSES = ("No space left on device", "Disk quota exceeded", "Permission denied",
                 "Read-only file system", "Input/output error")


class RunWriteError(RuntimeError):
  """A checkpoint or metrics write of a run failed (no space, permission, quota). Its message is
  one line: what failed, the path, the cause and the last good checkpoint step."""

  def __init__(self, what: str, path: str, cause: str, last_good: int | None = None,
               checkpoint_dir: str = ""):
    self.what, self.path, self.cause = what, path, cause
    self.last_good, self.checkpoint_dir = last_good, checkpoint_dir
    super().__init__(self._message())

  def _message(self) -> str:
    if self.last_good is None:
      last = "no checkpoint of this run was written before it"
    else:
      where = f" in {self.checkpoint_dir}" if self.checkpoint_dir else ""
      last = (f"the last good checkpoint is step {self.last_good}{where}; resume the run to "
              f"continue from it")
    return f"{self.what} could not be written to {self.path}: {self.cause}; {last}"

  def with_last_good(self, step: int | None, checkpoint_dir: str) -> RunWriteError:
    self.last_good, self.checkpoint_dir = step, checkpoint_dir
    self.args = (self._message(),)
    return self

  def __str__(self) -> str:
    return self._message()


def write_cause(exc: BaseException) -> str:
  """The cause of a failed write in words ("No space left on device"), from the exception or
  its chain: an OSError's strerror, an errno in the text (tensorstore's os_error_code), a known
  phrase; else the exception's type and first line."""
  chain, e = [], exc
  while e is not None and e not in chain:
    chain.append(e)
    e = e.__cause__ or e.__context__
  for e in chain:
    if isinstance(e, OSError) and e.strerror:
      return e.strerror
  for e in chain:
    text = str(e)
    m = _OS_ERROR_CODE.search(text)
    if m:
      return os.strerror(int(m.group(1)))
    for phrase in _KNOWN_CAUSES:
      if phrase.lower() in text.lower():
        return phrase
  first = (str(exc).splitlines() or [""])[0][:200]
  return f"{type(exc).__name__}: {first}"


def _plain(v: Any) -> Any:
  if isinstance(v, (str, bool)) or v is None:
    return v
  if isinstance(v, dict):
    return {k: _plain(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [_plain(x) for x in v]
  a = np.asarray(v)
  if a.ndim == 0:
    return int(a) if np.issubdtype(a.dtype, np.integer) else float(a)
  return a.tolist()


def _trim_torn_tail(path: str) -> int:
  """Cut a final line that has no newline (a crash mid-append); returns the bytes removed."""
  if not os.path.exists(path):
    return 0
  with open(path, "rb+") as f:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
      return 0
    f.seek(size - 1)
    if f.read(1) == b"\n":
      return 0
    back = min(size, 1 << 20)
    f.seek(size - back)
    tail = f.read(back)
    cut = tail.rfind(b"\n")
    keep = size - back + cut + 1 if cut >= 0 else 0
    f.truncate(keep)
    return size - keep


def append_jsonl(path: str, record: dict) -> None:
  """Append one record as one line, durably (write + flush + fsync)."""
  line = (json.dumps(_plain(record), sort_keys=True) + "\n").encode()
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, line)
    os.fsync(fd)
  finally:
    os.close(fd)


def truncate_metrics(path: str, last_step: int) -> int:
  """Cut a metrics JSONL back to the records (and events) of steps <= `last_step`, atomically
  (a new file renamed over the old one): a resumed run then logs every later step exactly once.
  Returns the number of lines removed."""
  if not os.path.exists(path):
    return 0
  keep, removed = [], 0
  with open(path, "rb") as f:
    for raw in f:
      try:
        ok = raw.endswith(b"\n") and int(json.loads(raw).get("step", 0)) <= last_step
      except ValueError:
        ok = False  # a torn or corrupt line
      if ok:
        keep.append(raw)
      elif raw.strip():
        removed += 1
  if removed:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
      f.writelines(keep)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  return removed


def read_metrics(path: str, dedupe: bool = True, events: bool = False) -> list[dict]:
  """Per-step records of a metrics JSONL (or, with `events`, the event records); a torn or corrupt
  line is skipped with a warning. With `dedupe`, a step logged twice (a run resumed from an
  earlier checkpoint) keeps its last record."""
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  records, bad = [], []
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      try:
        records.append(json.loads(raw))
      except ValueError:
        bad.append(lineno)
  if bad:
    warnings.warn(f"read_metrics: skipped {len(bad)} torn/corrupt line(s) in {path}: {bad}")
  records = [r for r in records if ("event" in r) == events]
  if dedupe and not events:
    by_step: dict[Any, dict] = {}
    for r in records:
      by_step[r.get("step", id(r))] = r
    records = list(by_step.values())
  return records


class MetricsLogger:
  """JSONL + TensorBoard + progress bar for one run (appends when resuming)."""

  def __init__(self, log_dir: str, *, total_steps: int, initial_step: int = 0,
               tensorboard: bool = True, progress: bool = True, enabled: bool = True):
    self.enabled = enabled  # multi-host: only process 0 writes
    self.tb = self.bar = None
    self.path = os.path.join(log_dir, METRICS_FILE)
    if not enabled:
      return
    try:
      os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
      raise RunWriteError("metrics", log_dir, write_cause(e)) from e
    removed = _trim_torn_tail(self.path)
    if removed:
      warnings.warn(f"MetricsLogger: trimmed a torn final line ({removed} bytes) of {self.path}")
    if tensorboard:
      from tensorboardX import SummaryWriter

      self.tb = SummaryWriter(os.path.join(log_dir, "tb"))
    if progress:
      from tqdm.auto import tqdm

      # named by the run's directory: runs that take turns (the driver's arms) keep two bars
      name = os.path.basename(os.path.normpath(log_dir))
      self.bar = tqdm(total=total_steps, initial=initial_step, desc=f"rl {name}",
                      dynamic_ncols=True)

  def log(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), **_plain(metrics)}
    self._append(record)
    if self.tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and \
            math.isfinite(v):
          self.tb.add_scalar(k, v, step)
    if self.bar is not None:
      post = {}
      for key, short in (("reward/mean", "reward"), ("spec/acceptance_length", "acc_len"),
                         ("time/step", "step_s"), ("val/accuracy", "val")):
        if key in record and isinstance(record[key], (int, float)):
          post[short] = f"{record[key]:.3g}"
      self.bar.set_postfix(post, refresh=False)
      self.bar.update(1)

  def log_event(self, step: int, kind: str, **fields) -> None:
    """A non-metric record (e.g. a reward-function error) in the same JSONL."""
    if self.enabled:
      self._append({"step": int(step), "event": kind, **_plain(fields)})

  def _append(self, record: dict) -> None:
    try:
      append_jsonl(self.path, record)
    except OSError as e:
      raise RunWriteError(f"the metrics of step {record['step']}", self.path,
                          write_cause(e)) from e

  def close(self) -> None:
    if self.tb is not None:
      try:
        self.tb.flush()
        self.tb.close()
      except OSError as e:  # the JSONL holds every metric; TensorBoard's copy is a view of it
        warnings.warn(f"MetricsLogger: closing the TensorBoard log failed ({write_cause(e)})")
      self.tb = None
    if self.bar is not None:
      self.bar.close()
      self.bar = None


def mean_metrics(records: Iterable[dict], key: str) -> float:
  vals = [r[key] for r in records if key in r]
  return float(np.mean(vals)) if vals else float("nan")
