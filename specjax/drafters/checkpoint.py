"""Save and load a draft head: specjax's own orbax layout, and the community EAGLE-3 layout.

Orbax (`save_head`/`load_head`) writes into a temporary directory and renames it when complete.
The community layout (`save_eagle3_hf`/`load_eagle3_hf`) is the one EAGLE-3's authors and SpecForge
publish and vLLM/SGLang load: config.json (LlamaForCausalLMEagle3) + safetensors with `midlayer.*`,
`fc`, `norm`, `lm_head`, `d2t` (offsets: target = draft + d2t[draft]) and `t2d` (bool over the
target vocabulary). `load_draft_head` reads either.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from specjax.drafters.head import Eagle3Head, HeadConfig
from specjax.errors import UserError
from specjax.drafters.vocab import VocabMaps, identity_maps
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.tokenizer import read_json

FORMAT = "specjax.eagle3/1"


def _checkpointer() -> ocp.Checkpointer:
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _config_to_json(cfg: HeadConfig) -> dict:
  return {"format": FORMAT, "draft_vocab": cfg.draft_vocab, "target": dataclasses.asdict(cfg.target)}


def _config_from_json(meta: dict) -> HeadConfig:
  if meta.get("format") != FORMAT:
    raise UserError(f"load_head: unknown checkpoint format {meta.get('format')!r} "
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
  try:
    meta = ckpt.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except (KeyError, FileNotFoundError, ValueError) as e:  # orbax's errors for a foreign dir
    raise UserError(f"draft head: {path} is neither a head of specjax's save_head nor a community "
                    f"EAGLE-3 directory ({type(e).__name__}: {e})") from None
  cfg = _config_from_json(meta)
  if target_cfg is not None:
    for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(target_cfg, name) != getattr(cfg.target, name):
        raise UserError(f"load_head: head trained for {name}={getattr(cfg.target, name)}, "
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


# -- community EAGLE-3 layout (LlamaForCausalLMEagle3) --------------------------------------------

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE3_WEIGHTS = "model.safetensors"


def is_eagle3_hf_dir(path: str) -> bool:
  """Whether `path` holds a community EAGLE-3 head (config.json naming an EAGLE-3 architecture)."""
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    return False
  archs = read_json(file).get("architectures") or []
  return any(a in EAGLE3_ARCHITECTURES for a in archs)


def _vllm_default_aux(num_layers: int) -> tuple[int, ...]:
  return (2, num_layers // 2, num_layers - 3)


def eagle3_aux_layers(path: str, num_layers: int) -> tuple[int, ...] | None:
  """The policy layers (specjax convention: layer *inputs*) whose states a community head was
  trained on, or None when its config leaves the default. Checkpoints name layer *outputs* in
  eagle_config.eagle_aux_hidden_state_layer_ids, so specjax's index is theirs + 1. Pass the
  result as `aux_layers=` when loading the policy."""
  file = os.path.join(path, "config.json")
  ids = (read_json(file).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  if ids is None:
    return None
  ours = tuple(int(i) + 1 for i in ids)
  if any(not 0 <= i < num_layers for i in ours):
    raise UserError(f"{file}: eagle_aux_hidden_state_layer_ids {list(ids)} name outputs of layers "
                    f"outside [0, {num_layers - 1}) of a {num_layers}-layer policy")
  return ours


def _head_target(hc: dict, target_cfg: ModelConfig, file: str) -> ModelConfig:
  """The ModelConfig the head's layer is built from: the target's, with the head's own attention,
  MLP, RoPE and norm shapes from its config.json (a Llama layer: no q/k norm)."""
  from specjax.models.hf_config import rope_from_hf

  def need(cond, msg):
    if not cond:
      raise UserError(f"{file}: {msg}")

  d = int(hc["hidden_size"])
  need(d == target_cfg.hidden_size, f"hidden_size={d}, the policy has {target_cfg.hidden_size}")
  need(int(hc.get("target_hidden_size", d)) == d,
       f"target_hidden_size={hc.get('target_hidden_size')} != hidden_size={d} is not supported")
  need(int(hc["vocab_size"]) == target_cfg.vocab_size,
       f"vocab_size={hc['vocab_size']}, the policy has {target_cfg.vocab_size}")
  need(int(hc.get("num_hidden_layers", 1)) == 1,
       f"num_hidden_layers={hc.get('num_hidden_layers')}: only one-layer heads are supported")
  need(not hc.get("norm_before_residual", False), "norm_before_residual=true is not supported")
  need((hc.get("eagle_config") or {}).get("use_aux_hidden_state", True),
       "use_aux_hidden_state=false (an EAGLE-1/2 style head) is not supported")
  for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
    need(hc.get(name, want) == want, f"{name}={hc.get(name)!r} is not supported (needs {want!r})")
  theta, scaling = rope_from_hf(hc, file)
  heads = int(hc["num_attention_heads"])
  aux = eagle3_aux_layers(os.path.dirname(file), target_cfg.num_layers)
  if aux is not None and aux != target_cfg.aux_layer_ids:
    raise UserError(f"{file}: the head was trained on the inputs of policy layers {list(aux)} "
                    f"(eagle_aux_hidden_state_layer_ids + 1), the policy exports "
                    f"{list(target_cfg.aux_layer_ids)}; load the policy with aux_layers={aux}")
  return target_cfg.replace(
      num_heads=heads, num_kv_heads=int(hc.get("num_key_value_heads") or heads),
      head_dim=int(hc.get("head_dim") or d // heads), mlp_hidden=int(hc["intermediate_size"]),
      rope_theta=theta, rope_scaling=scaling, rms_eps=float(hc.get("rms_norm_eps", 1e-6)),
      qk_norm=False)


def _head_tensor_map(cfg: HeadConfig):
  """HF name -> (attribute path in Eagle3Head, HF shape, to_ours, to_hf). torch Linear weights are
  [out, in]; ours [in, out] with split head axes."""
  t = cfg.target
  d, dh, f, n = t.hidden_size, t.head_dim, t.mlp_hidden, cfg.draft_vocab
  tr = (lambda x: x.T, lambda x: x.T)
  same = (lambda x: x, lambda x: x)

  def in_proj(h):
    return (lambda x: x.T.reshape(2 * d, h, dh)), (lambda x: x.reshape(2 * d, h * dh).T)

  table = {
      "fc.weight": (("fc",), (d, cfg.num_aux * d), *tr),
      "norm.weight": (("final_norm", "scale"), (d,), *same),
      "lm_head.weight": (("lm_head",), (n, d), *tr),
      "midlayer.input_layernorm.weight": (("embed_norm", "scale"), (d,), *same),
      "midlayer.hidden_norm.weight": (("hidden_norm", "scale"), (d,), *same),
      "midlayer.post_attention_layernorm.weight": (("post_attn_norm", "scale"), (d,), *same),
      "midlayer.self_attn.q_proj.weight": (("attn", "q_proj"), (t.num_heads * dh, 2 * d),
                                           *in_proj(t.num_heads)),
      "midlayer.self_attn.k_proj.weight": (("attn", "k_proj"), (t.num_kv_heads * dh, 2 * d),
                                           *in_proj(t.num_kv_heads)),
      "midlayer.self_attn.v_proj.weight": (("attn", "v_proj"), (t.num_kv_heads * dh, 2 * d),
                                           *in_proj(t.num_kv_heads)),
      "midlayer.self_attn.o_proj.weight": (
          ("attn", "o_proj"), (d, t.num_heads * dh),
          lambda x: x.T.reshape(t.num_heads, dh, d), lambda x: x.reshape(t.num_heads * dh, d).T),
      "midlayer.mlp.gate_proj.weight": (("mlp", "gate"), (f, d), *tr),
      "midlayer.mlp.up_proj.weight": (("mlp", "up"), (f, d), *tr),
      "midlayer.mlp.down_proj.weight": (("mlp", "down"), (d, f), *tr),
  }
  if t.qk_norm:  # specjax extension: a head built on a Qwen3 policy's layer shape
    table["midlayer.self_attn.q_norm.weight"] = (("attn", "q_norm", "scale"), (dh,), *same)
    table["midlayer.self_attn.k_norm.weight"] = (("attn", "k_norm", "scale"), (dh,), *same)
  return table


def _canonical(name: str) -> str:
  """Names as vLLM reads them: no leading "model.", "layers.0." is the midlayer."""
  name = name[len("model."):] if name.startswith("model.") else name
  return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open

  from specjax.models.tensor_sources import tensor_files

  out = {}
  for name, file in tensor_files(path).items():
    with safe_open(file, framework="np") as f:
      out[_canonical(name)] = f.get_tensor(name)
  return out


def load_eagle3_hf(path: str, target_cfg: ModelConfig, *,
                   policy_embed=None) -> tuple[Eagle3Head, VocabMaps]:
  """(head, maps) from a community EAGLE-3 directory, for the policy of config `target_cfg`.

  The head drafts with the policy's own embedding: an `embed_tokens.weight` in the checkpoint is
  not read (with `policy_embed`, a warning says when it differs from the policy's). Tensors are
  cast to the policy's param dtype. Errors name the file and the tensor or field at fault.
  """
  path = os.path.abspath(path)
  file = os.path.join(path, "config.json")
  if not is_eagle3_hf_dir(path):
    raise UserError(f"{file}: not an EAGLE-3 head (architectures must name one of "
                    f"{list(EAGLE3_ARCHITECTURES)})")
  hc = read_json(file)
  tensors = _read_tensors(path)
  try:
    n = int(hc.get("draft_vocab_size") or hc["vocab_size"])
    head_target = _head_target(hc, target_cfg, file)
  except KeyError as e:
    raise UserError(f"{file}: missing field {e.args[0]!r}") from None
  if "midlayer.self_attn.q_norm.weight" in tensors:
    head_target = head_target.replace(qk_norm=True)
  cfg = HeadConfig(head_target, n)
  table = _head_tensor_map(cfg)
  extra = sorted(set(tensors) - set(table) - {"d2t", "t2d", "embed_tokens.weight"})
  if extra:
    raise UserError(f"{path}: tensors with no place in the EAGLE-3 head: {extra[:5]}")
  head = nnx.eval_shape(lambda: Eagle3Head(cfg, rngs=nnx.Rngs(0)))
  for name, (attr, shape, to_ours, _) in table.items():
    if name not in tensors:
      raise UserError(f"{path}: tensor {name!r} not found (has {sorted(tensors)[:8]} ...)")
    x = tensors[name]
    if tuple(x.shape) != shape:
      raise UserError(f"{path}: tensor {name!r} has shape {tuple(x.shape)}, expected {shape} "
                      f"from {file}")
    var = head
    for a in attr:
      var = getattr(var, a)
    var.set_value(jnp.asarray(np.ascontiguousarray(to_ours(x)), target_cfg.params_dtype))
  maps = _maps_from_tensors(tensors, n, target_cfg.vocab_size, path)
  if policy_embed is not None and "embed_tokens.weight" in tensors:
    theirs, ours = tensors["embed_tokens.weight"], np.asarray(policy_embed, np.float32)
    if theirs.shape != ours.shape or not np.allclose(theirs.astype(np.float32), ours, atol=1e-3):
      warnings.warn(f"{path}: embed_tokens.weight differs from the policy's embedding; specjax "
                    "drafts with the policy's own table")
  return head, maps


def _maps_from_tensors(tensors: dict, n: int, v: int, path: str) -> VocabMaps:
  if "d2t" not in tensors and "t2d" not in tensors:
    if n != v:
      raise UserError(f"{path}: draft_vocab_size={n} < vocab_size={v} but no d2t/t2d tensors")
    return identity_maps(v)
  for name, shape in (("d2t", (n,)), ("t2d", (v,))):
    if name not in tensors:
      raise UserError(f"{path}: tensor {name!r} not found (the draft vocabulary maps)")
    if tuple(tensors[name].shape) != shape:
      raise UserError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                      f"expected {shape}")
  d2t = np.arange(n, dtype=np.int64) + tensors["d2t"].astype(np.int64)  # offsets -> target ids
  t2d = tensors["t2d"].astype(bool)
  if d2t.min() < 0 or d2t.max() >= v or len(set(d2t.tolist())) != n:
    raise UserError(f"{path}: d2t (offsets) gives target ids outside [0, {v}) or repeated ones")
  if int(t2d.sum()) != n or not t2d[d2t].all():
    raise UserError(f"{path}: t2d marks {int(t2d.sum())} target ids, not the {n} that d2t maps to")
  return VocabMaps(d2t=jnp.asarray(d2t, jnp.int32), t2d=jnp.asarray(t2d))


def eagle3_hf_config(cfg: HeadConfig, dtype: str | None = None) -> dict:
  """config.json of the community layout for a head."""
  t = cfg.target
  rs = t.rope_scaling
  hc = {
      "architectures": [EAGLE3_ARCHITECTURES[0]], "model_type": "llama",
      "hidden_size": t.hidden_size, "intermediate_size": t.mlp_hidden,
      "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
      "head_dim": t.head_dim, "num_hidden_layers": 1, "vocab_size": t.vocab_size,
      "draft_vocab_size": cfg.draft_vocab, "rms_norm_eps": t.rms_eps, "rope_theta": t.rope_theta,
      "rope_scaling": None if rs is None else {
          "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
          "high_freq_factor": rs.high_freq_factor,
          "original_max_position_embeddings": rs.original_max_position},
      "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
      "tie_word_embeddings": False, "torch_dtype": dtype or t.param_dtype,
      "eagle_config": {"use_aux_hidden_state": True},
  }
  if t.aux_layer_ids != _vllm_default_aux(t.num_layers):
    if min(t.aux_layer_ids) < 1:
      raise ValueError(f"save_eagle3_hf: aux layer 0 (the embedding output) cannot be named in "
                       f"eagle_aux_hidden_state_layer_ids (aux_layers={list(t.aux_layer_ids)})")
    hc["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in t.aux_layer_ids]
  return hc


def save_eagle3_hf(path: str, head: Eagle3Head, maps: VocabMaps, *, embed_table=None,
                   dtype: str | None = None, overwrite: bool = True) -> str:
  """Write `head` and `maps` as a community EAGLE-3 directory (atomically) that vLLM and SGLang
  load; returns its absolute path. `embed_table` (the policy's embedding) is written as
  embed_tokens.weight when given (loaders share the target's when it is absent). A head with q/k
  norm (`init_head(..., qk_norm=True)`, or loaded from such a file) also writes
  midlayer.self_attn.q_norm/k_norm, which only specjax reads; `init_head`'s default layer has
  none."""
  from safetensors.numpy import save_file

  from specjax.models.config import DTYPES
  from specjax.models.export import write_dir_atomically

  cfg = head.cfg
  if maps.draft_vocab != cfg.draft_vocab or maps.vocab_size != cfg.target.vocab_size:
    raise ValueError(f"save_eagle3_hf: maps ({maps.draft_vocab} of {maps.vocab_size}) do not fit "
                     f"the head ({cfg.draft_vocab} of {cfg.target.vocab_size})")
  if cfg.target.qk_norm:
    warnings.warn("save_eagle3_hf: the head uses q/k norm (init_head(..., qk_norm=True)), "
                  "which LlamaForCausalLMEagle3 has no place for; vLLM/SGLang will not load it")
  np_dtype = np.dtype(DTYPES[dtype or cfg.target.param_dtype])
  tensors = {}
  for name, (attr, _, _, to_hf) in _head_tensor_map(cfg).items():
    var = head
    for a in attr:
      var = getattr(var, a)
    ours = np.asarray(jax.device_get(var.get_value()), np.float32)
    tensors[name] = np.ascontiguousarray(to_hf(ours)).astype(np_dtype)
  d2t = np.asarray(maps.d2t, np.int64)
  tensors["d2t"] = d2t - np.arange(d2t.shape[0], dtype=np.int64)
  tensors["t2d"] = np.asarray(maps.t2d, bool)
  if embed_table is not None:
    tensors["embed_tokens.weight"] = np.asarray(jax.device_get(embed_table)).astype(np_dtype)
  config = eagle3_hf_config(cfg, dtype)

  def write(tmp):
    save_file(tensors, os.path.join(tmp, EAGLE3_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config, f, indent=2)

  return write_dir_atomically(path, write, overwrite=overwrite, who="save_eagle3_hf")


def load_draft_head(path: str, target_cfg: ModelConfig, *,
                    policy_embed=None) -> tuple[Eagle3Head, VocabMaps]:
  """(head, maps) from either a community EAGLE-3 directory or specjax's orbax `save_head`."""
  if is_eagle3_hf_dir(path):
    return load_eagle3_hf(path, target_cfg, policy_embed=policy_embed)
  if not os.path.isdir(path):
    raise UserError(f"draft head: {path} is not a directory")
  if os.path.exists(os.path.join(path, "config.json")):
    raise UserError(f"draft head: {os.path.join(path, 'config.json')} does not name an EAGLE-3 "
                    f"architecture ({list(EAGLE3_ARCHITECTURES)})")
  return load_head(path, target_cfg)
