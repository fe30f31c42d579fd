"""Function-preserving growth of a decoder: more layers and wider MLPs, same outputs.

Why: on a small CPU the main job's policy must be large enough that decoding is bound by weight
reads (where verifying K+1 drafted tokens costs about one step), yet a model that size cannot be
pretrained in the job's few minutes. So the base policy is pretrained small and grown: every
existing layer keeps its weights and gains MLP units whose output rows are zero; new layers are
appended with zero attention-output and MLP-down projections, so each is the identity on the
residual stream. The grown decoder computes exactly the small one's logits (up to float rounding)
but reads and multiplies all its weights at every step, and all of them train: the zero
projections get non-zero gradients from the first RL step on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config_tree import check
from specjax.models import Decoder, ModelConfig

# what may differ between the small and the grown config; everything else must match
GROWABLE = ("num_layers", "mlp_hidden", "aux_layers")


def check_growth(small: ModelConfig, big: ModelConfig) -> None:
  """Fail naming the field when `big` is not a function-preserving growth of `small`."""
  for field in ModelConfig.__dataclass_fields__:
    if field not in GROWABLE:
      check(getattr(small, field) == getattr(big, field), f"ModelConfig.{field}",
            f"growth keeps it: small {getattr(small, field)!r}, grown {getattr(big, field)!r}")
  check(big.num_layers >= small.num_layers, "ModelConfig.num_layers",
        f"growth cannot remove layers: small {small.num_layers}, grown {big.num_layers}")
  check(big.mlp_hidden >= small.mlp_hidden, "ModelConfig.mlp_hidden",
        f"growth cannot narrow the MLP: small {small.mlp_hidden}, grown {big.mlp_hidden}")
  check(not small.mtp and not big.mtp, "ModelConfig.mtp", "growth does not cover the MTP module")


def grow_decoder(small: Decoder, big_cfg: ModelConfig, seed: int = 0) -> Decoder:
  """A `big_cfg` decoder (fresh init, then the zeros and copies above) with `small`'s function."""
  check_growth(small.cfg, big_cfg)
  big = Decoder(big_cfg, rngs=nnx.Rngs(seed))
  src = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(small, nnx.Param))}
  state = nnx.state(big, nnx.Param)
  f = small.cfg.mlp_hidden
  for path, var in nnx.to_flat_state(state):
    var.set_value(_grown(path, var.get_value(), src, small.cfg.num_layers, f))
  nnx.update(big, state)
  return big


def _grown(path: tuple, init: jax.Array, src: dict, small_layers: int, f: int) -> jax.Array:
  """The grown value of one parameter (`init`: the big model's fresh initialisation)."""
  new_layer = path[0] == "layers" and path[1] >= small_layers
  if new_layer:  # identity layer: no attention output, no MLP output
    return jnp.zeros_like(init) if path[-1] in ("o_proj", "down") else init
  old = src[path]
  if old.shape == init.shape:
    return old.astype(init.dtype)
  if path[-1] in ("gate", "up"):  # [d, F]: old units first, fresh ones after
    return init.at[:, :f].set(old)
  if path[-1] == "down":  # [F, d]: the new units' output rows are zero
    return jnp.zeros_like(init).at[:f].set(old)
  raise ValueError(f"grow_decoder: no growth rule for {'/'.join(map(str, path))} "
                   f"{old.shape} -> {init.shape}")


def shrink_decoder(big: Decoder, num_layers: int, mlp_hidden: int) -> Decoder | None:
  """The inverse of `grow_decoder` while the grown parts are still zero: the first `num_layers`
  layers with the first `mlp_hidden` MLP units, or None when that would change the function
  (a dropped layer's output projections or a dropped unit's output row is not zero).

  Why: features of layers below `num_layers` and the logits are then the big decoder's exactly,
  so work that only reads them (the EAGLE-3 head's offline training on the base policy) runs on
  the small decoder at a fraction of the cost."""
  cfg = big.cfg
  if num_layers > cfg.num_layers or mlp_hidden > cfg.mlp_hidden:
    return None
  params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(big, nnx.Param))}
  for path, value in params.items():
    dropped_layer = path[0] == "layers" and path[1] >= num_layers
    if dropped_layer and path[-1] in ("o_proj", "down") and bool(jnp.any(value != 0)):
      return None
    if not dropped_layer and path[-1] == "down" and bool(jnp.any(value[mlp_hidden:] != 0)):
      return None
  aux = tuple(i for i in cfg.aux_layer_ids)
  if max(aux) >= num_layers:
    return None
  small_cfg = cfg.replace(num_layers=num_layers, mlp_hidden=mlp_hidden, aux_layers=aux)
  small = nnx.eval_shape(lambda: Decoder(small_cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(small, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    value = params[path]
    if path[-1] in ("gate", "up"):
      value = value[:, :mlp_hidden]
    elif path[-1] == "down":
      value = value[:mlp_hidden]
    var.set_value(value)
  nnx.update(small, state)
  return small
