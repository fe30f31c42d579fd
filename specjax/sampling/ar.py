"""The static-shape autoregressive sampler: ragged prompts, one prefill, then a `lax.while_loop`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.models.cache import KVCache
from specjax.sampling.core import (Rollout, SamplingConfig, check_prompts, finish, is_eos, prefill,
                                   split_model)
from specjax.sampling.processing import sample_token


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
