"""The asynchronous RL loop: a rollout worker generates on the generation mesh while the trainer
trains on the training mesh and pushes new weights after every step, within a bounded policy lag."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.rl.async_rl.config import AsyncConfig
from specjax.rl.async_rl.importance import tis_weights, weight_metrics
from specjax.rl.async_rl.worker import RolloutBatch, RolloutWorker
from specjax.rl.batch import build_train_batch, rollout_metrics
from specjax.rl.config import RLConfig
from specjax.rl.grpo import group_advantages
from specjax.rl.loop import RLRun, prompt_width, setup_run, validate, warm_widths
from specjax.rl.rollout import (RolloutSampler, decode_completions, pad_prompts, resize_columns,
                                sequence_arrays)
from specjax.rl.run_lifecycle import Hook, RunLifecycle, stop_on_signals
from specjax.rl.safety import NONFINITE_KEY, nonfinite_names
from specjax.rl.tasks import RewardBatch, Task, compute_rewards
from specjax.rl.timing import PhaseTimer
from specjax.rl.train_step import TrainBatch, Trainer, TrainState
from specjax.sharding import shard_batch, split_mesh, state_shardings, transfer

WORKER_PHASES = ("data", "gen", "reward")  # timed inside the worker, off the trainer's path


@dataclasses.dataclass
class ScoredRollout:
  """What the worker hands the trainer: sequence arrays (still on the generation mesh), rewards,
  host-side rollout metrics and the worker's phase times."""

  tokens: jax.Array
  loss_mask: jax.Array
  sampler_logprobs: jax.Array
  rewards: RewardBatch
  metrics: dict
  times: dict
  full_width: int = 0  # the rollout's padded width (prompt + max_new_tokens) before the cut
  # the engine tuning (costs, acceptance estimates) right after this rollout: a checkpoint of
  # the step that trained on it stores it, so that the resumed worker continues from it
  tuning: dict | None = None


class WeightPush:
  """Policy (+ draft head) params for the sampler on the generation mesh, from a train state.

  The raw pieces (forward params, draft group, draft aux) are copied with `transfer` onto the
  generation mesh's shardings of the same logical-axis rules; the sampler's view of them
  (`RolloutSampler.prepare`: the EAGLE-3 head with the policy's embedding, casts) is built there,
  so the embedding table is not sent twice."""

  def __init__(self, trainer: Trainer, sampler: RolloutSampler, gen_mesh):
    self.trainer, self.sampler, self.gen_mesh = trainer, sampler, gen_mesh
    self._shardings = None

  def __call__(self, state: TrainState) -> tuple[Any, Any]:
    tree = {"forward": self.trainer.forward_params(state.params), "draft": state.params["draft"],
            "aux": state.draft_aux}
    if self._shardings is None:
      self._shardings = state_shardings(tree, self.gen_mesh)
    moved = transfer(tree, self._shardings)
    return self.sampler.prepare({"policy": moved["forward"], "draft": moved["draft"]},
                               moved["forward"], moved["aux"])


def setup_async(cfg: RLConfig, async_cfg: AsyncConfig, policy, tokenizer, task: Task | None = None,
                *, draft=None, draft_maps=None, devices: Sequence[Any] | None = None
                ) -> tuple[RLRun, TrainState, RolloutSampler, Any]:
  """(run with its trainer on the training mesh, initial state there, the rollout sampler with
  fixed drafter params on the generation mesh, the generation mesh)."""
  gen_mesh, train_mesh = split_mesh(devices, async_cfg.gen_fraction, async_cfg.gen_mesh,
                                    async_cfg.train_mesh)
  run, state = setup_run(cfg, policy, tokenizer, task, draft=draft, draft_maps=draft_maps,
                         mesh=train_mesh)
  fixed = run.sampler.drafter_params
  if fixed is not None and jax.tree.leaves(fixed):
    fixed = transfer(fixed, state_shardings(fixed, gen_mesh))
  sampler = dataclasses.replace(run.sampler, drafter_params=fixed)
  return run, state, sampler, gen_mesh


def make_producer(run: RLRun, sampler: RolloutSampler, gen_mesh, base_key: jax.Array,
                  start: int, data_position: int):
  """The worker's `produce(index, version, params)`: data, generation, rewards of batch `index`
  with the same prompts and keys as step `index` of the synchronous loop."""
  cfg, task, tok = run.cfg, run.task, run.tokenizer
  g, n = cfg.grpo.group_size, cfg.prompts_per_step

  def produce(index: int, version: int, params) -> ScoredRollout:
    policy, drafter_params = params
    clock = _Clock()
    position = data_position + (index - start) * n
    examples = task.train_examples(position, n)
    ids = [task.encode_prompt(e) for e in examples]
    prompts, lengths, cut = pad_prompts(ids, prompt_width(run, ids), tok.pad_id, repeat=g)
    prompts, lengths = shard_batch((jnp.asarray(prompts), jnp.asarray(lengths)), gen_mesh)
    clock.lap("data", (prompts, lengths))
    key = jax.random.fold_in(jax.random.fold_in(base_key, index), 0)
    rollout = sampler.generate(policy, drafter_params, prompts, lengths, key)
    tokens, mask, sampler_lp = sequence_arrays(rollout, cfg.train_cut_block)
    clock.lap("gen", (rollout, tokens, mask, sampler_lp))
    texts = decode_completions(tok, rollout)
    rewards = compute_rewards(task.score, texts, [e for e in examples for _ in range(g)])
    metrics = rollout_metrics(rollout, rewards, g, position + n, cut)
    metrics["gen/tokens_per_s"] = metrics["gen/tokens"] / max(clock.times["gen"], 1e-9)
    metrics["train/width"] = int(tokens.shape[1])
    clock.lap("reward")
    return ScoredRollout(tokens, mask, sampler_lp, rewards, metrics, clock.times,
                         rollout.sequences.shape[1], sampler.tuning.to_json())

  return produce


class _Clock:
  def __init__(self):
    self._now = time.perf_counter
    self._t = self._now()
    self.times: dict[str, float] = {}

  def lap(self, name: str, sync: Any = None) -> None:
    if sync is not None:
      jax.block_until_ready(sync)
    t = self._now()
    self.times[name], self._t = t - self._t, t


def train_batch(run: RLRun, async_cfg: AsyncConfig, state: TrainState,
                scored: ScoredRollout) -> tuple[TrainBatch, dict]:
  """The train batch of a scored rollout on the training mesh: old (and reference) logprobs of the
  current policy, group advantages, and TIS weights min(pi_old / pi_sampler, is_clip)."""
  trainer, g = run.trainer, run.cfg.grpo
  tokens, mask, sampler_lp = shard_batch(
      (scored.tokens, scored.loss_mask, scored.sampler_logprobs), run.mesh)
  adv = group_advantages(scored.rewards.rewards, g.group_size, g.adv_mode, g.adv_eps)
  batch, extra = build_train_batch(trainer, state, run.ref_params, tokens, mask, sampler_lp, adv)
  if not async_cfg.is_correction:
    return batch, extra
  w = tis_weights(batch.old_logprobs, sampler_lp, mask, async_cfg.is_clip)
  extra.update(weight_metrics(w, mask, async_cfg.is_clip))
  return batch.replace(pg_weights=w), extra


def check_batch(item: RolloutBatch, step: int, policy_lag: int) -> int:
  """The version gap of the batch for `step`; raises if it is not that step's batch or too old."""
  if item.index != step:
    raise RuntimeError(f"async RL: step {step} got batch {item.index} (batches out of order: one "
                       f"would be used twice or dropped)")
  gap = step - item.version
  if not 0 <= gap <= policy_lag:
    raise RuntimeError(f"async RL: batch {step} was generated with params version {item.version}, "
                       f"a gap of {gap} outside [0, policy_lag={policy_lag}]")
  return gap


def async_step(run: RLRun, async_cfg: AsyncConfig, state: TrainState, step: int,
               worker: RolloutWorker, push: WeightPush, timer: PhaseTimer,
               consumed: dict | None = None) -> tuple[TrainState, dict, list[str]]:
  """One trainer step: wait for batch `step`, logprobs, train, push the new version (except after
  the last step). Returns (new state, metrics, reward-function error messages); `consumed`
  gets the batch's engine tuning under "tuning"."""
  with timer.phase("exposed_generation"):
    item = worker.get()
  gap = check_batch(item, step, async_cfg.policy_lag)
  scored: ScoredRollout = item.payload
  if consumed is not None:
    consumed["tuning"] = scored.tuning
  with timer.phase("logprob") as p:
    batch, extra = p.sync(train_batch(run, async_cfg, state, scored))
  bad = nonfinite_names(rewards=scored.rewards.rewards, advantages=batch.advantages)
  with timer.phase("train") as p:
    # RLConfig.minibatches optimizer steps, as in the sync loop (the schedules span them all);
    # no donation: the weight push may alias the state's buffers
    new_state, train_metrics = p.sync(run.trainer.train_on_batch(state, batch))
  train_metrics = {k: float(v) for k, v in jax.device_get(train_metrics).items()}
  bad += nonfinite_names(**{k: v for k, v in train_metrics.items() if not k.startswith("lr/")})
  if not bad or run.cfg.max_bad_steps == 0:  # a bad step keeps the previous state
    state = new_state
  def train_at(w: int):  # warm_widths: a throw-away update
    cut = dataclasses.replace(scored, tokens=resize_columns(scored.tokens, w),
                              loss_mask=resize_columns(scored.loss_mask, w),
                              sampler_logprobs=resize_columns(scored.sampler_logprobs, w))
    return run.trainer.train_on_batch(state, train_batch(run, async_cfg, state, cut)[0])

  warm_widths(run, scored.full_width or scored.tokens.shape[1], scored.tokens.shape[1], train_at,
              timer)
  if step + 1 < run.cfg.steps:
    with timer.phase("weight_sync") as p:
      gen_params = p.sync(push(state))
    worker.publish(step + 1, gen_params)
  metrics = {**scored.metrics,
             **{k: float(v) for k, v in jax.device_get(extra).items()},
             **train_metrics, "time/weight_sync": 0.0, **timer.end_step(),
             **{f"time/{k}": v for k, v in scored.times.items()},
             "time/worker_wait": item.wait_s, "async/batch_index": item.index,
             "async/version": item.version, "async/version_gap": gap,
             "async/queue_depth": worker.queue.qsize()}
  if bad:
    metrics[NONFINITE_KEY] = bad
  return state, metrics, scored.rewards.errors


def _timed(fn):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def run_rl_async(cfg: RLConfig, async_cfg: AsyncConfig, policy, tokenizer,
                 task: Task | None = None, *, out_dir: str, draft=None, draft_maps=None,
                 hooks: Sequence[Hook] = (), validation_hooks: Sequence[Hook] = (),
                 verbose: bool = True, devices: Sequence[Any] | None = None) -> dict[str, Any]:
  """`run_rl` with generation and training on disjoint device groups (`devices`, default all,
  split by async_cfg.gen_fraction); same arguments, checkpoints and metrics. Per step the trainer
  waits for its batch (time/exposed_generation), recomputes logprobs (time/logprob), trains
  (time/train) and pushes the new version (time/weight_sync); time/step is the effective step
  time; time/data, time/gen, time/reward are the worker's, off the critical path; async/* holds the
  batch index, its params version and the version gap. The summary adds the means of these, the
  version-gap counts and the batch accounting (produced, consumed, discarded).

  A stop signal (`CheckpointConfig.stop_signals`) ends it like `run_rl`: the trainer finishes its
  step, stops the worker (its queued batches are dropped, none was trained on), saves the last
  finished step with the engine tuning of the last batch trained on, and raises `Preempted`.

  Resume at policy_lag >= 1 is not bitwise exact: a checkpoint holds the train state, data
  position, RNG key and the engine tuning after the last batch trained on, but not the queue, so
  the batches that were queued or in flight are regenerated, with the same prompts and keys, from
  the restored (newest) parameters: the first batch after a resume has version gap 0 where an
  uninterrupted run would have had up to `policy_lag` (tests/test_async_resume.py). At
  policy_lag 0 it is exact (tests/test_preemption.py)."""
  os.makedirs(out_dir, exist_ok=True)
  signals = stop_on_signals(cfg)
  try:
    return _run_rl_async(cfg, async_cfg, policy, tokenizer, task, out_dir=out_dir, draft=draft,
                         draft_maps=draft_maps, hooks=hooks, validation_hooks=validation_hooks,
                         verbose=verbose, devices=devices, signals=signals)
  finally:
    if signals is not None:
      signals.release()


def _run_rl_async(cfg: RLConfig, async_cfg: AsyncConfig, policy, tokenizer, task, *, out_dir,
                  draft, draft_maps, hooks, validation_hooks, verbose, devices, signals):
  run, state, sampler, gen_mesh = setup_async(cfg, async_cfg, policy, tokenizer, task, draft=draft,
                                             draft_maps=draft_maps, devices=devices)
  identity = {"async": {k: getattr(async_cfg, k) for k in ("policy_lag", "is_correction",
                                                          "is_clip")}}
  # the tuning that goes with the last finished step: after the last batch trained on (the
  # worker may have generated further batches since)
  consumed: dict = {}
  life = RunLifecycle(cfg, out_dir, state, prompt_width=run.prompt_width,
                      validate=functools.partial(validate, run), signals=signals,
                      identity_extra=identity, tuning=sampler.tuning,
                      tuning_json=lambda: consumed["tuning"])
  consumed["tuning"] = sampler.tuning.to_json()  # (as restored on resume)
  timer, worker_times, gaps = PhaseTimer(), {k: [] for k in WORKER_PHASES}, []
  push = WeightPush(run.trainer, sampler, gen_mesh)
  produce = make_producer(run, sampler, gen_mesh, life.base_key, life.start, life.data_position)
  worker = RolloutWorker(produce, first_index=life.start, num_batches=cfg.steps - life.start,
                         policy_lag=async_cfg.policy_lag, queue_size=async_cfg.queue_size)

  def stop_worker() -> dict:  # on a stop signal, before the save: no batch is generated then
    worker.close(async_cfg.shutdown_timeout_s)
    return {"discarded_batches": worker.discarded}

  try:
    life.write_pending(hooks, validation_hooks)
    initial_push = _timed(lambda: push(life.state))
    worker.start(life.start, initial_push[0])
    for step in range(life.start, cfg.steps):
      state, metrics, errors = async_step(run, async_cfg, life.state, step, worker, push, timer,
                                          consumed)
      for k in WORKER_PHASES:
        worker_times[k].append(metrics[f"time/{k}"])
      gaps.append(metrics["async/version_gap"])
      if life.end_step(state, metrics, errors, hooks, validation_hooks, before_stop=stop_worker):
        break
  except BaseException as e:
    worker.close(async_cfg.shutdown_timeout_s)
    life.fail(e)
    raise
  worker.close(async_cfg.shutdown_timeout_s)
  summary = life.finish(timer, verbose)
  phases, start, completed = summary["phases"], life.start, life.completed
  steps = max(completed - start, 1)
  mean = lambda k: phases["phases"].get(k, {}).get("total_s", 0.0) / steps
  return {**summary,
          "exposed_generation": mean("exposed_generation"), "weight_sync": mean("weight_sync"),
          "initial_weight_sync": initial_push[1],
          "effective_step_s": phases["mean_step_s_after_first"],
          "worker_phases": {k: float(np.mean(v)) if v else 0.0 for k, v in worker_times.items()},
          "version_gap": {"mean": float(np.mean(gaps)) if gaps else 0.0,
                          "max": int(max(gaps, default=0)),
                          "counts": {int(k): gaps.count(k) for k in sorted(set(gaps))}},
          "batches": {"produced": worker.produced, "consumed": worker.consumed,
                      "discarded": worker.discarded},
          "async": dataclasses.asdict(async_cfg)}
