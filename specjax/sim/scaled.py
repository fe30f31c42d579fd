"""Project a measured (small) RL configuration to a real model on a GPU cluster: the same batch,
completion-length distribution, acceptance length and drafter, on e.g. Qwen3-8B on 8 H100s.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specjax.sim.catalog import MODELS
from specjax.sim.drafter_costs import EAGLE3, NO_DRAFT, drafter_for_kind
from specjax.sim.simulate import ENGINE_KINDS, Scenario, compare
from specjax.sim.workload import Workload


def _closest_model(params: float) -> str:
  dense = [m for m in MODELS.values() if not m.is_moe and m.name.startswith("qwen3")]
  return min(dense, key=lambda m: abs(math.log(m.num_params / params))).name


def project_scaled(*, batch: int, completion_lengths: Sequence[float] | float,
                   acceptance_length: float, draft_kind: str = EAGLE3.name, draft_len: int = 3,
                   model: str | None = "qwen3-8b", params: float | None = None,
                   hardware: str = "h100", gpus: int = 8, prompt_len: int = 256,
                   max_new: int | None = None, group_size: int = 1, mode: str = "sync",
                   policy_lag: int = 1, engine: str = "specjax",
                   adaptive: bool = False) -> dict:
  """Generation and step seconds of one RL step, AR and speculative, and the speedups.

  batch: rollouts per RL step (prompts x group_size); completion_lengths: measured lengths
  (their mean, spread and max set a lognormal clipped at `max_new`, default the longest) or one
  mean length; acceptance_length: vLLM convention at `draft_len`; draft_kind: a specjax draft
  kind (eagle3, mtp, draft-model, ngram, group-ngram, none); model: a catalog name, or None
  with `params` (the closest Qwen3 dense model). engine: a `simulate.ENGINE_KINDS` name
  ('specjax': static buckets, 'specjax-continuous': queue-fed paged slots, 'vllm').
  """
  drafter = drafter_for_kind(draft_kind, "project_scaled.draft_kind")
  if batch < 1:
    raise ValueError(f"project_scaled.batch: must be >= 1, got {batch}")
  if group_size < 1 or batch % group_size:
    raise ValueError(f"project_scaled.group_size: must divide batch={batch}, got {group_size}")
  if model is None:
    if not params or params <= 0:
      raise ValueError("project_scaled.params: give model= or params= > 0")
    model = _closest_model(params)
  lengths = np.atleast_1d(np.asarray(completion_lengths, float))
  if lengths.size == 0 or np.any(lengths < 1):
    raise ValueError("project_scaled.completion_lengths: must be lengths >= 1")
  cap = int(max_new or max(2, math.ceil(lengths.max())))
  mean = float(min(lengths.mean(), cap - 1))
  sigma = 0.9
  if lengths.size > 1 and lengths.std() > 0:
    logs = np.log(lengths)
    sigma = float(np.clip(logs.std(), 0.05, 2.0))
  k = draft_len if drafter.speculative else 0
  acc = float(np.clip(acceptance_length, 1.0, k + 1)) if k else None
  w = Workload(name="scaled", prompts=batch // group_size, samples=group_size,
               prompt_len=prompt_len, mean_response_len=max(mean, 1.0), max_response_len=cap,
               length_sigma=sigma, acceptance_at=max(k, 1))
  s = Scenario(model=model, hardware=hardware, gpus=gpus, mode=mode, policy_lag=policy_lag,
               drafter=(drafter if k else NO_DRAFT).name, draft_len=k, acceptance_length=acc,
               workload=w, engine=engine,
               adaptive=adaptive and k > 0 and getattr(ENGINE_KINDS.get(engine), "adaptive", False))
  c = compare(s)
  return {"model": model, "hardware": hardware, "gpus": gpus, "mode": mode, "engine": engine,
          "drafter": drafter.name, "draft_len": k, "acceptance_length": c.spec.acceptance_length,
          "batch": batch, "mean_completion_len": mean, "max_completion_len": cap,
          "length_sigma": sigma,
          "ar_gen_s": c.ar.gen, "spec_gen_s": c.spec.gen, "ar_step_s": c.ar.step,
          "spec_step_s": c.spec.step, "rollout_speedup": c.rollout_speedup,
          "step_speedup": c.step_speedup,
          "ar": c.ar.to_dict(), "spec": c.spec.to_dict()}
