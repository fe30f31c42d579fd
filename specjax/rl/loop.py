"""The synchronous RL loop: data -> prepare -> gen -> reward -> logprob -> train, every phase timed.

Entry point `run_rl(cfg, policy, tokenizer, task, draft=..., out_dir=...)` -> summary dict; per-step
metrics go to JSONL + TensorBoard, checkpoints to orbax (periodic, on exit, on error), and a fixed
held-out prompt set is scored every `cfg.validation.every` steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.rl.batch import build_train_batch, rollout_metrics
from specjax.rl.config import RLConfig
from specjax.rl.grpo import group_advantages
from specjax.rl.preemption import StopSignals
from specjax.rl.rollout import (RolloutSampler, acceptance_summary, build_drafter,
                                decode_completions, make_history, make_tuning, pad_prompts,
                                resize_columns, sequence_arrays, train_widths)
from specjax.rl.run_lifecycle import Hook, RunLifecycle, stop_on_signals
from specjax.rl.safety import NONFINITE_KEY, nonfinite_names
from specjax.rl.tasks import Task, compute_rewards, make_task
from specjax.rl.timing import PhaseTimer
from specjax.rl.train_step import Trainer, TrainState

_log = logging.getLogger(__name__)


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
               verbose: bool = True, stop_before_step: Callable[[], bool] | None = None):
  """`run_rl` one step at a time: a generator that yields (step, metrics) after each completed
  step (metrics written, checkpoint saved when due) and returns `run_rl`'s summary, so that
  several runs can take turns in one process (the experiment driver interleaves its AR and
  speculative arms). Closing it early saves and closes the run as an interruption does;
  `stop_before_step()` returning True before a step ends the run there as its last step would
  (a time budget: the summary is returned, a "budget" event logged)."""
  os.makedirs(out_dir, exist_ok=True)
  signals = stop_on_signals(cfg)
  try:
    summary = yield from _iterate_rl(cfg, policy, tokenizer, task, out_dir=out_dir, draft=draft,
                                     draft_maps=draft_maps, hooks=hooks,
                                     validation_hooks=validation_hooks, stop_after=stop_after,
                                     verbose=verbose, signals=signals,
                                     stop_before_step=stop_before_step)
  finally:
    if signals is not None:
      signals.release()
  return summary


def _iterate_rl(cfg: RLConfig, policy, tokenizer, task: Task | None, *, out_dir: str, draft,
                draft_maps, hooks: Sequence[Hook], validation_hooks: Sequence[Hook],
                stop_after: int | None, verbose: bool, signals: StopSignals | None,
                stop_before_step: Callable[[], bool] | None = None):
  run, state = setup_run(cfg, policy, tokenizer, task, draft=draft, draft_maps=draft_maps)
  life = RunLifecycle(cfg, out_dir, state, prompt_width=run.prompt_width,
                      validate=functools.partial(validate, run), signals=signals,
                      tuning=run.sampler.tuning, history=run.sampler.history)
  timer = PhaseTimer()
  try:
    life.write_pending(hooks, validation_hooks)
    end = cfg.steps if stop_after is None else min(cfg.steps, life.start + stop_after)
    for step in range(life.start, end):
      if stop_before_step is not None and stop_before_step():
        life.logger.log_event(life.completed, "budget", steps_left=end - step)
        _log.info(f"time budget spent: the run ends after step {life.completed} of {cfg.steps}")
        break
      state, metrics, errors = rl_step(run, life.state, step,
                                       jax.random.fold_in(life.base_key, step),
                                       life.data_position, timer)
      metrics.update(timer.end_step())
      metrics["perf/gen_tokens_per_s"] = metrics["gen/tokens"] / max(metrics["time/gen"], 1e-9)
      metrics["perf/wall_clock"] = time.time()  # when the step ended (runs may take turns)
      if life.end_step(state, metrics, errors, hooks, validation_hooks):
        break
      yield life.completed, metrics
  except BaseException as e:
    life.fail(e)
    raise
  return life.finish(timer, verbose)
