"""What the experiment scripts show on the terminal: the library's progress lines (logged with
`logging`, INFO) on stdout, as plain lines; progress bars stay on stderr (tqdm); and how a run
ends (`run_main`: one line and an exit code for a user's mistake, a failed write, a stop).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
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


DEBUG_FLAG = "--debug"
DEBUG_ENV = "SPECJAX_DEBUG"


def debug_requested(argv: Sequence[str]) -> tuple[bool, list[str]]:
  """(whether the traceback of a user's mistake is wanted, `argv` without --debug): the flag
  before a lone `--` (what follows it is another program's), or SPECJAX_DEBUG=1."""
  args = list(argv)
  end = args.index("--") if "--" in args else len(args)
  own = [a for a in args[:end] if a != DEBUG_FLAG]
  debug = len(own) < end or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")
  return debug, own + args[end:]


def run_main(main: Callable[[list[str]], T], argv: Sequence[str] | None = None) -> T:
  """A job's command line: `main(args)` (sys.argv's arguments, less --debug), its config parsed
  inside, with the run's expected ends as one line on stderr and an exit code:

  - a user's mistake (`UserError`: a config value, a dataset line, a checkpoint, a path, a KV
    budget) exits with USER_ERROR_EXIT_CODE (2), as a bad flag does;
  - a failed checkpoint, metrics or engine cost write (`RunWriteError`, `CostCacheError`: disk
    full, permission, quota) with WRITE_FAILED_EXIT_CODE (74);
  - a stop on a signal (`Preempted`, checkpoint saved) with PREEMPTED_EXIT_CODE (75).

  With --debug or SPECJAX_DEBUG=1 the first two propagate with their tracebacks. Any other
  exception (a bug) always does."""
  from specjax.errors import USER_ERROR_EXIT_CODE, UserError
  from specjax.rl.metrics_log import RunWriteError
  from specjax.sampling.cost_cache import CostCacheError
  from specjax.rl.preemption import (
    PREEMPTED_EXIT_CODE,
    WRITE_FAILED_EXIT_CODE,
    Preempted,
    log_line,
  )

  debug, args = debug_requested(sys.argv[1:] if argv is None else argv)
  try:
    return main(args)
  except Preempted as e:
    log_line(f"specjax: {e}")
    raise SystemExit(PREEMPTED_EXIT_CODE) from None
  except UserError as e:
    if debug:
      raise
    log_line(f"specjax: error: {e}")
    raise SystemExit(USER_ERROR_EXIT_CODE) from None
  except (RunWriteError, CostCacheError) as e:
    if debug:
      raise
    log_line(f"specjax: error: {e}")
    raise SystemExit(WRITE_FAILED_EXIT_CODE) from None
