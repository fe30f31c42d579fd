"""The EAGLE-3 head's parameters (logical axes, no embedding copy, zero gradient into the policy)
and the reduced draft vocabulary maps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters import (Eagle3Head, HeadConfig, build_vocab_maps, build_vocab_maps_from_tokens,
                           draft_to_target_logits, draft_to_target_probs, identity_maps,
                           target_to_draft, ttt_loss)
from experiments.toy import tiny_random_config
from specjax.models import Decoder

CFG = tiny_random_config(mtp=False)
SHARDING_AXES = {"embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "norm"}


@pytest.fixture(scope="module")
def policy():
  return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def head():
  return Eagle3Head(HeadConfig(CFG, 24), rngs=nnx.Rngs(1))


def _params_with_axes(state):
  return [(jax.tree_util.keystr(path), var) for path, var in
          jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))]


def test_every_head_param_carries_logical_axes_known_to_the_sharding_rules(head):
  params = _params_with_axes(nnx.state(head, nnx.Param))
  assert params
  for name, var in params:
    axes = var.get_metadata()["logical_axes"]
    assert len(axes) == var[...].ndim, name
    assert set(axes) <= SHARDING_AXES, (name, axes)
  shapes = {name: var[...].shape for name, var in params}
  d = CFG.hidden_size
  assert shapes["['fc']"] == (3 * d, d)
  assert shapes["['attn']['q_proj']"] == (2 * d, CFG.num_heads, CFG.head_dim)  # 2d-wide input
  assert shapes["['attn']['o_proj']"] == (CFG.num_heads, CFG.head_dim, d)
  assert shapes["['lm_head']"] == (d, 24)


def test_the_only_embedding_in_the_combined_tree_is_the_policys_and_draft_loss_gives_it_zero_grad(
    policy, head):
  policy_graphdef, policy_params = nnx.split(policy)
  head_graphdef, head_params = nnx.split(head)
  combined = {"policy": policy_params, "head": head_params}
  vd = (CFG.vocab_size, CFG.hidden_size)
  embeddings = [name for name, var in _params_with_axes(combined)
                if var[...].shape == vd or var.get_metadata()["logical_axes"] == ("vocab", "embed")]
  assert embeddings == ["['policy']['embed']"]

  tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, CFG.vocab_size)
  mask = jnp.ones((2, 10), bool)
  maps = build_vocab_maps_from_tokens(tokens, CFG.vocab_size, 24)

  def draft_loss(tree):
    model = nnx.merge(policy_graphdef, tree["policy"])
    out = model(tokens)  # features and logits come from the policy's own forward (as in RL)
    return ttt_loss(head_graphdef, tree["head"], model.embed[...], out.aux_hidden, out.logits,
                    tokens, mask, maps)[0]

  grads = jax.jit(jax.grad(draft_loss))(combined)
  for leaf in jax.tree.leaves(grads["policy"]):
    assert np.all(np.asarray(leaf) == 0.0)  # exactly zero, embedding included
  assert any(np.any(np.asarray(leaf) != 0.0) for leaf in jax.tree.leaves(grads["head"]))


def test_vocab_maps_keep_the_most_frequent_tokens_and_round_trip():
  counts = np.array([5, 0, 9, 9, 1, 7, 0, 3], np.int64)
  maps = build_vocab_maps(counts, 8, 4)
  np.testing.assert_array_equal(maps.d2t, [0, 2, 3, 5])  # ascending target ids
  np.testing.assert_array_equal(maps.t2d, [1, 0, 1, 1, 0, 1, 0, 0])
  assert maps.draft_vocab == 4 and maps.vocab_size == 8
  # ties break towards the lower id; always_include wins over frequency
  np.testing.assert_array_equal(build_vocab_maps(counts, 8, 2).d2t, [2, 3])
  np.testing.assert_array_equal(build_vocab_maps(counts, 8, 2, always_include=(6,)).d2t, [2, 6])
  # draft -> target -> draft is the identity; target -> draft keeps exactly the t2d entries
  draft = jax.random.normal(jax.random.key(0), (3, 4))
  full = draft_to_target_logits(draft, maps)
  np.testing.assert_array_equal(target_to_draft(full, maps), draft)
  assert np.all(np.isneginf(np.asarray(full)[:, ~np.asarray(maps.t2d)]))
  probs = draft_to_target_probs(jax.nn.softmax(draft), maps)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
  assert np.all(np.asarray(probs)[:, ~np.asarray(maps.t2d)] == 0.0)


def test_vocab_maps_from_tokens_count_only_masked_positions_and_full_size_is_identity():
  tokens = np.array([[1, 1, 2, 7], [7, 7, 7, 3]])
  mask = np.array([[1, 1, 1, 0], [0, 0, 0, 1]], bool)  # the 7s are prompt tokens
  np.testing.assert_array_equal(build_vocab_maps_from_tokens(tokens, 8, 3, mask=mask).d2t,
                                [1, 2, 3])
  full = build_vocab_maps_from_tokens(tokens, 8, 8)
  np.testing.assert_array_equal(full.d2t, identity_maps(8).d2t)
  assert bool(jnp.all(full.t2d))


def test_vocab_maps_reject_out_of_range_sizes_naming_the_field():
  with pytest.raises(ValueError, match="draft_vocab"):
    build_vocab_maps(np.ones(8), 8, 9)
  with pytest.raises(ValueError, match="counts must have shape"):
    build_vocab_maps(np.ones(7), 8, 4)
  with pytest.raises(ValueError, match="HeadConfig.draft_vocab"):
    HeadConfig(CFG, CFG.vocab_size + 1)
