"""The static-shape autoregressive sampler: ragged prompts, one prefill, then a `lax.while_loop`.

Also home of what every sampler shares: `SamplingConfig` (a static jit argument), the `Rollout`
result, prefill and validation helpers used by the speculative loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax.models.cache import KVCache
from specjax.sampling.processing import sample_token


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


# -- helpers shared with the speculative loop ------------------------------------------------------

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
           num_steps=None, stats=None) -> Rollout:
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
                 stats=stats)


# -- the AR sampler -----------------------------------------------------------------------------

@struct.dataclass
class _State:
  step: jax.Array  # int32[] tokens emitted so far by live rows
  last: jax.Array  # int32[B] last emitted token (not yet in the cache)
  cache: KVCache
  tokens: jax.Array  # int32[B, N]
  logprobs: jax.Array  # float32[B, N]
  lengths: jax.Array  # int32[B]
  done: jax.Array  # bool[B]


def _generate(graphdef, params, prompts, prompt_lengths, key, cfg: SamplingConfig,
              cache_size: int) -> Rollout:
  model = nnx.merge(graphdef, params)
  batch, n = prompts.shape[0], cfg.max_new_tokens
  sample = lambda k, logits: sample_token(k, logits, temperature=cfg.temperature,
                                          top_k=cfg.top_k, top_p=cfg.top_p)
  _, cache, logits = prefill(model, prompts, prompt_lengths, cache_size)
  first, first_lp = sample(jax.random.fold_in(key, 0), logits)
  tokens = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(first)
  logprobs = jnp.zeros((batch, n), jnp.float32).at[:, 0].set(first_lp)
  done = is_eos(first, cfg.eos_ids) | (n == 1)
  state = _State(step=jnp.int32(1), last=first, cache=cache, tokens=tokens, logprobs=logprobs,
                 lengths=jnp.ones((batch,), jnp.int32), done=done)

  def body(s: _State) -> _State:
    out = model(s.last[:, None], cache=s.cache)
    tok, lp = sample(jax.random.fold_in(key, s.step), out.logits[:, 0])
    live = ~s.done
    # every live row has emitted exactly `step` tokens, so they all write column `step`
    write = live[:, None] & (jnp.arange(n)[None, :] == s.step)
    lengths = s.lengths + live
    return _State(step=s.step + 1, last=jnp.where(live, tok, s.last),
                  cache=out.cache.advance(live.astype(jnp.int32)),
                  tokens=jnp.where(write, tok[:, None], s.tokens),
                  logprobs=jnp.where(write, lp[:, None], s.logprobs), lengths=lengths,
                  done=s.done | (live & is_eos(tok, cfg.eos_ids)) | (lengths >= n))

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return finish(prompts, prompt_lengths, state.tokens, state.logprobs, state.lengths, cfg,
                num_steps=state.step - 1)


_generate_jit = jax.jit(_generate, static_argnames=("graphdef", "cfg", "cache_size"))


def generate(model, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
             cfg: SamplingConfig, cache_size: int | None = None) -> Rollout:
  """Sample completions of right-padded `prompts[B, P]` (row b has `prompt_lengths[b]` tokens).

  `model` is a `Decoder` or its `(graphdef, params)` split; params are a traced argument, so new
  policy weights reuse the compiled program (one per batch, prompt width, cache size, config).
  `cache_size` defaults to P + max_new_tokens, the least it can be.
  """
  graphdef, params = split_model(model)
  prompts = jnp.asarray(prompts, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  needed = prompts.shape[1] + cfg.max_new_tokens
  cache_size = needed if cache_size is None else int(cache_size)
  check_prompts(prompts, prompt_lengths, cache_size, needed,
                f"prompt width {prompts.shape[1]} + max_new_tokens {cfg.max_new_tokens}")
  return _generate_jit(graphdef, params, prompts, prompt_lengths, key, cfg=cfg,
                       cache_size=cache_size)
