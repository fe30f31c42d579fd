"""The TTT loss (alignment, unrolled attention masks, draft-vocabulary masking), offline training of
the head on a tiny target's rollouts, and the orbax checkpoint of the head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters import (DraftTrainConfig, Eagle3Head, HeadConfig, build_vocab_maps,
                           collect_rollouts, eval_ttt, load_head, save_head, train_draft_head,
                           ttt_attention_mask, ttt_forward, ttt_loss)
from experiments.toy import tiny_prompts, tiny_random_config
from specjax.models import Decoder
from specjax.sampling import SamplingConfig

CFG = tiny_random_config()
SAMPLING = SamplingConfig(max_new_tokens=16, temperature=1.0)
# 300 steps (the trainer's default): at 80 the head's held-out loss is still above the best
# context-free draft's on every rollout draw measured (it is mostly undoing its random init), and
# its agreement gain fell under +0.1 at step 0 on 2 draws of 12
TRAIN = DraftTrainConfig(steps=300, batch_size=16, lr=3e-3, warmup_steps=5,
                         draft_vocab=24)


@pytest.fixture(scope="module")
def target():
  return Decoder(CFG, rngs=nnx.Rngs(0))


def test_unrolled_step_attends_causally_to_target_states_and_only_to_its_own_chain():
  m = ttt_attention_mask(4, 2, 3)  # T = 4, step 2 of 3: blocks [step 0 | step 1 | step 2]
  np.testing.assert_array_equal(m[:, :4], np.tril(np.ones((4, 4), bool)))
  np.testing.assert_array_equal(m[:, 4:8], np.eye(4, dtype=bool))
  np.testing.assert_array_equal(m[:, 8:], np.eye(4, dtype=bool))
  step1 = ttt_attention_mask(4, 1, 3)
  assert not step1[:, 8:].any()  # step 1 cannot see step 2's keys


def _reference_step_losses(step_logits, target_logits, tokens_mask, maps):
  """Per-step masked soft CE written position by position (the contract, in numpy)."""
  d2t, t2d = np.asarray(maps.d2t), np.asarray(maps.t2d)
  tl = np.asarray(target_logits, np.float64)
  b_size, t_size = tokens_mask.shape
  out = []
  for i, logits in enumerate(step_logits):
    logq = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
    total, count = 0.0, 0
    for b in range(b_size):
      for t in range(t_size):
        j, m = t + 1 + i, t + 2 + i  # target logits of token t+2+i sit at t+1+i
        if m >= t_size or not tokens_mask[b, m] or not t2d[np.argmax(tl[b, j])]:
          continue
        p = np.exp(tl[b, j, d2t] - tl[b, j, d2t].max())
        p /= p.sum()
        total += -(p * logq[b, t]).sum()
        count += 1
    out.append((total / max(count, 1), count))
  return out


def test_step_i_at_t_learns_token_t_plus_2_plus_i_on_completion_positions_with_draftable_mode(
    target):
  head = Eagle3Head(HeadConfig(CFG, 24), rngs=nnx.Rngs(3))
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, CFG.vocab_size)
  loss_mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1]], bool)
  maps = build_vocab_maps(np.arange(CFG.vocab_size), CFG.vocab_size, 24)  # drops ids 0..7
  graphdef, params = nnx.split(head)

  @jax.jit
  def run(params, tokens):
    out = target(tokens)
    # two positions with a draftable mode, then the same with the mode outside the draft vocab
    base_logits = out.logits.at[0, 4, 20].set(40.0).at[1, 6, 20].set(40.0)
    target_logits = base_logits.at[0, 4, 3].set(50.0).at[1, 6, 5].set(50.0)
    loss = lambda logits: ttt_loss(graphdef, params, target.embed[...], out.aux_hidden, logits,
                                   tokens, loss_mask, maps, num_steps=3, step_decay=0.8)
    step_logits = ttt_forward(nnx.merge(graphdef, params), target.embed[...], out.aux_hidden,
                              tokens, 3)
    return loss(target_logits), loss(base_logits)[1], step_logits, target_logits

  (loss, metrics), base, step_logits, target_logits = run(params, tokens)
  ref = _reference_step_losses(step_logits, target_logits, loss_mask, maps)
  for i, (ref_loss, ref_count) in enumerate(ref):
    np.testing.assert_allclose(metrics[f"loss_{i}"], ref_loss, rtol=1e-5)
    assert int(metrics[f"positions_{i}"]) == ref_count
  np.testing.assert_allclose(loss, sum(0.8 ** i * r for i, (r, _) in enumerate(ref)), rtol=1e-5)
  # each step loses exactly the two planted positions
  for i in range(3):
    assert int(base[f"positions_{i}"]) == ref[i][1] + 2


@pytest.fixture(scope="module")
def trained(target):
  prompts, lengths = tiny_prompts(96, seed=0)
  rollouts = collect_rollouts(target, prompts, lengths, jax.random.key(0), SAMPLING)
  held_out = collect_rollouts(target, *tiny_prompts(96, seed=1), jax.random.key(1), SAMPLING)
  result = train_draft_head(target, rollouts=rollouts, config=TRAIN, progress=False)
  return result, held_out


def _context_free_losses(target, rollouts, maps, num_steps):
  """Per step: the least TTT loss any draft that ignores its inputs can reach on `rollouts`, the
  entropy of the mean target distribution over the positions step i counts (and their count)."""
  logits = np.asarray(target(jnp.asarray(rollouts.tokens)).logits, np.float64)
  d2t, t2d = np.asarray(maps.d2t), np.asarray(maps.t2d)
  p = np.exp(logits[..., d2t] - logits[..., d2t].max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = []
  for i in range(num_steps):  # step i is taught the target at j = t + 1 + i, weight mask[j + 1]
    weight = np.zeros_like(rollouts.loss_mask)
    weight[:, 1 + i:-1] = rollouts.loss_mask[:, 2 + i:]
    weight &= t2d[logits.argmax(-1)].astype(bool)
    mean = p[weight].mean(0)
    out.append((-(mean * np.log(mean)).sum(), int(weight.sum())))
  return out


def test_ttt_loss_decreases_and_per_step_agreement_rises_when_training_on_target_rollouts(
    target, trained):
  result, held_out = trained
  losses = [h["loss"] for h in result.history]
  assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
  untrained = Eagle3Head(HeadConfig(CFG, 24), rngs=nnx.Rngs(TRAIN.seed))
  before = eval_ttt(target, untrained, result.maps, held_out)
  after = eval_ttt(target, result.head, result.maps, held_out)
  context_free = _context_free_losses(target, held_out, result.maps, TRAIN.ttt_steps)
  for i, (floor, count) in enumerate(context_free):
    assert after[f"acc_{i}"] > before[f"acc_{i}"] + 0.1, (i, before, after)
    assert after[f"loss_{i}"] < before[f"loss_{i}"]
    # the head uses its context: a head trained on shuffled targets (which learns the marginal)
    # halves the loss too, but cannot go below this floor
    assert int(after[f"positions_{i}"]) == count
    assert after[f"loss_{i}"] < floor, (i, floor, after)
  assert after["acc_0"] > 3 * before["acc_0"]


def test_saved_head_loads_back_identical_with_its_vocabulary_maps(trained, tmp_path):
  result, _ = trained
  path = save_head(str(tmp_path / "head"), result.head, result.maps)
  head, maps = load_head(path, CFG)
  np.testing.assert_array_equal(maps.d2t, result.maps.d2t)
  np.testing.assert_array_equal(maps.t2d, result.maps.t2d)
  assert head.cfg == result.head.cfg
  for a, b in zip(jax.tree.leaves(nnx.state(head)), jax.tree.leaves(nnx.state(result.head))):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="hidden_size"):
    load_head(path, CFG.replace(hidden_size=64))


def test_train_config_rejects_bad_values_naming_the_field():
  with pytest.raises(ValueError, match="DraftTrainConfig.warmup_steps"):
    DraftTrainConfig(steps=10, warmup_steps=10)
  with pytest.raises(ValueError, match="DraftTrainConfig.step_decay"):
    DraftTrainConfig(step_decay=0.0)
