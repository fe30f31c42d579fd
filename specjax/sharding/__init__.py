"""Device meshes (data, fsdp, tensor), logical-axis partition rules, split meshes for async RL,
and multi-host start with jax.distributed."""

from specjax.sharding.distributed import (DistributedConfig, global_batch, initialize_distributed,
                                          process_rows)
from specjax.sharding.mesh import MESH_AXES, MeshConfig, make_mesh, split_mesh, transfer
from specjax.sharding.rules import (DEFAULT_RULES, K_CACHE_AXES, TOKEN_AXES, V_CACHE_AXES,
                                    batch_sharding, cache_shardings, create_sharded,
                                    logical_sharding, logical_to_spec, optimizer_shardings,
                                    shard_batch, shard_model, state_shardings,
                                    with_logical_constraint)

__all__ = [
    "DistributedConfig", "global_batch", "initialize_distributed", "process_rows", "MESH_AXES",
    "MeshConfig", "make_mesh", "split_mesh", "transfer", "K_CACHE_AXES", "V_CACHE_AXES",
    "DEFAULT_RULES", "TOKEN_AXES", "batch_sharding", "cache_shardings", "create_sharded",
    "logical_sharding", "logical_to_spec", "optimizer_shardings", "shard_batch", "shard_model",
    "state_shardings", "with_logical_constraint",
]
