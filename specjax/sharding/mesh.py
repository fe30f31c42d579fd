"""Device meshes with the axes (data, fsdp, tensor): one mesh, or two disjoint ones for async RL.

`transfer` moves a pytree between meshes (policy weights from the training to the generation group).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from specjax.config_tree import refuse

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; at most one may be -1, which takes the remaining devices."""

  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def __post_init__(self):
    sizes = self.sizes
    for name, size in zip(MESH_AXES, sizes):
      if not isinstance(size, int) or (size < 1 and size != -1):
        refuse(f"MeshConfig.{name}: must be an int >= 1 or -1 (fill), got {size!r}")
    if sizes.count(-1) > 1:
      refuse(f"MeshConfig: at most one axis may be -1 (fill), got {self.shape_str()}")

  @property
  def sizes(self) -> tuple[int, int, int]:
    return (self.data, self.fsdp, self.tensor)

  def shape_str(self) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(MESH_AXES, self.sizes))

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    """The concrete (data, fsdp, tensor) shape on `num_devices` devices, or a ValueError."""
    sizes = list(self.sizes)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        refuse(
            f"mesh ({self.shape_str()}) does not fit {num_devices} devices: the fixed axes use "
            f"{known} devices, which does not divide {num_devices}")
      sizes[sizes.index(-1)] = num_devices // known
    elif known != num_devices:
      refuse(
          f"mesh ({self.shape_str()}) needs {known} devices but {num_devices} are available")
    return tuple(sizes)


def make_mesh(config: MeshConfig | Sequence[int] = MeshConfig(),
              devices: Sequence[Any] | None = None) -> Mesh:
  """A Mesh with axes (data, fsdp, tensor) over `devices` (default: all devices, every process).

  Axes are `Auto`, so jit propagates shardings from the NamedSharding of its inputs (GSPMD)."""
  if not isinstance(config, MeshConfig):
    config = MeshConfig(*config)
  devices = list(jax.devices() if devices is None else devices)
  shape = config.resolve(len(devices))
  auto = (AxisType.Auto,) * len(MESH_AXES)
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    # Some device subsets have no topology-aware layout; fall back to the given order.
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=auto)


def split_mesh(devices: Sequence[Any] | None, gen_fraction: float,
               gen_shape: MeshConfig | Sequence[int] | None = None,
               train_shape: MeshConfig | Sequence[int] | None = None) -> tuple[Mesh, Mesh]:
  """Split `devices` into a generation mesh (the first round(gen_fraction * n) devices) and a
  training mesh (the rest); the two share no device. Shapes default to all-fsdp."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if not 0.0 < gen_fraction < 1.0:
    raise ValueError(f"split_mesh: gen_fraction must be in (0, 1), got {gen_fraction}")
  num_gen = int(round(gen_fraction * n))
  if not 1 <= num_gen <= n - 1:
    raise ValueError(f"split_mesh: gen_fraction={gen_fraction} of {n} devices leaves a group "
                     f"empty ({num_gen} for generation, {n - num_gen} for training)")
  gen = make_mesh(gen_shape or MeshConfig(), devices[:num_gen])
  train = make_mesh(train_shape or MeshConfig(), devices[num_gen:])
  return gen, train


def transfer(tree: Any, to_shardings: Any, donate: bool = False) -> Any:
  """Copy a pytree of arrays onto `to_shardings` (one sharding or a pytree prefix of them), e.g.
  from the training mesh to the generation mesh. `donate` frees the source buffers."""
  if donate:
    return jax.device_put(tree, to_shardings, donate=True)
  return jax.device_put(tree, to_shardings)
