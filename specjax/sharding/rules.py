"""Logical-axis partition rules: one table from logical axis names to mesh axes, and the functions
that turn annotated NNX state, optax state, KV caches and token batches into NamedShardings.

A parameter declares its logical axes where it is defined (`nnx.Param(..., logical_axes=(...))`);
nothing else in the code names mesh axes. A dimension whose size is not divisible by its mesh
axes is replicated instead (e.g. 2 kv heads on a tensor axis of 4), so any mesh runs any model.
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# The one table. Activations: batch, sequence, cache_seq; parameters: the rest. The draft head
# and the MTP module reuse these names, so they need no entries of their own.
DEFAULT_RULES: Rules = MappingProxyType({
    "batch": ("data", "fsdp"),
    "sequence": None,
    "cache_seq": None,
    "embed": "fsdp",
    "vocab": "tensor",
    "draft_vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "layers": None,
})

# KV-cache buffers (`specjax.models.KVCache`): keys [B, Hkv, Dh, S], values [B, Hkv, S, Dh]
K_CACHE_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")
V_CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")
TOKEN_AXES = ("batch", "sequence")


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def logical_to_spec(axes: Sequence[str | None], rules: Rules = DEFAULT_RULES, *,
                    shape: Sequence[int] | None = None, mesh: Mesh | None = None,
                    where: str = "") -> P:
  """PartitionSpec for an array whose dimensions have the logical names `axes` (None: replicated).

  A mesh axis already used by an earlier dimension is dropped (('embed', 'embed') shards only the
  first). With `mesh`, mesh axes of size 1 are left out; with `shape` too, a dimension keeps
  only the mesh axes whose running product divides its size (it is replicated over the others)."""
  if shape is not None and len(shape) != len(axes):
    raise ValueError(f"{where or 'logical_to_spec'}: {len(axes)} logical axes {tuple(axes)} for "
                     f"an array of rank {len(shape)} (shape {tuple(shape)})")
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(axes):
    if name is None:
      spec.append(None)
      continue
    if name not in rules:
      raise ValueError(f"{where or 'logical_to_spec'}: logical axis {name!r} has no partition "
                       f"rule; known axes: {sorted(rules)}")
    kept, prod = [], 1
    for mesh_axis in _as_tuple(rules[name]):
      if mesh_axis in used:
        continue
      size = mesh.shape[mesh_axis] if mesh is not None else 1
      if mesh is not None and size == 1:
        continue  # sharding over one device is replication; keep the spec readable
      if shape is not None and shape[dim] % (prod * size):
        continue
      kept.append(mesh_axis)
      prod *= size
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*spec)


def logical_sharding(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int] | None = None,
                     rules: Rules = DEFAULT_RULES) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh))


def with_logical_constraint(x: jax.Array, axes: Sequence[str | None], mesh: Mesh,
                            rules: Rules = DEFAULT_RULES) -> jax.Array:
  """Inside jit: pin an activation to the sharding of its logical axes."""
  return jax.lax.with_sharding_constraint(x, logical_sharding(mesh, axes, x.shape, rules))


# -- NNX state -----------------------------------------------------------------------------------

with warnings.catch_warnings():  # flax >= 0.11 keeps VariableState only as a deprecated alias
  warnings.simplefilter("ignore")
  _VARIABLE_TYPES = tuple({nnx.Variable, getattr(nnx, "VariableState", nnx.Variable)})


def _is_variable(x: Any) -> bool:
  return isinstance(x, _VARIABLE_TYPES)


def _variable_value(v: Any) -> Any:
  return v.get_value() if hasattr(v, "get_value") else v.value


def _variable_axes(v: Any) -> tuple | None:
  meta = v.get_metadata() if hasattr(v, "get_metadata") else {}
  axes = meta.get("logical_axes") if isinstance(meta, Mapping) else None
  return axes if axes is not None else getattr(v, "logical_axes", None)


def _is_param(v: Any) -> bool:
  if isinstance(v, nnx.Param):
    return True
  var_type = getattr(v, "type", None)  # flax < 0.11 VariableState
  return isinstance(var_type, type) and issubclass(var_type, nnx.Param)


def state_shardings(state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """The NamedSharding of every Variable of an nnx.State (same tree, each Variable's value
  replaced by its sharding). Params must carry `logical_axes`; other Variables without them
  (counters, rng state, the step of an nnx.Optimizer) are replicated."""

  def one(path, v):
    if not _is_variable(v):  # a bare array in a pure-dict state: nothing to read, replicate
      return NamedSharding(mesh, P())
    where = "parameter " + jax.tree_util.keystr(path)
    value = _variable_value(v)
    shape = getattr(value, "shape", ())
    axes = _variable_axes(v)
    if axes is None:
      if _is_param(v):
        raise ValueError(f"{where} (shape {tuple(shape)}) has no `logical_axes` metadata; declare "
                         f"them where it is defined (specjax.models.layers.param)")
      return v.replace(NamedSharding(mesh, P()))
    return v.replace(NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh,
                                                         where=where)))

  return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def optimizer_shardings(opt_state: Any, params: Any, param_shardings: Any) -> Any:
  """Shardings for an optax state built on `params`: every sub-tree shaped like `params` (Adam's
  mu and nu, momentum, ...) takes `param_shardings` leaf by leaf where the shapes agree; all
  other leaves (step counts, factored statistics) are replicated."""
  param_def = jax.tree.structure(params)
  param_leaves = jax.tree.leaves(params)
  sharding_leaves = jax.tree.leaves(param_shardings)
  if len(param_leaves) != len(sharding_leaves):
    raise ValueError(f"optimizer_shardings: params have {len(param_leaves)} leaves but "
                     f"param_shardings {len(sharding_leaves)}")
  if not sharding_leaves:
    raise ValueError("optimizer_shardings: no parameters")
  replicated = NamedSharding(sharding_leaves[0].mesh, P())

  def mirrors_params(x):
    return jax.tree.structure(x) == param_def

  def one(sub):
    if not mirrors_params(sub):
      return replicated
    leaves = jax.tree.leaves(sub)
    out = [s if getattr(x, "shape", None) == getattr(p, "shape", None) else replicated
           for x, p, s in zip(leaves, param_leaves, sharding_leaves)]
    return jax.tree.unflatten(param_def, out)

  return jax.tree.map(one, opt_state, is_leaf=mirrors_params)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """Place an existing model's state on `mesh` following the rules (in place; returns model)."""
  _, state = nnx.split(model)
  nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
  return model


def create_sharded(make_model: Callable[[], nnx.Module], mesh: Mesh,
                   rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """Build a model directly in its sharded layout: shapes come from `nnx.eval_shape`, and the
  initialisation runs under jit with sharded outputs, so no device (or host) ever holds the
  whole model. Use this on multi-host meshes."""
  graphdef, abstract_state = nnx.split(nnx.eval_shape(make_model))
  shardings = state_shardings(abstract_state, mesh, rules)
  state = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)


# -- activations -----------------------------------------------------------------------------

def cache_shardings(cache: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """Shardings for a KVCache (per layer k [B, Hkv, Dh, S], v [B, Hkv, S, Dh]; lengths [B]): rows
  on the batch axes, kv heads on tensor, as the parameters that produce them."""
  k = lambda x: logical_sharding(mesh, K_CACHE_AXES, x.shape, rules)
  v = lambda x: logical_sharding(mesh, V_CACHE_AXES, x.shape, rules)
  return cache.replace(k=tuple(k(x) for x in cache.k), v=tuple(v(x) for x in cache.v),
                       lengths=logical_sharding(mesh, ("batch",), cache.lengths.shape, rules))


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """Sharding of a per-row array [B, ...] (tokens, rewards, logprobs): rows on the batch axes."""
  axes = (TOKEN_AXES + (None,) * max(len(shape) - 2, 0))[:len(shape)]
  return logical_sharding(mesh, axes, shape, rules)


def shard_batch(tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """device_put every array of a pytree of per-row arrays with `batch_sharding`."""
  return jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, x.shape, rules)), tree)
