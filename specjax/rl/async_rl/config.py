"""Config of asynchronous RL: policy lag, the generation/training device split, the bounded rollout
queue and the truncated importance-sampling correction of off-policy batches.
"""

from __future__ import annotations

import dataclasses

from specjax.config_tree import check
from specjax.sharding.mesh import MeshConfig

MAX_POLICY_LAG = 2


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
  """`run_rl_async` always runs the async machinery; `enabled` is what a launcher reads to pick
  it over the synchronous `run_rl`.

  policy_lag: the batch of step t is generated from params of version >= t - policy_lag (version
  v = params after v optimizer steps); 0 runs the same machinery in lockstep (equals `run_rl`).
  """

  enabled: bool = False
  policy_lag: int = 1
  gen_fraction: float = 0.5  # share of the devices in the generation mesh (the first ones)
  gen_mesh: MeshConfig = MeshConfig()  # shapes of the two meshes (default: all fsdp)
  train_mesh: MeshConfig = MeshConfig()
  queue_size: int = 2  # generated batches waiting for the trainer, at most
  is_correction: bool = True  # truncated importance sampling of the policy-gradient term
  is_clip: float = 2.0  # per-token weight min(pi_old / pi_sampler, is_clip)
  shutdown_timeout_s: float = 60.0  # wait this long for the worker to finish its batch on exit

  def __post_init__(self):
    w = "AsyncConfig"
    check(0 <= self.policy_lag <= MAX_POLICY_LAG, f"{w}.policy_lag",
          f"must be in [0, {MAX_POLICY_LAG}], got {self.policy_lag}")
    check(0.0 < self.gen_fraction < 1.0, f"{w}.gen_fraction",
          f"must be in (0, 1), got {self.gen_fraction}")
    check(self.queue_size >= 1, f"{w}.queue_size", f"must be >= 1, got {self.queue_size}")
    check(self.is_clip >= 1.0, f"{w}.is_clip",
          f"must be >= 1 (a cap on pi_old / pi_sampler), got {self.is_clip}")
    check(self.shutdown_timeout_s > 0, f"{w}.shutdown_timeout_s",
          f"must be > 0, got {self.shutdown_timeout_s}")
    for name in ("gen_mesh", "train_mesh"):
      check(isinstance(getattr(self, name), MeshConfig), f"{w}.{name}",
            f"must be a MeshConfig, got {getattr(self, name)!r}")
