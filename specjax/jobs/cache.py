"""The experiment's cache under `ExperimentConfig.cache_dir` (base policies, offline drafts): entry
keys from the configs that determine an entry, and entries written whole or not at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable

import numpy as np

from specjax.models.export import write_dir_atomically


def cache_key(*parts: Any) -> str:
  """A short digest of configs (dataclasses) and plain values: equal inputs, equal entry."""
  blob = json.dumps([dataclasses.asdict(p) if dataclasses.is_dataclass(p) else p for p in parts],
                    sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:12]


def params_fingerprint(params) -> float:
  """A cheap content key of a policy's params: the sum of its first leaves. Why: a draft trained
  on one policy must not be reused for another policy of the same config."""
  import jax

  return float(sum(float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(params)[:8]))


def write_cache_entry(path: str, write: Callable[[str], object]) -> str:
  """`write(tmp)` into a temporary sibling of `path`, then renamed into place: a crash never leaves
  half an entry. Replacing an existing entry is explicit here because cache entries belong to
  the cache (rebuilt with --fresh), never to the user."""
  return write_dir_atomically(path, write, overwrite=True, who="cache")
