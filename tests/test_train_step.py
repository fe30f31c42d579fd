"""The RL train step: gradient detachment of the online draft, separate optimizer groups,
gradient accumulation and the (2, 2, 2) mesh."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters.head import init_head
from specjax.drafters.vocab import identity_maps
from specjax.models import Decoder, ModelConfig
from specjax.optim import OptimConfig
from specjax.rl.config import DraftConfig, RLConfig
from specjax.rl.grpo import GRPOConfig
from specjax.rl.train_step import TrainBatch, Trainer
from specjax.sharding import MeshConfig, make_mesh

MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=16, mlp_hidden=64)
B, S = 8, 12
# Adam's first step is ~lr * sign(g): with eps 1e-8, a 1e-8 difference in a near-zero gradient
# (e.g. reduction order across devices) could move a parameter by up to lr; eps 1e-3 keeps the
# update Lipschitz in g, so comparisons test the program rather than float noise.
CFG = RLConfig(model=MODEL, prompts_per_step=2, steps=10,
               grpo=GRPOConfig(group_size=4, loss_agg="seq-mean-token-mean"),
               draft=DraftConfig(kind="eagle3", online=True, ttt_steps=2),
               policy_optim=OptimConfig(lr=1e-2, weight_decay=0.01, eps=1e-3),
               draft_optim=OptimConfig(lr=3e-2, weight_decay=0.01, clip_norm=0.5, eps=1e-3,
                                       schedule="linear", final_lr_ratio=0.1))


@pytest.fixture(scope="module")
def setup():
  pg, pp = nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))
  hg, hp = nnx.split(init_head(MODEL, seed=1))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 64, (B, S)), jnp.int32)
  lengths = rng.integers(2, 7, B)
  j = np.arange(S)[None]
  mask = jnp.asarray((j >= 5) & (j < 5 + lengths[:, None]), jnp.float32)
  adv = jnp.asarray(rng.normal(size=B), jnp.float32)
  trainer = Trainer(CFG, pg, hg)
  old = trainer.logprobs(pp, tokens)
  # pretend the sampler was a little off so that ratios != 1 and both clips are exercised
  old = old + 0.3 * jnp.sin(jnp.arange(S, dtype=jnp.float32))[None] * mask
  batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=adv, old_logprobs=old,
                     ref_logprobs=jnp.zeros_like(old))
  state = trainer.init_state(pp, hp, identity_maps(MODEL.vocab_size))
  return dict(pg=pg, pp=pp, hg=hg, hp=hp, trainer=trainer, batch=batch, state=state)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_policy_update_is_bitwise_identical_whether_the_draft_learns_or_not(setup):
  trainer, state, batch, pp, hp = (setup[k] for k in ("trainer", "state", "batch", "pp", "hp"))
  g0, _ = trainer.grads(state, batch, 0.0)
  g1, m1 = trainer.grads(state, batch, 1.0)
  for a, b in zip(_leaves(g0["policy"]), _leaves(g1["policy"])):
    np.testing.assert_array_equal(a, b)
  assert all(np.all(x == 0) for x in _leaves(g0["draft"]))
  assert any(np.any(x != 0) for x in _leaves(g1["draft"]))
  assert float(m1["draft/loss"]) > 0 and float(m1["clip_frac"]) > 0
  s0, _ = trainer.step(state, batch, 0.0)
  s1, _ = trainer.step(state, batch, 1.0)
  changed = False
  for a, b, init in zip(_leaves(s0.params["policy"]), _leaves(s1.params["policy"]), _leaves(pp)):
    np.testing.assert_array_equal(a, b)
    changed |= bool(np.any(a != init))
  assert changed, "the policy did not move"
  for a, init in zip(_leaves(s0.params["draft"]), _leaves(hp)):
    np.testing.assert_array_equal(a, init)  # lambda = 0: not even weight decay touches it
  assert any(np.any(a != init) for a, init in zip(_leaves(s1.params["draft"]), _leaves(hp)))
  # the policy update is the one of a run without any draft at all
  plain = Trainer(CFG.replace(draft=DraftConfig()), setup["pg"])
  sp, _ = plain.step(plain.init_state(pp), batch)
  for a, b in zip(_leaves(sp.params["policy"]), _leaves(s1.params["policy"])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # an offline head (no online loss) rides in the state for the sampler: frozen, weight decay
  # and lambda > 0 notwithstanding
  offline = Trainer(CFG.replace(draft=DraftConfig(kind="eagle3", online=False, ttt_steps=2)),
                    setup["pg"], setup["hg"])
  so, _ = offline.step(offline.init_state(pp, hp, identity_maps(MODEL.vocab_size)), batch, 1.0)
  for a, init in zip(_leaves(so.params["draft"]), _leaves(hp)):
    np.testing.assert_array_equal(a, init)


def test_pg_weights_scale_the_policy_gradient_and_leave_the_draft_gradient_alone(setup):
  trainer, state, batch = setup["trainer"], setup["state"], setup["batch"]
  g, m = trainer.grads(state, batch, 1.0)
  weighted = batch.replace(pg_weights=2.0 * batch.loss_mask)
  g2, m2 = trainer.grads(state, weighted, 1.0)
  for a, b in zip(_leaves(g["policy"]), _leaves(g2["policy"])):
    np.testing.assert_allclose(2.0 * a, b, rtol=1e-5, atol=1e-7)  # beta = 0: all pg
  for a, b in zip(_leaves(g["draft"]), _leaves(g2["draft"])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(m["pg_loss"], m2["pg_loss"], rtol=1e-6)  # metrics stay unweighted


def test_policy_and_draft_groups_follow_their_own_schedules(setup):
  trainer, state, batch = setup["trainer"], setup["state"], setup["batch"]
  state, m = trainer.step(state, batch, 1.0)
  assert float(m["lr/policy"]) == pytest.approx(1e-2) and float(m["lr/draft"]) == pytest.approx(3e-2)
  state, m = trainer.step(state, batch, 1.0)
  assert float(m["lr/policy"]) == pytest.approx(1e-2)
  assert float(m["lr/draft"]) == pytest.approx(3e-2 * (1 - 0.9 / 10))  # linear decay over 10 steps
  assert float(m["grad_norm/policy"]) > 0 and float(m["grad_norm/draft"]) > 0
  assert int(state.step) == 2


def test_gradient_accumulation_over_micro_batches_matches_the_full_batch(setup):
  state, batch = setup["state"], setup["batch"]
  g_full, m_full = setup["trainer"].grads(state, batch, 1.0)
  acc = Trainer(CFG.replace(micro_batches=2, minibatches=2), setup["pg"], setup["hg"])
  g_acc, m_acc = acc.grads(state, batch, 1.0)
  for a, b in zip(_leaves(g_full["policy"]), _leaves(g_acc["policy"])):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
  for k in ("pg_loss", "clip_frac", "entropy", "kl"):
    np.testing.assert_allclose(m_full[k], m_acc[k], rtol=1e-5)
  # minibatches: consecutive optimizer steps on slices, all against the batch's old logprobs
  after, _ = acc.train_on_batch(state, batch)
  by_hand = state
  for half in (slice(0, 4), slice(4, 8)):
    by_hand, _ = acc.step(by_hand, jax.tree.map(lambda x: x[half], batch))
  assert int(after.step) == 2
  for a, b in zip(_leaves(after.params), _leaves(by_hand.params)):
    np.testing.assert_array_equal(a, b)


def test_train_step_on_a_2x2x2_mesh_matches_the_single_device_step(setup):
  single, state, batch = setup["trainer"], setup["state"], setup["batch"]
  ref_state, ref_m = single.step(state, batch, 1.0)
  sharded = Trainer(CFG, setup["pg"], setup["hg"], mesh=make_mesh(MeshConfig(2, 2, 2)))
  sstate = sharded.init_state(setup["pp"], setup["hp"], identity_maps(MODEL.vocab_size))
  emb = sstate.params["policy"]["embed"][...]
  assert len(emb.sharding.device_set) == 8 and not emb.sharding.is_fully_replicated
  new_state, m = sharded.step(sstate, batch, 1.0)
  assert new_state.params["policy"]["embed"][...].sharding == emb.sharding
  for a, b in zip(_leaves(ref_state.params), _leaves(new_state.params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  np.testing.assert_allclose(m["pg_loss"], ref_m["pg_loss"], atol=1e-5)
  np.testing.assert_allclose(sharded.logprobs(setup["pp"], batch.tokens),
                             single.logprobs(setup["pp"], batch.tokens), atol=1e-5)


def test_online_mtp_trains_only_the_mtp_module_and_leaves_the_policy_gradient_exact(setup):
  from specjax.drafters.mtp import split_mtp

  model = Decoder(MODEL.replace(mtp=True, num_layers=1), rngs=nnx.Rngs(2))
  graphdef, full = nnx.split(model)
  trunk, mtp = split_mtp(full)
  assert "mtp" in mtp and "mtp" not in trunk
  cfg = CFG.replace(draft=DraftConfig(kind="mtp", online=True))
  trainer = Trainer(cfg, graphdef)
  state = trainer.init_state(trunk, mtp)
  batch = setup["batch"]
  g0, _ = trainer.grads(state, batch, 0.0)
  g1, m1 = trainer.grads(state, batch, 1.0)
  for a, b in zip(_leaves(g0["policy"]), _leaves(g1["policy"])):
    np.testing.assert_array_equal(a, b)  # the embedding / LM head shared with MTP included
  assert any(np.any(x != 0) for x in _leaves(g1["draft"]))
  assert all(np.all(x == 0) for x in _leaves(g0["draft"]))
  assert np.isfinite(float(m1["draft/loss"]))
