"""Multi-host start: `jax.distributed.initialize` from a config (CLI or environment), and global
arrays assembled from host-local data. One process per host; every process runs the same program.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.config_tree import refuse
from specjax.sharding.rules import DEFAULT_RULES, Rules, logical_to_spec

# Ours first, then the names JAX itself (or common launchers) use.
ENV_NAMES = {
    "coordinator_address": ("SPECJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("SPECJAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("SPECJAX_PROCESS_ID", "JAX_PROCESS_ID"),
    "local_device_ids": ("SPECJAX_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS"),
    "auto": ("SPECJAX_DISTRIBUTED_AUTO",),
    "timeout_s": ("SPECJAX_DISTRIBUTED_TIMEOUT",),
}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins the job. num_processes=1 (and auto=False) is a single-process run.

  auto=True lets JAX detect the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) by itself."""

  coordinator_address: str | None = None  # "host:port" of process 0
  num_processes: int = 1
  process_id: int = 0
  local_device_ids: tuple[int, ...] | None = None
  auto: bool = False
  timeout_s: int = 300  # how long to wait for every process to join

  def __post_init__(self):
    if self.num_processes < 1:
      refuse(f"DistributedConfig.num_processes: must be >= 1, got {self.num_processes}")
    if not 0 <= self.process_id < self.num_processes:
      refuse(f"DistributedConfig.process_id: must be in [0, {self.num_processes}), "
             f"got {self.process_id}")
    if self.timeout_s < 1:
      refuse(f"DistributedConfig.timeout_s: must be >= 1, got {self.timeout_s}")
    if self.num_processes > 1 and not self.auto:
      addr = self.coordinator_address or ""
      host, _, port = addr.rpartition(":")
      if not host or not port.isdigit():
        refuse("DistributedConfig.coordinator_address: a multi-process run needs "
               f"'host:port' of process 0, got {self.coordinator_address!r}")
    if self.local_device_ids is not None:
      object.__setattr__(self, "local_device_ids", tuple(int(i) for i in self.local_device_ids))

  @property
  def is_multi_process(self) -> bool:
    return self.auto or self.num_processes > 1

  @classmethod
  def from_env(cls, environ: Mapping[str, str] | None = None) -> "DistributedConfig":
    """Read SPECJAX_COORDINATOR, SPECJAX_NUM_PROCESSES, SPECJAX_PROCESS_ID,
    SPECJAX_LOCAL_DEVICE_IDS (comma-separated), SPECJAX_DISTRIBUTED_AUTO=1 and
    SPECJAX_DISTRIBUTED_TIMEOUT; JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID and
    JAX_LOCAL_DEVICE_IDS are used when ours are unset."""
    env = os.environ if environ is None else environ
    raw = {}
    for field, names in ENV_NAMES.items():
      for name in names:
        if env.get(name, "").strip():
          raw[field] = (name, env[name].strip())
          break
    kw: dict[str, Any] = {}
    for field, (name, value) in raw.items():
      try:
        if field == "coordinator_address":
          kw[field] = value
        elif field == "local_device_ids":
          kw[field] = tuple(int(i) for i in value.split(",") if i.strip())
        elif field == "auto":
          kw[field] = value.lower() in ("1", "true", "yes")
        else:
          kw[field] = int(value)
      except ValueError:
        refuse(f"environment variable {name}={value!r} is not a valid {field}")
    return cls(**kw)


def initialize_distributed(config: DistributedConfig | None = None) -> bool:
  """Join the multi-process job described by `config` (default: from the environment).

  Must run before anything touches a JAX device. A no-op for one process; returns whether
  jax.distributed was initialised (by this call or an earlier one)."""
  config = DistributedConfig.from_env() if config is None else config
  if not config.is_multi_process:
    return False
  is_initialized = getattr(jax.distributed, "is_initialized", None)
  if is_initialized is not None and is_initialized():
    return True
  # CPU processes need a collectives backend to talk to each other (gloo ships with jaxlib).
  flags = getattr(jax.config, "values", {})
  if flags.get("jax_cpu_collectives_implementation", "gloo") in (None, "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if config.auto:
    jax.distributed.initialize(initialization_timeout=config.timeout_s)
  else:
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        local_device_ids=list(config.local_device_ids) if config.local_device_ids else None,
        initialization_timeout=config.timeout_s)
  return True


def global_batch(local_data: Any, mesh: Mesh, spec: P | None = None,
                 rules: Rules = DEFAULT_RULES) -> Any:
  """Assemble per-process rows into arrays that span every process, sharded by `spec` (default:
  dim 0 on the batch axes). Each process passes the rows its own devices hold, e.g. process p of n
  passes rows [p * B / n, (p + 1) * B / n) of a batch of B rows when the batch axes span
  processes."""
  if spec is None:
    spec = logical_to_spec(("batch",), rules)
  sharding = NamedSharding(mesh, spec)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_data)


def process_rows(global_rows: int) -> slice:
  """The slice of the whole batch that this process loads when rows split evenly over processes."""
  n, p = jax.process_count(), jax.process_index()
  if global_rows % n:
    raise ValueError(f"process_rows: {global_rows} rows do not split over {n} processes")
  per = global_rows // n
  return slice(p * per, (p + 1) * per)
