"""What the experiment scripts show on the terminal: the library's progress lines (logged with
`logging`, INFO) on stdout, as plain lines; progress bars stay on stderr (tqdm).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PACKAGE = "specjax"


class _StdoutHandler(logging.StreamHandler):
  """Writes to whatever sys.stdout is at the time of the record (not at setup), so that output
  redirected or captured after setup still gets the lines."""

  def __init__(self):
    super().__init__(sys.stdout)
    self.setFormatter(logging.Formatter("%(message)s"))

  @property
  def stream(self):
    return sys.stdout

  @stream.setter
  def stream(self, _):
    pass


def setup_logging(level: int = logging.INFO) -> None:
  """Show specjax's log lines at `level` and above on stdout, exactly as logged ("%(message)s").
  Idempotent: a script's main may call it on every run; the lines do not also reach the root
  logger's handlers (each line appears once)."""
  logger = logging.getLogger(PACKAGE)
  logger.setLevel(level)
  if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
    logger.addHandler(_StdoutHandler())
  logger.propagate = False


def exit_on_stop(run: Callable[[], T]) -> T:
  """`run()`, with the run's expected ends turned into one line on stderr and an exit code: a
  stop on a signal (`Preempted`, checkpoint saved) exits with PREEMPTED_EXIT_CODE (75), a failed
  checkpoint or metrics write (`RunWriteError`: disk full, permission, quota) with
  WRITE_FAILED_EXIT_CODE (74). Other errors propagate as they are."""
  from specjax.rl.metrics_log import RunWriteError
  from specjax.rl.preemption import (
    PREEMPTED_EXIT_CODE,
    WRITE_FAILED_EXIT_CODE,
    Preempted,
    log_line,
  )

  try:
    return run()
  except Preempted as e:
    log_line(f"specjax: {e}")
    raise SystemExit(PREEMPTED_EXIT_CODE) from None
  except RunWriteError as e:
    log_line(f"specjax: error: {e}")
    raise SystemExit(WRITE_FAILED_EXIT_CODE) from None
