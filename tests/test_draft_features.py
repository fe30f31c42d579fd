"""Offline EAGLE-3 training on precomputed target features: the same loss, gradients and training
trajectory as running the frozen target inside every step, on a tiny target's rollouts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.toy import tiny_prompts, tiny_random_config
from specjax.drafters import (DraftTrainConfig, Eagle3Head, HeadConfig, Rollouts,
                              build_vocab_maps_from_tokens, collect_rollouts, train_draft_head,
                              ttt_loss)
from specjax.drafters.features import (batch_width, compute_features, feature_nbytes,
                                       loss_positions, ttt_loss_from_features)
from specjax.drafters.train import draft_train_step, feature_train_step
from specjax.models import Decoder
from specjax.optim import trainer_transform
from specjax.sampling import SamplingConfig

CFG = tiny_random_config()
DRAFT_VOCAB = 20  # of 32: the target's argmax falls outside the draft vocabulary at some positions
TRAIN = DraftTrainConfig(steps=12, batch_size=8, lr=3e-3, warmup_steps=2, draft_vocab=DRAFT_VOCAB)


@pytest.fixture(scope="module")
def setup():
  target = Decoder(CFG, rngs=nnx.Rngs(0))
  rollouts = collect_rollouts(target, *tiny_prompts(32, seed=0), jax.random.key(0),
                              SamplingConfig(max_new_tokens=16, temperature=1.0))
  # ragged completions, as EOS leaves them: row r's completion ends r % 9 tokens early
  tokens, mask = rollouts.tokens.copy(), rollouts.loss_mask.copy()
  for r in range(tokens.shape[0]):
    last = np.flatnonzero(mask[r])[-1]
    cut = last + 1 - r % 9
    mask[r, cut:] = False
    tokens[r, cut:] = 0
  rollouts = Rollouts(tokens=tokens, loss_mask=mask)
  maps = build_vocab_maps_from_tokens(tokens, CFG.vocab_size, DRAFT_VOCAB, mask=mask)
  return target, rollouts, maps


def _loss_and_grads(target, rollouts, maps, rows, width=None):
  """(metrics, grads) of the TTT loss on `rows`: running the target, and on its features."""
  head = Eagle3Head(HeadConfig(CFG, DRAFT_VOCAB), rngs=nnx.Rngs(3))
  graphdef, params = nnx.split(head)
  tokens = jnp.asarray(rollouts.tokens[rows])
  mask = jnp.asarray(rollouts.loss_mask[rows])
  features = compute_features(nnx.split(target), rollouts.tokens, batch_size=5)
  width = width or tokens.shape[1]
  aux, final, argmax = features.take(rows, width)
  positions = loss_positions(rollouts.loss_mask[rows, :width], 3)

  def from_target(p):
    out = target(tokens)
    return ttt_loss(graphdef, p, target.embed[...], out.aux_hidden, out.logits, tokens, mask,
                    maps)

  def from_features(p):
    return ttt_loss_from_features(graphdef, p, target.embed[...], target.head_weight(), aux,
                                  final, argmax, tokens[:, :width], mask[:, :width], maps,
                                  positions)

  grad = lambda f: jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  return grad(from_target), grad(from_features)


def _assert_same(ref, got):
  (_, ref_metrics), ref_grads = ref
  (_, metrics), grads = got
  for k, v in ref_metrics.items():
    if k.startswith("positions"):
      assert int(metrics[k]) == int(v), k
    else:
      np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_loss_and_gradients_on_precomputed_features_equal_those_of_running_the_target(setup):
  target, rollouts, maps = setup
  rows = np.arange(3, 11)
  ref, got = _loss_and_grads(target, rollouts, maps, rows)
  _assert_same(ref, got)
  # the vocabulary-sized work ran at fewer positions than the batch has
  assert loss_positions(rollouts.loss_mask[rows], 3)[0].size < rollouts.loss_mask[rows].size
  (_, metrics), _ = ref
  # the draftable mask matters here: fewer positions count than completion tokens shifted
  full = sum(int(rollouts.loss_mask[r, 2:].sum()) for r in rows)
  assert 0 < int(metrics["positions_0"]) < full


def test_a_batch_cut_after_its_last_completion_token_gives_the_same_loss_and_gradients(setup):
  target, rollouts, maps = setup
  rows = np.array([0, 9, 18, 27, 8, 17])  # rows ending 0-8 tokens early: width cut to the longest
  width = int(np.flatnonzero(rollouts.loss_mask[rows].any(0))[-1]) + 1
  assert width < rollouts.tokens.shape[1]
  ref, got = _loss_and_grads(target, rollouts, maps, rows, width=width)
  _assert_same(ref, got)
  assert width <= batch_width(rollouts.loss_mask[rows]) <= rollouts.tokens.shape[1]


def test_one_optimizer_step_on_features_matches_the_step_that_runs_the_target(setup):
  target, rollouts, maps = setup
  head = Eagle3Head(HeadConfig(CFG, DRAFT_VOCAB), rngs=nnx.Rngs(1))
  hg, hp = nnx.split(head)
  tg, tp = nnx.split(target)
  opt = trainer_transform(TRAIN).init(hp)
  rows = np.arange(8)
  features = compute_features((tg, tp), rollouts.tokens[rows], batch_size=8)
  width = rollouts.tokens.shape[1]
  mask = rollouts.loss_mask[rows]
  ref_params, _, ref_metrics = draft_train_step(hg, tg, TRAIN, hp, opt, tp, maps,
                                                rollouts.tokens[rows], rollouts.loss_mask[rows])
  params, _, metrics = feature_train_step(hg, TRAIN, hp, opt, target.embed[...],
                                          target.head_weight(), maps,
                                          *features.take(np.arange(8), width),
                                          rollouts.tokens[rows], mask, loss_positions(mask, 3))
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_training_on_features_follows_the_losses_of_training_with_the_target_inside(setup):
  target, rollouts, _ = setup
  on = train_draft_head(target, rollouts=rollouts, config=TRAIN, progress=False)
  off = train_draft_head(target, rollouts=rollouts, progress=False,
                         config=dataclasses.replace(TRAIN, precompute_features=False))
  assert off.feature_bytes is None
  rows, width = rollouts.tokens.shape
  assert on.feature_bytes == feature_nbytes(CFG, rows, width)
  losses = np.array([[h["loss"], h["acc_0"]] for h in on.history])
  ref = np.array([[h["loss"], h["acc_0"]] for h in off.history])
  np.testing.assert_allclose(losses, ref, rtol=1e-4, atol=1e-5)
  assert losses[-1, 0] < losses[0, 0]
  for a, b in zip(jax.tree.leaves(nnx.state(on.head)), jax.tree.leaves(nnx.state(off.head))):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_features_over_the_memory_cap_fall_back_to_running_the_target(setup):
  target, rollouts, _ = setup
  cfg = dataclasses.replace(TRAIN, steps=2, warmup_steps=0, max_feature_gib=1e-6)
  assert feature_nbytes(CFG, *rollouts.tokens.shape) > cfg.max_feature_gib * 2**30
  assert train_draft_head(target, rollouts=rollouts, config=cfg,
                          progress=False).feature_bytes is None
  with pytest.raises(ValueError, match="DraftTrainConfig.max_feature_gib"):
    DraftTrainConfig(max_feature_gib=0)
