"""The autoregressive sampler: ragged prompts, one prefill, then one target step per token, run by
the rollout engine (`specjax.sampling.engine`: live-batch compaction and a live-prefix attention window by
default; `engine=STATIC` is the plain full-batch loop)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling.core import Rollout, SamplingConfig, check_prompts, split_model
from specjax.sampling.calibration import EngineTuning
from specjax.sampling.engine import run_engine
from specjax.sampling.engine_config import EngineConfig


def generate(model, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
             cfg: SamplingConfig, cache_size: int | None = None, *,
             engine: EngineConfig = EngineConfig(), mesh=None,
             tuning: EngineTuning | None = None) -> Rollout:
  """Sample completions of right-padded `prompts[B, P]` (row b has `prompt_lengths[b]` tokens).

  `model` is a `Decoder` or its `(graphdef, params)` split; params are a traced argument, so new
  policy weights reuse the compiled programs (one per bucket, window and config).
  `cache_size` defaults to P + max_new_tokens, the least it can be. Rows are sharded over the
  data-parallel axes of `mesh` (default: the mesh the params live on, if any). `tuning` keeps
  the engine's measured costs across calls (`calibration.EngineTuning`; None: this call only).
  """
  graphdef, params = split_model(model)
  prompts = jnp.asarray(prompts, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  needed = prompts.shape[1] + cfg.max_new_tokens
  cache_size = needed if cache_size is None else int(cache_size)
  check_prompts(prompts, prompt_lengths, cache_size, needed,
                f"prompt width {prompts.shape[1]} + max_new_tokens {cfg.max_new_tokens}")
  return run_engine(graphdef, params, None, None, prompts, prompt_lengths, key, cfg, cache_size,
                    engine, mesh, tuning)
