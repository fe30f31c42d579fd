"""Sequence packing in the train step: the layout, attention kept inside each sequence, the same
update as the padded batch for every loss aggregation, one compiled program for every batch, and
the mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import Decoder, ModelConfig
from specjax.optim import OptimConfig
from specjax.rl import train_packed, train_step as ts
from specjax.rl.config import RLConfig, RolloutConfig, TrainConfig
from specjax.rl.grpo import GRPOConfig
from specjax.rl.logprobs import sequence_logprobs
from specjax.rl.packing import attention_work, first_fit_rows, pack, sequence_extents
from specjax.rl.train_step import TrainBatch, Trainer
from specjax.sharding import MeshConfig, make_mesh

MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=16, mlp_hidden=64)
B, S, PROMPT = 8, 24, 4
# eps 1e-3: Adam's first step is Lipschitz in the gradient, so packed and padded updates compare
# to float tolerance (the summation order differs)
CFG = RLConfig(model=MODEL, prompts_per_step=2, steps=10, grpo=GRPOConfig(group_size=4),
               policy_optim=OptimConfig(lr=1e-2, weight_decay=0.01, eps=1e-3))


def _batch(seed: int, max_len: int = S - PROMPT):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, 64, (B, S)).astype(np.int32)
  lengths = rng.integers(1, max_len + 1, B)
  lengths[1] = 0  # a row without completion tokens adds nothing and is left out
  j = np.arange(S)[None]
  mask = ((j >= PROMPT) & (j < PROMPT + lengths[:, None])).astype(np.float32)
  tokens = np.where(j < PROMPT + lengths[:, None], tokens, 0)
  adv = rng.normal(size=B).astype(np.float32)
  old = (rng.normal(size=(B, S)) * 0.2 - 2.0).astype(np.float32) * mask
  return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask),
                    advantages=jnp.asarray(adv), old_logprobs=jnp.asarray(old),
                    ref_logprobs=jnp.zeros((B, S), jnp.float32))


@pytest.fixture(scope="module")
def policy():
  return nnx.split(Decoder(MODEL, rngs=nnx.Rngs(0)))


def test_packing_lays_each_sequence_whole_in_one_row_from_position_zero():
  batch = jax.device_get(_batch(0))
  fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(TrainBatch)
            if f.name not in ("positions", "segment_ids", "seq_lengths")}
  extents = sequence_extents(batch.loss_mask)
  micro = pack(fields, S, 2)
  assert all(m["tokens"].shape == (2, S) for m in micro)
  seen = []
  for m in micro:
    for r in range(2):
      for s in sorted(set(m["segment_ids"][r]) - {-1}):
        at = np.flatnonzero(m["segment_ids"][r] == s)
        assert np.all(np.diff(at) == 1), "a sequence is split"
        np.testing.assert_array_equal(m["positions"][r, at], np.arange(len(at)))
        # the sequence it came from: the one with the same tokens, mask and advantage
        src = [i for i in range(B) if extents[i] == len(at)
               and np.array_equal(batch.tokens[i, :len(at)], m["tokens"][r, at])]
        assert src, "tokens do not come from one row"
        i = src[0]
        seen.append(i)
        np.testing.assert_array_equal(m["loss_mask"][r, at], batch.loss_mask[i, :len(at)])
        np.testing.assert_array_equal(m["old_logprobs"][r, at], batch.old_logprobs[i, :len(at)])
        assert np.all(m["advantages"][r, at] == batch.advantages[i])
        assert np.all(m["seq_lengths"][r, at] == batch.loss_mask[i].sum())
      pad = m["segment_ids"][r] == -1
      assert np.all(m["loss_mask"][r, pad] == 0)
  assert sorted(seen) == [i for i in range(B) if extents[i] > 0]
  # fewer positions than the padded batch: first fit fills rows
  assert len(first_fit_rows(extents, S)) < B - 1


def test_a_sequence_longer_than_a_packed_row_is_an_error_naming_the_field():
  with pytest.raises(ValueError, match="pack_width"):
    first_fit_rows(np.array([5, 30]), 24)


@pytest.mark.parametrize("block", [0, 4])
def test_packed_logprobs_equal_each_sequence_alone(policy, block):
  """Attention stays inside a sequence (dense mask, and the blockwise path with segment ids)."""
  cfg = dataclasses.replace(MODEL, attention_block=block)
  graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
  model = nnx.merge(graphdef, params)
  batch = jax.device_get(_batch(1))
  fields = {"tokens": batch.tokens, "loss_mask": batch.loss_mask,
            "advantages": batch.advantages}
  alone = np.asarray(sequence_logprobs(model(jnp.asarray(batch.tokens)).logits,
                                       jnp.asarray(batch.tokens), 1.0)[0])
  extents = sequence_extents(batch.loss_mask)
  for m in pack(fields, S, 1):
    out = model(jnp.asarray(m["tokens"]), positions=jnp.asarray(m["positions"]),
                segment_ids=jnp.asarray(m["segment_ids"]))
    lp = np.asarray(sequence_logprobs(out.logits, jnp.asarray(m["tokens"]), 1.0)[0])
    for s in sorted(set(m["segment_ids"][0]) - {-1}):
      at = np.flatnonzero(m["segment_ids"][0] == s)
      i = next(i for i in range(B) if extents[i] == len(at)
               and np.array_equal(batch.tokens[i, :len(at)], m["tokens"][0, at]))
      # position 0 of a segment follows another sequence: its logprob is never used (a prompt
      # token); the rest must equal the sequence forwarded alone
      np.testing.assert_allclose(lp[0, at[1:]], alone[i, 1:len(at)], rtol=2e-5, atol=2e-5)


def _cfg(agg: str, packing: bool, width: int = 0, rows: int = 1, beta: float = 0.0):
  return CFG.replace(grpo=GRPOConfig(group_size=4, loss_agg=agg, beta=beta),
                     rollout=RolloutConfig(max_new_tokens=S - PROMPT),
                     train=TrainConfig(packing=packing, pack_width=width, pack_rows=rows))


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("agg,width,rows,beta", [
    ("token-mean", 0, 1, 0.0), ("seq-mean-token-mean", 2 * S, 1, 0.0),
    ("seq-mean-token-sum-norm", 0, 2, 0.1)])
def test_a_packed_step_is_the_padded_step(policy, agg, width, rows, beta):
  graphdef, params = policy
  batch = _batch(2)
  if beta:
    batch = batch.replace(ref_logprobs=batch.old_logprobs * 1.1)
  packed, padded = Trainer(_cfg(agg, True, width, rows, beta), graphdef), \
      Trainer(_cfg(agg, False, beta=beta), graphdef)
  assert packed.packing and not padded.packing
  sp, mp = packed.step(packed.init_state(params), batch)
  sq, mq = padded.step(padded.init_state(params), batch)
  extra = {"train/packed_rows"} | ({"train/skipped_seqs"} if beta == 0 else set())
  assert set(mp) - set(mq) == extra
  for k in mq:
    np.testing.assert_allclose(float(mp[k]), float(mq[k]), rtol=2e-5, atol=2e-6, err_msg=k)
  assert float(mq["clip_frac"]) > 0  # ratios != 1: the old logprobs are used
  moved = False
  for a, b, init in zip(_leaves(sp.params), _leaves(sq.params), _leaves(params)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    moved |= bool(np.any(a != init))
  assert moved


def _close(a, b, err_msg=""):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=err_msg)


def test_sequences_with_zero_advantage_are_left_out_and_the_update_is_unchanged(policy):
  """A GRPO group whose samples all scored the same has advantage exactly 0: the packed step
  leaves its sequences out, yet the update equals the padded step on the whole batch (same
  loss denominators); token-mean metrics are those of the sequences trained on."""
  graphdef, params = policy
  batch = _batch(7)
  adv = np.asarray(batch.advantages).copy()
  adv[4:] = 0.0  # the second group (rows 4-7)
  batch = batch.replace(advantages=jnp.asarray(adv))
  skip, padded = Trainer(_cfg("token-mean", True), graphdef), \
      Trainer(_cfg("token-mean", False), graphdef)
  keep_all = Trainer(_cfg("token-mean", True).replace(train=dataclasses.replace(
      _cfg("token-mean", True).train, skip_zero_advantage=False)), graphdef)
  assert skip.step_cfg.skip_zero_advantage and not keep_all.step_cfg.skip_zero_advantage
  ss, ms = skip.step(skip.init_state(params), batch)
  sp, mp = padded.step(padded.init_state(params), batch)
  _, mk = keep_all.step(keep_all.init_state(params), batch)
  # row 1 has no completion tokens: 4 of the 7 sequences with tokens are left out
  assert float(ms["train/skipped_seqs"]) == pytest.approx(4 / 7)
  assert float(ms["train/packed_rows"]) < float(mk["train/packed_rows"])
  for a, b in zip(_leaves(ss.params), _leaves(sp.params)):
    _close(a, b)
  for k in ("pg_loss", "grad_norm/policy"):
    _close(ms[k], mp[k], k)
  # token means over rows 0-3 only: the padded step on the batch without rows 4-7's tokens
  mask = np.asarray(batch.loss_mask).copy()
  mask[4:] = 0.0
  _, mt = padded.step(padded.init_state(params), batch.replace(loss_mask=jnp.asarray(mask)))
  assert float(mt["clip_frac"]) > 0
  for k in ("entropy", "clip_frac", "ratio_mean", "approx_kl_old"):
    _close(ms[k], mt[k], k)


def test_a_batch_of_zero_advantages_trains_on_nothing_and_still_applies_the_update(policy):
  """Every advantage 0: no forward or backward, zero gradients into AdamW (weight decay still
  moves the parameters, as in the padded step), no token-mean metrics; with beta > 0 (the KL
  term reads every sequence) nothing is left out."""
  graphdef, params = policy
  batch = _batch(8)
  batch = batch.replace(advantages=jnp.zeros_like(batch.advantages))
  skip, padded = Trainer(_cfg("token-mean", True), graphdef), \
      Trainer(_cfg("token-mean", False), graphdef)
  ss, ms = skip.step(skip.init_state(params), batch)
  sp, mp = padded.step(padded.init_state(params), batch)
  assert float(ms["train/skipped_seqs"]) == 1.0 and float(ms["train/packed_rows"]) == 0
  assert not set(ms) & train_packed.TOKEN_MEAN_METRICS and "entropy" in mp
  moved = False
  for a, b, init in zip(_leaves(ss.params), _leaves(sp.params), _leaves(params)):
    _close(a, b)
    moved |= bool(np.any(a != init))
  assert moved  # weight decay
  assert not Trainer(_cfg("token-mean", True, beta=0.1), graphdef).step_cfg.skip_zero_advantage


def test_a_steps_work_counts_each_trained_sequence_to_its_last_loss_position(policy):
  """train/tokens and train/attention_pairs (the step's model FLOPs): a sequence of extent e
  (prompt and completion up to its last loss position) is e positions and e (e + 1) / 2 causal
  pairs; padded and packed steps count alike; minibatches add up."""
  mask = np.zeros((3, 10), np.float32)
  mask[0, 2:5] = 1  # extent 5
  mask[1, 3:4] = 1  # extent 4
  assert attention_work(mask) == (9.0, 15.0 + 10.0)  # row 2 trains nothing
  graphdef, params = policy
  batch = _batch(7)
  e = sequence_extents(np.asarray(batch.loss_mask)).astype(float)
  want = (e.sum(), (e * (e + 1) / 2).sum())
  cfg = _cfg("token-mean", False)
  for trainer in (Trainer(cfg, graphdef), Trainer(_cfg("token-mean", True), graphdef),
                  Trainer(cfg.replace(minibatches=2), graphdef)):
    _, m = trainer.train_on_batch(trainer.init_state(params), batch)
    assert (float(m["train/tokens"]), float(m["train/attention_pairs"])) == want


def test_on_policy_packed_steps_compile_once_for_batches_of_any_lengths(policy):
  graphdef, params = policy
  trainer = Trainer(_cfg("token-mean", True), graphdef)
  state = trainer.init_state(params)
  sizes = []
  # the first batch trains on nothing (every advantage 0): it compiles the step all the same
  for seed, longest, zero in ((9, 20, True), (3, 20, False), (4, 3, False), (5, 12, False)):
    batch = _batch(seed, longest).replace(old_logprobs=None)
    if zero:
      batch = batch.replace(advantages=jnp.zeros_like(batch.advantages))
    state, m = trainer.step(state, batch, donate=True)
    assert np.isfinite(float(m["pg_loss"]))
    sizes.append((train_packed._accumulate_jit._cache_size(), ts._apply_jit_donated._cache_size()))
  assert sizes[0] == sizes[1] == sizes[2] == sizes[3], sizes


def test_a_packed_step_on_a_mesh_equals_one_device(policy):
  """(2, 2, 2) mesh: micro-batches of 4 rows (one per data-parallel shard) and gradients
  accumulated sharded like the parameters."""
  graphdef, params = policy
  batch = _batch(6)
  cfg = _cfg("token-mean", True)
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  sharded, single = Trainer(cfg, graphdef, mesh=mesh), Trainer(cfg, graphdef)
  assert sharded.pack_rows == 4 and single.pack_rows == 1
  s1, m1 = sharded.step(sharded.init_state(params), batch)
  s2, m2 = single.step(single.init_state(params), batch)
  assert m1["train/packed_rows"] == 8 and m2["train/packed_rows"] == 5  # 4 rows per micro-batch
  for k in set(m2) - {"train/packed_rows"}:
    np.testing.assert_allclose(float(m1[k]), float(m2[k]), rtol=2e-5, atol=2e-6, err_msg=k)
  for a, b in zip(_leaves(s1.params), _leaves(s2.params)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
