"""The AR sampler: greedy equals a full-forward loop, processed-target logprobs, EOS and length
handling, rollout layout, first-token distribution, no recompilation for new params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import stats
from program_count import assert_the_count_rises_when_programs_compile

from specjax.models import Decoder, ModelConfig
from specjax.sampling import SamplingConfig, generate, process_logits
from specjax.sampling import buckets, engine

# the same tiny target, prompts and configs as test_drafters / test_speculative (shared programs)
CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, mlp_hidden=64, init_std=0.5)
PROMPTS = jnp.array([[3, 7, 3, 7, 3, 7, 3, 7], [9, 4, 11, 9, 4, 0, 0, 0],
                     [20, 21, 0, 0, 0, 0, 0, 0], [5, 6, 7, 8, 5, 6, 7, 0]], jnp.int32)
PROMPT_LENGTHS = jnp.array([8, 5, 2, 7], jnp.int32)
GREEDY = SamplingConfig(max_new_tokens=16, temperature=0.0, eos_ids=(18, 13))
FILTERED = SamplingConfig(max_new_tokens=16, temperature=0.7, top_k=6, top_p=0.9, eos_ids=(18, 13))


@pytest.mark.parametrize("kw,field", [({"max_new_tokens": 0}, "max_new_tokens"),
                                      ({"temperature": -0.1}, "temperature"),
                                      ({"top_k": 0}, "top_k"), ({"top_p": 1.5}, "top_p"),
                                      ({"eos_ids": (-1,)}, "eos_ids"), ({"pad_id": -2}, "pad_id")])
def test_sampling_config_rejects_bad_fields_naming_them(kw, field):
  with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
    SamplingConfig(**kw)


def test_sampling_config_is_hashable_so_it_can_be_a_static_jit_argument():
  assert hash(SamplingConfig(eos_ids=[1, 2])) == hash(SamplingConfig(eos_ids=(1, 2)))


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def full_logits(target):
  """Logits of a full (cache-free) forward over [B, P + N] tokens."""
  return jax.jit(lambda x: target(x).logits)


def full_forward_greedy(target, n):
  """Reference greedy completions [B, n]: recompute everything every token, ignore EOS."""
  logits = jax.jit(lambda x: target(x).logits)
  rows = jnp.arange(4)
  buf = jnp.zeros((4, PROMPTS.shape[1] + n), jnp.int32).at[:, :8].set(PROMPTS)
  for j in range(n):
    pos = PROMPT_LENGTHS + j
    tok = jnp.argmax(logits(buf)[rows, pos - 1], axis=-1)
    buf = buf.at[rows, pos].set(tok)
  return [np.asarray(buf[b, int(PROMPT_LENGTHS[b]):int(PROMPT_LENGTHS[b]) + n]) for b in range(4)]


def assert_greedy_equals(out, refs, cfg):
  for b, ref in enumerate(refs):
    hits = np.flatnonzero(np.isin(ref, cfg.eos_ids))
    length = int(hits[0]) + 1 if hits.size else cfg.max_new_tokens
    assert int(out.lengths[b]) == length
    np.testing.assert_array_equal(out.tokens[b, :length], ref[:length])


def test_greedy_generate_equals_a_full_forward_argmax_loop(target):
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY)
  assert_greedy_equals(out, full_forward_greedy(target, GREEDY.max_new_tokens), GREEDY)
  np.testing.assert_array_equal(out.eos, [False, True, False, True])  # both kinds of rows


def test_greedy_decode_and_verify_reading_the_cache_in_chunks_equal_a_full_forward_loop(
    monkeypatch):
  """The engine's cached steps with attention read a chunk at a time up to the live extent
  (`layers.attend_cache`; forced here: the tiny target's caches are below the size where it
  starts), AR and speculative (verify blocks of K + 1 = 4 queries), against full forwards."""
  from specjax.drafters import NgramDrafter
  from specjax.models import cache
  from specjax.sampling import speculative_generate
  monkeypatch.setattr(cache, "CACHE_CHUNK", 5)
  monkeypatch.setattr(cache, "CACHE_CHUNK_MIN_BYTES", 0)
  # a target of its own, so its programs are traced with the chunks on
  chunked = Decoder(CFG.replace(init_std=0.45), rngs=nnx.Rngs(1))
  cfg = SamplingConfig(max_new_tokens=24, temperature=0.0, eos_ids=(18,))
  refs = full_forward_greedy(chunked, cfg.max_new_tokens)
  assert_greedy_equals(generate(chunked, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), cfg), refs,
                       cfg)
  spec = speculative_generate(chunked, NgramDrafter(draft_len=3), None, PROMPTS, PROMPT_LENGTHS,
                              jax.random.key(0), cfg)
  assert_greedy_equals(spec, refs, cfg)


@pytest.fixture(scope="module")
def filtered(target):
  return generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(3), FILTERED)


def test_logprobs_are_the_processed_targets_logprobs_of_the_emitted_tokens(filtered, full_logits):
  out = filtered
  logp = process_logits(full_logits(out.sequences), temperature=FILTERED.temperature,
                        top_k=FILTERED.top_k, top_p=FILTERED.top_p)
  idx = out.prompt_lengths[:, None] + jnp.arange(FILTERED.max_new_tokens)[None, :] - 1
  want = jnp.take_along_axis(jnp.take_along_axis(logp, idx[..., None], axis=1),
                             out.tokens[..., None], axis=2)[..., 0]
  assert np.all(np.isfinite(np.where(out.mask, want, 0.0)))  # only top-k / top-p tokens emitted
  np.testing.assert_allclose(np.where(out.mask, want, 0.0), out.logprobs, atol=1e-4)


def test_rollout_layout_pads_after_the_end_and_joins_prompt_and_completion(filtered):
  out = jax.device_get(filtered)
  n, width = FILTERED.max_new_tokens, PROMPTS.shape[1]
  for b in range(4):
    plen, length = int(PROMPT_LENGTHS[b]), int(out.lengths[b])
    eos = np.isin(out.tokens[b, :length], FILTERED.eos_ids)
    # a row ends at its first EOS or at max_new_tokens, and nothing changes after that
    assert (eos.sum() == 1 and eos[-1]) if out.eos[b] else (eos.sum() == 0 and length == n)
    np.testing.assert_array_equal(out.mask[b], np.arange(n) < length)
    assert np.all(out.tokens[b, length:] == FILTERED.pad_id)
    assert np.all(out.logprobs[b, length:] == 0.0) and np.all(out.logprobs[b, :length] <= 0.0)
    want = np.concatenate([PROMPTS[b, :plen], out.tokens[b, :length]])
    np.testing.assert_array_equal(out.sequences[b, :plen + length], want)
    assert np.all(out.sequences[b, plen + length:] == FILTERED.pad_id)
    np.testing.assert_array_equal(out.sequence_mask[b], np.arange(width + n) < plen + length)
  assert int(out.num_steps) == int(out.lengths.max()) - 1  # decode steps after the prefill


def test_new_policy_params_reuse_the_compiled_program(target):
  graphdef, params = nnx.split(target)
  generate((graphdef, params), PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY)
  before = engine.compiled_programs()
  for scale in (1.01, 0.99):
    new = jax.tree.map(lambda x: x * scale, params)
    jax.block_until_ready(generate((graphdef, new), PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                                   GREEDY).tokens)
  assert engine.compiled_programs() == before
  assert_the_count_rises_when_programs_compile(lambda: generate(
      (graphdef, params), PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY).tokens)


def test_bad_inputs_raise_clear_errors(target):
  with pytest.raises(ValueError, match="cache_size=23 is too small"):
    generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, cache_size=23)
  with pytest.raises(ValueError, match="longer than the cache"):
    generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, cache_size=7)
  with pytest.raises(ValueError, match="prompt_lengths"):
    generate(target, PROMPTS, jnp.array([8, 5, 9, 7]), jax.random.key(0), GREEDY)
  with pytest.raises(ValueError, match="prompt_lengths"):
    generate(target, PROMPTS, PROMPT_LENGTHS[:3], jax.random.key(0), GREEDY)


# same rows and config as test_speculative's distribution test (one shared program)
ROWS = 8192
SAMPLE = SamplingConfig(max_new_tokens=6, temperature=1.0, eos_ids=(5,))


@pytest.mark.parametrize("layout", ["interleaved", "grouped"])
def test_first_token_is_distributed_as_the_target_after_each_ragged_prompt(target, layout):
  """Chi-square goodness of fit, alpha = 1e-3 (Bonferroni over the 2 prompts), 4096 rows each.
  "grouped": each prompt's rows are consecutive (GRPO groups), so the engine prefills each prompt
  once and hands its cache to 4096 rows, which must still sample independently."""
  a = jnp.array([3, 7, 3, 7, 3, 7, 3, 7])
  b = jnp.array([9, 4, 11, 9, 4, 0, 0, 0])
  rows = jnp.arange(ROWS)
  first_kind = rows % 2 == 0 if layout == "interleaved" else rows < ROWS // 2
  prompts = jnp.where(first_kind[:, None], a, b).astype(jnp.int32)
  lengths = jnp.where(first_kind, 8, 5).astype(jnp.int32)
  assert buckets.prompt_group(prompts, lengths) == (1 if layout == "interleaved" else ROWS // 2)
  out = generate(target, prompts, lengths, jax.random.key(10), SAMPLE)
  first = np.asarray(out.tokens[:, 0])
  for kind, (prompt, plen) in enumerate(((a, 8), (b, 5))):
    probs = jax.nn.softmax(target(prompt[None, :plen]).logits[0, -1])
    rows = np.flatnonzero(np.asarray(first_kind) == (kind == 0))
    stats.assert_same_distribution(first[rows], np.asarray(probs), stats.bonferroni(1e-3, 2),
                                   what=f"first token after prompt {kind} ({layout})")
