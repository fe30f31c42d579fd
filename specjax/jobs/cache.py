"""The experiment's cache under `ExperimentConfig.cache_dir` (base policies, offline drafts, and
XLA's compiled programs): entry keys from the configs that determine an entry, and entries
written whole or not at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable

import numpy as np

from specjax.models.export import write_dir_atomically


def cache_key(*parts: Any) -> str:
  """A short digest of configs (dataclasses) and plain values: equal inputs, equal entry."""
  blob = json.dumps([dataclasses.asdict(p) if dataclasses.is_dataclass(p) else p for p in parts],
                    sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:12]


def task_key(task_cfg) -> dict:
  """The part of a TaskConfig that what the cache holds depends on: all of it but pool_size
  (which of the task's prompts RL trains on, never what a base or a draft is trained on)."""
  return {k: v for k, v in dataclasses.asdict(task_cfg).items() if k != "pool_size"}


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


def use_compile_cache(cache_dir: str) -> str:
  """Keep XLA's compiled programs in `<cache_dir>/xla` (JAX's persistent compilation cache), so a
  second run of a job, or a resumed one, loads the programs its first rollout and train step
  would otherwise compile. A cache directory already set (`JAX_COMPILATION_CACHE_DIR`, or
  `jax_compilation_cache_dir` in the process) is kept. Returns the directory in use. Entries are
  keyed by the program and the compiler (JAX's own key): a changed program compiles anew."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  path = os.path.abspath(os.path.join(cache_dir, "xla"))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  compilation_cache.reset_cache()  # (JAX decides at its first compile whether a cache is used)
  return path
