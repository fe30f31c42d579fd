"""Sharding on 8 fake CPU devices: meshes, partition rules, sharded forward and KV cache, split
meshes and transfers, optimizer state, and the errors for impossible meshes or unknown axes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from multihost_worker import (BATCH, CACHE, FAST_COMPILE, forward_and_decode, global_tokens,
                              random_model, reference_outputs)
from specjax.models.layers import param
from specjax.sharding import (DEFAULT_RULES, DistributedConfig, MeshConfig, batch_sharding,
                              cache_shardings, create_sharded, global_batch,
                              initialize_distributed, logical_to_spec, make_mesh,
                              optimizer_shardings, shard_model, split_mesh, state_shardings,
                              transfer)

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2)]


@pytest.fixture(scope="module")
def tokens():
  return global_tokens()


@pytest.fixture(scope="module")
def reference():
  graphdef, state = random_model()  # the MTP module's ('embed', 'embed') projection included
  return nnx.merge(graphdef, jax.device_put(state, jax.devices()[0])), reference_outputs()


@pytest.fixture(scope="module")
def sharded_runs(tokens, reference):
  """For each mesh: the sharded model, its placed inputs and the outputs of the same program."""
  model, _ = reference
  runs = {}
  for shape in MESHES:
    mesh = make_mesh(MeshConfig(*shape))
    sharded = shard_model(nnx.clone(model), mesh)
    graphdef, state = nnx.split(sharded)
    toks = jax.device_put(tokens, batch_sharding(mesh, tokens.shape))
    cache = model.init_cache(BATCH, CACHE)
    cache = jax.device_put(cache, cache_shardings(cache, mesh))
    run = jax.jit(forward_and_decode, static_argnums=0, compiler_options=FAST_COMPILE)
    out = run(graphdef, state, toks, cache)
    runs[shape] = (mesh, sharded, toks, cache, out)
  return runs


@pytest.mark.parametrize("shape", MESHES)
def test_sharded_forward_and_cache_step_equal_unsharded(reference, sharded_runs, shape):
  _, expected = reference
  *_, got = sharded_runs[shape]
  for name, e, g in zip(("full logits", "decode logits", "cache k"), expected, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5, rtol=0, err_msg=name)


def test_parameters_are_sharded_by_the_rules(sharded_runs):
  mesh, model, *_ = sharded_runs[(1, 4, 2)]
  q = model.layers[0].attn.q_proj.get_value()  # [embed 32, heads 4, head_dim 8]
  assert q.sharding.spec == P("fsdp", "tensor", None)
  assert {s.data.shape for s in q.addressable_shards} == {(8, 2, 8)}
  assert len({s.device for s in q.addressable_shards}) == 8
  emb = model.embed.get_value()  # [vocab 64, embed 32]
  assert emb.sharding.spec == P("tensor", "fsdp")
  assert {s.data.shape for s in emb.addressable_shards} == {(32, 8)}
  assert model.layers[0].mlp.down.get_value().sharding.spec == P("tensor", "fsdp")
  assert model.mtp.proj.get_value().sharding.spec == P("fsdp", None)  # embed used once
  assert model.final_norm.scale.get_value().sharding.spec == P(None)
  _, model222, *_ = sharded_runs[(2, 2, 2)]
  q222 = model222.layers[0].attn.q_proj.get_value()
  assert {s.data.shape for s in q222.addressable_shards} == {(16, 2, 8)}


def test_tokens_and_cache_are_sharded_on_the_batch_axes(sharded_runs):
  _, _, toks, cache, _ = sharded_runs[(2, 2, 2)]
  assert toks.sharding.spec == P(("data", "fsdp"), None)
  assert {s.data.shape for s in toks.addressable_shards} == {(2, 8)}
  # keys [B, Hkv, Dh, S], values [B, Hkv, S, Dh]: rows on the batch axes, kv heads on tensor
  assert cache.k[0].sharding.spec == P(("data", "fsdp"), "tensor", None, None)
  assert cache.v[0].sharding.spec == P(("data", "fsdp"), "tensor", None, None)
  assert cache.lengths.sharding.spec == P(("data", "fsdp"))
  _, _, toks8, _, _ = sharded_runs[(8, 1, 1)]
  assert toks8.sharding.spec == P("data", None)


def test_dimensions_not_divisible_by_their_mesh_axes_are_replicated(sharded_runs):
  mesh, *_ = sharded_runs[(2, 2, 2)]
  big = make_mesh(MeshConfig(1, 2, 4))
  assert logical_to_spec(("kv_heads",), shape=(2,), mesh=big) == P(None)
  assert logical_to_spec(("batch", None), shape=(2, 3), mesh=mesh) == P("data", None)
  assert logical_to_spec(("batch",), shape=(3,), mesh=mesh) == P(None)
  assert logical_to_spec(("embed", "embed")) == P("fsdp", None)


def test_optax_state_mirrors_parameter_shardings(sharded_runs):
  mesh, model, *_ = sharded_runs[(1, 4, 2)]
  params = nnx.state(model, nnx.Param)
  param_sh = state_shardings(params, mesh)
  opt_state = optax.adamw(1e-3).init(params)
  placed = jax.device_put(opt_state, optimizer_shardings(opt_state, params, param_sh))
  adam = placed[0]
  assert adam.count.sharding.spec == P()
  assert adam.mu["embed"].get_value().sharding.spec == P("tensor", "fsdp")
  assert adam.nu["layers"][1]["attn"]["o_proj"].get_value().sharding.spec == P("tensor", None,
                                                                                "fsdp")


def test_nnx_optimizer_state_shards_through_its_logical_axes(sharded_runs):
  mesh, model, *_ = sharded_runs[(2, 2, 2)]
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  sh = state_shardings(nnx.state(opt), mesh)
  leaves = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(sh)}
  mu_q = [k for k in leaves if "mu" in k and "q_proj" in k][0]
  assert leaves[mu_q] == P("fsdp", "tensor", None)
  assert all(spec == P() for k, spec in leaves.items() if "count" in k or "step" in k)


def test_split_meshes_are_disjoint_and_transfer_round_trips_exactly(reference):
  model, _ = reference
  gen, train = split_mesh(jax.devices(), 0.75, gen_shape=MeshConfig(data=3, fsdp=2),
                          train_shape=MeshConfig(fsdp=1, tensor=2))
  gen_ids = {d.id for d in gen.devices.flat}
  train_ids = {d.id for d in train.devices.flat}
  assert len(gen_ids) == 6 and len(train_ids) == 2 and not gen_ids & train_ids
  params = nnx.state(model, nnx.Param)
  on_train = jax.device_put(params, state_shardings(params, train))
  on_gen = transfer(on_train, state_shardings(params, gen))
  back = transfer(on_gen, state_shardings(params, train))
  for a, g, b in zip(jax.tree.leaves(params), jax.tree.leaves(on_gen), jax.tree.leaves(back)):
    assert {d.id for d in g.sharding.device_set} <= gen_ids
    assert {d.id for d in b.sharding.device_set} <= train_ids
    np.testing.assert_array_equal(np.asarray(g), np.asarray(a))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_global_batch_on_one_process_is_the_whole_batch(sharded_runs, tokens):
  mesh, *_ = sharded_runs[(2, 2, 2)]
  arr = global_batch(tokens, mesh)
  assert arr.sharding == NamedSharding(mesh, P(("data", "fsdp")))
  np.testing.assert_array_equal(np.asarray(arr), tokens)


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, words", [
    (MeshConfig(data=3), ["8 devices", "data=3"]),
    (MeshConfig(data=2, fsdp=2, tensor=4), ["needs 16 devices", "8 are available"]),
])
def test_impossible_mesh_shapes_name_the_device_count_and_shape(config, words):
  with pytest.raises(ValueError) as err:
    make_mesh(config)
  for word in words:
    assert word in str(err.value)


def test_invalid_mesh_configs_and_splits_are_rejected():
  with pytest.raises(ValueError, match="MeshConfig.tensor"):
    MeshConfig(tensor=0)
  with pytest.raises(ValueError, match="at most one axis"):
    MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="gen_fraction"):
    split_mesh(jax.devices(), 0.01)


class _Odd(nnx.Module):
  def __init__(self, axes):
    self.w = nnx.Param(jnp.zeros((4, 4)), **axes)


class _Tiny(nnx.Module):
  def __init__(self, rngs):
    self.w = param(rngs, (16, 8), ("embed", "mlp"), jnp.float32, std=None)


def test_create_sharded_initialises_each_parameter_in_its_sharded_layout():
  mesh = make_mesh(MeshConfig(1, 4, 2))
  model = create_sharded(lambda: _Tiny(nnx.Rngs(0)), mesh)
  w = model.w.get_value()
  assert w.sharding.spec == P("fsdp", "tensor")
  assert {s.data.shape for s in w.addressable_shards} == {(4, 4)}
  np.testing.assert_array_equal(np.asarray(w), np.ones((16, 8), np.float32))


def test_a_logical_axis_without_a_rule_names_the_parameter():
  mesh = make_mesh(MeshConfig(fsdp=8))
  with pytest.raises(ValueError, match=r"\['w'\].*'mystery'"):
    shard_model(_Odd({"logical_axes": ("embed", "mystery")}), mesh)


def test_a_parameter_without_logical_axes_is_an_error_naming_it():
  mesh = make_mesh(MeshConfig(fsdp=8))
  with pytest.raises(ValueError, match=r"\['w'\].*logical_axes"):
    state_shardings(nnx.state(_Odd({})), mesh)


def test_rules_cover_every_parameter_name_of_the_decoder(reference):
  model, _ = reference
  axes = {a for _, v in jax.tree_util.tree_leaves_with_path(
      nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
          for a in v.get_metadata()["logical_axes"]}
  assert axes <= set(DEFAULT_RULES)


def test_distributed_config_reads_the_environment_and_validates():
  env = {"SPECJAX_COORDINATOR": "10.0.0.1:1234", "SPECJAX_NUM_PROCESSES": "4",
         "SPECJAX_PROCESS_ID": "3", "JAX_LOCAL_DEVICE_IDS": "0,1"}
  cfg = DistributedConfig.from_env(env)
  assert cfg == DistributedConfig("10.0.0.1:1234", 4, 3, (0, 1))
  assert DistributedConfig.from_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                                     "JAX_PROCESS_ID": "1"}).process_id == 1
  assert DistributedConfig.from_env({}) == DistributedConfig()
  with pytest.raises(ValueError, match="process_id"):
    DistributedConfig("h:1", num_processes=2, process_id=2)
  with pytest.raises(ValueError, match="coordinator_address"):
    DistributedConfig(None, num_processes=2)
  with pytest.raises(ValueError, match="SPECJAX_NUM_PROCESSES"):
    DistributedConfig.from_env({"SPECJAX_NUM_PROCESSES": "two"})
  assert initialize_distributed(DistributedConfig()) is False  # one process: nothing to join
