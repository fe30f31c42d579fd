"""Hugging Face import/export: Qwen3 and Llama checkpoints (config.json + safetensors) <-> Decoder,
including a native MTP module in the DeepSeek-V3, Qwen3-Next (`mtp.*`) or MiMo layout.

Loading reads tensors with numpy (no torch), builds the Decoder abstractly and fills its parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from specjax.errors import UserError
from specjax.models.config import DTYPES, ModelConfig
from specjax.models.decoder import Decoder, MTPModule
from specjax.models.gguf_import import GGUFCheckpoint, gguf_path
from specjax.models.hf_config import config_from_hf, config_to_hf
from specjax.models.tensor_sources import INDEX_FILE, GGUFTensors, SafetensorsDir
from specjax.models.tokenizer import CHAT_TEMPLATE_FILES, HFTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json") + CHAT_TEMPLATE_FILES[:2]
Array = np.ndarray


# -- tensor layout --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One HF tensor: its name and shape, where it lives in the Decoder, and the layout maps."""

  name: str
  shape: tuple[int, ...]
  path: tuple[str | int, ...]  # attribute path from the Decoder to the nnx.Param
  to_ours: Callable[[Array], Array]
  to_hf: Callable[[Array], Array]


def _same(x):
  return x


def _transpose(x):
  return x.T


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
  """Every tensor of the HF layout of `cfg`. torch Linear weights are [out, in]; ours are [in, out]
  with the head axes split: q/k/v [d, heads, head_dim], o [heads, head_dim, d]."""
  d, v = cfg.hidden_size, cfg.vocab_size
  specs = [TensorSpec("model.embed_tokens.weight", (v, d), ("embed",), _same, _same),
           TensorSpec("model.norm.weight", (d,), ("final_norm", "scale"), _same, _same)]
  if not cfg.tie_embeddings:
    specs.append(TensorSpec("lm_head.weight", (v, d), ("lm_head",), _transpose, _transpose))
  for i in range(cfg.num_layers):
    specs += _layer_specs(cfg, f"model.layers.{i}.", ("layers", i))
  return specs


def _layer_specs(cfg: ModelConfig, pre: str, base: tuple) -> list[TensorSpec]:
  """One decoder layer's tensors, named `pre` + HF name, at attribute path `base` in the Decoder."""
  d, f, dh = cfg.hidden_size, cfg.mlp_hidden, cfg.head_dim

  def in_proj(h):  # HF [h * dh, d] <-> ours [d, h, dh]
    return (lambda x: x.T.reshape(d, h, dh)), (lambda x: x.reshape(d, h * dh).T)

  def out_proj(h):  # HF [d, h * dh] <-> ours [h, dh, d]
    return (lambda x: x.T.reshape(h, dh, d)), (lambda x: x.reshape(h * dh, d).T)

  at = base + ("attn",)
  layer = [
      ("input_layernorm", (d,), base + ("input_norm", "scale"), _same, _same),
      ("post_attention_layernorm", (d,), base + ("post_attn_norm", "scale"), _same, _same),
      ("self_attn.q_proj", (cfg.num_heads * dh, d), at + ("q_proj",), *in_proj(cfg.num_heads)),
      ("self_attn.k_proj", (cfg.num_kv_heads * dh, d), at + ("k_proj",),
       *in_proj(cfg.num_kv_heads)),
      ("self_attn.v_proj", (cfg.num_kv_heads * dh, d), at + ("v_proj",),
       *in_proj(cfg.num_kv_heads)),
      ("self_attn.o_proj", (d, cfg.num_heads * dh), at + ("o_proj",), *out_proj(cfg.num_heads)),
      ("mlp.gate_proj", (f, d), base + ("mlp", "gate"), _transpose, _transpose),
      ("mlp.up_proj", (f, d), base + ("mlp", "up"), _transpose, _transpose),
      ("mlp.down_proj", (d, f), base + ("mlp", "down"), _transpose, _transpose),
  ]
  if cfg.qk_norm:
    layer += [("self_attn.q_norm", (dh,), at + ("q_norm", "scale"), _same, _same),
              ("self_attn.k_norm", (dh,), at + ("k_norm", "scale"), _same, _same)]
  return [TensorSpec(pre + n + ".weight", s, p, a, b) for n, s, p, a, b in layer]


# -- native MTP module ----------------------------------------------------------------------------
# layout -> (prefix of its first MTP layer ({L}: the decoder's layer count), names of the pieces
# (embed norm, hidden norm, fused projection, final norm), prefix of the decoder layer inside it,
# whether the projection's input is concat(hidden, embed) rather than concat(embed, hidden)).
MTP_LAYOUTS = {
    "deepseek": ("model.layers.{L}.", ("enorm", "hnorm", "eh_proj", "shared_head.norm"), "", False),
    "qwen3_next": ("mtp.", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
                   "layers.0.", False),
    "mimo": ("model.mtp_layers.0.", ("token_layernorm", "hidden_layernorm", "input_proj",
                                     "final_layernorm"), "", True),
}
# Copies of shared tensors some layouts keep inside the MTP layer (DeepSeek-V3); ours are shared.
MTP_SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight",
                     "shared_head.head.weight": "lm_head.weight"}


def _mtp_prefix(cfg: ModelConfig, layout: str) -> str:
  return MTP_LAYOUTS[layout][0].format(L=cfg.num_layers)


def mtp_specs(cfg: ModelConfig, layout: str = "deepseek") -> list[TensorSpec]:
  """The tensors of the Decoder's MTP module in a checkpoint layout (a key of MTP_LAYOUTS):
  DeepSeek-V3 (`model.layers.{L}.enorm/hnorm/eh_proj/shared_head.norm` + a decoder layer),
  Qwen3-Next (`mtp.pre_fc_norm_embedding/pre_fc_norm_hidden/fc/norm`, `mtp.layers.0.*`) or MiMo
  (`model.mtp_layers.0.token_layernorm/hidden_layernorm/input_proj/final_layernorm` + layer)."""
  if layout not in MTP_LAYOUTS:
    raise ValueError(f"MTP layout must be one of {sorted(MTP_LAYOUTS)}, got {layout!r}")
  _, (enorm, hnorm, proj, fnorm), layer_pre, hidden_first = MTP_LAYOUTS[layout]
  pre, d = _mtp_prefix(cfg, layout), cfg.hidden_size

  def proj_to_ours(x):  # HF [d, 2d] -> ours [2d, d] with rows (embed, hidden)
    x = x.T
    return np.concatenate([x[d:], x[:d]]) if hidden_first else x

  def proj_to_hf(x):
    return (np.concatenate([x[d:], x[:d]]) if hidden_first else x).T

  specs = [TensorSpec(pre + enorm + ".weight", (d,), ("mtp", "embed_norm", "scale"), _same, _same),
           TensorSpec(pre + hnorm + ".weight", (d,), ("mtp", "hidden_norm", "scale"), _same, _same),
           TensorSpec(pre + proj + ".weight", (d, 2 * d), ("mtp", "proj"), proj_to_ours,
                      proj_to_hf),
           TensorSpec(pre + fnorm + ".weight", (d,), ("mtp", "final_norm", "scale"), _same, _same)]
  return specs + _layer_specs(cfg, pre + layer_pre, ("mtp", "layer"))


def detect_mtp_layout(names, cfg: ModelConfig) -> str | None:
  """The MTP layout of a checkpoint's tensor names, or None when it ships no MTP weights."""
  found = [layout for layout in MTP_LAYOUTS
           if _mtp_prefix(cfg, layout) + MTP_LAYOUTS[layout][1][2] + ".weight" in names]
  if len(found) > 1:
    raise UserError(f"checkpoint has MTP tensors in several layouts: {found}")
  return found[0] if found else None


def _is_mtp(name: str, cfg: ModelConfig, names) -> bool:
  """Whether `name` belongs to any MTP layer (first or later) of any layout; a DeepSeek-V3 layer
  past the decoder's counts only when it has its eh_proj (else config and weights disagree)."""
  if name.startswith(("mtp.", "model.mtp_layers.")):
    return True
  parts = name.split(".")
  return (len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
          and int(parts[2]) >= cfg.num_layers and f"model.layers.{parts[2]}.eh_proj.weight" in names)


def _variable(model: Decoder, path) -> nnx.Variable:
  obj = model
  for p in path:
    obj = obj[p] if isinstance(p, int) else getattr(obj, p)
  return obj


# -- loading --------------------------------------------------------------------------------------

def _ignorable(name: str, cfg: ModelConfig) -> bool:
  # Old Llama exports carry RoPE buffers; tied checkpoints sometimes keep a copy of the embedding.
  return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


def load_pretrained(path: str, *, dtype: str = "float32", param_dtype: str | None = None,
                    device_put: Callable[[Array, tuple[str, ...]], jax.Array] | None = None,
                    seed: int = 0, **overrides) -> Decoder:
  """The Decoder of a local Hugging Face directory (config.json + safetensors shards) or of a
  GGUF file (`path` ending in .gguf; a Llama-architecture model, its tensors dequantized to
  float32 by the `gguf` package: `specjax.models.gguf_import`).

  `dtype` is the compute dtype, `param_dtype` (default: `dtype`) the stored one. The model is built
  abstractly (nnx.eval_shape) and every parameter is set once from the checkpoint, so no random
  weights are materialised. `device_put(array, logical_axes)` places each converted host array
  (default: jnp.asarray on the default device); pass a sharded put to load straight into a mesh.
  `overrides` replace ModelConfig fields. With mtp=True the MTP module is read from the checkpoint
  when it ships one (any layout of MTP_LAYOUTS; only the first of several MTP layers), else it is
  freshly initialised from `seed` with a warning saying so. With mtp=False any MTP weights are
  left unread. The tokenizer is separate: `load_tokenizer(path)`.
  """
  if gguf_path(path):
    ckpt = GGUFCheckpoint(path)
    source = GGUFTensors(ckpt)
    cfg = config_from_hf(ckpt.config, source=f"{path} (its GGUF metadata)", dtype=dtype,
                         param_dtype=param_dtype or dtype, **overrides)
  else:
    cfg = config_from_hf(path, dtype=dtype, param_dtype=param_dtype or dtype, **overrides)
    source = SafetensorsDir(path)
  files = source.files
  specs = tensor_specs(cfg)
  layout = detect_mtp_layout(files, cfg) if cfg.mtp else None
  if layout is not None:
    specs += mtp_specs(cfg, layout)
    _check_mtp_names(path, files, cfg, layout, {s.name for s in specs})
  elif cfg.mtp:
    warnings.warn(f"{path}: the checkpoint ships no MTP weights (looked for the "
                  f"{', '.join(sorted(MTP_LAYOUTS))} layouts); the MTP module is freshly "
                  f"initialised from seed {seed}")
  missing = [s.name for s in specs if s.name not in files]
  if missing:
    raise UserError(f"{path}: tensor {missing[0]!r} not found in {source.where()}"
                    + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
  expected = {s.name for s in specs}
  unexpected = sorted(n for n in files if n not in expected and not _ignorable(n, cfg)
                      and not _is_mtp(n, cfg, files))
  if unexpected:
    raise UserError(f"{path}: tensors with no place in the {cfg.num_layers}-layer decoder: "
                    f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")

  by_name = {s.name: s for s in specs}
  config_file = "its metadata" if gguf_path(path) else "config.json"
  for name, (shape, file) in source.shapes(by_name).items():  # headers: before any weight is read
    if shape != by_name[name].shape:
      raise UserError(f"{file}: tensor {name!r} has shape {shape}, expected "
                      f"{by_name[name].shape} from {config_file}")

  model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed)))
  put = device_put or (lambda x, axes: jnp.asarray(x))
  if cfg.mtp and layout is None:  # small (one layer): initialise for real and copy into the abstract model
    fresh = MTPModule(cfg, rngs=nnx.Rngs(seed))
    for p, var in nnx.to_flat_state(nnx.state(fresh)):
      _variable(model.mtp, p).set_value(put(np.asarray(var.get_value()), var.logical_axes))
  for name, tensor in source.read(by_name):
    s = by_name[name]
    var = _variable(model, s.path)
    value = np.ascontiguousarray(s.to_ours(tensor)).astype(var.get_value().dtype, copy=False)
    var.set_value(put(value, var.logical_axes))
  for p, var in nnx.to_flat_state(nnx.state(model)):
    if isinstance(var.get_value(), jax.ShapeDtypeStruct):  # the layout table missed a parameter
      raise RuntimeError(f"load_pretrained: parameter {p} has no Hugging Face tensor")
  return model


def _check_mtp_names(path: str, files: dict[str, str], cfg: ModelConfig, layout: str,
                     expected: set[str]) -> None:
  """Errors for MTP tensors of the first layer that have no place in MTPModule (e.g. an MoE MLP);
  warnings for further MTP layers (not read) and for copies of the shared embedding / LM head that
  differ from the decoder's (ours are shared, as DeepSeek-V3 trains them)."""
  pre = _mtp_prefix(cfg, layout)
  own = [n for n in files if n.startswith(pre) and n not in expected]
  copies = {pre + k: v for k, v in MTP_SHARED_COPIES.items()}
  if cfg.tie_embeddings:
    copies[pre + "shared_head.head.weight"] = "model.embed_tokens.weight"
  extra = sorted(n for n in own if n not in copies)
  if extra:
    raise UserError(f"{path}: MTP tensors ({layout} layout) with no place in specjax's MTP module "
                    f"(one dense decoder layer): {extra[:5]}{' ...' if len(extra) > 5 else ''}")
  further = sorted(n for n in files if _is_mtp(n, cfg, files) and not n.startswith(pre))
  if further:
    warnings.warn(f"{path}: only the first MTP layer is imported; {len(further)} tensors of "
                  f"further MTP layers are not read (e.g. {further[0]!r})")
  for copy in own:
    main = copies[copy]
    if main not in files:
      continue
    with safe_open(files[copy], framework="np") as f:
      a = f.get_tensor(copy)
    with safe_open(files[main], framework="np") as f:
      b = f.get_tensor(main)
    if a.shape != b.shape or not np.array_equal(a, b):
      warnings.warn(f"{path}: {copy} differs from {main}; specjax's MTP module shares the "
                    f"decoder's, so the copy is not used")


def load_tokenizer(path: str, chat_template: str | None = None, *,
                   require_chat_template: bool = True) -> HFTokenizer:
  """The tokenizer of a Hugging Face directory (tokenizer.json, with ids from its config files).

  The chat template comes from the directory (chat_template.jinja, chat_template.json or
  tokenizer_config.json) unless `chat_template` chooses: "none" (no template: plain
  "Role: content" prompts), a .jinja/.json file, or a jinja string. A directory without a
  template and no choice raises MissingChatTemplateError naming the directory (never a silent
  fallback), unless require_chat_template=False."""
  tok = HFTokenizer(path, chat_template)
  if require_chat_template:
    tok.require_chat_template()
  return tok


# -- export ---------------------------------------------------------------------------------------

def save_pretrained(model: Decoder, path: str, *, max_shard_bytes: int = 4 << 30,
                    tokenizer_from: str | None = None, mtp_layout: str = "deepseek",
                    dtype: str | None = None, config: dict | None = None) -> list[str]:
  """Writes `model` as a Hugging Face checkpoint that transformers and `load_pretrained` read:
  config.json (`config`, default `config_to_hf`), model.safetensors (or model-0000i-of-0000n
  shards + index when larger than `max_shard_bytes`) in `dtype` (default: the parameters' own),
  the MTP module (if any) in `mtp_layout`, and the tokenizer files copied from `tokenizer_from`.
  Returns the written file names. `specjax.models.export.export_hf` is the safe, atomic front."""
  cfg = model.cfg
  os.makedirs(path, exist_ok=True)
  specs = tensor_specs(cfg)
  if model.mtp is not None:
    specs += mtp_specs(cfg, mtp_layout)
  np_dtype = np.dtype(jnp.dtype(DTYPES[dtype] if dtype else cfg.params_dtype))
  itemsize = np_dtype.itemsize
  shards: list[list[TensorSpec]] = [[]]
  size = 0
  for s in specs:
    nbytes = int(np.prod(s.shape)) * itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(s)
    size += nbytes
  n = len(shards)
  names = ["model.safetensors"] if n == 1 else [
      f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  weight_map = {}
  for name, shard in zip(names, shards):
    tensors = {}
    for s in shard:
      ours = np.asarray(jax.device_get(_variable(model, s.path).get_value()))
      tensors[s.name] = np.ascontiguousarray(s.to_hf(ours)).astype(np_dtype, copy=False)
      weight_map[s.name] = name
    save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
  written = list(names)
  if n > 1:
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      total = sum(int(np.prod(s.shape)) * itemsize for s in specs)
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    written.append(INDEX_FILE)
  if config is None:
    config = config_to_hf(cfg)
    if dtype:
      config["torch_dtype"] = dtype
    if model.mtp is not None and mtp_layout in ("deepseek", "mimo"):
      config["num_nextn_predict_layers"] = 1
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  written.append("config.json")
  for file in TOKENIZER_FILES if tokenizer_from else ():
    src = os.path.join(tokenizer_from, file)
    if os.path.exists(src):
      with open(src, "rb") as fin, open(os.path.join(path, file), "wb") as fout:
        fout.write(fin.read())
      written.append(file)
  return written
