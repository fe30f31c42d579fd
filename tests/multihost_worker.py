"""One process of the 2-process test (tests/test_multihost.py), started by launch_local.py.

Joins the job from the environment, runs a sharded forward + KV-cache step on the global mesh and
writes the gathered results to OUT_DIR/result_p{process_id}.npz.
"""

from __future__ import annotations

import os
import sys

import numpy as np

MESH_SHAPE = (2, 1, 2)  # data across the two processes, tensor inside each
BATCH, SEQ, PREFILL, CACHE = 8, 8, 6, 16
# Tests compare programs compiled alike; XLA's backend optimisations only cost compile time here.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def model_config():
  from specjax.models import ModelConfig
  return ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=64, mtp=True)


def random_model(seed: int = 0):
  """(graphdef, state) of the test decoder with weights drawn by numpy: identical in every process
  and no random-number program to compile (that compile dominates a tiny model's start-up)."""
  import jax
  from flax import nnx
  from specjax.models import Decoder
  cfg = model_config()
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def draw(x):
    noise = rng.standard_normal(x.shape).astype(np.float32)
    return 1.0 + 0.1 * noise if len(x.shape) == 1 else 0.1 * noise  # norm scales near one

  return graphdef, jax.tree.map(draw, abstract)


def global_tokens() -> np.ndarray:
  return np.random.default_rng(1).integers(0, 64, (BATCH, SEQ), dtype=np.int32)


def forward_and_decode(graphdef, state, tokens, cache):
  """Full forward of `tokens`, then prefill PREFILL tokens into `cache` and decode one more."""
  from flax import nnx
  model = nnx.merge(graphdef, state)
  full = model(tokens).logits
  prefill = model(tokens[:, :PREFILL], cache=cache)
  cache = prefill.cache.advance(PREFILL)
  step = model(tokens[:, PREFILL:PREFILL + 1], cache=cache)
  return full, step.logits, step.cache.k[0]


_REFERENCE = []


def reference_outputs():
  """The same program unsharded, on one device (computed once per process)."""
  if not _REFERENCE:
    import jax
    from flax import nnx
    device = jax.devices()[0]
    graphdef, state = random_model()
    state = jax.device_put(state, device)
    cache = jax.device_put(nnx.merge(graphdef, state).init_cache(BATCH, CACHE), device)
    tokens = jax.device_put(global_tokens(), device)
    run = jax.jit(forward_and_decode, static_argnums=0, compiler_options=FAST_COMPILE)
    out = run(graphdef, state, tokens, cache)
    _REFERENCE.append(tuple(np.asarray(x) for x in out))
  return _REFERENCE[0]


def main(out_dir: str) -> None:
  from specjax.sharding import DistributedConfig, initialize_distributed
  config = DistributedConfig.from_env()
  assert initialize_distributed(config), "expected a multi-process environment"

  import jax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from specjax.sharding import (MeshConfig, cache_shardings, global_batch, make_mesh,
                                process_rows, shard_model)

  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  mesh = make_mesh(MeshConfig(*MESH_SHAPE))
  graphdef, state = random_model()
  model = shard_model(nnx.merge(graphdef, state), mesh)
  graphdef, state = nnx.split(model)
  q = model.layers[0].attn.q_proj.get_value()
  assert q.sharding.spec == P(None, "tensor", None), q.sharding.spec
  assert not q.is_fully_addressable  # a global array: half its shards live in the other process

  tokens = global_batch(global_tokens()[process_rows(BATCH)], mesh)
  cache_abstract = jax.eval_shape(lambda: model.init_cache(BATCH, CACHE))
  cache_sh = cache_shardings(cache_abstract, mesh)
  cache = jax.jit(lambda: model.init_cache(BATCH, CACHE), out_shardings=cache_sh)()
  replicated = NamedSharding(mesh, P())
  run = jax.jit(forward_and_decode, static_argnums=0, out_shardings=replicated,
                compiler_options=FAST_COMPILE)
  full, step, k0 = run(graphdef, state, tokens, cache)
  np.savez(os.path.join(out_dir, f"result_p{jax.process_index()}.npz"),
           full=np.asarray(full), step=np.asarray(step), k0=np.asarray(k0))
  print(f"process {jax.process_index()} done: logits {full.shape}", flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1])
