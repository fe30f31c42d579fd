"""Local datasets through the Hugging Face `datasets` library: JSON/JSONL and parquet files, a
`save_to_disk` directory, a directory of data files, or the hub cache layout (datasets--*/snapshots).

Nothing is downloaded: every source is a local path. Rows come back as (where, dict) pairs, where
`where` is "file:row" so that errors name the row at fault; a source that cannot be read is a
`UserError` naming it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Iterator

from specjax.errors import UserError

DATA_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}


def _data_files(folder: str) -> list[str]:
  found = []
  for root, dirs, files in os.walk(folder, followlinks=True):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    found += [os.path.join(root, f) for f in sorted(files)
              if os.path.splitext(f)[1] in DATA_SUFFIXES and not f.startswith(".")]
  return found


def _snapshot(repo_dir: str) -> str:
  """The snapshot of a hub cache repository (datasets--org--name): refs/main's, else the newest."""
  snaps = os.path.join(repo_dir, "snapshots")
  ref = os.path.join(repo_dir, "refs", "main")
  if os.path.exists(ref):
    with open(ref) as f:
      rev = f.read().strip()
    if os.path.isdir(os.path.join(snaps, rev)):
      return os.path.join(snaps, rev)
  revs = [os.path.join(snaps, r) for r in os.listdir(snaps)]
  if not revs:
    raise UserError(f"dataset: {snaps} has no snapshot")
  return max(revs, key=os.path.getmtime)


def _split_files(folder: str, split: str) -> list[str]:
  """The data files of `split` under `folder` (by file or directory name, as the hub names them:
  train-00000-of-00001.parquet, data/train.jsonl, ...); all files when none is named by a split."""
  files = _data_files(folder)
  if not files:
    raise UserError(f"dataset: no data file ({', '.join(DATA_SUFFIXES)}) under {folder}")

  def split_of(file):
    parts = os.path.relpath(file, folder).replace("-", "/").replace("_", "/").replace(".", "/")
    return [p for p in parts.split("/") if p in ("train", "test", "validation", "valid", "dev")]

  named = [f for f in files if split_of(f)]
  chosen = [f for f in files if split in split_of(f)] if named else files
  if not chosen:
    raise UserError(f"dataset: no data file of split {split!r} under {folder}; files: "
                    f"{[os.path.relpath(f, folder) for f in files][:8]}")
  dirs = sorted({os.path.dirname(f) for f in chosen})
  if len(dirs) > 1:
    raise UserError(f"dataset: {folder} holds several configurations for split {split!r} "
                    f"({[os.path.relpath(d, folder) for d in dirs]}); pass the directory of one")
  kinds = {DATA_SUFFIXES[os.path.splitext(f)[1]] for f in chosen}
  if len(kinds) > 1:
    raise UserError(f"dataset: mixed file types {sorted(kinds)} for split {split!r} under {folder}")
  return chosen


def _from_disk(path: str, split: str):
  import datasets

  ds = datasets.load_from_disk(path)
  if isinstance(ds, datasets.DatasetDict):
    if split not in ds:
      raise UserError(f"dataset: {path} has splits {sorted(ds)}, not {split!r}")
    ds = ds[split]
  return ds


def _json_lines(path: str) -> list[Any]:
  """Rows of a JSON-lines file parsed line by line (the fallback that names a bad line), or of a
  JSON file holding one list of rows."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  if path.endswith(".json") and text.lstrip().startswith("["):
    try:
      return json.loads(text)
    except json.JSONDecodeError as e:
      raise UserError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
  rows = []
  for i, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      raise UserError(f"{path}:{i}: invalid JSON ({e.msg})") from None
  return rows


def _check_parquet(path: str) -> None:
  """A damaged parquet file as an error naming it (the library would log and raise its own)."""
  import pyarrow.parquet as pq

  try:
    pq.read_schema(path)
  except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise UserError(f"{path}: not a readable parquet file ({reason})") from None


def _load_files(files: list[str], cache_dir: str | None):
  import datasets

  kind = DATA_SUFFIXES[os.path.splitext(files[0])[1]]
  if kind == "arrow":
    return datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
  return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir)


def open_dataset(path: str, split: str = "train", cache_dir: str | None = None):
  """(datasets.Dataset or a list of rows, the file or directory named in errors) for `path`."""
  if not os.path.exists(path):
    raise UserError(f"dataset: {path} does not exist")
  if os.path.isdir(path):
    if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
      return _from_disk(path, split), path  # written by Dataset(Dict).save_to_disk
    folder = _snapshot(path) if os.path.isdir(os.path.join(path, "snapshots")) else path
    files = _split_files(folder, split)
    return _load_files(files, cache_dir), files[0] if len(files) == 1 else folder
  suffix = os.path.splitext(path)[1]
  if suffix not in DATA_SUFFIXES:
    raise UserError(f"dataset: {path}: unknown file type {suffix!r} "
                    f"(supported: {', '.join(DATA_SUFFIXES)}, or a directory)")
  if DATA_SUFFIXES[suffix] == "parquet":
    _check_parquet(path)
  if DATA_SUFFIXES[suffix] != "json":
    return _load_files([path], cache_dir), path
  try:
    with _quiet_datasets():
      return _load_files([path], cache_dir), path
  except Exception:  # noqa: BLE001 - the library's JSON errors name no line; find it ourselves
    return _json_lines(path), path


@contextlib.contextmanager
def _quiet_datasets():
  """Without the library's log lines and progress bars: a JSON file it cannot read is read again
  line by line (`_json_lines`), whose error names the line; the library's report of the same
  failure would only bury it."""
  from datasets.utils import logging as ds_logging, tqdm as ds_tqdm

  level, bars = ds_logging.get_verbosity(), not ds_tqdm.are_progress_bars_disabled()
  ds_logging.set_verbosity(logging.CRITICAL)
  ds_tqdm.disable_progress_bars()
  try:
    yield
  finally:
    ds_logging.set_verbosity(level)
    if bars:
      ds_tqdm.enable_progress_bars()


def columns(ds) -> list[str]:
  if isinstance(ds, list):
    return sorted({k for row in ds if isinstance(row, dict) for k in row})
  return list(ds.column_names)


def iter_dataset_rows(path: str, split: str = "train",
                      cache_dir: str | None = None) -> Iterator[tuple[str, Any]]:
  """(where, row) for every row of the dataset at `path` (see `open_dataset`)."""
  ds, source = open_dataset(path, split, cache_dir)
  for i, row in enumerate(ds, 1):
    yield f"{source}:{i}", row
