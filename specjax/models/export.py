"""Export of a policy as a Hugging Face directory that transformers, vLLM and SGLang load.

`export_hf` writes atomically (a temporary sibling directory renamed into place), keeps the
source checkpoint's config.json (architecture, dtype, extra fields) and copies its tokenizer files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from typing import Callable

from specjax.models.config import DTYPES
from specjax.models.decoder import Decoder
from specjax.models.gguf_import import GGUFCheckpoint, gguf_path
from specjax.models.hf import config_from_hf, config_to_hf, detect_mtp_layout, save_pretrained
from specjax.models.tensor_sources import tensor_files

SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "mlp_hidden", "qk_norm", "tie_embeddings")
DTYPE_KEYS = ("torch_dtype", "dtype")  # transformers < 5 writes the first, 5 the second


def _source_config(model: Decoder, source_dir: str) -> dict:
  """The source's config.json, checked to describe the same shape as `model`."""
  file = os.path.join(source_dir, "config.json")
  if not os.path.exists(file):
    raise FileNotFoundError(f"export_hf: {file} does not exist (source_dir must be the Hugging "
                            "Face directory the policy was loaded from)")
  with open(file) as f:
    config = json.load(f)
  theirs = config_from_hf(config)
  for name in SHAPE_FIELDS:
    if getattr(theirs, name) != getattr(model.cfg, name):
      raise ValueError(f"export_hf: {file} has {name}={getattr(theirs, name)!r}, the policy "
                       f"{getattr(model.cfg, name)!r}; export without source_dir or from the "
                       "matching checkpoint")
  return config


def _dtype_of(config: dict) -> str | None:
  for key in DTYPE_KEYS:
    if isinstance(config.get(key), str):
      return config[key]
  return None


def export_hf(model: Decoder, out_dir: str, source_dir: str | None = None,
              dtype: str | None = None, *, overwrite: bool = False,
              mtp_layout: str | None = None, max_shard_bytes: int = 4 << 30) -> str:
  """Writes `model` to `out_dir` as a Hugging Face checkpoint and returns its absolute path.

  config.json: the source's (`source_dir`, the directory the policy came from: architecture,
  dtype and every other field kept) or, without one, `config_to_hf(model.cfg)`. Tensors: sharded
  safetensors (model-0000i-of-0000n.safetensors + model.safetensors.index.json past
  `max_shard_bytes`, else model.safetensors) in `dtype` (default: the source's dtype, else the
  parameters'), the MTP module in `mtp_layout` (default: the source's layout, else DeepSeek-V3).
  Tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja, ...) are copied from
  `source_dir`; a GGUF source (a .gguf file) gives its tokenizer and chat template as those files
  and the model's own config.json. An existing non-empty `out_dir` is an error unless
  overwrite=True; the directory appears whole or not at all.
  """
  out_dir = _check_target(out_dir, overwrite, "export_hf")
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"export_hf: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  gguf = GGUFCheckpoint(source_dir) if source_dir and gguf_path(source_dir) else None
  if gguf is not None:  # the model's own config.json (the dequantized weights: float32 default)
    config, source_dir = config_to_hf(model.cfg), None
  else:
    config = _source_config(model, source_dir) if source_dir else config_to_hf(model.cfg)
  dtype = dtype or _dtype_of(config) or model.cfg.param_dtype
  if dtype not in DTYPES:
    raise ValueError(f"export_hf: the source's dtype {dtype!r} is not one of {sorted(DTYPES)}; "
                     "pass dtype=")
  keys = [k for k in DTYPE_KEYS if k in config] or ["torch_dtype"]
  config.update({k: dtype for k in keys})
  source_layout = detect_mtp_layout(tensor_files(source_dir), model.cfg) if source_dir else None
  if model.mtp is not None:
    mtp_layout = mtp_layout or source_layout or "deepseek"
    if mtp_layout in ("deepseek", "mimo"):
      config.setdefault("num_nextn_predict_layers", 1)
  elif source_layout is not None:
    warnings.warn(f"export_hf: {source_dir} ships MTP weights ({source_layout} layout) but the "
                  "policy has no MTP module (loaded with mtp=False); they are not exported")

  def write(tmp: str) -> None:
    save_pretrained(model, tmp, max_shard_bytes=max_shard_bytes, tokenizer_from=source_dir,
                    mtp_layout=mtp_layout or "deepseek", dtype=dtype, config=config)
    if gguf is not None:
      gguf.write_tokenizer_files(tmp)

  return write_dir_atomically(out_dir, write, overwrite=overwrite, who="export_hf")


def _check_target(out_dir: str, overwrite: bool, who: str) -> str:
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise FileExistsError(f"{who}: {out_dir} exists and is not a directory")
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise FileExistsError(f"{who}: {out_dir} exists and is not empty (pass overwrite=True)")
  return out_dir


def write_dir_atomically(out_dir: str, write: Callable[[str], object], *, overwrite: bool = False,
                         who: str = "write") -> str:
  """Calls `write(tmp)` on a fresh sibling directory of `out_dir`, then renames it into place
  (replacing an existing `out_dir` only with overwrite=True). Returns the absolute path."""
  out_dir = _check_target(out_dir, overwrite, who)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
  try:
    write(tmp)
    os.chmod(tmp, 0o755)
    if os.path.isdir(out_dir):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
      os.rename(out_dir, os.path.join(old, "prev"))
      os.rename(tmp, out_dir)
      shutil.rmtree(old)
    else:
      os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


__all__ = ["export_hf", "write_dir_atomically"]
