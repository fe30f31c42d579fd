"""What both RL loops (sync and async) do around their steps: open a run (a fresh start or the
newest good checkpoint of the same run), end each step (reward-function errors and engine
segments logged, validation when due, metrics, the non-finite guard, hooks, periodic and
signal-driven checkpoints) and close it (exit save, `Preempted` after a stop signal, the summary).

`RunLifecycle` owns that state (checkpointer, metrics logger, the last completed step, its data
position and RNG key, a restored step whose metrics are still to be written); a loop owns only
its step.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specjax.rl.batch import SEGMENT_LOG
from specjax.rl.checkpoint import (CheckpointExists, Checkpointer, CheckpointWriteError,
                                   run_identity)
from specjax.rl.config import RLConfig
from specjax.rl.metrics_log import (METRICS_FILE, MetricsLogger, RunWriteError, truncate_metrics,
                                    write_cause)
from specjax.rl.preemption import Preempted, StepBoundary, StopSignals
from specjax.rl.safety import NONFINITE_KEY, NonFiniteGuard, PendingStep, state_donated
from specjax.rl.timing import PhaseTimer, format_summary
from specjax.rl.train_step import TrainState

_log = logging.getLogger(__name__)  # (`logger` names the run's MetricsLogger below)

Hook = Callable[[int, dict], None]  # (step, metrics) after every step (metrics incl. validation)
Validate = Callable[[Any, jax.Array], dict]  # (train state, key) -> validation metrics
MAX_ERRORS_LOGGED = 5  # reward-function errors written to the JSONL per step
TUNING_FILE = "engine_tuning.json"  # the engine's costs and acceptance estimates, in the run dir
COSTS_FILE = "engine_costs.json"  # every step cost the run read or measured, in the run dir


def open_run(cfg: RLConfig, out_dir: str, state: TrainState, identity_extra: dict | None = None,
             tuning=None, history=None):
  """Checkpointer and metrics logger of a run, and where it starts: the state, step, data
  position and RNG key of the newest good checkpoint of this run (same `run_identity`) when
  cfg.checkpoint.resume, else step 0 (a checkpoint dir with checkpoints is then an error). The
  checkpoint's engine tuning (costs, acceptance estimates) goes into `tuning` (an EngineTuning),
  and the run's costs are fixed in <log dir>/engine_costs.json (`CostTable.keep_in`: on resume
  read back from there, not from the machine's cost cache), so the resumed run picks the K the
  uninterrupted one would have; its drafting history into
  `history` (a HistoryStore), so the resumed run drafts what the uninterrupted one would have.
  metrics.jsonl is cut back to the start step, so every step is logged once. Returns (ckpt,
  logger, state, start, data_position, base_key, pending): `pending` is the restored step whose
  metrics were not written before the interruption (None mostly); the loop writes it first."""
  base_key = jax.random.PRNGKey(cfg.seed)
  identity = run_identity(cfg, **(identity_extra or {}))
  ckpt = Checkpointer(cfg.checkpoint.dir or os.path.join(out_dir, "checkpoints"),
                      keep=cfg.checkpoint.keep, identity=identity)
  start, data_position, pending = 0, 0, None
  if cfg.checkpoint.resume:
    restored = ckpt.restore(state)
    if restored is not None:
      state, meta = restored
      start, data_position = int(meta["step"]), int(meta["data_position"])
      base_key = jnp.asarray(meta["rng"], jnp.uint32)
      pending = PendingStep.from_json(meta["extra"].get("pending"))
      if tuning is not None:
        tuning.load_json(meta["extra"].get("engine_tuning"),
                         f"checkpoint {start} in {ckpt.directory}")
      if history is not None:
        history.load_json(meta["extra"].get("history"))
  elif ckpt.steps():
    steps = ckpt.steps()
    ckpt.close()
    raise CheckpointExists(f"{ckpt.directory} holds checkpoints {steps} of an earlier run; set "
                           f"CheckpointConfig.resume to continue it, or give this run its own "
                           f"checkpoint directory")
  log_dir = cfg.log_dir or out_dir
  if tuning is not None:  # the run's costs: fixed from now on, read back on resume
    tuning.costs.keep_in(os.path.join(log_dir, COSTS_FILE), resume=cfg.checkpoint.resume)
  if jax.process_index() == 0:
    keep_to = start - 1 if pending is not None else start
    removed = truncate_metrics(os.path.join(log_dir, METRICS_FILE), keep_to)
    if removed:
      warnings.warn(f"{os.path.join(log_dir, METRICS_FILE)}: removed {removed} line(s) after "
                    f"step {keep_to}, where this run {'resumes' if start else 'starts'}")
  logger = MetricsLogger(log_dir, total_steps=cfg.steps, initial_step=start,
                         tensorboard=cfg.tensorboard, progress=cfg.progress,
                         enabled=jax.process_index() == 0)
  return ckpt, logger, state, start, data_position, base_key, pending


def save_tuning(run_dir: str, data: dict) -> None:
  """<run_dir>/engine_tuning.json, atomically (process 0)."""
  from specjax.sampling.cost_cache import write_json_atomic

  if jax.process_index() != 0:
    return
  path = os.path.join(run_dir, TUNING_FILE)
  try:
    write_json_atomic(path, data)
  except OSError as e:
    raise RunWriteError("the engine tuning", path, write_cause(e)) from e


def checkpoint_saver(ckpt: Checkpointer, start: int, tuning: Callable[[], dict] | None = None,
                     run_dir: str = "", history: Callable[[], dict] | None = None):
  """`save(completed, state, rng, data_position, last, pending)` for the loops: each step is
  saved once (an exit save right after a periodic one is not repeated); a step whose metrics are
  pending is saved with them; a state donated to an interrupted update is not saved (warning).
  `tuning()`: the engine tuning (JSON) that goes with the saved step, stored in the checkpoint
  and as <run_dir>/engine_tuning.json; `history()`: the drafting history (JSON), stored in the
  checkpoint."""
  saved = {"step": start}

  def save(completed: int, state, rng, data_position: int, last: dict,
           pending: PendingStep | None) -> None:
    step, extra = completed, {"reward/mean": last.get("reward/mean")}
    if pending is not None:
      step, data_position = pending.step, pending.data_position
      extra = {"reward/mean": pending.metrics.get("reward/mean"), "pending": pending.to_json()}
    if step == saved["step"]:
      return
    if state_donated(state):
      warnings.warn(f"no checkpoint of step {step}: its state was donated to an update that was "
                    f"interrupted; the run resumes from checkpoint {ckpt.latest_step()}")
      return
    engine_tuning = tuning() if tuning is not None else None
    if engine_tuning is not None:
      extra["engine_tuning"] = engine_tuning
    if history is not None:
      extra["history"] = history()
    ckpt.save(step, state, rng=rng, data_position=data_position, extra=extra)
    saved["step"] = step
    if engine_tuning is not None and run_dir:
      save_tuning(run_dir, engine_tuning)

  return save


def close_run(cfg: RLConfig, ckpt: Checkpointer, logger: MetricsLogger, save: Callable[[], None],
              progressed: bool, *, failed: bool, error: BaseException | None = None) -> None:
  """Save on exit (if the run made progress) and close the logger and checkpointer. On a failure
  a failing save only warns, so the original error is the one that surfaces; after a failed
  write (`RunWriteError`: disk full, ...) no exit save is tried, and the error is completed with
  the last good checkpoint."""
  try:
    if isinstance(error, RunWriteError):
      if not isinstance(error, CheckpointWriteError):
        error.with_last_good(ckpt.latest_step(), ckpt.directory)
    elif cfg.checkpoint.save_on_exit and progressed:
      try:
        save()
      except Exception as e:  # noqa: BLE001
        if not failed:
          raise
        warnings.warn(f"saving a checkpoint on exit failed: {e!r}")
  finally:
    logger.close()
    ckpt.close()


def stop_on_signals(cfg: RLConfig) -> StopSignals | None:
  """The process's stop-signal handlers (`CheckpointConfig.stop_signals`) for a run's duration;
  `release()` when it ends."""
  return StopSignals.acquire(cfg.checkpoint.stop_signals)



class RunLifecycle:
  """A run from open to close, for either loop. `state` is the train state of the last completed
  step (what an exit save saves); `start`, `data_position` and `base_key` where the run starts.

  A loop calls `write_pending` once, then per step `end_step(...)` (True: a stop signal, leave
  the loop), then `finish(...)` (or `fail(error)` from its exception handler, and re-raise)."""

  def __init__(self, cfg: RLConfig, out_dir: str, state, *, prompt_width: int,
               validate: Validate, signals: StopSignals | None,
               identity_extra: dict | None = None, tuning=None,
               tuning_json: Callable[[], dict] | None = None, history=None):
    """`tuning`: the sampler's EngineTuning (restored on resume; its costs fixed in the run dir);
    `tuning_json()`: the tuning saved with a step (default `tuning.to_json`); `history`: the
    drafting history (a HistoryStore), restored on resume and saved with every step."""
    self.cfg, self.out_dir = cfg, out_dir
    self._validate, self._prompt_width = validate, prompt_width
    (self.ckpt, self.logger, self.state, self.start, self.data_position, self.base_key,
     self.pending) = open_run(cfg, out_dir, state, identity_extra, tuning=tuning, history=history)
    if tuning_json is None and tuning is not None:
      tuning_json = tuning.to_json
    self._saver = checkpoint_saver(ckpt=self.ckpt, start=self.start, tuning=tuning_json,
                                   run_dir=cfg.log_dir or out_dir,
                                   history=None if history is None else history.to_json)
    self.guard = NonFiniteGuard(cfg.max_bad_steps)
    self.boundary = StepBoundary(cfg.checkpoint.every, cfg.checkpoint.every_minutes, signals)
    self.completed, self.last, self.last_val = self.start, {}, {}
    self.stopped_by: str | None = None

  def save(self) -> None:
    self._saver(self.completed, self.state, self.base_key, self.data_position, self.last,
                self.pending)

  def _report(self, completed: int, metrics: dict, errors: list[str],
              validation_hooks: Sequence[Hook]) -> dict[str, float]:
    """Report reward-function errors and engine segments, validate when due, log the metrics.
    Returns this step's validation metrics ({} when none ran)."""
    for msg in errors[:MAX_ERRORS_LOGGED]:
      self.logger.log_event(completed, "reward_error", message=msg)
    for segment in metrics.pop(SEGMENT_LOG, ()):  # each choice of the rollout engine
      self.logger.log_event(completed, "engine_segment", **segment)
    cut, width = int(metrics.get("data/prompts_cut", 0)), self._prompt_width
    if cut:  # kept: the last max_prompt_len tokens; said out loud, not only as a metric
      self.logger.log_event(completed, "prompts_cut", count=cut, max_prompt_len=width)
      warnings.warn(f"step {completed}: {cut} prompt(s) longer than RolloutConfig.max_prompt_len="
                    f"{width} were cut to their last {width} tokens; raise "
                    f"--rl.rollout.max-prompt-len to keep them whole")
    if errors:
      warnings.warn(f"step {completed}: {len(errors)} reward function error(s), scored 0; "
                    f"first: {errors[0]}")
    val = {}
    v = self.cfg.validation
    if v.every and (completed % v.every == 0 or completed == self.cfg.steps):
      val = self._validate(self.state, jax.random.fold_in(self.base_key, 1_000_000 + completed))
      metrics.update(val)
      for hook in validation_hooks:
        hook(completed, val)
    self.logger.log(completed, metrics)
    return val

  def write_pending(self, hooks: Sequence[Hook], validation_hooks: Sequence[Hook]) -> None:
    """Finish a restored step whose metrics were not written: validate (same params and key as
    before the interruption), log, guard, hooks."""
    if self.pending is None:
      return
    step, metrics = self.pending.step, dict(self.pending.metrics)
    self._report(step, metrics, self.pending.errors, validation_hooks)
    self.guard.update(step, metrics.get(NONFINITE_KEY, []), self.logger)
    for hook in hooks:
      hook(step, metrics)
    self.last, self.pending = metrics, None

  def end_step(self, state, metrics: dict, errors: list[str], hooks: Sequence[Hook],
               validation_hooks: Sequence[Hook],
               before_stop: Callable[[], dict] | None = None) -> bool:
    """After step `completed` made `state` and `metrics`: report, guard, hooks, save when due.
    On a stop signal `before_stop()` runs before the save (its dict goes into the "preempted"
    event) and True is returned."""
    self.state = state
    # the step counts as done once its metrics are written (validation may be interrupted)
    self.pending = PendingStep(self.completed + 1, self.data_position + self.cfg.prompts_per_step,
                               dict(metrics), errors)
    self.last_val = self._report(self.pending.step, metrics, errors, validation_hooks) \
        or self.last_val
    self.completed, self.data_position = self.pending.step, self.pending.data_position
    self.pending, self.last = None, metrics
    self.guard.update(self.completed, metrics.get(NONFINITE_KEY, []), self.logger)
    for hook in hooks:
      hook(self.completed, metrics)
    save_now, stop = self.boundary.poll(self.completed)
    event = before_stop() if stop and before_stop is not None else {}
    if save_now:
      self.save()
      self.boundary.saved()
    if stop:
      self.stopped_by = self.boundary.signal_name or "a stop signal of another process"
      self.logger.log_event(self.completed, "preempted", signal=self.stopped_by,
                            checkpoint=self.completed, **event)
    return stop

  def fail(self, error: BaseException) -> None:
    """Close after `error` (the loop re-raises it): save what progressed, warn on a failing save."""
    close_run(self.cfg, self.ckpt, self.logger, self.save,
              self.completed > self.start or self.pending is not None, failed=True, error=error)

  def finish(self, timer: PhaseTimer, verbose: bool) -> dict[str, Any]:
    """Close after the last step; raise `Preempted` if a stop signal ended the run, else return
    the summary: steps, last metrics and validation, the phase breakdown, paths, final state."""
    close_run(self.cfg, self.ckpt, self.logger, self.save, self.completed > self.start,
              failed=False)
    if self.stopped_by is not None:
      raise Preempted(self.stopped_by, self.completed, self.ckpt.directory)
    phases = timer.summary()
    if verbose:
      _log.info("%s", format_summary(phases))
    return {"steps": self.completed, "start_step": self.start, "final": self.last,
            "validation": self.last_val, "phases": phases, "out_dir": self.out_dir,
            "metrics_path": self.logger.path, "state": self.state}
