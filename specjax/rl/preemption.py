"""Runs that survive a cluster: a scheduler's signal (SIGTERM, SIGINT, SLURM's SIGUSR1) stops the
loop at the next step boundary with a checkpoint, and periodic checkpoints (every N steps and
every M minutes of wall time) bound what a hard kill can lose.

A first signal only sets a flag: the step in flight finishes, the loops save a checkpoint of the
last finished step, flush the metrics and event logs and raise `Preempted` (the command-line jobs
exit with `PREEMPTED_EXIT_CODE`). A second signal exits at once (exit code 128 + the signal's
number), losing the step in flight but nothing already checkpointed. In a multi-process job every
process stops (and saves) at the same step: the stop flag and the wall-time decision are agreed
through the distributed runtime at each step boundary, never read from one process's own clock.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on a signal with a checkpoint; resume to go on
WRITE_FAILED_EXIT_CODE = 74  # EX_IOERR: a checkpoint or metrics write failed (disk full, ...)


class Preempted(Exception):
  """The run stopped on a signal after saving checkpoint `step`; `--resume` continues it."""

  def __init__(self, signal_name: str, step: int, checkpoint_dir: str):
    self.signal_name, self.step, self.checkpoint_dir = signal_name, step, checkpoint_dir
    super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {step} is in "
                     f"{checkpoint_dir}; resume the run to continue from it")


def signal_number(name: str) -> int:
  """signal.SIGTERM's number from "SIGTERM" (or "TERM"); ValueError naming unknown ones."""
  full = name if name.startswith("SIG") else f"SIG{name}"
  num = getattr(signal, full, None)
  if not isinstance(num, int) or full.startswith("SIG_"):
    raise ValueError(f"unknown signal {name!r}")
  return int(num)


class StopSignals:
  """Process-wide handlers of the stop signals, shared by every run of the process (the
  experiment's interleaved arms): the first signal sets `received`; the second exits at once.
  `acquire` / `release` count the runs using them; the last release restores the previous
  handlers. Handlers can only be installed from the main thread; elsewhere `acquire` returns
  None (the run then stops on signals as before: not at all, or by KeyboardInterrupt)."""

  _lock = threading.Lock()
  _instance: StopSignals | None = None

  def __init__(self, names: Sequence[str]):
    self.names = tuple(names)
    self.received: str | None = None
    self.received_at: float | None = None
    self.users = 0
    self._previous: dict[int, object] = {}

  @classmethod
  def acquire(cls, names: Sequence[str]) -> StopSignals | None:
    if not names or threading.current_thread() is not threading.main_thread():
      return None
    with cls._lock:
      if cls._instance is None:
        inst = cls(names)
        for name in inst.names:
          num = signal_number(name)
          inst._previous[num] = signal.signal(num, inst._handle)
        cls._instance = inst
      cls._instance.users += 1
      return cls._instance

  def release(self) -> None:
    with StopSignals._lock:
      self.users -= 1
      if self.users > 0 or StopSignals._instance is not self:
        return
      for num, previous in self._previous.items():
        signal.signal(num, previous)
      StopSignals._instance = None

  def _handle(self, signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if self.received is not None:
      os.write(2, f"specjax: second signal ({name}): exiting at once; the run resumes from its "
                  f"last checkpoint\n".encode())
      os._exit(128 + signum)
    self.received, self.received_at = name, time.monotonic()
    os.write(2, f"specjax: received {name}: finishing the step in flight, then saving a "
                f"checkpoint and exiting (send it again to exit at once)\n".encode())


def agree_any(flags: Sequence[bool]) -> list[bool]:
  """Each flag OR-ed over the processes of a multi-process job (an all-gather of a few ints,
  at a step boundary every process reaches); the flags themselves in a single process."""
  import jax

  if jax.process_count() == 1:
    return [bool(f) for f in flags]
  from jax.experimental import multihost_utils

  got = multihost_utils.process_allgather(np.asarray(flags, np.int32))
  return [bool(x) for x in np.asarray(got).reshape(-1, len(flags)).any(axis=0)]


class StepBoundary:
  """What a loop does after each finished step: save a checkpoint when `every` steps or
  `every_minutes` of wall time have passed since the last one (or a stop signal came), and stop
  on a signal. `poll(completed)` -> (save now, stop now), the same in every process."""

  def __init__(self, every: int, every_minutes: float, signals: StopSignals | None,
               clock: Callable[[], float] = time.monotonic):
    self.every, self.every_s = every, every_minutes * 60.0
    self.signals, self.clock = signals, clock
    self.last_save = clock()

  @property
  def signal_name(self) -> str | None:
    return None if self.signals is None else self.signals.received

  def poll(self, completed: int) -> tuple[bool, bool]:
    by_steps = bool(self.every) and completed % self.every == 0
    by_time = self.every_s > 0 and self.clock() - self.last_save >= self.every_s
    stop, by_time = agree_any([self.signal_name is not None, by_time])
    return by_steps or by_time or stop, stop

  def saved(self) -> None:
    self.last_save = self.clock()


def log_line(message: str) -> None:
  """One line on stderr (the command-line jobs' last word on a stop or a write failure)."""
  sys.stderr.write(message.rstrip("\n") + "\n")
  sys.stderr.flush()
