"""The synchronous RL loop: data -> prepare -> gen -> reward -> logprob -> train, every phase timed.

Entry point `run_rl(cfg, policy, tokenizer, task, draft=..., out_dir=...)` -> summary dict; per-step
metrics go to JSONL + TensorBoard, checkpoints to orbax (periodic, on exit, on error), and a fixed
held-out prompt set is scored every `cfg.validation.every` steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.rl.batch import SEGMENT_LOG, build_train_batch, rollout_metrics
from specjax.rl.checkpoint import (CheckpointExists, Checkpointer, CheckpointWriteError,
                                   run_identity)
from specjax.rl.config import RLConfig
from specjax.rl.grpo import group_advantages
from specjax.rl.metrics_log import (METRICS_FILE, MetricsLogger, RunWriteError, truncate_metrics,
                                    write_cause)
from specjax.rl.preemption import Preempted, StepBoundary, StopSignals
from specjax.rl.rollout import (RolloutSampler, acceptance_summary, build_drafter,
                                decode_completions, make_history, make_tuning, pad_prompts,
                                resize_columns, sequence_arrays, train_widths)
from specjax.rl.safety import (NONFINITE_KEY, NonFiniteGuard, PendingStep, nonfinite_names,
                               state_donated)
from specjax.rl.tasks import Task, compute_rewards, make_task
from specjax.rl.timing import PhaseTimer, format_summary
from specjax.rl.train_step import Trainer, TrainState

_log = logging.getLogger(__name__)  # (`logger` names the run's MetricsLogger below)

Hook = Callable[[int, dict], None]  # (step, metrics) after every step (metrics incl. validation)
MAX_ERRORS_LOGGED = 5  # reward-function errors written to the JSONL per step
TUNING_FILE = "engine_tuning.json"  # the engine's costs and acceptance estimates, in the run dir
COSTS_FILE = "engine_costs.json"  # every step cost the run read or measured, in the run dir


@dataclasses.dataclass
class RLRun:
  """Everything a step needs; built once by `setup_run`."""

  cfg: RLConfig
  trainer: Trainer
  sampler: RolloutSampler
  task: Task
  tokenizer: Any
  ref_params: Any  # frozen reference policy (beta > 0), else None
  prompt_width: int
  mesh: Any = None
  widths_warm: bool = False  # the train step is compiled at every train width (`warm_widths`)


def _policy_split(policy) -> tuple[Any, Any]:
  return nnx.split(policy) if isinstance(policy, nnx.Module) else policy


def setup_run(cfg: RLConfig, policy, tokenizer, task: Task | None = None, *, draft=None,
              draft_maps=None, mesh=None) -> tuple[RLRun, TrainState]:
  """Build trainer, rollout sampler and the initial train state: on `mesh` if given (then
  cfg.use_mesh is ignored), else on `make_mesh(cfg.mesh)` if cfg.use_mesh, else one device."""
  graphdef, params = _policy_split(policy)
  policy_cfg = nnx.merge(graphdef, params).cfg
  if mesh is None and cfg.use_mesh:
    from specjax.sharding import make_mesh
    mesh = make_mesh(cfg.mesh)
  method = cfg.draft.method
  init = method.init(cfg.draft, policy_cfg=policy_cfg, policy_params=params, draft=draft,
                     draft_maps=draft_maps, seed=cfg.seed)
  drafter, drafter_params = build_drafter(cfg, graphdef, policy_cfg, init.draft_obj)
  trainer = Trainer(cfg, graphdef, method.train_graphdef(drafter), mesh=mesh)
  state = trainer.init_state(init.policy, init.draft, init.draft_aux)
  task = task if task is not None else make_task(cfg.task, tokenizer)
  sampler = RolloutSampler(cfg, graphdef, tokenizer, drafter, drafter_params,
                           tuning=make_tuning(cfg), history=make_history(cfg, drafter))
  # a copy: the train step donates (reuses) the buffers of the state it updates
  ref = jax.tree.map(jnp.copy, trainer.forward_params(state.params)) if cfg.grpo.beta > 0 \
      else None
  width = cfg.rollout.max_prompt_len or getattr(task, "max_prompt_len", 0)
  return RLRun(cfg, trainer, sampler, task, tokenizer, ref, width, mesh), state


def prompt_width(run: RLRun, prompts: Sequence[Sequence[int]]) -> int:
  """Padded prompt width of a batch: the run's fixed width, else the longest prompt rounded up."""
  if run.prompt_width:
    return run.prompt_width
  longest = max(len(p) for p in prompts)
  return -(-longest // 32) * 32  # buckets of 32 keep the number of compiled shapes small


def warm_widths(run: RLRun, full: int, width: int, train_at: Callable[[int], Any],
                timer: PhaseTimer) -> None:
  """Compile the train step at every width a batch of padded width `full` can be cut to
  (TrainConfig.width_block), other than `width` (this step's): `train_at(w)` runs a
  throw-away step on this step's batch resized to w (timed as phase "warm"). Done once per
  process, in its first step (a step the reports leave out), so no later step compiles."""
  if run.widths_warm:
    return
  run.widths_warm = True
  others = [w for w in train_widths(full, run.cfg.train_cut_block) if w != width]
  if others:
    with timer.phase("warm"):
      for w in others:
        jax.block_until_ready(train_at(w))


def rl_step(run: RLRun, state: TrainState, step: int, key: jax.Array, data_position: int,
            timer: PhaseTimer) -> tuple[TrainState, dict, list[str]]:
  """One synchronous RL step. Returns (new state, metrics, reward-function error messages).
  Non-finite rewards, advantages, losses or gradients (named in metrics[NONFINITE_KEY]): the
  update is skipped and the state returned unchanged (unless cfg.max_bad_steps == 0, where the
  update is donated and the run stops)."""
  cfg = run.cfg
  g, n_prompts = cfg.grpo.group_size, cfg.prompts_per_step
  with timer.phase("data") as p:
    examples = run.task.train_examples(data_position, n_prompts)
    ids = [run.task.encode_prompt(e) for e in examples]
    prompts, lengths, cut = pad_prompts(ids, prompt_width(run, ids), run.tokenizer.pad_id,
                                        repeat=g)
    prompts, lengths = p.sync((jnp.asarray(prompts), jnp.asarray(lengths)))
  with timer.phase("prepare") as p:
    gen_params, drafter_params = p.sync(run.sampler.prepare(
        state.params, run.trainer.forward_params(state.params), state.draft_aux))
  with timer.phase("gen") as p:
    rollout = p.sync(run.sampler.generate(gen_params, drafter_params, prompts, lengths,
                                         jax.random.fold_in(key, 0)))
  with timer.phase("reward"):
    texts = decode_completions(run.tokenizer, rollout)
    rep = [e for e in examples for _ in range(g)]
    rewards = compute_rewards(run.task.score, texts, rep)
    adv = group_advantages(rewards.rewards, g, cfg.grpo.adv_mode, cfg.grpo.adv_eps)
  bad = nonfinite_names(rewards=rewards.rewards, advantages=adv)
  with timer.phase("logprob") as p:
    tokens, mask, sampler_lp = sequence_arrays(rollout, cfg.train_cut_block)
    # one optimizer step on this batch: old logprobs == the policy's own, no separate pass
    batch, mismatch = p.sync(build_train_batch(run.trainer, state, run.ref_params, tokens, mask,
                                               sampler_lp, adv, on_policy=cfg.minibatches == 1))
  train_metrics = {}
  if not bad:
    with timer.phase("train") as p:
      new_state, train_metrics = run.trainer.train_on_batch(state, batch,
                                                            donate=cfg.max_bad_steps == 0)
      p.sync((new_state, train_metrics))
    train_metrics = {k: float(v) for k, v in jax.device_get(train_metrics).items()}
    bad = nonfinite_names(**{k: v for k, v in train_metrics.items() if not k.startswith("lr/")})
    state = new_state if not bad or cfg.max_bad_steps == 0 else state
  donate = cfg.max_bad_steps == 0

  def train_at(w: int):  # warm_widths: a throw-away update (donated: of a copy of the state)
    b, _ = build_train_batch(run.trainer, state, run.ref_params, resize_columns(tokens, w),
                             resize_columns(mask, w), resize_columns(sampler_lp, w), adv,
                             on_policy=cfg.minibatches == 1)
    return run.trainer.train_on_batch(jax.tree.map(jnp.copy, state) if donate else state, b,
                                      donate=donate)

  warm_widths(run, rollout.sequences.shape[1], tokens.shape[1], train_at, timer)
  metrics = {
      **rollout_metrics(rollout, rewards, g, data_position + n_prompts, cut),
      **{k: float(v) for k, v in jax.device_get(mismatch).items()},
      **train_metrics,
      "train/width": int(tokens.shape[1]),
  }
  if cfg.task.pool_size:
    metrics["data/epoch"] = data_position // cfg.task.pool_size
  if run.sampler.history is not None:
    metrics["draft/history_prompts"] = run.sampler.history.prompts
  if bad:
    metrics[NONFINITE_KEY] = bad
  return state, metrics, rewards.errors


def validate(run: RLRun, state: TrainState, key: jax.Array) -> dict[str, float]:
  """Accuracy and mean reward on the task's fixed held-out prompts (greedy or sampled)."""
  v = run.cfg.validation
  examples = run.task.validation(v.num_prompts)
  if not examples:
    return {}
  gen_params, drafter_params = run.sampler.prepare(
      state.params, run.trainer.forward_params(state.params), state.draft_aux)
  ids = [run.task.encode_prompt(e) for e in examples]
  width = prompt_width(run, ids)
  rewards, correct, lengths, acc_len = [], [], [], []
  for i, start in enumerate(range(0, len(examples), v.batch_size)):
    chunk = ids[start:start + v.batch_size]
    n = len(chunk)
    chunk = chunk + [chunk[-1]] * (v.batch_size - n)  # one static shape for every chunk
    prompts, lens, _ = pad_prompts(chunk, width, run.tokenizer.pad_id)
    rollout = run.sampler.generate(gen_params, drafter_params, jnp.asarray(prompts),
                                  jnp.asarray(lens), jax.random.fold_in(key, i), greedy=v.greedy,
                                  group_size=1)
    texts = decode_completions(run.tokenizer, rollout)[:n]
    rb = compute_rewards(run.task.score, texts, examples[start:start + n])
    rewards.append(rb.rewards)
    correct.append(rb.correct)
    lengths.append(np.asarray(jax.device_get(rollout.lengths))[:n])
    acc_len.append(acceptance_summary(rollout).get("spec/acceptance_length", np.nan))
  out = {"val/accuracy": float(np.concatenate(correct).mean()),
         "val/reward": float(np.concatenate(rewards).mean()),
         "val/length_mean": float(np.concatenate(lengths).mean())}
  if not np.all(np.isnan(acc_len)):
    out["val/acceptance_length"] = float(np.nanmean(acc_len))
  return out


def finish_step(run: RLRun, state: TrainState, completed: int, metrics: dict, errors: list[str],
                logger: MetricsLogger, base_key: jax.Array, hooks: Sequence[Hook] = (),
                validation_hooks: Sequence[Hook] = ()) -> dict[str, float]:
  """After a step (sync or async): report reward-function errors, validate when due, log the
  metrics, call the hooks. Returns this step's validation metrics ({} when none ran)."""
  for msg in errors[:MAX_ERRORS_LOGGED]:
    logger.log_event(completed, "reward_error", message=msg)
  for segment in metrics.pop(SEGMENT_LOG, ()):  # each choice of the rollout engine
    logger.log_event(completed, "engine_segment", **segment)
  cut = int(metrics.get("data/prompts_cut", 0))
  if cut:  # kept: the last max_prompt_len tokens; said out loud, not only as a metric
    logger.log_event(completed, "prompts_cut", count=cut, max_prompt_len=run.prompt_width)
    warnings.warn(f"step {completed}: {cut} prompt(s) longer than RolloutConfig.max_prompt_len="
                  f"{run.prompt_width} were cut to their last {run.prompt_width} tokens; raise "
                  f"--rl.rollout.max-prompt-len to keep them whole")
  if errors:
    warnings.warn(f"step {completed}: {len(errors)} reward function error(s), scored 0; "
                  f"first: {errors[0]}")
  val = {}
  v = run.cfg.validation
  if v.every and (completed % v.every == 0 or completed == run.cfg.steps):
    val = validate(run, state, jax.random.fold_in(base_key, 1_000_000 + completed))
    metrics.update(val)
    for hook in validation_hooks:
      hook(completed, val)
  logger.log(completed, metrics)
  for hook in hooks:
    hook(completed, metrics)
  return val


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


def write_pending(run: RLRun, state: TrainState, pending: PendingStep, logger: MetricsLogger,
                  base_key: jax.Array, hooks: Sequence[Hook], validation_hooks: Sequence[Hook],
                  guard: NonFiniteGuard) -> dict:
  """Finish a restored step whose metrics were not written: validate (same params and key as
  before the interruption), log, guard, hooks. Returns its metrics."""
  metrics = dict(pending.metrics)
  finish_step(run, state, pending.step, metrics, pending.errors, logger, base_key, (),
              validation_hooks)
  guard.update(pending.step, metrics.get(NONFINITE_KEY, []), logger)
  for hook in hooks:
    hook(pending.step, metrics)
  return metrics


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


def run_rl(cfg: RLConfig, policy, tokenizer, task: Task | None = None, *, out_dir: str,
           draft=None, draft_maps=None, hooks: Sequence[Hook] = (),
           validation_hooks: Sequence[Hook] = (), stop_after: int | None = None,
           verbose: bool = True) -> dict[str, Any]:
  """Run GRPO up to cfg.steps steps (resuming from the newest good checkpoint in the run's
  checkpoint dir when cfg.checkpoint.resume); `stop_after` ends this call after that many steps
  (a time-sliced job: the schedules still span cfg.steps). `policy` is a `Decoder` or its
  (graphdef, params); `draft` the EAGLE-3 head or the draft `Decoder` when the kind needs one.

  Returns a summary: steps run, last metrics, last validation, the phase breakdown, paths and the
  final train state ("state")."""
  return drain(iterate_rl(cfg, policy, tokenizer, task, out_dir=out_dir, draft=draft,
                          draft_maps=draft_maps, hooks=hooks, validation_hooks=validation_hooks,
                          stop_after=stop_after, verbose=verbose))


def drain(steps) -> Any:
  """Run a step generator (`iterate_rl`) to its end; its return value."""
  while True:
    try:
      next(steps)
    except StopIteration as done:
      return done.value


def iterate_rl(cfg: RLConfig, policy, tokenizer, task: Task | None = None, *, out_dir: str,
               draft=None, draft_maps=None, hooks: Sequence[Hook] = (),
               validation_hooks: Sequence[Hook] = (), stop_after: int | None = None,
               verbose: bool = True):
  """`run_rl` one step at a time: a generator that yields (step, metrics) after each completed
  step (metrics written, checkpoint saved when due) and returns `run_rl`'s summary, so that
  several runs can take turns in one process (the experiment driver interleaves its AR and
  speculative arms). Closing it early saves and closes the run as an interruption does."""
  os.makedirs(out_dir, exist_ok=True)
  signals = stop_on_signals(cfg)
  try:
    summary = yield from _iterate_rl(cfg, policy, tokenizer, task, out_dir=out_dir, draft=draft,
                                     draft_maps=draft_maps, hooks=hooks,
                                     validation_hooks=validation_hooks, stop_after=stop_after,
                                     verbose=verbose, signals=signals)
  finally:
    if signals is not None:
      signals.release()
  return summary


def _iterate_rl(cfg: RLConfig, policy, tokenizer, task: Task | None, *, out_dir: str, draft,
                draft_maps, hooks: Sequence[Hook], validation_hooks: Sequence[Hook],
                stop_after: int | None, verbose: bool, signals: StopSignals | None):
  run, state = setup_run(cfg, policy, tokenizer, task, draft=draft, draft_maps=draft_maps)
  history = run.sampler.history
  ckpt, logger, state, start, data_position, base_key, pending = open_run(
      cfg, out_dir, state, tuning=run.sampler.tuning, history=history)
  timer, guard = PhaseTimer(), NonFiniteGuard(cfg.max_bad_steps)
  completed, last, last_val, stopped_by = start, {}, {}, None
  saver = checkpoint_saver(ckpt, start, run.sampler.tuning.to_json, cfg.log_dir or out_dir,
                           history=None if history is None else history.to_json)
  boundary = StepBoundary(cfg.checkpoint.every, cfg.checkpoint.every_minutes, signals)

  def save() -> None:
    saver(completed, state, base_key, data_position, last, pending)

  try:
    if pending is not None:  # restored with its metrics unwritten: write them first
      last, pending = write_pending(run, state, pending, logger, base_key, hooks,
                                    validation_hooks, guard), None
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for step in range(start, end):
      state, metrics, errors = rl_step(run, state, step, jax.random.fold_in(base_key, step),
                                       data_position, timer)
      metrics.update(timer.end_step())
      metrics["perf/gen_tokens_per_s"] = metrics["gen/tokens"] / max(metrics["time/gen"], 1e-9)
      metrics["perf/wall_clock"] = time.time()  # when the step ended (runs may take turns)
      # the step counts as done once its metrics are written (validation may be interrupted)
      pending = PendingStep(step + 1, data_position + cfg.prompts_per_step, dict(metrics), errors)
      last_val = finish_step(run, state, pending.step, metrics, errors, logger, base_key, (),
                             validation_hooks) or last_val
      completed, data_position, pending, last = pending.step, pending.data_position, None, metrics
      guard.update(completed, metrics.get(NONFINITE_KEY, []), logger)
      for hook in hooks:
        hook(completed, metrics)
      save_now, stop = boundary.poll(completed)
      if save_now:
        save()
        boundary.saved()
      if stop:
        stopped_by = boundary.signal_name or "a stop signal of another process"
        logger.log_event(completed, "preempted", signal=stopped_by, checkpoint=completed)
        break
      yield completed, metrics
  except BaseException as e:
    close_run(cfg, ckpt, logger, save, completed > start or pending is not None, failed=True,
              error=e)
    raise
  close_run(cfg, ckpt, logger, save, completed > start, failed=False)
  if stopped_by is not None:
    raise Preempted(stopped_by, completed, ckpt.directory)
  phases = timer.summary()
  if verbose:
    _log.info("%s", format_summary(phases))
  return {"steps": completed, "start_step": start, "final": last, "validation": last_val,
          "phases": phases, "out_dir": out_dir, "metrics_path": logger.path, "state": state}
