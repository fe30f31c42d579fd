"""Acceptance metrics (vLLM conventions) against hand-computed cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling.metrics import (AcceptanceCounts, AcceptanceMetrics, acceptance_metrics,
                                      count_acceptance, tokens_per_second)

# 3 steps x 2 rows, K = 3; row 1 was finished (not live) in step 1, so its 2 does not count.
# Live drafts accepted 3, 0, 1, 2, 0 tokens: 5 drafts, 6 accepted of 15 drafted;
# first i+1 all accepted: i=0: {3, 1, 2} -> 3, i=1: {3, 2} -> 2, i=2: {3} -> 1.
NUM_ACCEPTED = np.array([[3, 0], [1, 2], [2, 0]], np.int32)
LIVE = np.array([[True, True], [True, False], [True, True]])


def test_hand_computed_run_follows_vllm_conventions():
  m = acceptance_metrics(NUM_ACCEPTED, LIVE, draft_len=3)
  assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (5, 15, 6)
  assert m.acceptance_length == pytest.approx(1 + 6 / 5)
  assert m.acceptance_rate == pytest.approx(6 / 15)
  assert m.per_position_acceptance_rate == pytest.approx((3 / 5, 2 / 5, 1 / 5))
  summary = m.summary()
  assert summary["acceptance_length"] == pytest.approx(2.2)
  assert summary["per_position_acceptance_rate"] == pytest.approx([0.6, 0.4, 0.2])
  assert summary["num_drafts"] == 5 and summary["draft_len"] == 3


def test_acceptance_length_is_one_plus_the_sum_of_per_position_rates():
  m = acceptance_metrics(NUM_ACCEPTED, LIVE, draft_len=3)
  assert m.acceptance_length == pytest.approx(1 + sum(m.per_position_acceptance_rate))


def test_all_rows_live_by_default():
  m = acceptance_metrics(NUM_ACCEPTED, None, draft_len=3)
  assert (m.num_drafts, m.num_accepted_tokens) == (6, 8)
  assert m.per_position_acceptance_rate == pytest.approx((4 / 6, 3 / 6, 1 / 6))


def test_counts_accumulate_inside_jit_pooled_and_per_row():
  @jax.jit
  def run(num_accepted, live):
    def step(carry, x):
      pooled, per_row = carry
      return (pooled.update(*x), per_row.update(*x)), None
    init = (AcceptanceCounts.zeros(3), AcceptanceCounts.zeros(3, batch=2))
    return jax.lax.scan(step, init, (num_accepted, live))[0]

  pooled, per_row = run(jnp.asarray(NUM_ACCEPTED), jnp.asarray(LIVE))
  assert pooled.num_drafts.dtype == jnp.int32 and pooled.accepted_per_position.shape == (3,)
  np.testing.assert_array_equal(per_row.num_drafts, [3, 2])
  np.testing.assert_array_equal(per_row.accepted_per_position, [[3, 2, 1], [0, 0, 0]])
  np.testing.assert_array_equal(per_row.pooled().accepted_per_position, [3, 2, 1])
  assert AcceptanceMetrics.from_counts(pooled) == AcceptanceMetrics.from_counts(per_row)
  assert AcceptanceMetrics.from_counts(pooled) == acceptance_metrics(NUM_ACCEPTED, LIVE, 3)


def test_counts_of_separate_runs_add_up():
  a = count_acceptance(NUM_ACCEPTED[:1], LIVE[:1], 3)
  b = count_acceptance(NUM_ACCEPTED[1:], LIVE[1:], 3)
  assert AcceptanceMetrics.from_counts(a + b) == acceptance_metrics(NUM_ACCEPTED, LIVE, 3)


def test_no_drafts_gives_nan_rates():
  m = AcceptanceMetrics.from_counts(AcceptanceCounts.zeros(2))
  assert m.num_drafts == 0 and m.num_accepted_tokens == 0
  assert math.isnan(m.acceptance_length) and math.isnan(m.acceptance_rate)
  assert all(math.isnan(r) for r in m.per_position_acceptance_rate)


def test_tokens_per_second_sums_counts_lengths_or_masks():
  assert tokens_per_second(100, 2.0) == pytest.approx(50.0)
  assert tokens_per_second(jnp.array([3, 4]), 0.5) == pytest.approx(14.0)
  assert tokens_per_second(np.array([[True, False], [True, True]]), 1.5) == pytest.approx(2.0)
  with pytest.raises(ValueError, match="seconds"):
    tokens_per_second(10, 0.0)


def test_bad_inputs_raise_value_errors():
  with pytest.raises(ValueError, match="draft_len"):
    AcceptanceCounts.zeros(0)
  with pytest.raises(ValueError, match=r"\[steps, B\]"):
    count_acceptance(NUM_ACCEPTED[0], None, 3)
  with pytest.raises(ValueError, match="live"):
    count_acceptance(NUM_ACCEPTED, LIVE[:, :1], 3)
