"""The speculative loop: EOS inside accepted windows, per-row length limits, acceptance counts,
the distribution of temperature-1 rollouts versus AR sampling (with the engine's live-batch
compaction and adaptive draft length on), target logprobs, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from program_count import assert_the_count_rises_when_programs_compile

from specjax.models import Decoder, ModelConfig
from specjax.sampling import AcceptanceMetrics, SamplingConfig, generate, speculative_generate
from specjax.drafters import DraftModelDrafter, NgramDrafter
from specjax.drafters.draft_model import truncated_copy
from specjax.sampling import engine, speculative
from specjax.sampling import STATIC, EngineConfig
from specjax.sampling.engine_config import (AdaptiveConfig, BucketConfig, CalibrationConfig,
                                            PagingConfig, QueueConfig)
import stats

# the same tiny target, prompts and greedy config as test_drafters (programs are shared)
CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, mlp_hidden=64, init_std=0.5)
PROMPTS = jnp.array([[3, 7, 3, 7, 3, 7, 3, 7], [9, 4, 11, 9, 4, 0, 0, 0],
                     [20, 21, 0, 0, 0, 0, 0, 0], [5, 6, 7, 8, 5, 6, 7, 0]], jnp.int32)
PROMPT_LENGTHS = jnp.array([8, 5, 2, 7], jnp.int32)
GREEDY = SamplingConfig(max_new_tokens=16, temperature=0.0, eos_ids=(18, 13))
K = 3


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def greedy_runs(target):
  """AR greedy and speculative greedy with a draft identical to the target (all drafts accepted):
  windows are [1..4], [5..8], [9..12], [13..15]; row 1 emits EOS at 10, row 3 at 7 (both inside
  a window), rows 0 and 2 reach 16 tokens inside the last window."""
  ar = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY)
  drafter, params = DraftModelDrafter.from_model(target, K)
  spec = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS,
                              jax.random.key(1), GREEDY, engine=STATIC)  # K = 3 at every step
  return ar, spec, drafter, params


def test_a_draft_identical_to_the_target_has_every_greedy_draft_accepted(greedy_runs):
  _, spec, _, _ = greedy_runs
  s = spec.stats  # per row; a draft is one row in one verify step
  np.testing.assert_array_equal(s.accepted_per_position, np.repeat(s.num_drafts[:, None], K, 1))
  # one prefill token, then K + 1 per step
  np.testing.assert_array_equal(s.num_drafts, -(-(spec.lengths - 1) // (K + 1)))
  assert int(spec.num_steps) == int(s.num_drafts.max())
  m = AcceptanceMetrics.from_counts(s)
  assert m.acceptance_length == K + 1 and m.acceptance_rate == 1.0


def test_eos_inside_an_accepted_window_ends_the_row_there(greedy_runs):
  ar, spec, _, _ = greedy_runs
  np.testing.assert_array_equal(spec.tokens, ar.tokens)
  np.testing.assert_array_equal(spec.lengths, [16, 11, 16, 8])
  np.testing.assert_array_equal(spec.eos, [False, True, False, True])
  for row, eos_at in ((1, 10), (3, 7)):
    assert (eos_at - 1) % (K + 1) != K  # not the window's last token: later tokens were dropped
    assert int(spec.tokens[row, eos_at]) in GREEDY.eos_ids
    assert not np.any(np.isin(spec.tokens[row, :eos_at], GREEDY.eos_ids))
    assert np.all(np.asarray(spec.tokens[row, eos_at + 1:]) == GREEDY.pad_id)
    assert not np.any(spec.mask[row, eos_at + 1:]) and np.all(spec.mask[row, :eos_at + 1])
    assert np.all(np.asarray(spec.logprobs[row, eos_at + 1:]) == 0.0)


def test_rows_reaching_max_new_tokens_mid_window_are_truncated(greedy_runs):
  ar, spec, _, _ = greedy_runs
  n = GREEDY.max_new_tokens
  for row in (0, 2):
    assert int(spec.lengths[row]) == n and (n - 1) % (K + 1) != 0
    assert int(spec.stats.num_drafts[row]) == -(-(n - 1) // (K + 1))
  np.testing.assert_array_equal(spec.sequences, ar.sequences)
  np.testing.assert_array_equal(spec.sequence_mask, ar.sequence_mask)
  np.testing.assert_allclose(spec.logprobs, ar.logprobs, atol=1e-5)


def test_new_target_params_reuse_the_compiled_loop(target, greedy_runs):
  _, _, drafter, params = greedy_runs
  graphdef, target_params = nnx.split(target)
  before = engine.compiled_programs()
  shifted = jax.tree.map(lambda x: x * 1.01, target_params)
  out = speculative_generate((graphdef, shifted), drafter, params, PROMPTS, PROMPT_LENGTHS,
                             jax.random.key(1), GREEDY, engine=STATIC)
  jax.block_until_ready(out.tokens)
  assert engine.compiled_programs() == before
  assert_the_count_rises_when_programs_compile(lambda: speculative_generate(
      (graphdef, shifted), drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY,
      engine=STATIC).tokens)


@pytest.mark.parametrize("width,depth", [(2, 0), (3, 1)])
def test_greedy_draft_trees_equal_greedy_autoregressive(target, greedy_runs, width, depth):
  # the target's first layer as the draft: its chains are often rejected where its next most
  # likely token is the target's (depth 1: alternatives at the first depth only)
  ar = greedy_runs[0]
  other = truncated_copy(target, 1)
  for tree_width in (1, width):
    drafter, params = DraftModelDrafter.from_model(other, K, tree_width=tree_width,
                                                   tree_depth=depth)
    # the chain's adaptive engine is test_engine's; here it gives the chain's acceptance only
    for eng in (STATIC, EngineConfig()) if tree_width > 1 else (STATIC,):
      out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS,
                                 jax.random.key(1), GREEDY, engine=eng)
      np.testing.assert_array_equal(out.tokens, ar.tokens)
      np.testing.assert_array_equal(out.lengths, ar.lengths)
      if eng is STATIC:
        accepted = AcceptanceMetrics.from_counts(out.stats).num_accepted_tokens
        if tree_width == 1:
          chain_accepted = accepted
  assert accepted > chain_accepted  # the alternatives were accepted where the chain was not


def test_draft_trees_need_a_ranking_drafter_and_run_on_pages(target, greedy_runs):
  with pytest.raises(ValueError, match="drafts chains only"):
    speculative_generate(target, NgramDrafter(K, n=2, tree_width=2), (), PROMPTS,
                         PROMPT_LENGTHS, jax.random.key(1), GREEDY)
  # paged KV memory verifies trees too (tests/test_paged_engine.py), of at most
  # MAX_TREE_TOKENS nodes (K = 11, 3 candidates per depth: 34)
  paged = EngineConfig(queue=QueueConfig(max_rows=4), paging=PagingConfig(kv_cache_gb=0.01),
                       adaptive=AdaptiveConfig(enabled=False))
  drafter, params = DraftModelDrafter.from_model(target, K, tree_width=2)
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=paged)
  np.testing.assert_array_equal(out.tokens, greedy_runs[0].tokens)
  np.testing.assert_array_equal(out.lengths, greedy_runs[0].lengths)
  with pytest.raises(ValueError, match="at most 32 nodes.*has 34"):
    speculative_generate(target, DraftModelDrafter.from_model(target, 11, tree_width=3)[0],
                         params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY,
                         engine=paged)
  with pytest.raises(ValueError, match="tree_width must be an int >= 1"):
    speculative_generate(target, DraftModelDrafter.from_model(target, K, tree_width=0)[0],
                         params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY)
  with pytest.raises(ValueError, match="tree_depth must be an int >= 0"):
    speculative_generate(target, DraftModelDrafter.from_model(target, K, tree_width=2,
                                                              tree_depth=-1)[0],
                         params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1), GREEDY)


def test_bad_inputs_raise_clear_errors(target, greedy_runs):
  _, _, drafter, params = greedy_runs
  run = lambda d=drafter, p=params, **kw: speculative_generate(
      target, d, p, kw.pop("prompts", PROMPTS), kw.pop("lengths", PROMPT_LENGTHS),
      jax.random.key(0), GREEDY, **kw)
  with pytest.raises(ValueError, match="draft_len"):
    run(draft_len=0)
  needed = speculative.required_cache_size(8, GREEDY.max_new_tokens, K)
  with pytest.raises(ValueError, match=f"cache_size={needed - 1} is too small"):
    run(cache_size=needed - 1)
  with pytest.raises(ValueError, match="is too small"):  # K larger than the remaining cache
    run(cache_size=needed, draft_len=K + 1)
  with pytest.raises(ValueError, match="longer than the cache"):
    run(cache_size=6)
  with pytest.raises(ValueError, match="prompt_lengths"):
    run(lengths=jnp.array([8, 0, 2, 7]))
  small_vocab = Decoder(CFG.replace(vocab_size=16, num_layers=1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="vocab_size=16 differs from the target's vocab_size=32"):
    run(*DraftModelDrafter.from_model(small_vocab, K))
  with pytest.raises(TypeError, match="Drafter"):
    run(d=object())


# -- temperature 1: spec-decoded rollouts are distributed as AR-sampled rollouts -------------------

ROWS = 8192  # per sampler
SAMPLE = SamplingConfig(max_new_tokens=6, temperature=1.0, eos_ids=(5,))
POSITIONS = (1, 2, 3, 4)
ALPHA = 1e-3  # family-wise, Bonferroni over the positions and the pair test of each drafter
# The engine's defaults (compaction, adaptive K) with two bucket sizes and one calibration repeat:
# about a quarter of the rows end early, so the live batch never fits even the half bucket, and
# the default's further halvings would only be compiled and calibrated (63 -> 19 s, 44 -> 14 s).
ENGINE = EngineConfig(buckets=BucketConfig(max_buckets=2), calibration=CalibrationConfig(repeats=1))


def stat_prompts():
  """Two ragged prompts alternating over the rows (the second repeats itself for the n-gram)."""
  a = jnp.array([3, 7, 3, 7, 3, 7, 3, 7])
  b = jnp.array([9, 4, 11, 9, 4, 0, 0, 0])
  prompts = jnp.where((jnp.arange(ROWS) % 2 == 0)[:, None], a, b).astype(jnp.int32)
  return prompts, jnp.where(jnp.arange(ROWS) % 2 == 0, 8, 5).astype(jnp.int32)


def categories(out) -> np.ndarray:
  """int[B, N]: (prompt kind, token) per position; finished positions are token V (end)."""
  v = CFG.vocab_size
  tok = np.where(np.asarray(out.mask), np.asarray(out.tokens), v)
  return tok + (v + 1) * (np.arange(ROWS) % 2)[:, None]


@pytest.fixture(scope="module")
def ar_samples(target):
  prompts, lengths = stat_prompts()
  return generate(target, prompts, lengths, jax.random.key(10), SAMPLE)


@pytest.fixture(scope="module",
                params=["draft_model", "ngram", "draft_model_tree", "draft_model_tree_argmax",
                        "draft_model_tree_paged"])
def spec_samples(request, target):
  prompts, lengths = stat_prompts()
  engine = ENGINE
  if request.param.endswith("_paged"):  # the tree on paged KV memory at every step (K fixed)
    engine = ENGINE.replace(paging=dict(kv_cache_gb=0.1, page_size=4, page_ahead=4),
                            adaptive=dict(enabled=False))
  if request.param == "ngram":
    drafter, params = NgramDrafter(K, n=2), ()
  else:  # an unrelated random draft: q far from p, the residual correction matters
    other = Decoder(CFG.replace(num_layers=1), rngs=nnx.Rngs(7))
    # (a tree: the draft's 2 next most likely tokens tried at each depth after a rejection;
    # argmax: its chain the draft's most likely tokens, alternatives at the first depth only)
    tree = "_tree" in request.param
    argmax = request.param.endswith("argmax")
    drafter, params = DraftModelDrafter.from_model(
        other, K, tree_width=3 if tree else 1, tree_depth=1 if argmax else 0,
        tree_argmax=argmax)
  return request.param, speculative_generate(target, drafter, params, prompts, lengths,
                                             jax.random.key(20), SAMPLE, engine=engine)


def test_temperature_one_speculative_matches_autoregressive_distribution(ar_samples,
                                                                          spec_samples):
  name, spec = spec_samples
  accepted = AcceptanceMetrics.from_counts(spec.stats).num_accepted_tokens
  assert accepted > ROWS // 4, f"too few accepted drafts ({accepted}) to be a test"
  a, b = categories(ar_samples), categories(spec)
  num_cats = 2 * (CFG.vocab_size + 1)
  alpha = stats.bonferroni(ALPHA, len(POSITIONS) + 1)
  for j in POSITIONS:
    stats.assert_two_sample_same(a[:, j], b[:, j], num_cats, alpha, what=f"{name} position {j}")
  stats.assert_two_sample_same(stats.pair_index(a[:, 1], a[:, 2], num_cats),
                               stats.pair_index(b[:, 1], b[:, 2], num_cats), num_cats ** 2,
                               alpha, what=f"{name} positions (1, 2)")


def test_speculative_logprobs_are_the_targets_logprobs_of_the_emitted_tokens(target,
                                                                              spec_samples):
  _, spec = spec_samples
  logits = jax.jit(lambda x: target(x).logits)(spec.sequences)
  logp = jax.nn.log_softmax(logits, axis=-1)  # temperature 1, no filtering
  idx = spec.prompt_lengths[:, None] + jnp.arange(SAMPLE.max_new_tokens)[None, :] - 1
  want = jnp.take_along_axis(jnp.take_along_axis(logp, idx[..., None], axis=1),
                             spec.tokens[..., None], axis=2)[..., 0]
  np.testing.assert_allclose(np.where(spec.mask, want, 0.0), spec.logprobs, atol=1e-4)
