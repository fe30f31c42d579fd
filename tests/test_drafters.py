"""Drafters: n-gram lookup on hand-made contexts, the group-aware search, the draft-model drafter;
and, for every drafter and K, greedy speculative decoding equals greedy AR decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters import (DraftModelDrafter, GroupNgramDrafter, NgramDrafter, ngram,
                              truncated_copy)
from specjax.models import Decoder, ModelConfig
from specjax.sampling import STATIC, SamplingConfig, Sequences, generate, speculative_generate

CFG = ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, mlp_hidden=64, init_std=0.5)
PROMPTS = jnp.array([[3, 7, 3, 7, 3, 7, 3, 7], [9, 4, 11, 9, 4, 0, 0, 0],
                     [20, 21, 0, 0, 0, 0, 0, 0], [5, 6, 7, 8, 5, 6, 7, 0]], jnp.int32)
PROMPT_LENGTHS = jnp.array([8, 5, 2, 7], jnp.int32)
# with seed 0 the greedy continuations emit 18 (row 1) and 13 (row 3) mid-sequence; rows 0 and 2
# run to the limit
lookup = jax.jit(ngram.lookup, static_argnums=(1, 2, 3, 4))
GREEDY = SamplingConfig(max_new_tokens=16, temperature=0.0, eos_ids=(18, 13))


def seqs(rows, lengths, width=16):
  tokens = np.zeros((len(rows), width), np.int32) + 31  # garbage beyond each length
  for b, r in enumerate(rows):
    tokens[b, :len(r)] = r
  return Sequences(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths, jnp.int32),
                   prompt_lengths=jnp.ones((len(rows),), jnp.int32))


def test_ngram_proposes_the_continuation_of_the_most_recent_earlier_occurrence():
  row = [5, 1, 2, 7, 9, 1, 2, 8, 3, 1, 2]
  s = seqs([row], [len(row)])
  np.testing.assert_array_equal(lookup(s, 3, 2, 1, 1), [[8, 3, 1]])
  # past the present the match repeats with period 4 (= 11 - 2 - 5)
  np.testing.assert_array_equal(lookup(s, 6, 2, 1, 1), [[8, 3, 1, 2, 8, 3]])


def test_ngram_backs_off_to_shorter_ngrams_and_else_repeats_the_last_token():
  s = seqs([[4, 6, 9, 1, 6, 9], [1, 2, 3, 4]], [6, 4])
  # "1 6 9" never occurred before, "6 9" did (followed by 1)
  np.testing.assert_array_equal(lookup(s, 2, 3, 1, 1), [[1, 6], [4, 4]])
  # with min_n = 3 the back-off stops before the 2-gram
  np.testing.assert_array_equal(lookup(s, 2, 3, 3, 1), [[9, 9], [4, 4]])


def test_ngram_reads_only_each_rows_committed_tokens():
  # row 0 holds [7, 8] after its length: neither a match nor a continuation may come from there
  s = seqs([[1, 2, 3, 2, 7, 8, 2, 9], [2, 5, 2]], [4, 3])
  np.testing.assert_array_equal(lookup(s, 3, 1, 1, 1), [[3, 2, 3], [5, 2, 5]])


def test_group_ngram_searches_siblings_and_prefers_the_rows_own_match():
  rows = [[1, 2, 3, 4, 5, 6], [9, 8, 3, 4],  # group 0: row 1's "3 4" is only in row 0
          [3, 4, 7, 3, 4], [0, 3, 4]]  # group 1: row 2 matches itself, row 3 its sibling
  s = seqs(rows, [6, 4, 5, 3])
  got = lookup(s, 3, 2, 2, 2)
  np.testing.assert_array_equal(got[0], [6, 6, 6])  # nothing found: repeat
  np.testing.assert_array_equal(got[1], [5, 6, 6])  # sibling continuation, clamped at its end
  np.testing.assert_array_equal(got[2], [7, 3, 4])  # own earlier occurrence, not row 3's
  np.testing.assert_array_equal(got[3], [7, 3, 4])
  # a plain n-gram drafter does not look across rows
  np.testing.assert_array_equal(lookup(s, 3, 2, 2, 1)[1], [4, 4, 4])


def test_group_ngram_rejects_a_batch_that_is_not_a_multiple_of_the_group():
  with pytest.raises(ValueError, match="group_size"):
    ngram.lookup(seqs([[1, 2]] * 3, [2] * 3), 2, 2, 1, 2)


def test_drafter_configs_are_validated_naming_the_field():
  with pytest.raises(ValueError, match="min_n"):
    NgramDrafter(2, n=2, min_n=3)
  with pytest.raises(ValueError, match="group_size"):
    GroupNgramDrafter(2, group_size=0)
  with pytest.raises(ValueError, match="vocab_size"):
    DraftModelDrafter(draft_len=2, graphdef=None)


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


def test_truncated_copy_shares_the_targets_layers_embedding_and_head(target):
  x = PROMPTS[:, :6]
  full = truncated_copy(target, CFG.num_layers)
  np.testing.assert_allclose(full(x).logits, target(x).logits, atol=1e-6)
  one = truncated_copy(target, 1)
  assert one.cfg.num_layers == 1
  np.testing.assert_array_equal(one.layers[0].mlp.up[...], target.layers[0].mlp.up[...])


@pytest.fixture(scope="module")
def ar_greedy(target):
  out = generate(target, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), GREEDY, engine=STATIC)
  # the fixture covers what it should: EOS rows and rows at the limit, ending at different steps
  assert list(np.asarray(out.eos)) == [False, True, False, True], out.tokens
  assert list(np.asarray(out.lengths)) == [16, 11, 16, 8], out.lengths
  return out


def make_drafter(name, k, target):
  if name == "ngram":
    return NgramDrafter(k, n=2), ()
  if name == "group_ngram":
    return GroupNgramDrafter(k, n=3, group_size=2), ()
  return DraftModelDrafter.from_model(truncated_copy(target, 1), k)


# K in {1, 2, 3, 5} for the n-gram drafter, the edges for the others (each pair is one compile
# of the plain loop: these tests pin the drafters; test_engine covers compaction and adaptive K)
@pytest.mark.parametrize("name,k", [("ngram", 1), ("ngram", 2), ("ngram", 3), ("ngram", 5),
                                    ("group_ngram", 3), ("draft_model", 1), ("draft_model", 5)])
def test_greedy_speculative_equals_greedy_autoregressive(target, ar_greedy, name, k):
  drafter, params = make_drafter(name, k, target)
  out = speculative_generate(target, drafter, params, PROMPTS, PROMPT_LENGTHS, jax.random.key(1),
                             GREEDY, engine=STATIC)
  for field in ("tokens", "mask", "lengths", "eos", "sequences", "sequence_mask"):
    np.testing.assert_array_equal(getattr(out, field), getattr(ar_greedy, field), err_msg=field)
  np.testing.assert_allclose(out.logprobs, ar_greedy.logprobs, atol=1e-5)
  # windows longer than one token were exercised
  assert int(out.stats.accepted_per_position.sum()) > 0
