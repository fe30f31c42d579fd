"""The rollout side of the RL loop: sampler and drafter built from the config, the "prepare" phase
that hands the current weights to the sampler, and the conversion of a `Rollout` to a train batch.

Colocated prepare hands over the very arrays of the train state (no copy); it casts only when the
generation dtype differs from the parameters' dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import DTYPES
from specjax.rl.config import RLConfig, RolloutConfig
from specjax.sampling import (AcceptanceMetrics, Drafter, EngineConfig, EngineTuning, Rollout,
                              SamplingConfig, generate, speculative_generate)
from specjax.sampling.engine.paged_state import kv_cache_gb_for
from specjax.drafters import (CorpusStore, GroupNgramDrafter, HistoryDrafter, HistoryParams,
                              HistoryStore)


def sampling_config(cfg: RLConfig, tokenizer, greedy: bool = False) -> SamplingConfig:
  r = cfg.rollout
  return SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
                        top_k=r.top_k or None, top_p=r.top_p if r.top_p < 1.0 else None,
                        eos_ids=tuple(tokenizer.eos_ids), pad_id=int(tokenizer.pad_id))


@dataclasses.dataclass
class KVBudget:
  """The rollouts' KV memory in GiB, fixed for the run at its first rollout: RolloutConfig's
  engine.paging.kv_cache_gb, or kv_cache_fraction of the device memory free then. One pool size
  for every rollout, so later rollouts compile nothing new for it."""

  gb: float | None = None

  def resolve(self, r: RolloutConfig) -> float:
    if self.gb is None:
      self.gb = kv_cache_gb_for(r.kv_cache_fraction, field="RolloutConfig.kv_cache_fraction") \
          if r.kv_cache_fraction else r.engine.paging.kv_cache_gb
    return self.gb


def engine_config(cfg: RLConfig, kv_cache_gb: float | None = None) -> EngineConfig:
  """The rollout engine's settings: RolloutConfig.engine, with `kv_cache_gb` (a `KVBudget`'s,
  resolved from RolloutConfig.kv_cache_fraction) in place of its paging.kv_cache_gb when given
  (the largest K is resolved by `speculative_generate`)."""
  engine = cfg.rollout.engine
  return engine if kv_cache_gb is None else engine.replace(paging=dict(kv_cache_gb=kv_cache_gb))


def make_tuning(cfg: RLConfig) -> EngineTuning:
  """The run's engine tuning, with the machine's cost cache of RolloutConfig.cost_cache."""
  from specjax.sampling.cost_cache import default_cost_cache_path

  path = cfg.rollout.cost_cache
  return EngineTuning.with_cache("off" if path == "off" else path or default_cost_cache_path())


def build_drafter(cfg: RLConfig, policy_graphdef, policy_cfg, draft: Any = None) -> tuple[Drafter | None, Any]:
  """(drafter, fixed drafter params) of the run's draft method (`DraftMethod.build_drafter`).
  `draft`: the draft `Decoder` (or its split) for "draft-model", the EAGLE-3 head (module or split)
  for "eagle3"; unused otherwise. Drafters whose params follow training (eagle3, mtp) get them
  from `RolloutSampler.prepare`."""
  drafter, params = cfg.draft.method.build_drafter(cfg.draft, policy_graphdef=policy_graphdef,
                                                   policy_cfg=policy_cfg, draft=draft,
                                                   group_size=cfg.grpo.group_size)
  width = cfg.draft.tree_width
  if drafter is not None and width > 1:
    if not drafter.drafts_trees:
      raise ValueError(f"DraftConfig.tree_width={width}: the {cfg.draft.kind!r} drafter drafts "
                       f"chains only; use 1, or kind eagle3, mtp or draft-model")
    drafter = dataclasses.replace(drafter, tree_width=width, tree_depth=cfg.draft.tree_depth,
                                  tree_argmax=cfg.draft.tree_argmax)
  return drafter, params


def make_history(cfg: RLConfig, drafter: Drafter | None) -> HistoryStore | None:
  """The run's store of each prompt's earlier completions, for a drafter that reads one."""
  if not isinstance(drafter, HistoryDrafter):
    return None
  d = cfg.draft
  corpus = None if not d.corpus_slots else CorpusStore(
      slots=d.corpus_slots, width=max(drafter.draft_len, 1), min_n=d.corpus_min_match,
      max_n=d.corpus_ngram_max)
  return HistoryStore(max_prompts=d.history_prompts, per_prompt=d.history_per_prompt,
                      width=d.history_tokens or drafter.n + cfg.rollout.max_new_tokens,
                      tail=drafter.n, corpus=corpus)


def cast_floats(tree: Any, dtype) -> Any:
  def one(x):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return x.astype(dtype)
    return x
  return jax.tree.map(one, tree)


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutSampler:
  """AR or speculative sampling of G completions per prompt with the current policy. Owns the
  run's `EngineTuning`: the rollout engine's step costs, calibrated in the first rollout, and its
  acceptance estimates, carried from rollout to rollout; and, for the history drafters, the
  `HistoryStore` every sampled (not greedy) rollout's completions are recorded in."""

  cfg: RLConfig
  policy_graphdef: Any
  tokenizer: Any
  drafter: Drafter | None = None
  drafter_params: Any = None  # fixed params (draft model); None when they follow training
  tuning: EngineTuning = dataclasses.field(default_factory=EngineTuning)
  history: HistoryStore | None = None
  kv_budget: KVBudget = dataclasses.field(default_factory=KVBudget)

  def prepare(self, params: dict, forward_params: Any, draft_aux: Any = ()) -> tuple[Any, Any]:
    """(policy params, drafter params) for the sampler from the train state's params (the
    drafter's by `DraftMethod.sampler_params`). Colocated: the same arrays; cast to
    cfg.rollout.gen_dtype when it differs."""
    policy = forward_params
    if self.cfg.rollout.gen_dtype:
      policy = cast_floats(policy, DTYPES[self.cfg.rollout.gen_dtype])
    drafter_params = self.cfg.draft.method.sampler_params(params, policy, draft_aux,
                                                          self.drafter_params)
    return policy, drafter_params

  def generate(self, policy, drafter_params, prompts: jax.Array, prompt_lengths: jax.Array,
               key: jax.Array, greedy: bool = False, group_size: int | None = None) -> Rollout:
    scfg = sampling_config(self.cfg, self.tokenizer, greedy)
    engine = engine_config(self.cfg, self.kv_budget.resolve(self.cfg.rollout))
    if greedy:  # validation: accuracy, not speed; few buckets and a fixed K keep compiles few
      engine = engine.replace(adaptive=dict(enabled=False, max_draft_len=0),
                              buckets=dict(max_buckets=3))
    if self.drafter is None:
      return generate((self.policy_graphdef, policy), prompts, prompt_lengths, key, scfg,
                      engine=engine, tuning=self.tuning)
    drafter = self.drafter
    if isinstance(drafter, GroupNgramDrafter) and group_size is not None and \
        group_size != drafter.group_size:
      drafter = dataclasses.replace(drafter, group_size=group_size)
    if self.history is not None:
      # the device gets this rollout's prompts' entries only
      table = self.history.table(*jax.device_get((prompts, prompt_lengths)))
      corpus = None if self.history.corpus is None else self.history.corpus.table()
      drafter_params = HistoryParams(table=table, inner=drafter_params, corpus=corpus)
    rollout = speculative_generate((self.policy_graphdef, policy), drafter, drafter_params,
                                   prompts, prompt_lengths, key, scfg, engine=engine,
                                   tuning=self.tuning)
    if self.history is not None and not greedy:
      self.history.record(*jax.device_get((prompts, prompt_lengths, rollout.tokens,
                                           rollout.lengths)))
    return rollout


def pad_prompts(prompts: Sequence[Sequence[int]], width: int, pad_id: int,
                repeat: int = 1) -> tuple[np.ndarray, np.ndarray, int]:
  """Right-padded int32[N * repeat, width] prompts (each repeated `repeat` times, consecutively),
  their lengths, and how many prompts were cut (kept: the last `width` tokens)."""
  n = len(prompts)
  out = np.full((n, width), pad_id, np.int32)
  lengths = np.zeros((n,), np.int32)
  cut = 0
  for i, p in enumerate(prompts):
    if len(p) > width:
      p, cut = p[-width:], cut + 1
    out[i, :len(p)] = p
    lengths[i] = len(p)
  return np.repeat(out, repeat, axis=0), np.repeat(lengths, repeat), cut


def train_widths(full: int, block: int) -> list[int]:
  """The widths a train batch of padded width `full` can be cut to, ascending: `block` * 2^j
  while that saves at least a quarter of `full`, then `full` itself (`block` 0: `full` only)."""
  out = []
  w = block
  while 0 < w and 4 * w <= 3 * full:
    out.append(w)
    w *= 2
  return out + [full]


def train_width(full: int, longest: int, block: int) -> int:
  """Width of a train batch whose longest row holds `longest` tokens: the smallest of
  `train_widths(full, block)` that holds it."""
  return next(w for w in train_widths(full, block) if w >= longest or w == full)


def resize_columns(x: jax.Array, width: int) -> jax.Array:
  """[B, S] -> [B, width]: cut, or padded with zeros (masked columns in a train batch)."""
  if x.shape[1] >= width:
    return x[:, :width]
  return jnp.pad(x, ((0, 0), (0, width - x.shape[1])))


def sequence_arrays(rollout: Rollout, width_block: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(tokens [B, S], loss mask float32[B, S] on completion tokens, sampler logprobs [B, S]) in the
  sequence layout of the train batch (position j holds token j). `width_block` > 0 cuts S to
  the longest row (prompt + completion) rounded up by `train_width`; the columns cut hold only
  padding, and a causal policy's logprobs of the kept columns do not depend on them."""
  tokens = rollout.sequences
  s = tokens.shape[1]
  if width_block:
    longest = int(np.max(np.asarray(jax.device_get(rollout.prompt_lengths + rollout.lengths))))
    s = train_width(s, longest, width_block)
    tokens = tokens[:, :s]
  j = jnp.arange(s)[None, :]
  start = rollout.prompt_lengths[:, None]
  mask = (j >= start) & (j < start + rollout.lengths[:, None])
  idx = jnp.clip(j - start, 0, rollout.logprobs.shape[1] - 1)
  lp = jnp.where(mask, jnp.take_along_axis(rollout.logprobs, idx, axis=1), 0.0)
  return tokens, mask.astype(jnp.float32), lp


def engine_summary(rollout: Rollout) -> dict[str, float]:
  """What the engine did in a rollout: segments, forward steps per K, the mean K over steps, and
  the steps spent per bucket ({} for a rollout without segments)."""
  segs = rollout.segments
  if not segs:
    return {}
  steps = sum(s.iterations for s in segs)
  out = {"engine/segments": len(segs),
         "engine/mean_draft_len": sum(s.draft_len * s.iterations for s in segs) / max(steps, 1),
         "engine/min_bucket": min(s.bucket for s in segs)}
  for s in segs:
    out[f"engine/steps_b{s.bucket}_k{s.draft_len}"] = \
        out.get(f"engine/steps_b{s.bucket}_k{s.draft_len}", 0) + s.iterations
  return out


def segment_events(rollout: Rollout) -> list[dict]:
  """One record per segment: (bucket, K, window, steps, live rows, expected vs measured
  tokens/s, and the queue's and paged memory's state when it started) — each choice of the
  adaptive engine, for the run's event log."""
  return [{"bucket": s.bucket, "draft_len": s.draft_len, "tree_width": s.tree_width,
           "window": s.window, "iterations": s.iterations, "live_rows": s.live_rows_start,
           "tokens": s.tokens, "seconds": round(s.seconds, 6),
           "tokens_per_s": round(s.tokens_per_s, 1),
           "expected_tokens_per_s": None if math.isnan(s.expected_tokens_per_s)
           else round(s.expected_tokens_per_s, 1),
           "drafter_retired": s.drafter_retired, "pages_in_use": s.pages_in_use,
           "swapped_out": s.swapped_out, "waiting_for_pages": s.waiting_for_pages,
           "refill_at": s.refill_at} for s in rollout.segments]


def acceptance_summary(rollout: Rollout) -> dict[str, float]:
  """vLLM-convention acceptance numbers of a speculative rollout ({} for AR)."""
  if rollout.stats is None:
    return {}
  m = AcceptanceMetrics.from_counts(rollout.stats)
  out = {"spec/acceptance_length": m.acceptance_length, "spec/acceptance_rate": m.acceptance_rate,
         "spec/num_drafts": m.num_drafts}
  if rollout.num_steps is not None:
    out["spec/verify_steps"] = int(rollout.num_steps)
  for i, r in enumerate(m.per_position_acceptance_rate):
    out[f"spec/accept_pos{i}"] = r
  return out


def decode_completions(tokenizer, rollout: Rollout) -> list[str]:
  tokens = np.asarray(jax.device_get(rollout.tokens))
  lengths = np.asarray(jax.device_get(rollout.lengths))
  eos = set(int(e) for e in tokenizer.eos_ids)
  texts = []
  for row, n in zip(tokens, lengths):
    ids = [int(t) for t in row[:n]]
    if ids and ids[-1] in eos:
      ids = ids[:-1]
    texts.append(tokenizer.decode(ids))
  return texts
