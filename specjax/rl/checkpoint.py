"""Checkpoints of an RL run with orbax: train state (policy, draft, both optimizer states), step,
RNG key and data position; atomic writes (orbax's tmp dir + rename), the last N kept.

The state is stored as a flat list of arrays plus its tree paths (checked on restore), so any
pytree (nnx.State, optax states) round-trips; restore places arrays with the template's shardings.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Any

import jax
import numpy as np

COMMITTED_MARKER = "_CHECKPOINT_METADATA"  # orbax writes it last into a finalized step dir


class CheckpointMismatch(ValueError):
  """The checkpoint holds a differently structured train state (another model/draft/optimizer)."""


def _flat(tree: Any) -> tuple[list[str], list[Any]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [jax.tree_util.keystr(p) for p, _ in leaves], [x for _, x in leaves]


class Checkpointer:
  """Periodic/exit checkpoints of one run directory; resumes from the newest good checkpoint."""

  def __init__(self, directory: str, keep: int = 3):
    import orbax.checkpoint as ocp

    self.ocp = ocp
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    self._quarantine_incomplete()
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False,
                                           create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  # -- bookkeeping ---------------------------------------------------------------------------
  def _step_dirs(self) -> list[int]:
    return sorted(int(n) for n in os.listdir(self.directory)
                  if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))

  def _complete(self, step: int) -> bool:
    d = os.path.join(self.directory, str(step))
    return all(os.path.exists(os.path.join(d, f)) for f in (COMMITTED_MARKER, "meta", "state"))

  def _quarantine_incomplete(self) -> None:
    """Move step dirs that were never finalized (a crash while something wrote them) out of the
    way, so they neither shadow the last good checkpoint nor block a later save of that step."""
    for step in self._step_dirs():
      if not self._complete(step):
        src = os.path.join(self.directory, str(step))
        dst = os.path.join(self.directory, f"incomplete-{step}-{int(time.time() * 1e3)}")
        warnings.warn(f"Checkpointer: step dir {src} is incomplete; moved to {dst}")
        os.rename(src, dst)

  def steps(self) -> list[int]:
    return [s for s in self.manager.all_steps() if self._complete(s)]

  def latest_step(self) -> int | None:
    steps = self.steps()
    return max(steps) if steps else None

  # -- save / restore ------------------------------------------------------------------------
  def save(self, step: int, state: Any, *, rng: jax.Array, data_position: int,
           extra: dict | None = None) -> bool:
    """Write checkpoint `step` (skipped if it already exists); blocks until it is committed."""
    if step in self.manager.all_steps():
      return False
    paths, leaves = _flat(state)
    arrays = {f"{i:06d}": x for i, x in enumerate(leaves)}
    meta = {"step": int(step), "data_position": int(data_position), "paths": paths,
            "rng": np.asarray(jax.device_get(rng)).tolist(), "time": time.time(),
            "extra": json.loads(json.dumps(extra or {}, default=str))}
    args = self.ocp.args
    self.manager.save(step, args=args.Composite(state=args.StandardSave(arrays),
                                                meta=args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()
    return True

  def _restore_step(self, step: int, template: Any) -> tuple[Any, dict]:
    paths, leaves = _flat(template)

    def abstract(x):
      x = x if hasattr(x, "dtype") else np.asarray(x)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    args = self.ocp.args
    meta = dict(self.manager.restore(step, args=args.Composite(meta=args.JsonRestore()))["meta"])
    if meta["paths"] != paths:
      diff = next((f"{a} != {b}" for a, b in zip(meta["paths"], paths) if a != b),
                  f"{len(meta['paths'])} leaves saved vs {len(paths)} in the template")
      raise CheckpointMismatch(f"checkpoint {step} in {self.directory} does not match the current "
                               f"train state ({diff}): different model, draft or optimizer config?")
    target = {f"{i:06d}": abstract(x) for i, x in enumerate(leaves)}
    out = self.manager.restore(step, args=args.Composite(state=args.StandardRestore(target)))
    restored = [out["state"][f"{i:06d}"] for i in range(len(leaves))]
    treedef = jax.tree_util.tree_structure(template)
    meta["rng"] = np.asarray(meta["rng"], np.uint32)
    return jax.tree_util.tree_unflatten(treedef, restored), meta

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict] | None:
    """(state, meta) of `step`, or of the newest checkpoint that restores (a broken one is
    reported and skipped); None when there is none. `template` gives structure and shardings."""
    if step is not None:
      return self._restore_step(step, template)
    for s in sorted(self.steps(), reverse=True):
      try:
        return self._restore_step(s, template)
      except CheckpointMismatch:
        raise
      except Exception as e:  # noqa: BLE001 - a damaged checkpoint: fall back to an older one
        warnings.warn(f"Checkpointer: checkpoint {s} in {self.directory} does not restore "
                      f"({type(e).__name__}: {e}); trying an older one")
    return None

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
