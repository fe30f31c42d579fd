"""What the experiment scripts show on the terminal: the library's progress lines (logged with
`logging`, INFO) on stdout, as plain lines; progress bars stay on stderr (tqdm).
"""

from __future__ import annotations

import logging
import sys

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
