"""Writing a benchmark's results: standard library only, so a peer's worker running in its own
virtual environment (without specjax) can use it too."""

from __future__ import annotations

import json
import os
import tempfile


def write_json(path: str, obj) -> None:
  """Atomic: a temp file in the same folder, then os.replace (a crash leaves the old file)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(obj, f, indent=1, default=float)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
