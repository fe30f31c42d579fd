"""Tests of tree verification (`rejection.verify_tree`, `models.tree.DraftTree`): exact
distributions (statistical), greedy, the path it returns, bad inputs.

Statistical checks: 200k rows per case in one jit, fixed seeds, chi-square at ALPHA per check
(22 checks: family-wise false-failure rate <= 22 * ALPHA < 0.3%). The target is a Markov chain as
in test_rejection.py: target_logits at a node are the chain's row of the node's token, so the
(first, second) pair of a sequence must follow p(x1) p(x2 | x1) whichever node the second token
came from, and the last pair (the bonus token after a whole accepted chain among them) the
chain's marginal there times p(x | previous).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.tree import DraftTree
from specjax.sampling.processing import process_logits
from specjax.sampling.rejection import verify, verify_tree
from stats import assert_same_distribution, pair_index, sample_rows, softmax

NUM_ROWS = 200_000
DRAFT_LEN = 3
WIDTH = 3
VOCAB = 8
ALPHA = 1e-4
SETTINGS = {"temperature_1": dict(temperature=1.0), "top_k_4": dict(temperature=0.8, top_k=4)}
DRAFTS = ["random", "deterministic", "one_hot"]


@functools.lru_cache(maxsize=None)
def _case(setting: str, draft: str):
  seed = 10 * DRAFTS.index(draft) + list(SETTINGS).index(setting) + 500
  rng = np.random.default_rng(seed)
  first_logits = (1.2 * rng.standard_normal(VOCAB)).astype(np.float32)
  next_logits = (1.2 * rng.standard_normal((VOCAB, VOCAB))).astype(np.float32)
  both = np.asarray(jax.jit(lambda x: process_logits(x, **SETTINGS[setting]))(
      np.concatenate([first_logits[None], next_logits])), np.float64)
  p_first, p_next = np.exp(both[0]), np.exp(both[1:])
  if draft == "one_hot":  # point mass on the target's runner-up: every chain draft is rare
    q = [np.eye(VOCAB)[np.argsort(-x, axis=-1)[..., 1]] for x in (first_logits, next_logits)]
  else:
    q = [softmax(x + 0.9 * rng.standard_normal(x.shape)) for x in (first_logits, next_logits)]
  return first_logits, next_logits, q[0].astype(np.float32), q[1].astype(np.float32), \
      p_first, p_next


def _alternatives(q_rows, drafts):
  """The W-1 most likely tokens of each row's q [R, V] other than its draft [R] (numpy)."""
  order = np.argsort(-q_rows, axis=-1, kind="stable")
  keep = order != drafts[:, None]
  idx = np.argsort(~keep, axis=-1, kind="stable")[:, :WIDTH - 1]
  return np.take_along_axis(order, idx, axis=-1)


def verify_tree_without_residual(key, target_logits, draft_tokens, draft_probs, alternatives,
                                 **setting):
  """A BROKEN tree verifier for the tests only: alternatives are accepted with the target's p(x)
  instead of the residual's r(x) (what a verifier that ignores the chain's rejection would do)."""
  k = draft_tokens.shape[1]
  res, path = verify_tree(key, target_logits, draft_tokens, draft_probs, alternatives, **setting)
  n = jnp.where(path[jnp.arange(path.shape[0]), jnp.minimum(res.num_accepted, k)] > k,
                res.num_accepted - 1, res.num_accepted)
  p = jnp.exp(process_logits(target_logits, **setting))
  rows = jnp.arange(draft_tokens.shape[0])
  first_alt = alternatives[rows, jnp.minimum(n, k - 1), 0]
  u = jax.random.uniform(jax.random.fold_in(key, 7), (draft_tokens.shape[0],))
  take = (n < k) & (u < p[rows, n, first_alt])
  tokens = res.tokens.at[rows, n].set(jnp.where(take, first_alt, res.tokens[rows, n]))
  return res.replace(tokens=tokens), path


def verify_tree_bonus_without_alternatives(key, target_logits, draft_tokens, draft_probs,
                                           alternatives, **setting):
  """A BROKEN tree verifier for the tests only: a row whose chain was accepted whole draws its
  bonus token from p with the last depth's alternatives left out."""
  k = draft_tokens.shape[1]
  res, path = verify_tree(key, target_logits, draft_tokens, draft_probs, alternatives, **setting)
  rows = jnp.arange(draft_tokens.shape[0])
  logp = process_logits(target_logits[:, k], **setting)
  logp = logp.at[rows[:, None], alternatives[:, -1]].set(-jnp.inf)
  redrawn = jax.random.categorical(jax.random.fold_in(key, 11), logp, axis=-1)
  whole = (res.num_accepted == k) & (path[:, k] == k)
  tokens = res.tokens.at[:, k].set(jnp.where(whole, redrawn, res.tokens[:, k]))
  return res.replace(tokens=tokens), path


BROKEN = {"": verify_tree, "residual": verify_tree_without_residual,
          "bonus": verify_tree_bonus_without_alternatives}


@functools.partial(jax.jit, static_argnames=("setting", "deterministic", "broken", "depth"))
def _verify(key, first_logits, next_logits, q_first, q_next, drafts, alts, *, setting,
            deterministic, broken="", depth=DRAFT_LEN):
  rows = drafts.shape[0]
  alts = alts[:, :depth]  # alternatives at the first `depth` depths only
  chain_logits = jnp.concatenate([jnp.broadcast_to(first_logits, (rows, 1, VOCAB)),
                                  next_logits[drafts]], axis=1)
  target_logits = jnp.concatenate([chain_logits, next_logits[alts.reshape(rows, -1)]], axis=1)
  probs = jnp.concatenate([jnp.broadcast_to(q_first, (rows, 1, VOCAB)),
                           q_next[drafts[:, :-1]]], axis=1)
  fn = BROKEN[broken]
  res, path = fn(key, target_logits, drafts, None if deterministic else probs, alts,
                 **dict(setting))
  chain = verify(key, chain_logits, drafts, None if deterministic else probs, **dict(setting))
  return res.tokens, res.num_accepted, path, chain.num_accepted


@functools.lru_cache(maxsize=None)
def _sampled(setting: str, draft: str, broken: str = "", depth: int = DRAFT_LEN):
  first_logits, next_logits, q_first, q_next, _, p_next = _case(setting, draft)
  seed = 2000 + 10 * DRAFTS.index(draft) + list(SETTINGS).index(setting)
  rng = np.random.default_rng(seed)
  drafts, alts = [], []
  q_rows = np.broadcast_to(q_first, (NUM_ROWS, VOCAB))
  for _ in range(DRAFT_LEN):
    drafts.append(sample_rows(rng, q_rows))
    alts.append(_alternatives(q_rows, drafts[-1]))
    q_rows = q_next[drafts[-1]]
  out = _verify(jax.random.key(seed, impl="rbg"), first_logits, next_logits, q_first, q_next,
                np.stack(drafts, 1), np.stack(alts, 1), setting=tuple(SETTINGS[setting].items()),
                deterministic=draft == "deterministic", broken=broken, depth=depth)
  tokens, num_accepted, path, chain_accepted = map(np.asarray, out)
  # each row's sequence over DRAFT_LEN + 1 positions: the emitted tokens, then the target's own
  # continuation past them (so every position's joint with the next is known)
  seq = tokens.copy()
  for i in range(1, DRAFT_LEN + 1):
    seq[:, i] = np.where(num_accepted >= i, tokens[:, i], sample_rows(rng, p_next[seq[:, i - 1]]))
  return seq, num_accepted, path, chain_accepted


def _last_pair(p_first, p_next):
  """The joint of (token DRAFT_LEN - 1, token DRAFT_LEN), flattened: the chain's marginal at
  DRAFT_LEN - 1 times p(x | previous)."""
  marginal = p_first
  for _ in range(DRAFT_LEN - 1):
    marginal = marginal @ p_next
  return (marginal[:, None] * p_next).reshape(-1)


GRID = [(s, d, DRAFT_LEN) for s in SETTINGS for d in DRAFTS] + \
    [("temperature_1", "random", 1)]  # alternatives at the first depth only


@pytest.mark.parametrize("setting,draft,depth", GRID)
def test_tree_verification_keeps_the_target_distribution(setting, draft, depth):
  seq, *_ = _sampled(setting, draft, depth=depth)
  *_, p_first, p_next = _case(setting, draft)
  assert_same_distribution(seq[:, 0], p_first, ALPHA, what=f"first token {setting}/{draft}")
  assert_same_distribution(pair_index(seq[:, 0], seq[:, 1], VOCAB),
                           (p_first[:, None] * p_next).reshape(-1), ALPHA,
                           what=f"(first, second) {setting}/{draft}")
  # the last two positions: the bonus token after a whole accepted chain comes last
  assert_same_distribution(pair_index(seq[:, -2], seq[:, -1], VOCAB), _last_pair(p_first, p_next),
                           ALPHA, what=f"last pair {setting}/{draft}")


@pytest.mark.parametrize("setting,draft,depth", GRID)
def test_alternatives_add_accepted_tokens_to_the_chains(setting, draft, depth):
  _, num_accepted, path, chain_accepted = _sampled(setting, draft, depth=depth)
  # the chain part of the tree decides as `verify` does (the same uniforms): a row accepts at
  # least the chain's count, and one more exactly where an alternative was taken
  took = np.take_along_axis(path, np.minimum(num_accepted, DRAFT_LEN)[:, None], 1)[:, 0] > \
      DRAFT_LEN
  assert (num_accepted == chain_accepted + took).all()
  assert not (took & (chain_accepted >= depth)).any()  # only at the depths with alternatives
  if draft != "one_hot":  # (a point-mass q ranks no alternative: they are arbitrary tokens)
    least = 0.05 if depth == DRAFT_LEN else 0.02  # (fewer depths, fewer chances)
    assert took.mean() > least, f"alternatives taken in only {took.mean():.3f} of rows"


def test_accepting_alternatives_by_the_target_instead_of_the_residual_fails_the_check():
  seq, *_ = _sampled("temperature_1", "random", broken="residual")
  first = seq[:, 0]
  p_first = _case("temperature_1", "random")[4]
  with pytest.raises(AssertionError, match="not distributed as expected"):
    assert_same_distribution(first, p_first, ALPHA, what="broken tree verifier")


def test_a_bonus_token_without_the_last_alternatives_fails_the_last_pair_check():
  seq, *_ = _sampled("temperature_1", "random", broken="bonus")
  *_, p_first, p_next = _case("temperature_1", "random")
  with pytest.raises(AssertionError, match="not distributed as expected"):
    assert_same_distribution(pair_index(seq[:, -2], seq[:, -1], VOCAB),
                             _last_pair(p_first, p_next), ALPHA, what="broken bonus token")


def test_greedy_takes_an_alternative_that_is_the_argmax_and_continues_from_its_node():
  k, w, v = 3, 3, 6
  tree = DraftTree(k, w)
  logits = np.full((2, tree.nodes, v), -5.0, np.float32)
  # row 0: chain drafts 1, 2, 3; the target wants 1, then 4 (an alternative at depth 2), then
  # from that alternative's node 5
  wants = {0: 1, 1: 4, tree.alternative(2, 1): 5}
  for node, tok in wants.items():
    logits[0, node, tok] = 5.0
  # row 1: every chain draft is the argmax, then the bonus 0
  for node, tok in {0: 1, 1: 2, 2: 3, 3: 0}.items():
    logits[1, node, tok] = 5.0
  drafts = np.array([[1, 2, 3], [1, 2, 3]], np.int32)
  alts = np.array([[[0, 5], [0, 4], [0, 1]], [[0, 5], [0, 4], [0, 1]]], np.int32)
  res, path = verify_tree(jax.random.key(0), jnp.asarray(logits), drafts, None, alts,
                          temperature=0.0)
  assert res.num_accepted.tolist() == [2, 3]
  assert res.tokens.tolist() == [[1, 4, 5, 0], [1, 2, 3, 0]]
  assert path.tolist() == [[0, 1, tree.alternative(2, 1), 3], [0, 1, 2, 3]]


def test_the_tree_shape_depths_and_ancestors():
  tree = DraftTree(draft_len=2, width=3)
  assert tree.nodes == 7
  assert tree.depths.tolist() == [0, 1, 2, 1, 1, 2, 2]
  anc = tree.ancestors
  assert anc[2].tolist() == [True, True, True, False, False, False, False]
  assert anc[tree.alternative(1, 1)].tolist() == [True, False, False, False, True, False, False]
  assert anc[tree.alternative(2, 0)].tolist() == [True, True, False, False, False, True, False]
  with pytest.raises(ValueError, match="width"):
    DraftTree(2, 0)
  shallow = DraftTree(draft_len=3, width=3, depth=1)  # alternatives at the first depth only
  assert shallow.nodes == 6 and shallow.alt_depths == 1
  assert shallow.depths.tolist() == [0, 1, 2, 3, 1, 1]
  assert shallow.ancestors[shallow.alternative(1, 1)].tolist() == [True] + [False] * 4 + [True]
  assert DraftTree(2, 3, depth=5).nodes == DraftTree(2, 3).nodes  # capped at K
  with pytest.raises(ValueError, match="depth"):
    DraftTree(2, 3, depth=-1)


def test_wrong_shapes_raise_a_clear_value_error():
  logits = jnp.zeros((2, 7, 5))
  with pytest.raises(ValueError, match="alternatives must be"):
    verify_tree(jax.random.key(0), logits, jnp.zeros((2, 2), jnp.int32), None,
                jnp.zeros((2, 3, 2), jnp.int32), temperature=1.0)
  with pytest.raises(ValueError, match="1 \\+ K \\+ D \\* \\(W-1\\)"):
    verify_tree(jax.random.key(0), logits[:, :6], jnp.zeros((2, 2), jnp.int32), None,
                jnp.zeros((2, 2, 2), jnp.int32), temperature=1.0)
