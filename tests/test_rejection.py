"""Tests of the lossless verifier: exact distributions (statistical), greedy, shapes, bad inputs.

Statistical checks: 200k rows per case in one jit, fixed seeds, chi-square at ALPHA per check.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling.processing import process_logits
from specjax.sampling.rejection import VerifyResult, verify
import stats
from stats import assert_same_distribution, pair_index, sample_rows, softmax

NUM_ROWS = 200_000
DRAFT_LEN = 3
VOCAB = 8
SETTINGS = {
  "temperature_1": dict(temperature=1.0),
  "temperature_0.7": dict(temperature=0.7),
  "top_k_3": dict(temperature=1.0, top_k=3),
  "top_p_0.8": dict(temperature=0.9, top_p=0.8),
}
DRAFTS = ["random", "adversarial", "equal", "one_hot", "deterministic"]
# 3 checks per (setting, draft) case + 4 bonus checks: 64; Bonferroni: family-wise false-failure
# rate <= 64 * ALPHA < 0.7%. The seeds are fixed, so a pass is reproducible; a broken verifier gives
# p-values below 1e-50 at this sample size (see test_skipping_the_residual_correction_...).
ALPHA = 1e-4

# How the "pair" check is built. target_logits[:, i] is the target's distribution after the prefix
# + drafts[:i], so verify only ever sees the second position's distribution conditioned on the
# *drafted* first token. The joint of (tokens[0], tokens[1]) restricted to num_accepted >= 1 is not
# the AR joint (conditioning on acceptance tilts the first token towards what q proposes). Instead
# the target here is a Markov chain: p(x1) from `first_logits`, p(x2 | x1) from row x1 of
# `next_logits`, and target_logits[:, i] = next_logits[drafts[:, i-1]] exactly as the target model
# would score the drafted prefix. The second emitted token of the sequence is tokens[1] when the
# first draft was accepted; otherwise the step ended after the first token and the loop's next
# step samples it from p(. | x1): here drawn directly from the processed next_logits[x1]. The pair
# must then follow p(x1) p(x2 | x1), which tests the correction at position 0, the conditional
# at position 1 given an accepted first draft (accepted second draft or residual there) and that
# mixing the two branches is exact. The count of accepted drafts must follow the exact law
# computed from min(p, q) along the chain, which catches lossless-but-wasteful verifiers.


@functools.partial(jax.jit, static_argnames="setting")
def _process(logits, setting):
  return process_logits(logits, **dict(setting))


@functools.lru_cache(maxsize=None)
def _case(setting: str, draft: str):
  """Problem of a (setting, draft) case, seeded by its index: the target chain (logits and the
  processed probabilities, float64) and the proposal chain q the drafts are drawn from."""
  seed = 10 * DRAFTS.index(draft) + list(SETTINGS).index(setting)
  rng = np.random.default_rng(seed)
  first_logits = (1.2 * rng.standard_normal(VOCAB)).astype(np.float32)
  next_logits = (1.2 * rng.standard_normal((VOCAB, VOCAB))).astype(np.float32)
  both = np.asarray(_process(np.concatenate([first_logits[None], next_logits]),
                            tuple(SETTINGS[setting].items())))
  processed = [both[0], both[1:]]
  if draft == "random":
    q = [softmax(1.2 * rng.standard_normal(x.shape)) for x in (first_logits, next_logits)]
  elif draft == "adversarial":  # mass on what the target finds unlikely, filtered tokens included
    q = [0.8 * softmax(-2.0 * x) + 0.2 / VOCAB for x in (first_logits, next_logits)]
  elif draft == "equal":  # q = p exactly: every draft must be accepted
    q = [np.exp(lp) for lp in processed]
  elif draft == "one_hot":  # point mass on the target's runner-up, given as probabilities
    q = [np.eye(VOCAB)[np.argsort(-x, axis=-1)[..., 1]] for x in (first_logits, next_logits)]
  else:  # deterministic (draft_probs=None): drafts from a near-target drafter, see below
    q = [softmax(x + 0.7 * rng.standard_normal(x.shape)) for x in (first_logits, next_logits)]
  q_first, q_next = (np.asarray(x, np.float32) for x in q)
  p_first, p_next = (np.exp(lp.astype(np.float64)) for lp in processed)
  return first_logits, next_logits, q_first, q_next, p_first, p_next


def _key(seed: int) -> jax.Array:
  # rbg keys: the same statistics as the default threefry, several times faster to compile on CPU
  return jax.random.key(seed, impl="rbg")


def verify_without_residual(key, target_logits, draft_tokens, draft_probs, **setting):
  """A BROKEN verifier for the tests only: same acceptance, but after a rejection it samples the
  target p instead of normalize(max(0, p - q))."""
  k_verify, k_fresh = jax.random.split(key)
  res = verify(k_verify, target_logits, draft_tokens, draft_probs, **setting)
  fresh = jax.random.categorical(k_fresh, process_logits(target_logits, **setting), axis=-1)
  at_rejection = ((jnp.arange(DRAFT_LEN + 1) == res.num_accepted[:, None])
                  & (res.num_accepted < DRAFT_LEN)[:, None])
  return res.replace(tokens=jnp.where(at_rejection, fresh, res.tokens))


@functools.partial(jax.jit, static_argnames=("setting", "deterministic", "verifier"))
def _verify_chain(key, first_logits, next_logits, q_first, q_next, drafts, *, setting,
                  deterministic, verifier=verify):
  """Score the drafted prefixes with the target chain and verify; one compile per setting."""
  rows = drafts.shape[0]
  target_logits = jnp.concatenate([jnp.broadcast_to(first_logits, (rows, 1, VOCAB)),
                                   next_logits[drafts]], axis=1)
  probs = jnp.concatenate([jnp.broadcast_to(q_first, (rows, 1, VOCAB)),
                           q_next[drafts[:, :-1]]], axis=1)
  res = verifier(key, target_logits, drafts, None if deterministic else probs, **dict(setting))
  return res.tokens, res.num_accepted


@functools.lru_cache(maxsize=None)
def _sampled(setting: str, draft: str, broken: bool = False):
  """(first, second, num_accepted, tokens) of NUM_ROWS verified rows of a case (numpy)."""
  first_logits, next_logits, q_first, q_next, _, p_next = _case(setting, draft)
  seed = 1000 + 10 * DRAFTS.index(draft) + list(SETTINGS).index(setting)
  rng = np.random.default_rng(seed)
  # drafts: a Markov chain from q (a deterministic drafter's proposals may be any function of the
  # context; drawing them at random, independently of the verifier's randomness, covers that)
  drafts = [sample_rows(rng, np.broadcast_to(q_first, (NUM_ROWS, VOCAB)))]
  for _ in range(DRAFT_LEN - 1):
    drafts.append(sample_rows(rng, q_next[drafts[-1]]))
  tokens, num_accepted = _verify_chain(
      _key(seed), first_logits, next_logits, q_first, q_next,
      np.stack(drafts, axis=1), setting=tuple(SETTINGS[setting].items()),
      deterministic=draft == "deterministic",
      verifier=verify_without_residual if broken else verify)
  tokens, num_accepted = np.asarray(tokens), np.asarray(num_accepted)
  first = tokens[:, 0]
  continuation = sample_rows(rng, p_next[first])
  second = np.where(num_accepted >= 1, tokens[:, 1], continuation)
  return first, second, num_accepted, tokens


def _accepted_law(setting: str, draft: str) -> np.ndarray:
  """Exact P(num_accepted = j), j = 0..K: chain the per-token acceptance mass min(p, q)."""
  _, _, q_first, q_next, p_first, p_next = _case(setting, draft)
  q_first, q_next = q_first.astype(np.float64), q_next.astype(np.float64)
  if draft == "deterministic":  # q one-hot on the drafted token: accept with p(x)
    mass_first, mass_next = q_first * p_first, q_next * p_next
  else:
    mass_first, mass_next = np.minimum(p_first, q_first), np.minimum(p_next, q_next)
  at_least = [1.0]
  reach = mass_first  # reach[x]: P(first j drafts accepted and the j-th is x)
  for _ in range(DRAFT_LEN):
    at_least.append(reach.sum())
    reach = reach @ mass_next
  at_least.append(0.0)
  return np.clip(-np.diff(at_least), 0.0, None)


GRID = [(s, d) for s in SETTINGS for d in DRAFTS]


@pytest.mark.parametrize("setting,draft", GRID)
def test_first_emitted_token_is_distributed_as_the_processed_target(setting, draft):
  first, *_ = _sampled(setting, draft)
  p_first = _case(setting, draft)[4]
  assert_same_distribution(first, p_first, ALPHA, what=f"first token {setting}/{draft}")


@pytest.mark.parametrize("setting,draft", GRID)
def test_first_two_emitted_tokens_follow_the_target_chain(setting, draft):
  first, second, *_ = _sampled(setting, draft)
  *_, p_first, p_next = _case(setting, draft)
  joint = p_first[:, None] * p_next
  assert_same_distribution(pair_index(first, second, VOCAB), joint.reshape(-1), ALPHA,
                           what=f"(first, second) {setting}/{draft}")


@pytest.mark.parametrize("setting,draft", GRID)
def test_number_of_accepted_drafts_follows_the_min_p_q_law(setting, draft):
  _, _, num_accepted, _ = _sampled(setting, draft)
  law = _accepted_law(setting, draft)
  assert_same_distribution(num_accepted, law, ALPHA, what=f"num_accepted {setting}/{draft}")
  if draft == "equal":
    assert (num_accepted == DRAFT_LEN).all()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_bonus_token_follows_the_target_after_all_drafts_are_accepted(setting):
  # with q = p every draft is accepted and the row emits K drafts + the bonus drawn from p at
  # position K: (tokens[K-1], tokens[K]) must follow P(x_K) p(x_{K+1} | x_K) of the chain
  _, _, num_accepted, tokens = _sampled(setting, "equal")
  *_, p_first, p_next = _case(setting, "equal")
  marginal = p_first @ np.linalg.matrix_power(p_next, DRAFT_LEN - 1)
  joint = marginal[:, None] * p_next
  assert (num_accepted == DRAFT_LEN).all()
  assert_same_distribution(pair_index(tokens[:, -2], tokens[:, -1], VOCAB), joint.reshape(-1),
                           ALPHA, what=f"(last draft, bonus) {setting}")


@pytest.mark.parametrize("draft", ["adversarial", "random"])
def test_skipping_the_residual_correction_fails_the_same_check(draft):
  setting = "temperature_1"
  first, *_ = _sampled(setting, draft, broken=True)
  p_first = _case(setting, draft)[4]
  with pytest.raises(AssertionError, match="not distributed as expected"):
    assert_same_distribution(first, p_first, ALPHA, what="broken verifier")


# ------------------------------------------------------------ the statistical harness (tests/stats)


def test_the_harness_rejects_at_rate_alpha_under_the_null_and_detects_a_small_shift():
  rng = np.random.default_rng(11)
  probs = np.array([0.4, 0.3, 0.2, 0.0995, 0.0005, 0.0])  # a tiny cell (pooled) and an empty one
  # 400 tests at alpha = 0.05 under the null: rejections ~ Binomial(400, 0.05), mean 20, sd 4.4
  gof = [stats.goodness_of_fit(rng.choice(6, 3000, p=probs), probs).pvalue for _ in range(400)]
  homog = [stats.two_sample(rng.choice(6, 3000, p=probs), rng.choice(6, 1000, p=probs), 6).pvalue
           for _ in range(400)]
  for pvalues in (gof, homog):
    assert 5 <= np.sum(np.array(pvalues) < 0.05) <= 40
  shifted = probs + np.array([0.01, -0.01, 0, 0, 0, 0])  # TV 0.01 at 200k samples
  with pytest.raises(AssertionError):
    assert_same_distribution(rng.choice(6, NUM_ROWS, p=shifted), probs, ALPHA)
  with pytest.raises(AssertionError):
    stats.assert_two_sample_same(rng.choice(6, NUM_ROWS, p=shifted),
                                 rng.choice(6, NUM_ROWS, p=probs), 6, ALPHA)
  impossible = stats.goodness_of_fit(np.array([0, 1, 5]), probs)
  assert impossible.pvalue == 0.0 and impossible.impossible == 1
  assert stats.bonferroni(0.006, 60) == pytest.approx(ALPHA)


# ---------------------------------------------------------------------------- greedy and contract


def _greedy_problem():
  """Rows with known target argmaxes (never token 0, so padding is unambiguous)."""
  argmax = np.array([[1, 2, 3, 4], [1, 2, 3, 1], [2, 1, 1, 1], [3, 3, 3, 3]])
  drafts = np.array([[1, 2, 3], [1, 4, 3], [4, 1, 1], [3, 3, 2]], np.int32)
  noise = np.random.default_rng(0).uniform(-1, 1, (4, 4, 5)).astype(np.float32)
  logits = noise + 4.0 * np.eye(5, dtype=np.float32)[argmax]
  return logits, drafts


def test_greedy_accepts_while_the_draft_is_the_argmax_then_emits_the_argmax():
  logits, drafts = _greedy_problem()
  res = verify(jax.random.key(0), logits, drafts, None, temperature=0.0)
  np.testing.assert_array_equal(res.num_accepted, [3, 1, 0, 2])
  np.testing.assert_array_equal(res.tokens, [[1, 2, 3, 4], [1, 2, 0, 0], [2, 0, 0, 0],
                                             [3, 3, 3, 0]])
  lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  expected = np.take_along_axis(lp, np.asarray(res.tokens)[..., None], axis=-1)[..., 0]
  expected = np.where(np.asarray(res.emitted_mask), expected, 0.0)
  np.testing.assert_allclose(res.logprobs, expected, rtol=1e-6)


def test_greedy_ignores_the_key_draft_probs_top_k_and_top_p():
  logits, drafts = _greedy_problem()
  base = verify(jax.random.key(0), logits, drafts, None, temperature=0.0)
  probs = np.full(drafts.shape + (5,), 0.2, np.float32)
  other = verify(jax.random.key(7), logits, drafts, probs, temperature=0.0, top_k=2, top_p=0.5)
  np.testing.assert_array_equal(base.tokens, other.tokens)
  np.testing.assert_array_equal(base.num_accepted, other.num_accepted)
  np.testing.assert_allclose(base.logprobs, other.logprobs)


def _random_problem(batch=64, k=3, vocab=12, seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((batch, k + 1, vocab)).astype(np.float32)
  probs = softmax(rng.standard_normal((batch, k, vocab))).astype(np.float32)
  # half the drafts are the target's argmax so that some rows accept several tokens
  drafts = np.where(rng.random((batch, k)) < 0.5, logits[:, :k].argmax(-1),
                    rng.integers(vocab, size=(batch, k))).astype(np.int32)
  return logits, drafts, probs


@pytest.mark.parametrize("with_probs", [True, False])
def test_result_shapes_dtypes_padding_and_target_logprobs(with_probs):
  logits, drafts, probs = _random_problem()
  setting = dict(temperature=0.8, top_p=0.9)
  if not with_probs:  # bfloat16 logits (a bf16 policy) still give float32 logprobs
    logits = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
  res = jax.jit(functools.partial(verify, **setting))(
      _key(3), logits if with_probs else jnp.asarray(logits, jnp.bfloat16), drafts,
      probs if with_probs else None)
  assert isinstance(res, VerifyResult)
  assert res.tokens.shape == (64, 4) and res.tokens.dtype == jnp.int32
  assert res.num_accepted.shape == (64,) and res.num_accepted.dtype == jnp.int32
  assert res.logprobs.shape == (64, 4) and res.logprobs.dtype == jnp.float32
  tokens, n, lps = (np.asarray(x) for x in (res.tokens, res.num_accepted, res.logprobs))
  mask = np.asarray(res.emitted_mask)
  np.testing.assert_array_equal(mask.sum(1), n + 1)
  np.testing.assert_array_equal(res.num_emitted, n + 1)
  assert 0 < n.max() and n.min() >= 0 and n.max() <= 3
  pos = np.arange(4)
  accepted = pos[None, :3] < n[:, None]
  np.testing.assert_array_equal(np.where(accepted, tokens[:, :3], 0),
                                np.where(accepted, drafts, 0))
  assert (tokens[~mask] == 0).all() and (lps[~mask] == 0).all()
  target_lp = np.asarray(jax.jit(functools.partial(process_logits, **setting))(logits))
  expected = np.take_along_axis(target_lp, tokens[..., None], axis=-1)[..., 0]
  assert np.isfinite(expected[mask]).all()  # emitted tokens lie in the processed support
  np.testing.assert_allclose(lps[mask], expected[mask], rtol=1e-5)


def test_verify_vmaps_over_an_outer_axis():
  logits, drafts, probs = _random_problem(batch=8)
  stack = lambda x: np.stack([x, x[::-1]])  # noqa: E731
  keys = jax.random.split(_key(0), 2)
  res = jax.jit(jax.vmap(functools.partial(verify, temperature=1.0, top_k=4)))(
      keys, stack(logits), stack(drafts), stack(probs))
  assert res.tokens.shape == (2, 8, 4) and res.num_accepted.shape == (2, 8)


_L = np.zeros((2, 4, 6), np.float32)
_D = np.zeros((2, 3), np.int32)
_P = np.full((2, 3, 6), 1 / 6, np.float32)
BAD_INPUTS = [
  ("rank", dict(target_logits=_L[0]), "target_logits must be"),
  ("draft rank", dict(draft_tokens=_D[0]), "draft_tokens must be"),
  ("batch", dict(draft_tokens=_D[:1]), "batch"),
  ("K < 1", dict(target_logits=_L[:, :1], draft_tokens=_D[:, :0]), "K must be >= 1"),
  ("K+1 positions", dict(target_logits=_L[:, :3]), "K\\+1"),
  ("probs vocab", dict(draft_probs=_P[..., :5]), "draft_probs must be"),
  ("probs K", dict(draft_probs=_P[:, :2]), "draft_probs must be"),
  ("float drafts", dict(draft_tokens=_D.astype(np.float32)), "integers"),
  ("temperature", dict(temperature=-0.5), "temperature"),
  ("top_k", dict(top_k=0), "top_k"),
  ("top_p", dict(top_p=1.5), "top_p"),
  ("top_p zero", dict(top_p=0.0), "top_p"),
]


@pytest.mark.parametrize("name,change,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_inconsistent_inputs_raise_a_clear_value_error(name, change, message):
  args = dict(target_logits=_L, draft_tokens=_D, draft_probs=_P, temperature=1.0)
  args.update(change)
  with pytest.raises(ValueError, match=message):
    verify(jax.random.key(0), **args)
