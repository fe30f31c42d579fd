"""The AR-vs-speculative RL experiment behind experiments/rl_zero.py and rl_think.py.

Stages: base policy (`base_policy.py`) -> offline draft initialisation on the base policy's rollouts
(`draft_init.py`) -> two GRPO runs from the same seed and data order, AR and speculative (by
default a step of each in turn) -> report (summary.json, plots, table; `report.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from flax import nnx

from specjax.config_tree import check
from specjax.jobs.base_policy import base_policy_dir, load_base_policy, policy_model_cfg
from specjax.jobs.cache import use_compile_cache
from specjax.jobs.config import Examples, ExperimentConfig
from specjax.jobs.draft_init import build_offline_draft
from specjax.jobs.run_dir import (Replacement, check_dir_path, check_flags, check_kv_budget,
                                  check_model_dir, check_policy, claim_run_dir, run_paths)
from specjax.rl.config import RLConfig

logger = logging.getLogger(__name__)


def build_tokenizer(cfg: ExperimentConfig):
  """--model-path's tokenizer (with --chat-template), else the embedded character tokenizer."""
  from specjax.models import CharTokenizer, load_tokenizer

  if cfg.model_path:
    return load_tokenizer(cfg.model_path, cfg.chat_template or None)
  check(not cfg.chat_template, "ExperimentConfig.chat_template",
        "applies to a --model-path tokenizer; the embedded default has its own")
  return CharTokenizer()


def resolve_dataset(cfg: ExperimentConfig) -> ExperimentConfig:
  """`cfg` with --dataset as its RL task: the math task on the whole dataset, epoch after epoch
  (the embedded task's prompt pool does not carry over: ExperimentConfig.dataset)."""
  if not cfg.dataset:
    return cfg
  task = dataclasses.replace(cfg.rl.task, name="math", path=cfg.dataset, pool_size=0)
  return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, task=task))


def policy_config(cfg: ExperimentConfig, tokenizer):
  """The policy's ModelConfig as far as the checks need it, before anything is loaded or built:
  --model-path's config.json (an unsupported architecture fails here), at --rl.model's compute
  dtype; else --rl.model with a row per token id (`policy_model_cfg`)."""
  if not cfg.model_path:
    return policy_model_cfg(cfg, tokenizer)
  from specjax.models.gguf_import import GGUFCheckpoint, gguf_path
  from specjax.models.hf_config import config_from_hf

  if gguf_path(cfg.model_path):
    return config_from_hf(GGUFCheckpoint(cfg.model_path).config,
                          source=f"{cfg.model_path} (its GGUF metadata)", dtype=cfg.rl.model.dtype)
  return config_from_hf(cfg.model_path, dtype=cfg.rl.model.dtype)


def build_task(cfg: ExperimentConfig, tokenizer):
  """--rl.task, or the math task on --dataset."""
  from specjax.rl.tasks import make_task

  return make_task(resolve_dataset(cfg).rl.task, tokenizer)


def export_outputs(cfg: ExperimentConfig, rl_cfg: RLConfig, policy_graphdef, state,
                   draft) -> dict[str, str]:
  """--export-hf: the run's final policy as a Hugging Face directory (config and tokenizer files
  of --model-path kept) and, for a draft that trains (EAGLE-3), the draft in its serving format
  in a subdirectory named after the method."""
  from specjax.models.export import export_hf

  method = rl_cfg.draft.method
  policy = nnx.merge(policy_graphdef, method.forward_params(state.params))
  out = {"policy": export_hf(policy, cfg.export_hf, source_dir=cfg.model_path or None)}
  logger.info(f"[export] final policy -> {out['policy']}")
  head = method.save_draft(os.path.join(out["policy"], method.name), params=state.params,
                           draft_aux=state.draft_aux, draft=draft)
  if head is not None:
    out["draft"] = head
    logger.info(f"[export] {method.name} draft -> {head}")
  return out


def run_modes(cfg: ExperimentConfig) -> list[tuple[str, RLConfig]]:
  """(label, RL config) of each run: the AR baseline and the speculative run, same seed/data."""
  spec = cfg.rl
  ar = dataclasses.replace(spec, draft=dataclasses.replace(spec.draft, kind="none", online=False))
  if not spec.draft.speculative:
    return [("ar", ar)]
  return [("ar", ar), ("spec", spec)] if cfg.compare else [("spec", spec)]


def run_experiment(cfg: ExperimentConfig, *, base_examples: Examples,
                   finetune_examples: Examples | None = None) -> dict[str, Any]:
  """All stages; returns the summary written to <out_dir>/<name>/summary.json."""
  import jax
  import jax.numpy as jnp

  from specjax.jobs.report import write_report

  t_start = time.perf_counter()
  cfg = resolve_dataset(cfg)
  out = os.path.join(cfg.out_dir, cfg.name)
  # The user's input first (flags, paths, checkpoint, data, KV budget), all read-only: a mistake
  # fails in seconds, and writes or moves nothing (an existing run directory stays as it was)
  check_flags(cfg)
  claim_run_dir(out, resume=cfg.resume, fresh=cfg.fresh)
  check_export_dir(cfg)
  if cfg.model_path:
    check_model_dir(cfg.model_path)
  tokenizer = build_tokenizer(cfg)
  task = build_task(cfg, tokenizer)
  model_cfg = policy_config(cfg, tokenizer)
  check_policy(cfg, model_cfg, tokenizer, cfg.model_path or "--rl.model")
  check_kv_budget(cfg, model_cfg, task)
  if cfg.compile_cache:
    logger.info(f"[cache] compiled programs: {use_compile_cache(cfg.cache_dir)}")
  policy_dir = base_policy_dir(cfg, tokenizer, task, base_examples, finetune_examples)
  check_model_dir(policy_dir)
  policy = load_base_policy(cfg, tokenizer, policy_dir)
  offline = build_offline_draft(cfg, policy, tokenizer, task, policy_dir)
  policy, head, maps = offline.policy, offline.draft, offline.draft_maps
  initial = initial_validation(cfg, policy, tokenizer, task)
  results, final = {}, None
  modes = run_modes(cfg)
  paths = {label: run_paths(out, label, rl_cfg) for label, rl_cfg in modes}
  # every check passed: only now may --fresh move the earlier run aside (deleted at the end)
  replaced = Replacement([out] + [d for p in paths.values()
                                  for d in (p.checkpoint_dir, p.log_dir)]) \
      if cfg.fresh else None
  os.makedirs(out, exist_ok=True)
  runs = {}
  for i, (label, rl_cfg) in enumerate(modes):
    how = "AR decoding" if label == "ar" else f"{rl_cfg.draft.kind} K={rl_cfg.draft.draft_len}"
    logger.info(f"[rl:{label}] {rl_cfg.steps} GRPO steps, rollouts by {how}")
    rl_cfg = dataclasses.replace(
        rl_cfg, log_dir=paths[label].log_dir, checkpoint=dataclasses.replace(
            rl_cfg.checkpoint, resume=cfg.resume, dir=paths[label].checkpoint_dir))
    graphdef, params = nnx.split(policy)
    if i < len(modes) - 1:  # the train step donates its state: later runs need the originals
      params = jax.tree.map(jnp.copy, params)
    runs[label] = (rl_cfg, graphdef, params)
  budget = TimeBudget(cfg.budget_s, t_start)
  summaries = run_arms(cfg, runs, tokenizer, task, head, maps, paths, budget)
  for label, (rl_cfg, graphdef, _) in runs.items():
    run_dir = paths[label].run_dir
    summary = summaries[label]
    state = summary.pop("state", None)
    results[label] = summary
    final = (rl_cfg, graphdef, state, head if label == "spec" else None)
    saved = rl_cfg.draft.method.save_draft(os.path.join(run_dir, "draft_hf"),
                                           params=state.params, draft_aux=state.draft_aux,
                                           draft=final[3]) if state is not None else None
    if saved:
      logger.info(f"[rl:{label}] trained {rl_cfg.draft.kind} draft (serving format) -> {saved}")
  if cfg.export_hf and final is not None:  # the last run: the speculative one, or the only one
    export_outputs(cfg, *final)
  report = write_report(cfg, out, results, wall_s=time.perf_counter() - t_start, initial=initial,
                        model_cfg=model_cfg, device_kind=jax.devices()[0].device_kind,
                        budget_stopped_after=budget.stopped_after)
  if replaced is not None:
    replaced.commit()
  return report


class TimeBudget:
  """The experiment's wall-clock budget (`ExperimentConfig.budget_s`) for its RL runs: polled
  between rounds of one step of each run, so that once it is spent every run stops before the
  same step; never before `MIN_STEPS` steps (the first compiles, the second is the first timed)."""

  MIN_STEPS = 2

  def __init__(self, budget_s: float, t_start: float):
    self.deadline = t_start + budget_s if budget_s > 0 else None
    self.stopped_after: int | None = None  # rounds completed when the budget was found spent

  def poll(self, rounds: int) -> None:
    if (self.deadline is not None and self.stopped_after is None and rounds >= self.MIN_STEPS
        and time.perf_counter() > self.deadline):
      self.stopped_after = rounds
      logger.info(f"[rl] time budget spent after {rounds} steps of each run: stopping them")

  def spent(self) -> bool:
    return self.stopped_after is not None


def run_arms(cfg: ExperimentConfig, runs: dict, tokenizer, task, head, maps, paths,
             budget: TimeBudget | None = None) -> dict[str, dict]:
  """Each arm's RL run ({label: (RL config, graphdef, params)}) -> {label: its summary}: one
  after the other, or (sync RL, `ExperimentConfig.interleave`) a step of each in turn, until
  `budget` (interleaved runs only) is spent."""
  def kwargs(label):
    return dict(out_dir=paths[label].run_dir, draft=head if label == "spec" else None,
                draft_maps=maps if label == "spec" else None, verbose=True)

  if cfg.async_rl.enabled:
    from specjax.rl.async_rl.loop import run_rl_async
    return {label: run_rl_async(c, cfg.async_rl, (g, p), tokenizer, task, **kwargs(label))
            for label, (c, g, p) in runs.items()}
  from specjax.rl.loop import drain, iterate_rl

  stop = budget.spent if budget is not None else None
  steps = {label: iterate_rl(c, (g, p), tokenizer, task, stop_before_step=stop, **kwargs(label))
           for label, (c, g, p) in runs.items()}
  if not cfg.interleave:
    return {label: drain(s) for label, s in steps.items()}
  if len(steps) > 1:
    logger.info(f"[rl] arms interleaved: a step of each in turn ({', '.join(steps)})")
  summaries, live, rounds = {}, list(steps), 0
  try:
    while live:
      if budget is not None:
        budget.poll(rounds)
      rounds += 1
      for label in list(live):
        try:
          next(steps[label])
        except StopIteration as done:
          summaries[label] = done.value
          live.remove(label)
  finally:  # an error in one arm: the other saves and closes as on an interruption
    for s in steps.values():
      s.close()
  return {label: summaries[label] for label in runs}


def check_export_dir(cfg: ExperimentConfig) -> None:
  """Fail before any run when --export-hf names a non-empty directory or the source checkpoint."""
  if not cfg.export_hf:
    return
  check_dir_path(cfg.export_hf, "ExperimentConfig.export_hf")
  target = os.path.abspath(cfg.export_hf)
  check(not cfg.model_path or target != os.path.abspath(cfg.model_path),
        "ExperimentConfig.export_hf", f"must differ from --model-path ({cfg.model_path})")
  check(not (os.path.isdir(target) and os.listdir(target)), "ExperimentConfig.export_hf",
        f"{cfg.export_hf} exists and is not empty; choose a new directory")
  check(not os.path.exists(target) or os.path.isdir(target), "ExperimentConfig.export_hf",
        f"{cfg.export_hf} exists and is not a directory")


def initial_validation(cfg: ExperimentConfig, policy, tokenizer, task) -> dict:
  """The base policy's validation score (step 0), with the loop's own validation code."""
  import jax
  from specjax.rl.loop import setup_run, validate

  if not cfg.rl.validation.every:
    return {}
  ar_cfg = run_modes(cfg)[0][1]
  run, state = setup_run(ar_cfg, nnx.split(policy), tokenizer, task)
  out = validate(run, state, jax.random.fold_in(jax.random.PRNGKey(cfg.rl.seed), 1_000_000))
  logger.info(f"[base] validation accuracy {out.get('val/accuracy', float('nan')):.3f} on "
              f"{cfg.rl.validation.num_prompts} held-out prompts")
  return out
