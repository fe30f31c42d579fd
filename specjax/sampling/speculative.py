"""The speculative decoding loop in static shapes: a drafter proposes K tokens, the target scores
K+1 positions in one forward, `rejection.verify` decides, every row commits at its own offset.

Output is distributed exactly as `ar.generate` (same `Rollout`, target log-probabilities), plus
per-row acceptance counts that `metrics.AcceptanceMetrics` turns into vLLM-convention numbers.

Long tail: rows that finish early keep being stepped (their drafts, target positions and verify
draws are computed and discarded) until every row is done; a static-shape program cannot skip
that work per row, so the loop's cost per step is the full batch's. Compaction into a smaller
batch bucket is the caller's job (run the unfinished rows again from their `sequences`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.models.cache import KVCache
from specjax.sampling.core import (Rollout, SamplingConfig, check_prompts, finish, is_eos, prefill,
                                   split_model)
from specjax.sampling.drafter import Drafter, Sequences, TargetStep
from specjax.sampling.metrics import AcceptanceCounts
from specjax.sampling.processing import sample_token
from specjax.sampling.rejection import verify


@struct.dataclass
class _State:
  iteration: jax.Array  # int32[]
  seq: Sequences  # committed tokens; seq.lengths = prompt + generated
  cache: KVCache  # target cache: every committed token except the last one
  tokens: jax.Array  # int32[B, N+K+1] completion buffer
  logprobs: jax.Array  # float32[B, N+K+1]
  lengths: jax.Array  # int32[B] completion lengths
  done: jax.Array  # bool[B]
  drafter_state: Any
  counts: AcceptanceCounts  # per row


def _scatter(buf: jax.Array, new: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
  """buf[b, start[b] + j] = new[b, j] for j < count[b]; nothing else changes."""
  j = jnp.arange(new.shape[1])[None, :]
  idx = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])  # out of range: dropped
  return buf.at[jnp.arange(buf.shape[0])[:, None], idx].set(new.astype(buf.dtype), mode="drop")


def _step(target, drafter: Drafter, drafter_params, cfg: SamplingConfig, key, s: _State) -> _State:
  k, n = drafter.draft_len, cfg.max_new_tokens
  key_draft, key_verify = jax.random.split(jax.random.fold_in(key, s.iteration))
  drafts, draft_probs, dstate = drafter.propose(drafter_params, s.drafter_state, s.seq, key_draft)
  last = jnp.take_along_axis(s.seq.tokens, (s.seq.lengths - 1)[:, None], axis=1)
  inputs = jnp.concatenate([last, drafts.astype(jnp.int32)], axis=1)  # [B, K+1]
  out = target(inputs, cache=s.cache)
  res = verify(key_verify, out.logits, drafts, draft_probs, temperature=cfg.temperature,
               top_k=cfg.top_k, top_p=cfg.top_p)
  live = ~s.done
  # commit the emitted window up to (and including) its first EOS, within max_new_tokens
  pos = jnp.arange(k + 1)[None, :]
  eos_at = jnp.where(is_eos(res.tokens, cfg.eos_ids) & (pos <= res.num_accepted[:, None]),
                     pos, k + 1)
  first_eos = jnp.min(eos_at, axis=1)
  commit = jnp.minimum(jnp.minimum(res.num_accepted + 1, first_eos + 1), n - s.lengths)
  commit = jnp.where(live, commit, 0).astype(jnp.int32)
  lengths = s.lengths + commit
  done = s.done | (live & (first_eos < commit)) | (lengths >= n)
  seq = s.seq.replace(tokens=_scatter(s.seq.tokens, res.tokens, s.seq.lengths, commit),
                      lengths=s.seq.lengths + commit)
  dstate = drafter.observe(drafter_params, dstate, TargetStep(
      input_tokens=inputs, next_tokens=res.tokens, start=s.cache.lengths, num_new=commit, out=out))
  return _State(iteration=s.iteration + 1, seq=seq, cache=out.cache.advance(commit),
                tokens=_scatter(s.tokens, res.tokens, s.lengths, commit),
                logprobs=_scatter(s.logprobs, res.logprobs, s.lengths, commit),
                lengths=lengths, done=done, drafter_state=dstate,
                counts=s.counts.update(res.num_accepted, live))


def _speculative_generate(graphdef, params, drafter: Drafter, drafter_params, prompts,
                          prompt_lengths, key, cfg: SamplingConfig, cache_size: int) -> Rollout:
  target = nnx.merge(graphdef, params)
  batch, width = prompts.shape
  k, n = drafter.draft_len, cfg.max_new_tokens
  key_first, key = jax.random.split(key)
  pre_out, cache, logits = prefill(target, prompts, prompt_lengths, cache_size)
  first, first_lp = sample_token(key_first, logits, temperature=cfg.temperature,
                                 top_k=cfg.top_k, top_p=cfg.top_p)
  rows = jnp.arange(batch)
  seq_tokens = jnp.zeros((batch, cache_size), jnp.int32).at[:, :width].set(prompts)
  seq_tokens = seq_tokens.at[rows, prompt_lengths].set(first)
  seq = Sequences(tokens=seq_tokens, lengths=prompt_lengths + 1, prompt_lengths=prompt_lengths)
  shifted = jnp.concatenate([prompts[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
  next_tokens = shifted.at[rows, prompt_lengths - 1].set(first)
  dstate = drafter.init(drafter_params, batch, cache_size)
  # prompt logits are not computed (B x P x V); drafters get hidden and aux_hidden
  dstate = drafter.observe(drafter_params, dstate, TargetStep(
      input_tokens=prompts, next_tokens=next_tokens, start=jnp.zeros((batch,), jnp.int32),
      num_new=prompt_lengths, out=pre_out.replace(logits=None)))
  state = _State(
      iteration=jnp.int32(0), seq=seq, cache=cache,
      tokens=jnp.zeros((batch, n + k + 1), jnp.int32).at[:, 0].set(first),
      logprobs=jnp.zeros((batch, n + k + 1), jnp.float32).at[:, 0].set(first_lp),
      lengths=jnp.ones((batch,), jnp.int32), done=is_eos(first, cfg.eos_ids) | (n == 1),
      drafter_state=dstate, counts=AcceptanceCounts.zeros(k, batch))
  body = lambda s: _step(target, drafter, drafter_params, cfg, key, s)
  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return finish(prompts, prompt_lengths, state.tokens, state.logprobs, state.lengths, cfg,
                num_steps=state.iteration, stats=state.counts)


_speculative_jit = jax.jit(_speculative_generate,
                           static_argnames=("graphdef", "drafter", "cfg", "cache_size"))


def required_cache_size(prompt_width: int, max_new_tokens: int, draft_len: int) -> int:
  """Prompt + completion + the K+1 positions a verify step writes past a row's end."""
  return prompt_width + max_new_tokens + draft_len + 1


def speculative_generate(target, drafter: Drafter, drafter_params, prompts: jax.Array,
                         prompt_lengths: jax.Array, key: jax.Array, cfg: SamplingConfig,
                         cache_size: int | None = None,
                         draft_len: int | None = None) -> Rollout:
  """Speculative sampling of completions; same contract and distribution as `ar.generate`.

  `target` is a `Decoder` or its `(graphdef, params)`; `drafter` a hashable `Drafter` (static)
  with its params pytree `drafter_params` (traced). `draft_len` overrides `drafter.draft_len`.
  The drafter proposes at the sampling temperature. `Rollout.stats` holds per-row
  `metrics.AcceptanceCounts` (a draft = one live row in one verify step; summarise with
  `AcceptanceMetrics.from_counts`); `Rollout.num_steps` the verify steps of the batch.
  `cache_size` defaults to `required_cache_size(P, max_new_tokens, K)`, the least it can be.
  """
  graphdef, params = split_model(target)
  if not isinstance(drafter, Drafter):
    raise TypeError(f"drafter must be a specjax.sampling.Drafter, got {type(drafter).__name__}")
  k = drafter.draft_len if draft_len is None else draft_len
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"draft_len K must be an int >= 1, got {k!r}")
  drafter = dataclasses.replace(drafter, draft_len=k, temperature=cfg.temperature)
  vocab = nnx.merge(graphdef, params).cfg.vocab_size
  if drafter.vocab_size is not None and drafter.vocab_size != vocab:
    raise ValueError(f"drafter vocab_size={drafter.vocab_size} differs from the target's "
                     f"vocab_size={vocab}: drafter and target must share one vocabulary")
  prompts = jnp.asarray(prompts, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  needed = required_cache_size(prompts.shape[1], cfg.max_new_tokens, k)
  cache_size = needed if cache_size is None else int(cache_size)
  check_prompts(prompts, prompt_lengths, cache_size, needed,
                f"prompt width {prompts.shape[1]} + max_new_tokens {cfg.max_new_tokens} + "
                f"draft_len {k} + 1")
  return _speculative_jit(graphdef, params, drafter, drafter_params, prompts, prompt_lengths, key,
                          cfg=cfg, cache_size=cache_size)
