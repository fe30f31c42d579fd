"""What every sampler shares: `SamplingConfig` (a static jit argument), the `Rollout` result, the
prefill, the end-of-row bookkeeping and the input checks. `ar.py` and `speculative.py` are peers on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct



@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How completions are sampled. Hashable: passed to `jit` as a static argument."""

  max_new_tokens: int = 64
  temperature: float = 1.0  # 0 is greedy
  top_k: int | None = None
  top_p: float | None = None
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
    _check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
    _check(self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
    _check(self.top_k is None or self.top_k >= 1, "top_k", f"must be None or >= 1, got {self.top_k}")
    _check(self.top_p is None or 0.0 < self.top_p <= 1.0, "top_p",
           f"must be None or in (0, 1], got {self.top_p}")
    _check(all(i >= 0 for i in self.eos_ids), "eos_ids", f"must be >= 0, got {self.eos_ids}")
    _check(self.pad_id >= 0, "pad_id", f"must be >= 0, got {self.pad_id}")


def _check(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ValueError(f"SamplingConfig.{field}: {msg}")


@struct.dataclass
class Rollout:
  """Completions of a batch of ragged prompts (N = max_new_tokens, P = padded prompt width)."""

  tokens: jax.Array  # int32[B, N] completion tokens, pad_id after the end
  mask: jax.Array  # bool[B, N] True on completion tokens (the EOS token included)
  logprobs: jax.Array  # float32[B, N] processed-target logprob of each emitted token, 0 on padding
  lengths: jax.Array  # int32[B] completion lengths
  eos: jax.Array  # bool[B] the completion ended with an EOS token (else: hit max_new_tokens)
  sequences: jax.Array  # int32[B, P+N] prompt immediately followed by its completion, then pad
  sequence_mask: jax.Array  # bool[B, P+N] True on prompt + completion tokens
  prompt_lengths: jax.Array  # int32[B]
  num_steps: Any = None  # int32[] batch forward steps after the prefill (AR decode / verify)
  stats: Any = None  # speculative loop only: per-row `metrics.AcceptanceCounts`
  # the engine's segments as they ran (`engine.Segment`: bucket, K, window, steps, time)
  segments: tuple = struct.field(pytree_node=False, default=())


def split_model(model) -> tuple[nnx.GraphDef, Any]:
  """(graphdef, params) from an NNX module or an already split pair."""
  if isinstance(model, nnx.Module):
    return nnx.split(model)
  graphdef, params = model
  return graphdef, params


def concrete(x) -> np.ndarray | None:
  """The value of `x` as numpy, or None when it is traced (checks then happen only eagerly)."""
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


def check_prompts(prompts, prompt_lengths, cache_size: int, needed: int, what: str) -> None:
  if prompts.ndim != 2:
    raise ValueError(f"prompts must be int[B, P], got shape {prompts.shape}")
  if prompt_lengths.shape != prompts.shape[:1]:
    raise ValueError(f"prompt_lengths must be int[B] = [{prompts.shape[0]}], "
                     f"got shape {prompt_lengths.shape}")
  if prompts.shape[1] > cache_size:
    raise ValueError(f"prompts of width {prompts.shape[1]} are longer than the cache "
                     f"(cache_size={cache_size})")
  if cache_size < needed:
    raise ValueError(f"cache_size={cache_size} is too small: {what} needs >= {needed}")
  lengths = concrete(prompt_lengths)
  if lengths is not None and (lengths.min() < 1 or lengths.max() > prompts.shape[1]):
    raise ValueError(f"prompt_lengths must be in [1, {prompts.shape[1]}], got min "
                     f"{lengths.min()} max {lengths.max()}")


def prefill(model, prompts: jax.Array, prompt_lengths: jax.Array, cache_size: int):
  """One forward over the padded prompts; logits only at each row's last prompt position.

  Returns (DecoderOutput without logits, cache committed to the prompt, last logits [B, V])."""
  cache = model.init_cache(prompts.shape[0], cache_size)
  out = model(prompts, cache=cache, compute_logits=False)
  last = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)
  logits = model.head(last)[:, 0]
  return out, out.cache.with_lengths(prompt_lengths), logits


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  if not eos_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.any(tokens[..., None] == jnp.asarray(eos_ids, tokens.dtype), axis=-1)


def finish(prompts, prompt_lengths, tokens, logprobs, lengths, cfg: SamplingConfig,
           num_steps=None, stats=None, segments: tuple = ()) -> Rollout:
  """Rollout from completion buffers (width >= N): pad after each row's end, build sequences."""
  n = cfg.max_new_tokens
  tokens, logprobs = tokens[:, :n], logprobs[:, :n]
  mask = jnp.arange(n)[None, :] < lengths[:, None]
  tokens = jnp.where(mask, tokens, cfg.pad_id).astype(jnp.int32)
  last = jnp.take_along_axis(tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
  width = prompts.shape[1]
  prompt_mask = jnp.arange(width)[None, :] < prompt_lengths[:, None]
  seq = jnp.concatenate([jnp.where(prompt_mask, prompts, cfg.pad_id),
                         jnp.full(tokens.shape, cfg.pad_id, jnp.int32)], axis=1).astype(jnp.int32)
  rows = jnp.arange(seq.shape[0])[:, None]
  seq = seq.at[rows, prompt_lengths[:, None] + jnp.arange(n)[None, :]].set(tokens)
  seq_mask = jnp.arange(width + n)[None, :] < (prompt_lengths + lengths)[:, None]
  return Rollout(tokens=tokens, mask=mask, logprobs=jnp.where(mask, logprobs, 0.0),
                 lengths=lengths.astype(jnp.int32), eos=is_eos(last, cfg.eos_ids) & (lengths > 0),
                 sequences=seq, sequence_mask=seq_mask,
                 prompt_lengths=prompt_lengths.astype(jnp.int32), num_steps=num_steps,
                 stats=stats, segments=segments)
