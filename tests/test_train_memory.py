"""The memory-bounded train step equals the dense one; on-policy batches skip the old-logprob pass
with the same update; micro-batching does not scale the draft gradient; donation changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters.head import init_head
from specjax.drafters.ttt import ttt_loss, ttt_loss_chunked
from specjax.drafters.vocab import build_vocab_maps, identity_maps
from specjax.models import Decoder, ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.config import DraftConfig, RLConfig
from specjax.rl.grpo import GRPOConfig
from specjax.rl.train_step import TrainBatch, Trainer

MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=16, mlp_hidden=64)
CHUNKED = MODEL.replace(attention_block=4, remat="full", logits_chunk=5)
B, S = 8, 12
CFG = RLConfig(model=MODEL, prompts_per_step=2, steps=10,
               grpo=GRPOConfig(group_size=4),
               draft=DraftConfig(kind="eagle3", online=True, ttt_steps=2),
               policy_optim=OptimConfig(lr=1e-2, eps=1e-3),
               draft_optim=OptimConfig(lr=3e-2, eps=1e-3))


@pytest.fixture(scope="module")
def setup():
  pg, pp = nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))
  hg, hp = nnx.split(init_head(MODEL, draft_vocab=48, seed=1))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 64, (B, S)), jnp.int32)
  j = np.arange(S)[None]
  mask = jnp.asarray((j >= 4) & (j < 4 + rng.integers(3, 8, B)[:, None]), jnp.float32)
  adv = jnp.asarray(rng.normal(size=B), jnp.float32)
  maps = build_vocab_maps(rng.integers(1, 100, 64), 64, 48)
  trainer = Trainer(CFG, pg, hg)
  old = trainer.logprobs(pp, tokens) * mask
  batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=adv, old_logprobs=old,
                     ref_logprobs=jnp.zeros_like(old))
  state = trainer.init_state(pp, hp, maps)
  return {"pg": pg, "pp": pp, "hg": hg, "hp": hp, "maps": maps, "trainer": trainer, "batch": batch, "state": state}


def _close(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol)


def test_chunked_train_step_equals_dense_train_step_for_both_groups(setup):
  chunked_pg = nnx.graphdef(Decoder(CHUNKED, rngs=nnx.Rngs(0)))
  chunked = Trainer(CFG.replace(model=CHUNKED), chunked_pg, setup["hg"])
  batch = setup["batch"]
  _close(chunked.logprobs(setup["pp"], batch.tokens), setup["trainer"].logprobs(
      setup["pp"], batch.tokens), 1e-5)
  g_dense, m_dense = setup["trainer"].grads(setup["state"], batch)
  g_chunk, m_chunk = chunked.grads(setup["state"], batch)
  _close(g_chunk, g_dense, 1e-5)
  for k in ("draft/loss", "draft/acc_1", "pg_loss", "entropy"):
    np.testing.assert_allclose(m_chunk[k], m_dense[k], rtol=1e-5, atol=1e-6)


def test_chunked_ttt_loss_equals_ttt_loss_with_gradients(setup):
  model = nnx.merge(setup["pg"], setup["pp"])
  tokens, mask = setup["batch"].tokens, setup["batch"].loss_mask
  out = model(tokens)
  embed = model.embed[...]
  h, w = model.final_norm(out.hidden), model.head_weight()

  def dense(hp):
    return ttt_loss(setup["hg"], hp, embed, out.aux_hidden, out.logits, tokens, mask,
                    setup["maps"], num_steps=3)

  def linear(hp):
    return ttt_loss_chunked(setup["hg"], hp, embed, out.aux_hidden, h, w, tokens, mask,
                            setup["maps"], num_steps=3, block=4, chunk=5)

  remat_hg = nnx.graphdef(init_head(CHUNKED, draft_vocab=48, seed=1))  # head steps rematerialised

  def linear_remat(hp):
    return ttt_loss_chunked(remat_hg, hp, embed, out.aux_hidden, h, w, tokens, mask,
                            setup["maps"], num_steps=3, block=4, chunk=5)

  (l1, m1), g1 = jax.value_and_grad(dense, has_aux=True)(setup["hp"])
  for fn in (linear, linear_remat):
    (l2, m2), g2 = jax.jit(jax.value_and_grad(fn, has_aux=True))(setup["hp"])
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for k in m1:
      np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-6)
    _close(g2, g1, 1e-5)


def test_on_policy_batch_skips_old_logprobs_with_the_same_gradients(setup):
  batch = setup["batch"]
  sampler = batch.old_logprobs + 0.01 * batch.loss_mask
  on_policy = batch.replace(old_logprobs=None, sampler_logprobs=sampler)
  g_old, m_old = setup["trainer"].grads(setup["state"], batch)
  g_on, m_on = setup["trainer"].grads(setup["state"], on_policy)
  _close(g_on, g_old, 1e-6)
  np.testing.assert_allclose(m_on["mismatch/max_abs"], 0.01, atol=1e-5)
  np.testing.assert_allclose(m_on["ratio_mean"], m_old["ratio_mean"], atol=1e-5)


def test_draft_and_policy_gradients_with_four_micro_batches_equal_one_batch(setup):
  # every row holds the same number of completion tokens and the full draft vocabulary, so the
  # token-weighted micro-batch means are exactly the full-batch mean
  batch = setup["batch"]
  mask = jnp.broadcast_to(jnp.asarray((np.arange(S) >= 4) & (np.arange(S) < 10), jnp.float32),
                          (B, S))
  batch = batch.replace(loss_mask=mask, old_logprobs=batch.old_logprobs * mask)
  hg, hp = nnx.split(init_head(MODEL, seed=1))
  one = Trainer(CFG, setup["pg"], hg)
  four = Trainer(CFG.replace(micro_batches=4), setup["pg"], hg)
  state = one.init_state(setup["pp"], hp, identity_maps(64))
  g1, m1 = one.grads(state, batch)
  g4, m4 = four.grads(state, batch)
  for group in ("policy", "draft"):
    _close(g4[group], g1[group], 2e-6)
  np.testing.assert_allclose(m4["draft/loss"], m1["draft/loss"], rtol=1e-5)


def test_donated_step_equals_the_undonated_step(setup):
  trainer, state, batch = setup["trainer"], setup["state"], setup["batch"]
  want, _ = trainer.step(state, batch)
  copy = jax.tree.map(jnp.copy, state)
  got, _ = trainer.step(copy, batch, donate=True)
  # two programs, compiled apart: XLA may order a fused reduction differently in each (at the
  # tests' compile flags the parameters differ by a few 1e-9), while a donated buffer read
  # after its update would differ by whole updates
  _close(got.params, want.params, 1e-7)
  _close(got.opt_state, want.opt_state, 1e-7)
