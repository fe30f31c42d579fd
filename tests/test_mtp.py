"""The native MTP module as a drafter (greedy equals AR, first draft is `mtp_forward` on the last
committed pair), its loss on token t + 2, and its offline training on a frozen trunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import toy
from specjax.drafters import collect_rollouts, mtp_drafter, mtp_loss
from specjax.jobs.pretrain import LmTrainConfig, lm_mtp_loss, train_lm
from specjax.models import Decoder
from specjax.sampling import STATIC
from specjax.sampling import (AcceptanceMetrics, SamplingConfig, TargetStep, generate,
                              speculative_generate)

# the tiny target and configs of the EAGLE tests: compiled programs are shared
CFG = toy.tiny_random_config()
SAMPLING = SamplingConfig(max_new_tokens=16, temperature=1.0)
GREEDY = SamplingConfig(max_new_tokens=16, temperature=0.0, eos_ids=(13,))
K = 3


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def mtp_trained(target):
  rollouts = collect_rollouts(target, *toy.tiny_prompts(96, seed=0), jax.random.key(0), SAMPLING)
  cfg = LmTrainConfig(steps=80, batch_size=16, warmup_steps=5, mtp_only=True)
  return train_lm(target, rollouts.tokens, rollouts.loss_mask, cfg, progress=False)


def test_first_mtp_draft_is_mtp_forward_on_the_last_committed_pair(target):
  drafter, params = mtp_drafter(target, draft_len=2)
  prompts, lengths = toy.tiny_prompts(2, seed=3, width=7)
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
  rows = jnp.arange(2)
  nxt = jnp.concatenate([prompts[:, 1:], prompts[:, :1]], 1).at[rows, lengths - 1].set(4)

  @jax.jit
  def draft(params, key):
    model = nnx.merge(drafter.graphdef, params)
    state = drafter.init(params, 2, 16)
    state = drafter.observe(params, state, TargetStep(prompts, nxt, jnp.zeros(2, jnp.int32),
                                                      lengths, model(prompts)))
    probs = drafter.propose(params, state, None, key)[1]
    # no cache: the module over the whole prompt, read at each row's last committed pair
    ref = model.mtp_forward(model(prompts).hidden, nxt).logits[rows, lengths - 1]
    return probs[:, 0], jax.nn.softmax(ref, -1)

  got, want = draft(params, jax.random.key(0))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_greedy_speculative_with_the_mtp_drafter_equals_greedy_autoregressive(target,
                                                                             mtp_trained):
  prompts, lengths = toy.tiny_prompts(8, seed=4)
  ar = generate(target, prompts, lengths, jax.random.key(0), GREEDY)
  accepted = {}
  for name, model in (("untrained", target), ("trained", mtp_trained[0])):
    drafter, params = mtp_drafter(model, draft_len=K)
    spec = speculative_generate(model, drafter, params, prompts, lengths, jax.random.key(1),
                                GREEDY, engine=STATIC)  # fixed K: compares the drafters
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
    accepted[name] = AcceptanceMetrics.from_counts(spec.stats).num_accepted_tokens
  assert accepted["trained"] > accepted["untrained"], accepted


def test_mtp_only_training_leaves_the_trunk_unchanged_and_lowers_the_mtp_loss(target,
                                                                             mtp_trained):
  model, history = mtp_trained
  before = nnx.to_pure_dict(nnx.state(target))
  after = nnx.to_pure_dict(nnx.state(model))
  for name in before:
    same = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), before[name],
                                        after[name]))
    assert all(same) == (name != "mtp"), name
  assert np.mean([h["mtp_loss"] for h in history[-10:]]) < np.mean(
      [h["mtp_loss"] for h in history[:10]]) - 0.3


def test_mtp_loss_with_stopped_trunk_gradient_trains_only_the_mtp_module(target):
  graphdef, params = nnx.split(target)
  tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, CFG.vocab_size)
  mask = jnp.ones((2, 10), bool)

  def loss(p, stop):
    model = nnx.merge(graphdef, p)
    return mtp_loss(model, model(tokens).hidden, tokens, mask, stop_trunk_gradient=stop)[0]

  grads, joint = jax.jit(lambda p: (jax.grad(loss)(p, True), jax.grad(loss)(p, False)))(params)
  grads, joint = nnx.to_pure_dict(grads), nnx.to_pure_dict(joint)
  assert all(np.all(np.asarray(g) == 0) for k, v in grads.items() if k != "mtp"
             for g in jax.tree.leaves(v))  # trunk, embedding and LM head: exactly zero
  assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads["mtp"]))
  assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(joint["layers"]))


def test_joint_loss_is_lm_loss_plus_weighted_mtp_loss_on_token_t_plus_2(target):
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, CFG.vocab_size)
  mask = jnp.ones((2, 10), bool)

  @jax.jit
  def losses(tokens):
    total, m = lm_mtp_loss(target, tokens, mask, mtp_weight=0.5)
    logits = target.mtp_forward(target(tokens).hidden[:, :-1], tokens[:, 1:]).logits  # t -> t+2
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 2:, None], -1)
    return total, m, nll.mean()

  total, m, want = losses(tokens)
  np.testing.assert_allclose(total, m["lm_loss"] + 0.5 * m["mtp_loss"], rtol=1e-6)
  np.testing.assert_allclose(m["mtp_loss"], want, rtol=1e-5)
  with pytest.raises(ValueError, match="LmTrainConfig.warmup_steps"):
    LmTrainConfig(steps=5, warmup_steps=5)
