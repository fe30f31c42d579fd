"""Checkpoints of an RL run with orbax: train state (policy, draft, both optimizer states), step,
RNG key and data position; atomic writes (orbax's tmp dir + rename), the last N kept.

The state is stored as a flat list of arrays plus its tree paths (checked on restore), so any
pytree (nnx.State, optax states) round-trips; restore places arrays with the template's shardings.
Each checkpoint carries its run's identity (the configuration that determines the trajectory and
its digest): a run refuses another run's checkpoints. A save never skips: saving a step that
already exists is an error (`CheckpointExists`), and a state with a non-finite value is refused
(`NonFiniteState`). A restore falls back to an older checkpoint only past one that is provably
damaged (`DamagedCheckpoint`: a file of its own missing, or one that does not parse or decode);
any other failure (an I/O error, a sharding error) stops the run with that error, nothing moved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from typing import Any

import jax
import numpy as np

from specjax.errors import UserError
from specjax.rl.checkpoint_damage import COMMITTED_MARKER, step_damage
from specjax.rl.metrics_log import RunWriteError, write_cause

META_KEYS = ("step", "data_position", "paths", "rng", "extra")  # what a restore reads of meta

# RLConfig fields that do not change the trajectory of a run: where and how often it is saved,
# logged and validated, how long it runs (see `run_identity` for the schedules) and the mesh
RUN_IDENTITY_EXCLUDES = ("checkpoint", "validation", "log_dir", "progress", "tensorboard", "mesh",
                         "use_mesh", "steps", "rollout.cost_cache")


class CheckpointMismatch(UserError):
  """The checkpoint holds a differently structured train state (another model/draft/optimizer),
  or belongs to another run (a different trajectory-determining configuration)."""


class CheckpointExists(UserError):
  """A checkpoint of this step is already in the directory; saves never skip or overwrite."""


class NonFiniteState(ValueError):
  """The train state to save holds NaN or infinite values; such a state is never checkpointed."""


class DamagedCheckpoint(UserError):
  """A checkpoint with a file of its own missing or unreadable (a JSON file that does not parse,
  a manifest or data file that does not decode or is shorter than its manifest says, an array
  its store lacks). `restore` sets such a checkpoint aside and falls back to an older one."""

  def __init__(self, step: int, directory: str, reason: str):
    self.step, self.directory, self.reason = step, directory, reason
    super().__init__(f"checkpoint {step} in {directory} is damaged ({reason})")


class CheckpointWriteError(RunWriteError):
  """A checkpoint could not be written (no space, permission, quota); its partial directory was
  removed and the earlier checkpoints are untouched."""


def _without(config: dict, dotted: str) -> None:
  head, _, rest = dotted.partition(".")
  if not rest:
    config.pop(head, None)
  elif isinstance(config.get(head), dict):
    _without(config[head], rest)


def _plain_json(x: Any) -> Any:
  return json.loads(json.dumps(x, sort_keys=True, default=str))


def run_identity(cfg: Any, **extra: Any) -> dict:
  """The identity of a run: the fields of its config (a dataclass) that determine its trajectory
  plus `extra` (e.g. the async config), and their digest. `steps` is left out on purpose: a run
  may be extended on resume (its learning-rate schedules then span the new total)."""
  config = dataclasses.asdict(cfg)
  for name in RUN_IDENTITY_EXCLUDES:
    _without(config, name)
  config.update(extra)
  config = _plain_json(config)
  digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
  return {"digest": digest, "config": config}


def _flat_dict(d: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(d, dict):
    return {prefix: d}
  out = {}
  for k, v in d.items():
    out.update(_flat_dict(v, f"{prefix}.{k}" if prefix else str(k)))
  return out


def identity_diff(saved: dict, current: dict, limit: int = 5) -> str:
  """The first differing fields of two run identities, as `field: saved -> current`."""
  a, b = _flat_dict(saved.get("config", {})), _flat_dict(current.get("config", {}))
  diffs = [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
           for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]
  more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
  return "; ".join(diffs[:limit]) + more


def nonfinite_leaves(tree: Any, limit: int = 3) -> list[str]:
  """Tree paths of floating-point leaves that hold NaN or infinite values (at most `limit`)."""
  import jax.numpy as jnp

  bad = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact) and \
        not bool(jnp.isfinite(x).all()):
      bad.append(jax.tree_util.keystr(path))
      if len(bad) >= limit:
        break
  return bad


# a save is refused up front when the disk has less than this share of the state's bytes (orbax
# compresses: the Adam moments of a young run shrink several times) plus this margin; a write
# that fails anyway is cleaned up and reported the same way
SPACE_SHARE, SPACE_MARGIN = 0.25, 256 << 10


def _quiet_failed_writes() -> None:
  """After a failed orbax save, its writes still in flight fail one by one in background threads,
  each reported with a traceback (asyncio's "exception was never retrieved", tensorstore's
  callbacks into a closed event loop). The run is ending with one clear error: silence them."""
  import sys

  for name in ("absl", "asyncio", "concurrent.futures"):
    logging.getLogger(name).setLevel(logging.CRITICAL + 1)
  previous = sys.excepthook
  if getattr(previous, "_specjax_quiet", False):
    return

  def hook(kind, value, tb):
    if isinstance(value, RuntimeError) and "Event loop is closed" in str(value):
      return
    previous(kind, value, tb)

  hook._specjax_quiet = True
  sys.excepthook = hook


def _sync_processes(name: str) -> None:
  """Barrier across the processes of a multi-process job (a no-op in a single process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _flat(tree: Any) -> tuple[list[str], list[Any]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [jax.tree_util.keystr(p) for p, _ in leaves], [x for _, x in leaves]


class Checkpointer:
  """Periodic/exit checkpoints of one run directory; resumes from the newest good checkpoint."""

  def __init__(self, directory: str, keep: int = 3, identity: dict | None = None):
    """`identity` (`run_identity`) is written into every checkpoint and checked on restore."""
    import orbax.checkpoint as ocp

    self.ocp = ocp
    self.identity = identity
    self.directory = os.path.abspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:
      raise CheckpointWriteError("the checkpoint directory", self.directory, write_cause(e)) \
          from e
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

  def _move_aside(self, step: int, why: str) -> str:
    src = os.path.join(self.directory, str(step))
    dst = os.path.join(self.directory, f"{why}-{step}-{int(time.time() * 1e3)}")
    os.rename(src, dst)
    return dst

  def _quarantine_incomplete(self) -> None:
    """Move step dirs that were never finalized (a crash while something wrote them) out of the
    way, so they neither shadow the last good checkpoint nor block a later save of that step.
    Process 0 moves them (every process sees the same directory; a second rename of the same
    dir fails), the others wait until it has."""
    if jax.process_index() == 0:
      for step in self._step_dirs():
        if not self._complete(step):
          dst = self._move_aside(step, "incomplete")
          warnings.warn(f"Checkpointer: step dir {self.directory}/{step} is incomplete; moved to "
                        f"{dst}")
    _sync_processes(f"specjax checkpointer open {self.directory}")

  def steps(self) -> list[int]:
    return [s for s in self.manager.all_steps() if self._complete(s)]

  def latest_step(self) -> int | None:
    steps = self.steps()
    return max(steps) if steps else None

  # -- save / restore ------------------------------------------------------------------------
  def save(self, step: int, state: Any, *, rng: jax.Array, data_position: int,
           extra: dict | None = None) -> bool:
    """Write checkpoint `step`; blocks until it is committed. Raises `CheckpointExists` if the
    directory already holds step `step` (callers save each step once: a save never skips), and
    `NonFiniteState` if the state holds NaN or infinite values."""
    if step in self.manager.all_steps() or os.path.exists(os.path.join(self.directory, str(step))):
      raise CheckpointExists(f"checkpoint {step} already exists in {self.directory}; a save never "
                             f"overwrites (is another run writing to this directory?)")
    bad = nonfinite_leaves(state)
    if bad:
      raise NonFiniteState(f"refusing to checkpoint step {step} in {self.directory}: the train "
                           f"state holds non-finite values (in {', '.join(bad)})")
    paths, leaves = _flat(state)
    arrays = {f"{i:06d}": x for i, x in enumerate(leaves)}
    meta = {"step": int(step), "data_position": int(data_position), "paths": paths,
            "rng": np.asarray(jax.device_get(rng)).tolist(), "time": time.time(),
            "extra": _plain_json(extra or {}), "identity": self.identity}
    self._check_space(step, leaves)
    args = self.ocp.args
    # orbax reports a failed write from each of its threads (absl ERROR lines with tracebacks)
    # before the save raises it: quiet while saving; the error raised below says it in one line
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
      self.manager.save(step, args=args.Composite(state=args.StandardSave(arrays),
                                                  meta=args.JsonSave(meta)), force=True)
      self.manager.wait_until_finished()
    except Exception as e:  # any failure of the write: clean up, one clear error
      _quiet_failed_writes()
      self._discard_partial(step)
      raise CheckpointWriteError(f"checkpoint {step}", os.path.join(self.directory, str(step)),
                                 write_cause(e), self.latest_step(), self.directory) from e
    finally:
      absl.setLevel(level)
    return True

  def _check_space(self, step: int, leaves: list) -> None:
    """Refuse a save the disk has clearly no room for before anything is written (agreed by
    every process)."""
    from specjax.rl.preemption import agree_any

    need = int(SPACE_SHARE * sum(int(getattr(x, "nbytes", 0)) for x in leaves)) + SPACE_MARGIN
    try:
      free = shutil.disk_usage(self.directory).free
    except OSError:
      free = need  # unknown: let the write itself find out
    if agree_any([free < need])[0]:
      raise CheckpointWriteError(
          f"checkpoint {step}", os.path.join(self.directory, str(step)),
          f"No space left on device ({free / 2**20:.1f} MiB free, a checkpoint needs at least "
          f"{need / 2**20:.1f} MiB)", self.latest_step(), self.directory)

  def _discard_partial(self, step: int) -> None:
    """Remove what a failed save of `step` left (its step dir, orbax's tmp dirs of it); never
    another step's. Process 0 removes, the others wait."""
    if jax.process_index() == 0:
      prefix = f"{step}.orbax-checkpoint-tmp"
      for name in os.listdir(self.directory):
        if name == str(step) or name.startswith(prefix):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    try:
      self.manager.reload()
    except Exception as e:  # noqa: BLE001 - the directory listing is re-read on the next save
      warnings.warn(f"Checkpointer: re-reading {self.directory} after a failed save: {e!r}")

  def _restore_step(self, step: int, template: Any) -> tuple[Any, dict]:
    paths, leaves = _flat(template)

    def abstract(x):
      x = x if hasattr(x, "dtype") else np.asarray(x)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    args = self.ocp.args
    meta = self.manager.restore(step, args=args.Composite(meta=args.JsonRestore()))["meta"]
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
      raise DamagedCheckpoint(step, self.directory, f"meta/metadata lacks {', '.join(missing)}")
    meta = dict(meta)
    saved = meta.get("identity")
    if self.identity is not None and saved is None:
      warnings.warn(f"Checkpointer: checkpoint {step} in {self.directory} carries no run identity "
                    f"(written before identities existed); restoring it unchecked")
    elif self.identity is not None and saved["digest"] != self.identity["digest"]:
      raise CheckpointMismatch(
          f"checkpoint {step} in {self.directory} belongs to another run (config digest "
          f"{saved['digest']}, this run {self.identity['digest']}; differing: "
          f"{identity_diff(saved, self.identity)}); resume from that run's own checkpoint "
          f"directory or start this run in a new one")
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

  def _restore_checked(self, step: int, template: Any) -> tuple[Any, dict]:
    """`_restore_step`, its failure raised as `DamagedCheckpoint` where the checkpoint's files
    prove it damaged; any other error as it is, with a note that nothing was moved."""
    try:
      return self._restore_step(step, template)
    except (CheckpointMismatch, DamagedCheckpoint):
      raise
    except Exception as e:
      reason = step_damage(os.path.join(self.directory, str(step)), e)
      if reason is None:
        e.add_note(f"Checkpointer: restoring checkpoint {step} in {self.directory} failed and its "
                   f"files show no damage: the run stops here, no checkpoint moved")
        raise
      raise DamagedCheckpoint(step, self.directory, reason) from e

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict] | None:
    """(state, meta) of `step`, or of the newest checkpoint that restores; None when there is
    none. Only a provably damaged checkpoint (`DamagedCheckpoint`) is passed over: once an older
    one restores, each damaged one is moved aside (a one-line warning says which, why and
    where). Any other error is raised at once, nothing moved; when every checkpoint is damaged,
    a `UserError` says so, nothing moved either. `template` gives structure and shardings."""
    if step is not None:
      return self._restore_checked(step, template)
    damaged: list[DamagedCheckpoint] = []
    for s in sorted(self.steps(), reverse=True):
      try:
        out = self._restore_checked(s, template)
      except DamagedCheckpoint as e:
        damaged.append(e)
        continue
      # the run goes on from step s and will save those steps again: keep the damaged ones aside
      # (process 0 moves them; the barrier's name also fails the job if processes restored
      # different steps)
      if jax.process_index() == 0:
        for d in damaged:
          aside = self._move_aside(d.step, "damaged")
          warnings.warn(f"Checkpointer: checkpoint {d.step} in {self.directory} does not restore: "
                        f"it is damaged ({d.reason}); moved to {aside}, resuming from checkpoint "
                        f"{s}")
      _sync_processes(f"specjax checkpointer restored {self.directory}/{s}")
      self.manager.reload()
      return out
    if damaged:  # starting over would silently drop the whole run: the user decides
      reasons = "; ".join(f"{d.step}: {d.reason}" for d in damaged)
      raise UserError(f"every checkpoint in {self.directory} is damaged ({reasons}); nothing was "
                      f"moved: move the step directories away to start the run afresh") \
          from damaged[0]
    return None

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
