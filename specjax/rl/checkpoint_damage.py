"""When a checkpoint is provably damaged: what orbax writes into a finalized step directory, and
which failures of a restore its files prove to be damage (a file of its own missing, one that
does not parse, decode or is shorter than its manifest says) rather than a transient error."""

from __future__ import annotations

import json
import os
import re

COMMITTED_MARKER = "_CHECKPOINT_METADATA"  # orbax writes it last into a finalized step dir

# What orbax writes into a finalized step dir of this Checkpointer: the commit marker (JSON), the
# meta item (one JSON file) and the state item, its tree metadata (JSON) and an OCDBT database:
# a manifest naming data files under state/d/ (the per-process databases are merged into it
# when the save finalizes). A restore reads the meta file, the manifest and the data files.
STEP_JSON_FILES = (COMMITTED_MARKER, "meta/metadata", "state/_METADATA")
OCDBT_MANIFEST = "state/manifest.ocdbt"
# a file named in an error of tensorstore (orbax's array store)
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')
_STORE_KEY = re.compile(r'"([^"]+)" in OCDBT database')


def _store_damage(step_dir: str, error: BaseException) -> str | None:
  """Which of the step's array files tensorstore found missing, truncated or undecodable, from
  `error` or the errors it chains; None for any other failure. tensorstore names the file and
  a status: DATA_LOSS or "Error decoding" (a manifest or data file that does not decode),
  OUT_OF_RANGE on a byte range past a file's end (one shorter than its manifest says) and
  NOT_FOUND (checked: the file is gone, or the manifest lacks the array). Its other statuses (an
  I/O error, a permission, a full or unavailable store) prove nothing about the checkpoint."""
  root = os.path.realpath(step_dir) + os.sep
  rel = lambda f: os.path.relpath(f, step_dir) + ("/" if f.endswith("/") else "")
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    msg = str(error)
    files = [f for f in _LOCAL_FILE.findall(msg)
             if (os.path.realpath(f) + os.sep).startswith(root)]
    if files:  # the innermost file named is the one that failed
      if msg.startswith("DATA_LOSS:") or "Error decoding" in msg:
        return f"{rel(files[-1])} does not decode"
      if msg.startswith("OUT_OF_RANGE:") and "is not valid for value of size" in msg:
        return f"{rel(files[-1])} is shorter than its manifest says"
      if msg.startswith("NOT_FOUND:"):
        gone = [f for f in files if not os.path.exists(f)]
        if gone:
          return f"{rel(gone[-1])} is missing"
        key = _STORE_KEY.search(msg)
        if key and "does not exist" in msg:
          return f"the array store {rel(files[-1])} lacks {key.group(1)}"
    error = error.__cause__ or error.__context__
  return None


def step_damage(d: str, error: BaseException) -> str | None:
  """Why the step directory `d` is damaged, as its files show after `error` while restoring it;
  None when nothing proves it (the error may be transient: an I/O error, a sharding error)."""
  parsed = {}
  try:
    for rel in STEP_JSON_FILES:
      path = os.path.join(d, rel)
      if not os.path.isfile(path):
        return f"{rel} is missing"
      with open(path, "rb") as f:
        raw = f.read()
      try:
        parsed[rel] = json.loads(raw)
      except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return f"{rel} does not parse: {e}"
    ocdbt = not isinstance(parsed["state/_METADATA"], dict) or \
        parsed["state/_METADATA"].get("use_ocdbt", True)
    if ocdbt and not os.path.isfile(os.path.join(d, OCDBT_MANIFEST)):
      return f"{OCDBT_MANIFEST} is missing"
  except OSError:  # the files cannot be read now: no proof either way
    return None
  return _store_damage(d, error)
