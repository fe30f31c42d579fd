"""Save and load a draft head (params, vocabulary maps, shape) with orbax.

Orbax writes into a temporary directory and renames it when complete, so a checkpoint either
exists whole or not at all; `load_head` rebuilds the head from the stored shape.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from specjax.eagle.head import Eagle3Head, HeadConfig
from specjax.eagle.vocab import VocabMaps
from specjax.models.config import ModelConfig, RopeScaling

FORMAT = "specjax.eagle3/1"


def _checkpointer() -> ocp.Checkpointer:
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _config_to_json(cfg: HeadConfig) -> dict:
  return {"format": FORMAT, "draft_vocab": cfg.draft_vocab, "target": dataclasses.asdict(cfg.target)}


def _config_from_json(meta: dict) -> HeadConfig:
  if meta.get("format") != FORMAT:
    raise ValueError(f"load_head: unknown checkpoint format {meta.get('format')!r} "
                     f"(expected {FORMAT!r})")
  target = dict(meta["target"])
  if target.get("rope_scaling") is not None:
    target["rope_scaling"] = RopeScaling(**target["rope_scaling"])
  if target.get("aux_layers") is not None:
    target["aux_layers"] = tuple(target["aux_layers"])
  return HeadConfig(ModelConfig(**target), int(meta["draft_vocab"]))


def save_head(path: str, head: Eagle3Head | nnx.State, maps: VocabMaps,
              cfg: HeadConfig | None = None, *, overwrite: bool = True) -> str:
  """Write `head` (a module, or its params with `cfg`) and `maps` to directory `path`."""
  if isinstance(head, Eagle3Head):
    cfg, state = head.cfg, nnx.split(head)[1]
  elif cfg is None:
    raise ValueError("save_head: pass cfg (HeadConfig) when saving a params State")
  else:
    state = head
  if maps.draft_vocab != cfg.draft_vocab or maps.vocab_size != cfg.target.vocab_size:
    raise ValueError(f"save_head: maps ({maps.draft_vocab} of {maps.vocab_size}) do not fit the "
                     f"head ({cfg.draft_vocab} of {cfg.target.vocab_size})")
  path = os.path.abspath(path)
  tree = {"head": nnx.to_pure_dict(state),
          "d2t": np.asarray(maps.d2t, np.int32), "t2d": np.asarray(maps.t2d, np.int32)}
  _checkpointer().save(path, ocp.args.Composite(params=ocp.args.StandardSave(tree),
                                                meta=ocp.args.JsonSave(_config_to_json(cfg))),
                       force=overwrite)
  return path


def load_head(path: str, target_cfg: ModelConfig | None = None) -> tuple[Eagle3Head, VocabMaps]:
  """(head, maps) from `save_head`'s directory; with `target_cfg`, check the head fits it."""
  path = os.path.abspath(path)
  ckpt = _checkpointer()
  meta = ckpt.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  cfg = _config_from_json(meta)
  if target_cfg is not None:
    for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(target_cfg, name) != getattr(cfg.target, name):
        raise ValueError(f"load_head: head trained for {name}={getattr(cfg.target, name)}, "
                         f"target has {getattr(target_cfg, name)}")
  abstract = nnx.eval_shape(lambda: Eagle3Head(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  n, v = cfg.draft_vocab, cfg.target.vocab_size
  target = {"head": nnx.to_pure_dict(state), "d2t": jax.ShapeDtypeStruct((n,), jnp.int32),
            "t2d": jax.ShapeDtypeStruct((v,), jnp.int32)}
  tree = ckpt.restore(path, ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
  nnx.replace_by_pure_dict(state, tree["head"])
  maps = VocabMaps(d2t=jnp.asarray(tree["d2t"], jnp.int32), t2d=jnp.asarray(tree["t2d"]) > 0)
  return nnx.merge(graphdef, state), maps
