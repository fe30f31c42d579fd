"""Hugging Face config.json <-> ModelConfig for the Qwen3 and Llama families, with a clear error
(a `UserError` naming the file) for every architecture or option the decoder does not implement."""

from __future__ import annotations

import os

from specjax.errors import UserError
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.tokenizer import read_json

# architecture -> (model_type, whether the family normalises q and k per head)
ARCHITECTURES = {"Qwen3ForCausalLM": ("qwen3", True), "LlamaForCausalLM": ("llama", False)}
MODEL_TYPES = {mt: (arch, qk) for arch, (mt, qk) in ARCHITECTURES.items()}


def _read_config(path_or_dict) -> tuple[dict, str]:
  if isinstance(path_or_dict, dict):
    return path_or_dict, "config.json (dict)"
  file = os.path.join(path_or_dict, "config.json") if os.path.isdir(path_or_dict) else path_or_dict
  if not os.path.isfile(file):
    raise UserError(f"Hugging Face import: {file} does not exist")
  return read_json(file), file


def rope_from_hf(hf: dict, source: str) -> tuple[float, RopeScaling | None]:
  """RoPE theta and scaling from either layout: transformers >= 5 writes `rope_parameters`,
  older checkpoints `rope_theta` + `rope_scaling`."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise UserError(f"{source}: RoPE type {kind!r} is not supported (supported: default, llama3)")
  return theta, RopeScaling(
      factor=_number(params, "factor", float, source),
      low_freq_factor=_number(params, "low_freq_factor", float, source),
      high_freq_factor=_number(params, "high_freq_factor", float, source),
      original_max_position=_number(params, "original_max_position_embeddings", int, source))


def _number(hf: dict, key: str, kind: type, source: str, default=None):
  """`hf[key]` as `kind`, or `default` when absent and one is given; a missing or non-numeric
  value is an error naming the file and the key (not a KeyError from deep in the loader)."""
  value = hf.get(key)
  if value is None:
    if default is not None:
      return default
    raise UserError(f"{source}: missing field {key!r}")
  if isinstance(value, bool) or not isinstance(value, (int, float)) \
      or (kind is int and value != int(value)):
    raise UserError(f"{source}: field {key!r} must be a{'n int' if kind is int else ' number'}, "
                    f"got {value!r}")
  return kind(value)


def config_from_hf(path_or_dict, *, source: str | None = None, **overrides) -> ModelConfig:
  """ModelConfig of a Qwen3 or Llama checkpoint: a directory, its config.json, or the parsed dict
  (`source`: what errors name for a dict). `overrides` replace ModelConfig fields (dtype,
  param_dtype, aux_layers, mtp, ...)."""
  hf, read_from = _read_config(path_or_dict)
  source = source or read_from
  archs = hf.get("architectures") or []
  arch = archs[0] if archs else MODEL_TYPES.get(hf.get("model_type"), (None,))[0]
  if arch not in ARCHITECTURES:
    raise UserError(f"{source}: unsupported architecture {archs or None} (model_type "
                    f"{hf.get('model_type')!r}); supported: {sorted(ARCHITECTURES)}")
  unsupported = {"hidden_act": ("silu", hf.get("hidden_act", "silu")),
                 "attention_bias": (False, bool(hf.get("attention_bias", False))),
                 "mlp_bias": (False, bool(hf.get("mlp_bias", False))),
                 "use_sliding_window": (False, bool(hf.get("use_sliding_window", False)))}
  for name, (want, got) in unsupported.items():
    if want != got:
      raise UserError(f"{source}: {arch} with {name}={got!r} is not supported (needs {want!r})")
  theta, scaling = rope_from_hf(hf, source)
  heads = _number(hf, "num_attention_heads", int, source)
  hidden = _number(hf, "hidden_size", int, source)
  fields = dict(
      vocab_size=_number(hf, "vocab_size", int, source),
      hidden_size=hidden,
      num_layers=_number(hf, "num_hidden_layers", int, source),
      num_heads=heads,
      num_kv_heads=_number(hf, "num_key_value_heads", int, source, heads),
      head_dim=_number(hf, "head_dim", int, source, hidden // max(heads, 1)),
      mlp_hidden=_number(hf, "intermediate_size", int, source),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_eps=_number(hf, "rms_norm_eps", float, source, 1e-6),
      qk_norm=ARCHITECTURES[arch][1],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
  try:
    cfg = ModelConfig(**fields)
  except UserError as e:  # a range check names ModelConfig's field: name the file too
    raise UserError(f"{source}: {e}") from None
  return cfg.replace(**overrides) if overrides else cfg


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json contents for `cfg` (Qwen3 when it uses q/k norm, else Llama); legacy RoPE keys,
  which every transformers version reads."""
  arch = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
  rs = cfg.rope_scaling
  return {
      "architectures": [arch], "model_type": ARCHITECTURES[arch][0],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "intermediate_size": cfg.mlp_hidden, "hidden_act": "silu", "rms_norm_eps": cfg.rms_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None if rs is None else {
          "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
          "high_freq_factor": rs.high_freq_factor,
          "original_max_position_embeddings": rs.original_max_position},
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "torch_dtype": cfg.param_dtype,
  }
