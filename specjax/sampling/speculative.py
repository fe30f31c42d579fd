"""Speculative sampling: a drafter proposes K tokens, the target scores K+1 positions in one
forward, `rejection.verify` decides, every row commits at its own offset. The steps run in the
rollout engine (`specjax.sampling.engine`): by default live rows are compacted into smaller buckets as rows
finish, attention reads only the live prefix, and K is chosen per bucket (0..max) from measured
step costs and running acceptance rates; `engine=STATIC` is the plain loop with a fixed K.

Output is distributed exactly as `ar.generate` (same `Rollout`, target log-probabilities), plus
per-row acceptance counts that `metrics.AcceptanceMetrics` turns into vLLM-convention numbers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.paged_attention import MAX_TREE_TOKENS
from specjax.sampling.core import Rollout, SamplingConfig, check_prompts, split_model
from specjax.sampling.drafter import Drafter
from specjax.sampling.calibration import EngineTuning
from specjax.sampling.engine import run_engine
from specjax.sampling.engine_config import EngineConfig


def required_cache_size(prompt_width: int, max_new_tokens: int, draft_len: int) -> int:
  """Prompt + completion + the K+1 positions a verify step writes past a row's end (a draft
  tree: `draft_len` is its drafted nodes, `Drafter.write_span`)."""
  return prompt_width + max_new_tokens + draft_len + 1


def speculative_generate(target, drafter: Drafter, drafter_params, prompts: jax.Array,
                         prompt_lengths: jax.Array, key: jax.Array, cfg: SamplingConfig,
                         cache_size: int | None = None,
                         draft_len: int | None = None, *,
                         engine: EngineConfig = EngineConfig(), mesh=None,
                         tuning: EngineTuning | None = None) -> Rollout:
  """Speculative sampling of completions; same contract and distribution as `ar.generate`.

  `target` is a `Decoder` or its `(graphdef, params)`; `drafter` a hashable `Drafter` (static)
  with its params pytree `drafter_params` (traced). `draft_len` overrides `drafter.draft_len`.
  The drafter proposes at the sampling temperature. `Rollout.stats` holds per-row
  `metrics.AcceptanceCounts` (a draft = one live row in one verify step; summarise with
  `AcceptanceMetrics.from_counts`); `Rollout.num_steps` the batch forward steps after the
  prefill; `Rollout.segments` what the engine did. With `engine.adaptive.enabled`, K is the largest
  draft length the engine may pick (`engine.adaptive.max_draft_len` overrides it when > 0).
  `cache_size` defaults to `required_cache_size(P, max_new_tokens, K)`, the least it can be.
  `tuning` keeps the engine's measured costs and acceptance estimates across calls
  (`calibration.EngineTuning`; None: this call only).
  """
  graphdef, params = split_model(target)
  if not isinstance(drafter, Drafter):
    raise TypeError(f"drafter must be a specjax.sampling.Drafter, got {type(drafter).__name__}")
  k = drafter.draft_len if draft_len is None else draft_len
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"draft_len K must be an int >= 1, got {k!r}")
  # the one place it is resolved
  k_max = (engine.adaptive.max_draft_len or k) if engine.adaptive.enabled else k
  if not isinstance(drafter.tree_width, int) or drafter.tree_width < 1:
    raise ValueError(f"drafter.tree_width must be an int >= 1, got {drafter.tree_width!r}")
  if not isinstance(drafter.tree_depth, int) or drafter.tree_depth < 0:
    raise ValueError(f"drafter.tree_depth must be an int >= 0 (0: every depth), got "
                     f"{drafter.tree_depth!r}")
  if drafter.tree_width > 1 and not drafter.drafts_trees:
    raise ValueError(f"drafter.tree_width={drafter.tree_width}: {type(drafter).__name__} "
                     f"drafts chains only (tree_width 1)")
  drafter = dataclasses.replace(drafter, draft_len=k_max, temperature=cfg.temperature)
  if drafter.tree_width > 1 and engine.paging.kv_cache_gb > 0 and \
      drafter.tree.nodes > MAX_TREE_TOKENS:
    raise ValueError(f"drafter.tree_width={drafter.tree_width}: paged attention verifies draft "
                     f"trees of at most {MAX_TREE_TOKENS} nodes, and {drafter.tree} has "
                     f"{drafter.tree.nodes}; lower the draft length, tree_width or tree_depth, "
                     f"or set EngineConfig.paging.kv_cache_gb to 0 (dense caches)")
  vocab = nnx.merge(graphdef, params).cfg.vocab_size
  if drafter.vocab_size is not None and drafter.vocab_size != vocab:
    raise ValueError(f"drafter vocab_size={drafter.vocab_size} differs from the target's "
                     f"vocab_size={vocab}: drafter and target must share one vocabulary")
  prompts = jnp.asarray(prompts, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  needed = required_cache_size(prompts.shape[1], cfg.max_new_tokens, drafter.write_span)
  cache_size = needed if cache_size is None else int(cache_size)
  check_prompts(prompts, prompt_lengths, cache_size, needed,
                f"prompt width {prompts.shape[1]} + max_new_tokens {cfg.max_new_tokens} + "
                f"{f'the draft tree {drafter.tree}' if drafter.tree_width > 1 else f'draft_len {k_max}'}"
                f" + 1")
  return run_engine(graphdef, params, drafter, drafter_params, prompts, prompt_lengths, key, cfg,
                    cache_size, engine, mesh, tuning)
